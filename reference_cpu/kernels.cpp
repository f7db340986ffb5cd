// The reference's dot-product kernels (reference_cpu/kernels.hpp): AVX-512 or AVX2+FMA lane sums where the build has
// them, and the portable loops (std::fma) that take the same sums in the same order. The order is documented in
// kernels.hpp; the vector kernels differ only in how many rows and tokens they take at once.
#include "reference_cpu/kernels.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DIFFRUN_REF_AVX2 1
#if defined(__AVX512F__)
#define DIFFRUN_REF_AVX512 1
#endif
#endif

namespace diffrun::ref {

namespace {

std::atomic<bool> g_portable{false};

// acc for (row r, token t): acc + r * lda + t * 16. Rows of weights w + r * ldw, token rows x + t * ldx.

// ---- portable: lane k mod 16 takes fma(x[k], w[k], s) for k in order ----

template <typename T, typename W>
void accumulate_portable(T* acc, int64_t lda, const W* w, int64_t ldw, int nr, const T* x, int64_t ldx, int nt,
                         int64_t n) {
  for (int r = 0; r < nr; ++r) {
    for (int t = 0; t < nt; ++t) {
      T* s = acc + r * lda + t * kLanes;
      const W* wr = w + r * ldw;
      const T* xt = x + t * ldx;
      int64_t k = 0;
      for (; k + kLanes <= n; k += kLanes) {
        for (int j = 0; j < kLanes; ++j) s[j] = std::fma(xt[k + j], static_cast<T>(wr[k + j]), s[j]);
      }
      for (int j = 0; k < n; ++k, ++j) s[j] = std::fma(xt[k], static_cast<T>(wr[k]), s[j]);
    }
  }
}

#if DIFFRUN_REF_AVX2

// A piece's last n mod 16 inputs are taken as one more group of 16 with zeros after them: fma(0, 0, s) is s for every
// s these sums can hold (they start at +0, and an exact zero result of fma rounds to +0, so no lane is ever -0), so
// the padding changes nothing and the tail follows the same order. Tail copies the last inputs of NR rows and NT
// tokens into zero-padded groups of 16.
template <typename T, typename W, int NR, int NT>
struct Tail {
  alignas(64) W w[NR][kLanes] = {};
  alignas(64) T x[NT][kLanes] = {};
  Tail(const W* wsrc, int64_t ldw, const T* xsrc, int64_t ldx, int64_t k0, int64_t n) {
    for (int r = 0; r < NR; ++r) std::copy(wsrc + r * ldw + k0, wsrc + r * ldw + n, w[r]);
    for (int t = 0; t < NT; ++t) std::copy(xsrc + t * ldx + k0, xsrc + t * ldx + n, x[t]);
  }
};

#if DIFFRUN_REF_AVX512
// ---- AVX-512: the 16 lanes of one output in two __m512d (f64) or one __m512 (f32) ----

inline void load16(const float* w, __m512d& lo, __m512d& hi) {
  lo = _mm512_cvtps_pd(_mm256_loadu_ps(w));
  hi = _mm512_cvtps_pd(_mm256_loadu_ps(w + 8));
}
inline void load16(const double* w, __m512d& lo, __m512d& hi) {
  lo = _mm512_loadu_pd(w);
  hi = _mm512_loadu_pd(w + 8);
}

// f64: NR rows (1..2) by NT tokens (1..4), each weight loaded once for NT tokens and each input once for NR rows.
template <int NR, int NT, typename W>
void kernel_f64(double* acc, int64_t lda, const W* w, int64_t ldw, const double* x, int64_t ldx, int64_t n) {
  __m512d s[NR][NT][2];
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) {
      for (int i = 0; i < 2; ++i) s[r][t][i] = _mm512_loadu_pd(acc + r * lda + t * kLanes + 8 * i);
    }
  }
  auto step = [&](const W* const* wr, const double* const* xt, int64_t k) {
    __m512d wl[NR], wh[NR];
    for (int r = 0; r < NR; ++r) load16(wr[r] + k, wl[r], wh[r]);
    for (int t = 0; t < NT; ++t) {
      const __m512d xl = _mm512_loadu_pd(xt[t] + k), xh = _mm512_loadu_pd(xt[t] + k + 8);
      for (int r = 0; r < NR; ++r) {
        s[r][t][0] = _mm512_fmadd_pd(xl, wl[r], s[r][t][0]);
        s[r][t][1] = _mm512_fmadd_pd(xh, wh[r], s[r][t][1]);
      }
    }
  };
  const W* wr[NR];
  const double* xt[NT];
  for (int r = 0; r < NR; ++r) wr[r] = w + r * ldw;
  for (int t = 0; t < NT; ++t) xt[t] = x + t * ldx;
  const int64_t n16 = n / kLanes * kLanes;
  for (int64_t k = 0; k < n16; k += kLanes) step(wr, xt, k);
  if (n16 < n) {
    const Tail<double, W, NR, NT> tail(w, ldw, x, ldx, n16, n);
    for (int r = 0; r < NR; ++r) wr[r] = tail.w[r];
    for (int t = 0; t < NT; ++t) xt[t] = tail.x[t];
    step(wr, xt, 0);
  }
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) {
      for (int i = 0; i < 2; ++i) _mm512_storeu_pd(acc + r * lda + t * kLanes + 8 * i, s[r][t][i]);
    }
  }
}

// f32: NR rows (1..4) by NT tokens (1..4).
template <int NR, int NT>
void kernel_f32(float* acc, int64_t lda, const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t n) {
  __m512 s[NR][NT];
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) s[r][t] = _mm512_loadu_ps(acc + r * lda + t * kLanes);
  }
  auto step = [&](const float* const* wr, const float* const* xt, int64_t k) {
    __m512 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = _mm512_loadu_ps(wr[r] + k);
    for (int t = 0; t < NT; ++t) {
      const __m512 xv = _mm512_loadu_ps(xt[t] + k);
      for (int r = 0; r < NR; ++r) s[r][t] = _mm512_fmadd_ps(xv, wv[r], s[r][t]);
    }
  };
  const float* wr[NR];
  const float* xt[NT];
  for (int r = 0; r < NR; ++r) wr[r] = w + r * ldw;
  for (int t = 0; t < NT; ++t) xt[t] = x + t * ldx;
  const int64_t n16 = n / kLanes * kLanes;
  for (int64_t k = 0; k < n16; k += kLanes) step(wr, xt, k);
  if (n16 < n) {
    const Tail<float, float, NR, NT> tail(w, ldw, x, ldx, n16, n);
    for (int r = 0; r < NR; ++r) wr[r] = tail.w[r];
    for (int t = 0; t < NT; ++t) xt[t] = tail.x[t];
    step(wr, xt, 0);
  }
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(acc + r * lda + t * kLanes, s[r][t]);
  }
}

constexpr int kRowsF64 = 2, kTokensF64 = 4, kRowsF32 = 4, kTokensF32 = 4;

#else  // AVX2 + FMA: the 16 lanes of one output in four __m256d (f64) or two __m256 (f32)

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

// f64: one row by NT tokens (1..3), 4 registers of lane sums each; the inputs read from memory by the FMAs.
template <int NR, int NT, typename W>
void kernel_f64(double* acc, int64_t lda, const W* w, int64_t ldw, const double* x, int64_t ldx, int64_t n) {
  static_assert(NR == 1);
  (void)lda, (void)ldw;
  __m256d s[NT][4];
  for (int t = 0; t < NT; ++t) {
    for (int i = 0; i < 4; ++i) s[t][i] = _mm256_loadu_pd(acc + t * kLanes + 4 * i);
  }
  auto step = [&](const W* wr, const double* const* xt, int64_t k) {
    __m256d wv[4];
    load16(wr + k, wv);
    for (int t = 0; t < NT; ++t) {
      for (int i = 0; i < 4; ++i) s[t][i] = _mm256_fmadd_pd(_mm256_loadu_pd(xt[t] + k + 4 * i), wv[i], s[t][i]);
    }
  };
  const double* xt[NT];
  for (int t = 0; t < NT; ++t) xt[t] = x + t * ldx;
  const int64_t n16 = n / kLanes * kLanes;
  for (int64_t k = 0; k < n16; k += kLanes) step(w, xt, k);
  if (n16 < n) {
    const Tail<double, W, 1, NT> tail(w, ldw, x, ldx, n16, n);
    for (int t = 0; t < NT; ++t) xt[t] = tail.x[t];
    step(tail.w[0], xt, 0);
  }
  for (int t = 0; t < NT; ++t) {
    for (int i = 0; i < 4; ++i) _mm256_storeu_pd(acc + t * kLanes + 4 * i, s[t][i]);
  }
}

// f32: NR rows (1..2) by NT tokens (1..3), 2 registers of lane sums each; per half of the 16 lanes the rows'
// weights in registers, each token's inputs loaded once for them.
template <int NR, int NT>
void kernel_f32(float* acc, int64_t lda, const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t n) {
  __m256 s[NR][NT][2];
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) {
      for (int i = 0; i < 2; ++i) s[r][t][i] = _mm256_loadu_ps(acc + r * lda + t * kLanes + 8 * i);
    }
  }
  auto step = [&](const float* const* wr, const float* const* xt, int64_t k) {
    for (int i = 0; i < 2; ++i) {
      __m256 wv[NR];
      for (int r = 0; r < NR; ++r) wv[r] = _mm256_loadu_ps(wr[r] + k + 8 * i);
      for (int t = 0; t < NT; ++t) {
        const __m256 xv = _mm256_loadu_ps(xt[t] + k + 8 * i);
        for (int r = 0; r < NR; ++r) s[r][t][i] = _mm256_fmadd_ps(xv, wv[r], s[r][t][i]);
      }
    }
  };
  const float* wr[NR];
  const float* xt[NT];
  for (int r = 0; r < NR; ++r) wr[r] = w + r * ldw;
  for (int t = 0; t < NT; ++t) xt[t] = x + t * ldx;
  const int64_t n16 = n / kLanes * kLanes;
  for (int64_t k = 0; k < n16; k += kLanes) step(wr, xt, k);
  if (n16 < n) {
    const Tail<float, float, NR, NT> tail(w, ldw, x, ldx, n16, n);
    for (int r = 0; r < NR; ++r) wr[r] = tail.w[r];
    for (int t = 0; t < NT; ++t) xt[t] = tail.x[t];
    step(wr, xt, 0);
  }
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) {
      for (int i = 0; i < 2; ++i) _mm256_storeu_ps(acc + r * lda + t * kLanes + 8 * i, s[r][t][i]);
    }
  }
}

constexpr int kRowsF64 = 1, kTokensF64 = 3, kRowsF32 = 2, kTokensF32 = 3;

#endif  // DIFFRUN_REF_AVX512

// One block of at most kRows rows and kTokens tokens through the kernel instantiated for its size.
template <int kRows, int kTokens, typename Kernel>
void dispatch_block(int nr, int nt, Kernel&& kernel) {
  [&]<int... R, int... Tk>(std::integer_sequence<int, R...>, std::integer_sequence<int, Tk...>) {
    auto row = [&]<int NR>(std::integral_constant<int, NR>) {
      ((nt == Tk + 1 ? (kernel.template operator()<NR, Tk + 1>(), true) : false) || ...);
    };
    ((nr == R + 1 ? (row(std::integral_constant<int, R + 1>{}), true) : false) || ...);
  }(std::make_integer_sequence<int, kRows>{}, std::make_integer_sequence<int, kTokens>{});
}

template <typename W>
void accumulate_vector(double* acc, int64_t lda, const W* w, int64_t ldw, int nr, const double* x, int64_t ldx,
                       int nt, int64_t n) {
  for (int r0 = 0; r0 < nr; r0 += kRowsF64) {
    for (int t0 = 0; t0 < nt; t0 += kTokensF64) {
      double* a = acc + r0 * lda + t0 * kLanes;
      const W* wb = w + r0 * ldw;
      const double* xb = x + t0 * ldx;
      dispatch_block<kRowsF64, kTokensF64>(std::min(kRowsF64, nr - r0), std::min(kTokensF64, nt - t0),
                                           [&]<int NR, int NT>() { kernel_f64<NR, NT>(a, lda, wb, ldw, xb, ldx, n); });
    }
  }
}

void accumulate_vector(float* acc, int64_t lda, const float* w, int64_t ldw, int nr, const float* x, int64_t ldx,
                       int nt, int64_t n) {
  for (int r0 = 0; r0 < nr; r0 += kRowsF32) {
    for (int t0 = 0; t0 < nt; t0 += kTokensF32) {
      float* a = acc + r0 * lda + t0 * kLanes;
      const float* wb = w + r0 * ldw;
      const float* xb = x + t0 * ldx;
      dispatch_block<kRowsF32, kTokensF32>(std::min(kRowsF32, nr - r0), std::min(kTokensF32, nt - t0),
                                           [&]<int NR, int NT>() { kernel_f32<NR, NT>(a, lda, wb, ldw, xb, ldx, n); });
    }
  }
}

#endif  // DIFFRUN_REF_AVX2

}  // namespace

void set_portable_kernels(bool portable) { g_portable.store(portable, std::memory_order_relaxed); }
bool portable_kernels() { return g_portable.load(std::memory_order_relaxed); }

const char* kernels_name() {
#if DIFFRUN_REF_AVX512
  if (!portable_kernels()) return "avx512";
#elif DIFFRUN_REF_AVX2
  if (!portable_kernels()) return "avx2-fma";
#endif
  return "portable";
}

template <typename T>
int kernel_rows() {
#if DIFFRUN_REF_AVX2
  if (!portable_kernels()) return sizeof(T) == 8 ? kRowsF64 : kRowsF32;
#endif
  return 1;
}

template <typename T>
int kernel_tokens() {
#if DIFFRUN_REF_AVX2
  if (!portable_kernels()) return sizeof(T) == 8 ? kTokensF64 : kTokensF32;
#endif
  return 1;
}

template <typename T, typename W>
void lane_accumulate(T* acc /* [nr,lda] */, int64_t lda, const W* w /* [nr,ldw] */, int64_t ldw, int nr,
                     const T* x /* [nt,ldx] */, int64_t ldx, int nt, int64_t n) {
#if DIFFRUN_REF_AVX2
  if (!portable_kernels()) {
    accumulate_vector(acc, lda, w, ldw, nr, x, ldx, nt, n);
    return;
  }
#endif
  accumulate_portable(acc, lda, w, ldw, nr, x, ldx, nt, n);
}

template <typename T, typename W>
void lane_accumulate(T* acc /* [nt,16] */, const W* w /* [n] */, const T* x /* [nt,ldx] */, int64_t ldx, int nt,
                     int64_t n) {
  lane_accumulate(acc, static_cast<int64_t>(nt) * kLanes, w, 0, 1, x, ldx, nt, n);
}

#if DIFFRUN_REF_AVX2
// The tree with vector adds: each step adds lanes j + h to lanes j for j < h, as the loop below does one at a time.
float total_vector(const float* acc) {
  const __m256 a = _mm256_add_ps(_mm256_loadu_ps(acc), _mm256_loadu_ps(acc + 8));                 // h = 8
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));           // h = 4
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                                            // h = 2
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));                                  // h = 1
}
double total_vector(const double* acc) {
  const __m256d a0 = _mm256_add_pd(_mm256_loadu_pd(acc), _mm256_loadu_pd(acc + 8));              // h = 8
  const __m256d a1 = _mm256_add_pd(_mm256_loadu_pd(acc + 4), _mm256_loadu_pd(acc + 12));
  const __m256d b = _mm256_add_pd(a0, a1);                                                        // h = 4
  const __m128d c = _mm_add_pd(_mm256_castpd256_pd128(b), _mm256_extractf128_pd(b, 1));          // h = 2
  return _mm_cvtsd_f64(_mm_add_sd(c, _mm_unpackhi_pd(c, c)));                                    // h = 1
}
#endif

template <typename T>
T lane_total(const T* acc /* [16] */) {
#if DIFFRUN_REF_AVX2
  if (!portable_kernels()) return total_vector(acc);
#endif
  T s[kLanes];
  std::copy(acc, acc + kLanes, s);
  for (int h = kLanes / 2; h >= 1; h /= 2) {
    for (int j = 0; j < h; ++j) s[j] = s[j] + s[j + h];
  }
  return s[0];
}

#if DIFFRUN_REF_AVX512
namespace {

// Per type: the vector, the tokens per vector (L), the rows a kernel takes (NR), the vectors of tokens (VT): NR * VT
// lane sums in registers, VT input vectors and one broadcast weight besides.
template <typename T>
struct TokenLanes;
template <>
struct TokenLanes<double> {
  using V = __m512d;
  static constexpr int L = 8, NR = 6, VT = 4;
  static V zero() { return _mm512_setzero_pd(); }
  static V load(const double* p) { return _mm512_loadu_pd(p); }
  static void store(double* p, V v) { _mm512_storeu_pd(p, v); }
  static V set1(double v) { return _mm512_set1_pd(v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_pd(a, b, c); }
  static V add(V a, V b) { return _mm512_add_pd(a, b); }
  static V one_nan(V v) {
    return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(v, v, _CMP_UNORD_Q), v,
                                _mm512_set1_pd(std::numeric_limits<double>::quiet_NaN()));
  }
};
template <>
struct TokenLanes<float> {
  using V = __m512;
  static constexpr int L = 16, NR = 12, VT = 2;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V one_nan(V v) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v,
                                _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  }
};

template <typename T>
int64_t n_i(int K) { return (K + kLanes - 1) / kLanes; }

// NR rows by VT vectors of tokens over the inputs of one piece: for each chain j, its inputs k = c0 + j + 16 i of
// the piece in order, acc[v][r] = fma(x[t, k], w[r, k], acc[v][r]) for the tokens t of vector v. sums [16][VT][NR][L]
// (this group of tokens); xp the group's packed inputs from the piece's first i; js the stride between chains.
template <typename T, int NR, int VT>
void token_lanes_kernel(T* sums, bool first, const T* w, int64_t ldw, const T* xp, int64_t js, int kc) {
  using K = TokenLanes<T>;
  using V = typename K::V;
  constexpr int L = K::L, G = VT * L;
  for (int j = 0; j < kLanes; ++j) {
    const int n = (kc - j + kLanes - 1) / kLanes;  // the piece's inputs of chain j (c0 is a multiple of 16)
    T* sj = sums + static_cast<int64_t>(j) * K::VT * K::NR * L;
    V acc[VT][NR];
    for (int v = 0; v < VT; ++v) {
      for (int r = 0; r < NR; ++r) acc[v][r] = first ? K::zero() : K::load(sj + (v * K::NR + r) * L);
    }
    const T* xj = xp + j * js;
    const T* wj = w + j;
    for (int i = 0; i < n; ++i, xj += G, wj += kLanes) {
      V xv[VT];
      for (int v = 0; v < VT; ++v) xv[v] = K::load(xj + v * L);
      for (int r = 0; r < NR; ++r) {
        const V b = K::set1(wj[r * ldw]);
        for (int v = 0; v < VT; ++v) acc[v][r] = K::fma(xv[v], b, acc[v][r]);
      }
    }
    for (int v = 0; v < VT; ++v) {
      for (int r = 0; r < NR; ++r) K::store(sj + (v * K::NR + r) * L, acc[v][r]);
    }
  }
}

}  // namespace

template <typename T>
bool token_lanes() {
  return !portable_kernels();
}
template <typename T>
int token_lanes_rows() {
  return TokenLanes<T>::NR;
}
template <typename T>
int token_lanes_group() {
  return TokenLanes<T>::VT * TokenLanes<T>::L;
}
template <typename T>
int64_t token_lanes_packed_size(int n_tokens, int K) {
  const int G = token_lanes_group<T>();
  return static_cast<int64_t>((n_tokens + G - 1) / G) * G * kLanes * n_i<T>(K);
}
template <typename T>
void token_lanes_pack(T* xp, const T* x, int n_tokens, int K) {
  using KL = TokenLanes<T>;
  const int G = token_lanes_group<T>();
  const int64_t nI = n_i<T>(K);
  for (int t0 = 0; t0 < n_tokens; t0 += G) {
    const int gw = std::min(G, (n_tokens - t0 + KL::L - 1) / KL::L * KL::L);  // the group's lanes, whole vectors
    T* g = xp + static_cast<int64_t>(t0) * kLanes * nI;
    for (int j = 0; j < kLanes; ++j) {
      for (int64_t i = 0; i < nI; ++i) {
        T* p = g + (j * nI + i) * gw;
        const int64_t k = 16 * i + j;
        for (int t = 0; t < gw; ++t) p[t] = (t0 + t < n_tokens && k < K) ? x[static_cast<int64_t>(t0 + t) * K + k] : T(0);
      }
    }
  }
}
template <typename T>
int64_t token_lanes_sums_size(int n_tokens) {
  using KL = TokenLanes<T>;
  const int G = token_lanes_group<T>();
  return static_cast<int64_t>((n_tokens + G - 1) / G) * kLanes * KL::VT * KL::NR * KL::L;
}
template <typename T>
void token_lanes_accumulate(T* sums, bool first, const T* w, int64_t ldw, int nr, const T* xp, int n_tokens, int K,
                            int c0, int kc) {
  using KL = TokenLanes<T>;
  const int G = token_lanes_group<T>();
  const int64_t nI = n_i<T>(K);
  for (int t0 = 0; t0 < n_tokens; t0 += G) {
    const int vt = std::min(KL::VT, (n_tokens - t0 + KL::L - 1) / KL::L);
    const int gw = vt * KL::L;
    const T* g = xp + static_cast<int64_t>(t0) * kLanes * nI + (c0 / kLanes) * gw;
    T* s = sums + static_cast<int64_t>(t0 / G) * kLanes * KL::VT * KL::NR * KL::L;
    dispatch_block<KL::NR, KL::VT>(nr, vt, [&]<int NR, int VT>() {
      token_lanes_kernel<T, NR, VT>(s, first, w, ldw, g, nI * gw, kc);
    });
  }
}
template <typename T>
void token_lanes_finish(T* out, int N, int n0, int nr, const T* sums, const T* bias, int n_tokens) {
  using KL = TokenLanes<T>;
  using V = typename KL::V;
  constexpr int L = KL::L;
  const int G = token_lanes_group<T>();
  const int64_t js = static_cast<int64_t>(KL::VT) * KL::NR * L;
  for (int t0 = 0; t0 < n_tokens; t0 += G) {
    const T* s = sums + static_cast<int64_t>(t0 / G) * kLanes * js;
    for (int v = 0; v * L < std::min(G, n_tokens - t0); ++v) {
      for (int r = 0; r < nr; ++r) {
        V l[kLanes];
        for (int j = 0; j < kLanes; ++j) l[j] = KL::load(s + j * js + (v * KL::NR + r) * L);
        for (int h = kLanes / 2; h >= 1; h /= 2) {
          for (int j = 0; j < h; ++j) l[j] = KL::add(l[j], l[j + h]);
        }
        if (bias) l[0] = KL::add(l[0], KL::set1(bias[n0 + r]));
        alignas(64) T o[L];
        KL::store(o, KL::one_nan(l[0]));
        const int nt = std::min(L, n_tokens - t0 - v * L);
        for (int t = 0; t < nt; ++t) out[static_cast<int64_t>(t0 + v * L + t) * N + n0 + r] = o[t];
      }
    }
  }
}
#else
template <typename T>
bool token_lanes() {
  return false;
}
template <typename T>
int token_lanes_rows() {
  return 1;
}
template <typename T>
int token_lanes_group() {
  return 1;
}
template <typename T>
int64_t token_lanes_packed_size(int, int) {
  return 0;
}
template <typename T>
void token_lanes_pack(T*, const T*, int, int) {}
template <typename T>
int64_t token_lanes_sums_size(int) {
  return 0;
}
template <typename T>
void token_lanes_accumulate(T*, bool, const T*, int64_t, int, const T*, int, int, int, int) {}
template <typename T>
void token_lanes_finish(T*, int, int, int, const T*, const T*, int) {}
#endif  // DIFFRUN_REF_AVX512

#define DIFFRUN_REF_TOKEN_LANES(T)                                                                          \
  template bool token_lanes<T>();                                                                           \
  template int token_lanes_rows<T>();                                                                       \
  template int token_lanes_group<T>();                                                                      \
  template int64_t token_lanes_packed_size<T>(int, int);                                                    \
  template void token_lanes_pack<T>(T*, const T*, int, int);                                                \
  template int64_t token_lanes_sums_size<T>(int);                                                           \
  template void token_lanes_accumulate<T>(T*, bool, const T*, int64_t, int, const T*, int, int, int, int); \
  template void token_lanes_finish<T>(T*, int, int, int, const T*, const T*, int);
DIFFRUN_REF_TOKEN_LANES(float)
DIFFRUN_REF_TOKEN_LANES(double)
#undef DIFFRUN_REF_TOKEN_LANES

template int kernel_rows<float>();
template int kernel_rows<double>();
template int kernel_tokens<float>();
template int kernel_tokens<double>();
template void lane_accumulate<float, float>(float*, int64_t, const float*, int64_t, int, const float*, int64_t, int,
                                            int64_t);
template void lane_accumulate<double, float>(double*, int64_t, const float*, int64_t, int, const double*, int64_t,
                                             int, int64_t);
template void lane_accumulate<double, double>(double*, int64_t, const double*, int64_t, int, const double*, int64_t,
                                              int, int64_t);
template void lane_accumulate<float, float>(float*, const float*, const float*, int64_t, int, int64_t);
template void lane_accumulate<double, float>(double*, const float*, const double*, int64_t, int, int64_t);
template void lane_accumulate<double, double>(double*, const double*, const double*, int64_t, int, int64_t);
template float lane_total<float>(const float*);
template double lane_total<double>(const double*);

}  // namespace diffrun::ref
