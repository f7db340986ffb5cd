// The reference's dot-product kernels (reference_cpu/kernels.hpp): AVX2+FMA lane sums where the build has them, and
// the portable loops (std::fma) that take the same sums in the same order. The order is documented in kernels.hpp.
#include "reference_cpu/kernels.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DIFFRUN_REF_AVX2 1
#endif

namespace diffrun::ref {

namespace {

std::atomic<bool> g_portable{false};

// ---- portable: lane k mod 16 takes fma(x[k], w[k], s) for k in order ----

template <typename T, typename W>
void accumulate_portable(T* acc, const W* w, const T* x, int64_t ldx, int nt, int64_t n) {
  for (int t = 0; t < nt; ++t) {
    T* s = acc + t * kLanes;
    const T* xt = x + t * ldx;
    int64_t k = 0;
    for (; k + kLanes <= n; k += kLanes) {
      for (int j = 0; j < kLanes; ++j) s[j] = std::fma(xt[k + j], static_cast<T>(w[k + j]), s[j]);
    }
    for (int j = 0; k < n; ++k, ++j) s[j] = std::fma(xt[k], static_cast<T>(w[k]), s[j]);
  }
}

#if DIFFRUN_REF_AVX2

// ---- AVX2 + FMA: the 16 lanes of one output in four __m256d (f64) or two __m256 (f32) registers ----
//
// A piece's last n mod 16 inputs are taken as one more group of 16 with zeros after them: fma(0, 0, s) is s for every
// s these sums can hold (they start at +0, and an exact zero result of fma rounds to +0, so no lane is ever -0), so
// the padding changes nothing and the tail follows the same order.

inline void load16(const double* w, __m256d v[4]) {
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_pd(w + 4 * i);
}
inline void load16(const float* w, __m256d v[4]) {
  const __m256 a = _mm256_loadu_ps(w), b = _mm256_loadu_ps(w + 8);
  v[0] = _mm256_cvtps_pd(_mm256_castps256_ps128(a));
  v[1] = _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
  v[2] = _mm256_cvtps_pd(_mm256_castps256_ps128(b));
  v[3] = _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1));
}

// f64: NT tokens (1..3), 4 registers of lane sums each; x operands read from memory by the FMAs.
template <int NT, typename W>
void accumulate_f64(double* acc, const W* w, const double* x, int64_t ldx, int64_t n) {
  __m256d s[NT][4];
  for (int t = 0; t < NT; ++t) {
    for (int i = 0; i < 4; ++i) s[t][i] = _mm256_loadu_pd(acc + t * kLanes + 4 * i);
  }
  const int64_t n16 = n / kLanes * kLanes;
  for (int64_t k = 0; k < n16; k += kLanes) {
    __m256d wv[4];
    load16(w + k, wv);
    for (int t = 0; t < NT; ++t) {
      const double* xt = x + t * ldx + k;
      for (int i = 0; i < 4; ++i) s[t][i] = _mm256_fmadd_pd(_mm256_loadu_pd(xt + 4 * i), wv[i], s[t][i]);
    }
  }
  if (n16 < n) {
    alignas(32) W wt[kLanes] = {};
    alignas(32) double xt[NT][kLanes] = {};
    std::copy(w + n16, w + n, wt);
    for (int t = 0; t < NT; ++t) std::copy(x + t * ldx + n16, x + t * ldx + n, xt[t]);
    __m256d wv[4];
    load16(wt, wv);
    for (int t = 0; t < NT; ++t) {
      for (int i = 0; i < 4; ++i) s[t][i] = _mm256_fmadd_pd(_mm256_loadu_pd(xt[t] + 4 * i), wv[i], s[t][i]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    for (int i = 0; i < 4; ++i) _mm256_storeu_pd(acc + t * kLanes + 4 * i, s[t][i]);
  }
}

// f32: NT tokens (1..4), 2 registers of lane sums each.
template <int NT>
void accumulate_f32(float* acc, const float* w, const float* x, int64_t ldx, int64_t n) {
  __m256 s[NT][2];
  for (int t = 0; t < NT; ++t) {
    for (int i = 0; i < 2; ++i) s[t][i] = _mm256_loadu_ps(acc + t * kLanes + 8 * i);
  }
  const int64_t n16 = n / kLanes * kLanes;
  for (int64_t k = 0; k < n16; k += kLanes) {
    const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
    for (int t = 0; t < NT; ++t) {
      const float* xt = x + t * ldx + k;
      s[t][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xt), w0, s[t][0]);
      s[t][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xt + 8), w1, s[t][1]);
    }
  }
  if (n16 < n) {
    alignas(32) float wt[kLanes] = {};
    alignas(32) float xt[NT][kLanes] = {};
    std::copy(w + n16, w + n, wt);
    for (int t = 0; t < NT; ++t) std::copy(x + t * ldx + n16, x + t * ldx + n, xt[t]);
    const __m256 w0 = _mm256_load_ps(wt), w1 = _mm256_load_ps(wt + 8);
    for (int t = 0; t < NT; ++t) {
      s[t][0] = _mm256_fmadd_ps(_mm256_load_ps(xt[t]), w0, s[t][0]);
      s[t][1] = _mm256_fmadd_ps(_mm256_load_ps(xt[t] + 8), w1, s[t][1]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    for (int i = 0; i < 2; ++i) _mm256_storeu_ps(acc + t * kLanes + 8 * i, s[t][i]);
  }
}

template <typename W>
void accumulate_vector(double* acc, const W* w, const double* x, int64_t ldx, int nt, int64_t n) {
  for (; nt >= 3; nt -= 3, acc += 3 * kLanes, x += 3 * ldx) accumulate_f64<3>(acc, w, x, ldx, n);
  if (nt == 2) accumulate_f64<2>(acc, w, x, ldx, n);
  if (nt == 1) accumulate_f64<1>(acc, w, x, ldx, n);
}

void accumulate_vector(float* acc, const float* w, const float* x, int64_t ldx, int nt, int64_t n) {
  for (; nt >= 4; nt -= 4, acc += 4 * kLanes, x += 4 * ldx) accumulate_f32<4>(acc, w, x, ldx, n);
  if (nt == 3) accumulate_f32<3>(acc, w, x, ldx, n);
  if (nt == 2) accumulate_f32<2>(acc, w, x, ldx, n);
  if (nt == 1) accumulate_f32<1>(acc, w, x, ldx, n);
}

#endif  // DIFFRUN_REF_AVX2

}  // namespace

void set_portable_kernels(bool portable) { g_portable.store(portable, std::memory_order_relaxed); }
bool portable_kernels() { return g_portable.load(std::memory_order_relaxed); }

const char* kernels_name() {
#if DIFFRUN_REF_AVX2
  if (!portable_kernels()) return "avx2-fma";
#endif
  return "portable";
}

template <typename T, typename W>
void lane_accumulate(T* acc /* [nt,16] */, const W* w /* [n] */, const T* x /* [nt,ldx] */, int64_t ldx, int nt,
                     int64_t n) {
#if DIFFRUN_REF_AVX2
  if (!portable_kernels()) {
    accumulate_vector(acc, w, x, ldx, nt, n);
    return;
  }
#endif
  accumulate_portable(acc, w, x, ldx, nt, n);
}

template <typename T>
T lane_total(const T* acc /* [16] */) {
  T s[kLanes];
  std::copy(acc, acc + kLanes, s);
  for (int h = kLanes / 2; h >= 1; h /= 2) {
    for (int j = 0; j < h; ++j) s[j] = s[j] + s[j + h];
  }
  return s[0];
}

template void lane_accumulate<float, float>(float*, const float*, const float*, int64_t, int, int64_t);
template void lane_accumulate<double, float>(double*, const float*, const double*, int64_t, int, int64_t);
template void lane_accumulate<double, double>(double*, const double*, const double*, int64_t, int, int64_t);
template float lane_total<float>(const float*);
template double lane_total<double>(const double*);

}  // namespace diffrun::ref
