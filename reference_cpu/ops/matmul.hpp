// Linear layer: out = x · Wᵀ (+ bias), W row-major [N,K] as GGUF stores it. T tokens, K inputs, N outputs.
#pragma once

#include <cstddef>
#include <memory>

namespace diffrun::ref {

template <typename T>
class WeightMatrix;  // reference_cpu/weights.hpp (not included: ops headers carry no Eigen types)

// The values a prefill GEMM decodes its weights into, grown as needed and reused across calls. Never
// zero-filled: each thread's decode writes its column block before the GEMM reads it, so the pages of
// a new allocation are first touched, in parallel, by the threads that use them (a value-initialized
// std::vector zero-filled the lm head's 1.09 GB f64 scratch on one thread first: the 0.5B shape).
template <typename T>
class Scratch {
 public:
  // At least n values, uninitialized.
  T* reserve(size_t n) {
    if (n > n_) {
      p_.reset();
      p_.reset(new T[n]);
      n_ = n;
    }
    return p_.get();
  }

 private:
  std::unique_ptr<T[]> p_;
  size_t n_ = 0;
};

// out[t, n] = sum_k x[t, k] * W[n, k] + bias[n] (bias may be null). One token: a mat-vec parallel over
// output rows (OpenMP); several tokens: Eigen GEMMs on per-thread column blocks.
template <typename T>
void matmul(T* out /* [T,N] */, const T* x /* [T,K] */, const T* W /* [N,K] */, const T* bias /* [N] or null */,
            int n_tokens, int K, int N);

// The same over the first N rows of a weight matrix held as GGUF bytes, with the same result bit for bit: one
// token decodes a few rows at a time into a per-thread buffer (a few KB) and takes the same dot products; several
// tokens decode each thread's column block into `scratch` ([N,K] values) and run the same GEMMs on it. A dense W
// takes the pointer path.
template <typename T>
void matmul(T* out /* [T,N] */, const T* x /* [T,K] */, const WeightMatrix<T>& W /* [>=N,K] */,
            const T* bias /* [N] or null */, int n_tokens, int K, int N, Scratch<T>& scratch /* [N*K] */);

}  // namespace diffrun::ref
