// Linear layer: out = x · Wᵀ (+ bias), W row-major [N,K] as GGUF stores it. T tokens, K inputs, N outputs.
#pragma once

namespace diffrun::ref {

template <typename T>
class WeightMatrix;  // reference_cpu/weights.hpp (not included: ops headers carry no Eigen types)

// out[t, n] = sum_k x[t, k] * W[n, k] + bias[n] (bias may be null), every output summed in the one order of
// reference_cpu/kernels.hpp (16 fma lane sums, a fixed tree, then the bias), so the values depend on neither the
// thread count nor the CPU. One token: rows shared among the threads (OpenMP); several tokens: tiles of rows, each
// against every token.
template <typename T>
void matmul(T* out /* [T,N] */, const T* x /* [T,K] */, const T* W /* [N,K] */, const T* bias /* [N] or null */,
            int n_tokens, int K, int N);

// The same over the first N rows of a weight matrix held as GGUF bytes, with the same result bit for bit: one
// token decodes each row a piece at a time into a per-thread buffer of floats (4 KB) and takes it into the row's sums
// at once; several tokens decode a tile of rows (~256 KB of floats) into a per-thread buffer once and take it against
// every token. A dense W takes the pointer path.
template <typename T>
void matmul(T* out /* [T,N] */, const T* x /* [T,K] */, const WeightMatrix<T>& W /* [>=N,K] */,
            const T* bias /* [N] or null */, int n_tokens, int K, int N);

}  // namespace diffrun::ref
