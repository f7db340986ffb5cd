// Linear layer: out = x · Wᵀ (+ bias), W row-major [N,K] as GGUF stores it. T tokens, K inputs, N outputs.
#pragma once

namespace diffrun::ref {

// out[t, n] = sum_k x[t, k] * W[n, k] + bias[n] (bias may be null). One token: a mat-vec parallel over
// output rows (OpenMP); several tokens: Eigen GEMMs on per-thread column blocks.
template <typename T>
void matmul(T* out /* [T,N] */, const T* x /* [T,K] */, const T* W /* [N,K] */, const T* bias /* [N] or null */,
            int n_tokens, int K, int N);

}  // namespace diffrun::ref
