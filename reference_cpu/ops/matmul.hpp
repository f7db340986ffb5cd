// Linear layer: out = x · Wᵀ (+ bias), W row-major [N,K] as GGUF stores it. T tokens, K inputs, N outputs.
#pragma once

namespace diffrun::ref {

template <typename T>
class WeightMatrix;  // reference_cpu/weights.hpp (not included: ops headers carry no Eigen types)

// out[t, n] = sum_k x[t, k] * W[n, k] + bias[n] (bias may be null). One token: a mat-vec parallel over
// output rows (OpenMP); several tokens: single-threaded Eigen GEMMs on blocks of output columns of ~512 KB
// of weights, shared among the threads (the blocks depend on K alone, so the values not on the thread count).
template <typename T>
void matmul(T* out /* [T,N] */, const T* x /* [T,K] */, const T* W /* [N,K] */, const T* bias /* [N] or null */,
            int n_tokens, int K, int N);

// The same over the first N rows of a weight matrix held as GGUF bytes, with the same result bit for bit: one
// token decodes a few rows at a time into a per-thread buffer (~32 KB) and takes the same dot products; several
// tokens decode each column block into a per-thread buffer (~512 KB) and run the same GEMM on it. A dense W takes
// the pointer path.
template <typename T>
void matmul(T* out /* [T,N] */, const T* x /* [T,K] */, const WeightMatrix<T>& W /* [>=N,K] */,
            const T* bias /* [N] or null */, int n_tokens, int K, int N);

}  // namespace diffrun::ref
