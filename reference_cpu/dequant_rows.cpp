// Row dequantization for the reference's streamed weights: model/dequant.cpp's block decoders restated as loops the
// compiler vectorizes for the host CPU, the same operations in the same order, so the same values bit for bit.
#include "reference_cpu/dequant_rows.hpp"

#include <bit>
#include <cmath>
#include <cstring>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__F16C__)
#define DIFFRUN_REF_AVX2_DECODE 1
#endif

#include "model/dequant.hpp"
#include "reference_cpu/kernels.hpp"
#include "reference_cpu/storage.hpp"

// As in model/dequant.cpp: no fused multiply-add, so the operation order is ggml's by construction (every product
// here is exact, so a contraction could not change a value; this keeps it so by construction).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace diffrun::ref {

namespace {

constexpr int QK_K = 256;

// Decoding outruns what the hardware prefetchers fetch from a mapped file (measured on SmolLM2's Q4_1 rows: 0.45
// ns/weight without, 0.24 with): each block asks for the bytes this far ahead, a few blocks' worth of work.
constexpr int64_t kPrefetchAhead = 8192;

// Prefetches the cache lines of a block of `bytes` bytes kPrefetchAhead beyond b (never faults).
inline void prefetch_ahead(const uint8_t* b, int bytes) {
  for (int c = 0; c < bytes; c += 64) __builtin_prefetch(b + kPrefetchAhead + c);
}

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// IEEE half to float, exact, NaN payload kept (the same bits as model/dequant.cpp's table).
float half_to_float(uint16_t h) {
#if defined(__F16C__)
  if ((h & 0x7c00u) != 0x7c00u) return _cvtsh_ss(h);  // finite: the hardware conversion is exact
#endif
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact
    const float v = static_cast<float>(mant) * 0x1p-24f;
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

float half_at(const uint8_t* p) { return half_to_float(load_u16(p)); }

// ---- whole rows of blocks into floats ----

void rows_q4_0(const uint8_t* __restrict b, float* __restrict y, int64_t n_blocks) {  // d f16 | qs[16]
  for (int64_t i = 0; i < n_blocks; ++i, b += 18, y += 32) {
    if (i % 2 == 0) prefetch_ahead(b, 64);
    const float d = half_at(b);
    const uint8_t* qs = b + 2;
    for (int j = 0; j < 16; ++j) y[j] = static_cast<float>((qs[j] & 0x0f) - 8) * d;
    for (int j = 0; j < 16; ++j) y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

void rows_q4_1(const uint8_t* __restrict b, float* __restrict y, int64_t n_blocks) {  // d f16 | m f16 | qs[16]
  for (int64_t i = 0; i < n_blocks; ++i, b += 20, y += 32) {
    if (i % 2 == 0) prefetch_ahead(b, 64);
    const float d = half_at(b);
    const float m = half_at(b + 2);
    const uint8_t* qs = b + 4;
    for (int j = 0; j < 16; ++j) y[j] = static_cast<float>(qs[j] & 0x0f) * d + m;
    for (int j = 0; j < 16; ++j) y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

void rows_q8_0(const uint8_t* __restrict b, float* __restrict y, int64_t n_blocks) {  // d f16 | qs int8[32]
  for (int64_t i = 0; i < n_blocks; ++i, b += 34, y += 32) {
    prefetch_ahead(b, 64);
    const float d = half_at(b);
    const auto* qs = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
  }
}

// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block (ggml's get_scale_min_k4).
void scale_min_k4(int j, const uint8_t* q, float* d, float* m) {
  if (j < 4) {
    *d = static_cast<float>(q[j] & 63);
    *m = static_cast<float>(q[j + 4] & 63);
  } else {
    *d = static_cast<float>((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<float>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

void rows_q4_k(const uint8_t* __restrict b, float* __restrict y, int64_t n_blocks) {  // d f16 | dmin f16 | scales[12] | qs[128]
  for (int64_t i = 0; i < n_blocks; ++i, b += 144) {
    prefetch_ahead(b, 144);
    const float d = half_at(b);
    const float min = half_at(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* q = b + 16;
    for (int is = 0; is < 8; is += 2, q += 32, y += 64) {
      float sc, m;
      scale_min_k4(is + 0, scales, &sc, &m);
      const float d1 = d * sc;
      const float m1 = min * m;
      scale_min_k4(is + 1, scales, &sc, &m);
      const float d2 = d * sc;
      const float m2 = min * m;
      for (int l = 0; l < 32; ++l) y[l] = d1 * static_cast<float>(q[l] & 0xf) - m1;
      for (int l = 0; l < 32; ++l) y[l + 32] = d2 * static_cast<float>(q[l] >> 4) - m2;
    }
  }
}

void rows_q5_k(const uint8_t* __restrict b, float* __restrict y, int64_t n_blocks) {  // d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
  for (int64_t i = 0; i < n_blocks; ++i, b += 176) {
    prefetch_ahead(b, 176);
    const float d = half_at(b);
    const float min = half_at(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* ql = b + 48;
    for (int is = 0, shift = 0; is < 8; is += 2, shift += 2, ql += 32, y += 64) {
      float sc, m;
      scale_min_k4(is + 0, scales, &sc, &m);
      const float d1 = d * sc;
      const float m1 = min * m;
      scale_min_k4(is + 1, scales, &sc, &m);
      const float d2 = d * sc;
      const float m2 = min * m;
      for (int l = 0; l < 32; ++l) y[l] = d1 * static_cast<float>((ql[l] & 0xf) | (((qh[l] >> shift) & 1) << 4)) - m1;
      for (int l = 0; l < 32; ++l)
        y[l + 32] = d2 * static_cast<float>((ql[l] >> 4) | (((qh[l] >> (shift + 1)) & 1) << 4)) - m2;
    }
  }
}

void rows_q6_k(const uint8_t* __restrict b, float* __restrict y, int64_t n_blocks) {  // ql[128] | qh[64] | scales int8[16] | d f16
  for (int64_t i = 0; i < n_blocks; ++i, b += 210) {
    prefetch_ahead(b, 210);
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int half = 0; half < 2; ++half) {  // l in [16*half, 16*half + 16) reads scales sc[half + 0, 2, 4, 6]
        const float s1 = d * static_cast<float>(sc[half + 0]);
        const float s2 = d * static_cast<float>(sc[half + 2]);
        const float s3 = d * static_cast<float>(sc[half + 4]);
        const float s4 = d * static_cast<float>(sc[half + 6]);
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          const int q1 = ((ql[l + 0] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
          const int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int q3 = ((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          y[l + 0] = s1 * static_cast<float>(q1);
          y[l + 32] = s2 * static_cast<float>(q2);
          y[l + 64] = s3 * static_cast<float>(q3);
          y[l + 96] = s4 * static_cast<float>(q4);
        }
      }
    }
  }
}

#if DIFFRUN_REF_AVX2_DECODE
// ---- the block formats by hand for AVX2: each block's values made 16 at a time, in the operation order of the
// scalar decoders above (so the same values bit for bit), and handed to an output: stored (rows_avx2) or taken
// straight into the lane sums of reference_cpu/kernels.hpp (dot_avx2, with FMA) ----

// round_f16's eight values at once: vcvtps2ph (nearest even) and back, NaN made Eigen's quiet NaN of the same sign.
inline __m256 round8_f16(__m256 v) {
  const __m256 quiet_nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256 rounded = _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  const __m256 nan = _mm256_or_ps(_mm256_and_ps(v, sign), quiet_nan);
  return _mm256_blendv_ps(rounded, nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// An output's values rounded to f16 on their way: kRound 1 as round_f16 does, 2 as it does values that cannot be NaN
// (a block whose scales are finite has only finite values in every format here).
template <int kRound, typename Out>
struct Rounded {
  Out& out;
  void take16(__m256 a, __m256 b, int k) {
    if (kRound == 1) {
      a = round8_f16(a);
      b = round8_f16(b);
    } else {
      a = _mm256_cvtph_ps(_mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
      b = _mm256_cvtph_ps(_mm256_cvtps_ph(b, _MM_FROUND_TO_NEAREST_INT));
    }
    out.take16(a, b, k);
  }
};

// Bytes 0..7 of q as floats, unsigned or signed.
inline __m256 u8_ps(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)); }
inline __m256 i8_ps(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }
inline __m128i lo128(__m256i v) { return _mm256_castsi256_si128(v); }
inline __m128i hi128(__m256i v) { return _mm256_extracti128_si256(v, 1); }
inline __m128i high8(__m128i v) { return _mm_srli_si128(v, 8); }

// d * q - m for the 16 codes in bytes of q (one product, one difference, as the scalar K-quant decoders).
template <typename Out>
inline void k_values16(Out& out, __m128i q, __m256 d, __m256 m, int k) {
  out.take16(_mm256_sub_ps(_mm256_mul_ps(d, u8_ps(q)), m), _mm256_sub_ps(_mm256_mul_ps(d, u8_ps(high8(q))), m), k);
}

// The eight sub-block scales d * sc_j and mins dmin * m_j of a Q4_K/Q5_K block at once (scale_min_k4's values, the
// same products). The 12 scale bytes as three words w0, w1, w2: sc_0..3 = w0 & 63, m_0..3 = w1 & 63 (bytewise),
// sc_4..7 = (w2 & 15) | (w0 >> 6) << 4 and m_4..7 = (w2 >> 4) | (w1 >> 6) << 4.
inline void scales_k4_avx2(const uint8_t* scales, float d, float dmin, float* dsc /* [8] */, float* dm /* [8] */) {
  uint32_t w[3];
  std::memcpy(w, scales, 12);
  const uint32_t sc_lo = w[0] & 0x3f3f3f3fu;
  const uint32_t m_lo = w[1] & 0x3f3f3f3fu;
  const uint32_t sc_hi = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
  const uint32_t m_hi = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
  const __m128i sc = _mm_set_epi32(0, 0, static_cast<int>(sc_hi), static_cast<int>(sc_lo));
  const __m128i m = _mm_set_epi32(0, 0, static_cast<int>(m_hi), static_cast<int>(m_lo));
  _mm256_storeu_ps(dsc, _mm256_mul_ps(_mm256_set1_ps(d), u8_ps(sc)));
  _mm256_storeu_ps(dm, _mm256_mul_ps(_mm256_set1_ps(dmin), u8_ps(m)));
}

// Each format: block size and bytes, whether a block's scales are finite, and the block's values.
struct BlockQ4_0 {  // d f16 | qs[16]: (q - 8) * d, low nibbles values 0..15, high nibbles 16..31
  static constexpr int kElems = 32, kBytes = 18;
  static bool finite(const uint8_t* b) { return std::isfinite(half_at(b)); }
  template <typename Out>
  static void block(const uint8_t* b, Out& out) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i low4 = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(qs, low4), eight);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(qs, 4), low4), eight);
    out.take16(_mm256_mul_ps(i8_ps(lo), d), _mm256_mul_ps(i8_ps(high8(lo)), d), 0);
    out.take16(_mm256_mul_ps(i8_ps(hi), d), _mm256_mul_ps(i8_ps(high8(hi)), d), 16);
  }
};

struct BlockQ4_1 {  // d f16 | m f16 | qs[16]: q * d + m
  static constexpr int kElems = 32, kBytes = 20;
  static bool finite(const uint8_t* b) { return std::isfinite(half_at(b)) && std::isfinite(half_at(b + 2)); }
  template <typename Out>
  static void block(const uint8_t* b, Out& out) {
    const __m256 d = _mm256_set1_ps(half_at(b)), m = _mm256_set1_ps(half_at(b + 2));
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(qs, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
    auto v = [&](__m128i q) { return _mm256_add_ps(_mm256_mul_ps(u8_ps(q), d), m); };
    out.take16(v(lo), v(high8(lo)), 0);
    out.take16(v(hi), v(high8(hi)), 16);
  }
};

struct BlockQ8_0 {  // d f16 | qs int8[32]: q * d
  static constexpr int kElems = 32, kBytes = 34;
  static bool finite(const uint8_t* b) { return std::isfinite(half_at(b)); }
  template <typename Out>
  static void block(const uint8_t* b, Out& out) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    const __m128i lo = lo128(qs), hi = hi128(qs);
    out.take16(_mm256_mul_ps(i8_ps(lo), d), _mm256_mul_ps(i8_ps(high8(lo)), d), 0);
    out.take16(_mm256_mul_ps(i8_ps(hi), d), _mm256_mul_ps(i8_ps(high8(hi)), d), 16);
  }
};

struct BlockQ4_K {  // d f16 | dmin f16 | scales[12] | qs[128]; each pair of sub-blocks 32 bytes, low nibbles first
  static constexpr int kElems = QK_K, kBytes = 144;
  static bool finite(const uint8_t* b) { return std::isfinite(half_at(b)) && std::isfinite(half_at(b + 2)); }
  template <typename Out>
  static void block(const uint8_t* b, Out& out) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    alignas(32) float dsc[8], dm[8];
    scales_k4_avx2(b + 4, half_at(b), half_at(b + 2), dsc, dm);
    const uint8_t* q = b + 16;
    for (int is = 0; is < 8; is += 2, q += 32) {
      const __m256 d1 = _mm256_broadcast_ss(dsc + is), m1 = _mm256_broadcast_ss(dm + is);
      const __m256 d2 = _mm256_broadcast_ss(dsc + is + 1), m2 = _mm256_broadcast_ss(dm + is + 1);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
      const __m256i lo = _mm256_and_si256(v, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      const int k = 32 * is;
      k_values16(out, lo128(lo), d1, m1, k);
      k_values16(out, hi128(lo), d1, m1, k + 16);
      k_values16(out, lo128(hi), d2, m2, k + 32);
      k_values16(out, hi128(hi), d2, m2, k + 48);
    }
  }
};

struct BlockQ5_K {  // d f16 | dmin f16 | scales[12] | qh[32] | qs[128]: Q4_K's nibbles with bit 4 from qh
  static constexpr int kElems = QK_K, kBytes = 176;
  static bool finite(const uint8_t* b) { return std::isfinite(half_at(b)) && std::isfinite(half_at(b + 2)); }
  template <typename Out>
  static void block(const uint8_t* b, Out& out) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    alignas(32) float dsc[8], dm[8];
    scales_k4_avx2(b + 4, half_at(b), half_at(b + 2), dsc, dm);
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));  // bits 2p, 2p+1 at bits 0, 1
    const uint8_t* q = b + 48;
    for (int is = 0; is < 8; is += 2, q += 32, h = _mm256_srli_epi16(h, 2)) {
      const __m256 d1 = _mm256_broadcast_ss(dsc + is), m1 = _mm256_broadcast_ss(dm + is);
      const __m256 d2 = _mm256_broadcast_ss(dsc + is + 1), m2 = _mm256_broadcast_ss(dm + is + 1);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
      const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_slli_epi16(_mm256_and_si256(h, one), 4));
      const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 1), one), 4));
      const int k = 32 * is;
      k_values16(out, lo128(lo), d1, m1, k);
      k_values16(out, hi128(lo), d1, m1, k + 16);
      k_values16(out, lo128(hi), d2, m2, k + 32);
      k_values16(out, hi128(hi), d2, m2, k + 48);
    }
  }
};

// ql[128] | qh[64] | scales int8[16] | d f16. Per half of 128 values: ql[0..31] low nibbles are values 0..31 and
// high nibbles 64..95, ql[32..63] low 32..63 and high 96..127, with qh bits (0,1), (4,5), (2,3), (6,7) on top; each
// 16 values v have the scale d * sc[v / 16]; value = scale * (q - 32).
struct BlockQ6_K {
  static constexpr int kElems = QK_K, kBytes = 210;
  static bool finite(const uint8_t* b) { return std::isfinite(half_at(b + 208)); }
  template <typename Out>
  static void block(const uint8_t* b, Out& out) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3), bias = _mm256_set1_epi8(32);
    const __m256 d = _mm256_set1_ps(half_at(b + 208));
    alignas(32) float s[16];
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    _mm256_storeu_ps(s, _mm256_mul_ps(d, i8_ps(sc)));
    _mm256_storeu_ps(s + 8, _mm256_mul_ps(d, i8_ps(high8(sc))));
    for (int c = 0; c < 2; ++c) {
      const uint8_t* ql = b + 64 * c;
      const __m256i A = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i B = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * c));
      auto codes = [&](__m256i nibbles, int shift) {  // (nibble | ((qh >> shift) & 3) << 4) - 32, signed bytes
        const __m256i top = _mm256_and_si256(_mm256_srli_epi16(H, shift), three);
        return _mm256_sub_epi8(_mm256_or_si256(nibbles, _mm256_slli_epi16(top, 4)), bias);
      };
      const __m256i q[4] = {codes(_mm256_and_si256(A, low4), 0), codes(_mm256_and_si256(B, low4), 2),
                            codes(_mm256_and_si256(_mm256_srli_epi16(A, 4), low4), 4),
                            codes(_mm256_and_si256(_mm256_srli_epi16(B, 4), low4), 6)};
      for (int j = 0; j < 4; ++j) {  // values 32j .. 32j+31 of this half
        const int g = 8 * c + 2 * j;
        const __m256 s0 = _mm256_broadcast_ss(s + g), s1 = _mm256_broadcast_ss(s + g + 1);
        const __m128i q0 = lo128(q[j]), q1 = hi128(q[j]);
        out.take16(_mm256_mul_ps(s0, i8_ps(q0)), _mm256_mul_ps(s0, i8_ps(high8(q0))), 128 * c + 32 * j);
        out.take16(_mm256_mul_ps(s1, i8_ps(q1)), _mm256_mul_ps(s1, i8_ps(high8(q1))), 128 * c + 32 * j + 16);
      }
    }
  }
};

// The blocks of a row, block i's values handed to outs.at(i), rounded to f16 when kRound (the NaN handling only in
// blocks whose scales are not finite).
template <typename F, bool kRound, typename Outs>
inline void blocks_avx2(const uint8_t* __restrict b, int64_t n_blocks, Outs& outs) {
  for (int64_t i = 0; i < n_blocks; ++i, b += F::kBytes) {
    prefetch_ahead(b, F::kBytes);
    decltype(auto) out = outs.at(i);  // LaneBlocks: the one set of lane sums
    using Out = std::remove_reference_t<decltype(out)>;
    if (!kRound) {
      F::block(b, out);
    } else if (F::finite(b)) {
      Rounded<2, Out> rounded{out};
      F::block(b, rounded);
    } else {
      Rounded<1, Out> rounded{out};
      F::block(b, rounded);
    }
  }
}

struct StoreValues {
  float* y;
  void take16(__m256 a, __m256 b, int k) {
    _mm256_storeu_ps(y + k, a);
    _mm256_storeu_ps(y + k + 8, b);
  }
};
template <int kElems>
struct StoreBlocks {
  float* y;
  StoreValues at(int64_t i) const { return {y + i * kElems}; }
};

template <typename F, bool kRound>
void rows_avx2(const uint8_t* b, float* y, int64_t n_blocks) {
  StoreBlocks<F::kElems> outs{y};
  blocks_avx2<F, kRound>(b, n_blocks, outs);
}

#if defined(__AVX512F__) && defined(__FMA__)
template <bool kRound>
void rows_q4_k_table(const uint8_t* b, float* y, int64_t n_blocks);  // below, with the decode-dot's tables
#endif

// The block formats with decoders written by hand (BlockQ4_0 .. BlockQ6_K): f.template operator()<F>() with type's
// block struct, and true; false, calling nothing, for any other type. The decoders of rows, of one token's dot
// product and of several tokens' all dispatch through it.
template <typename Fn>
bool with_block_format(GgmlType type, Fn&& f) {
  switch (type) {
    case GgmlType::Q4_0: f.template operator()<BlockQ4_0>(); return true;
    case GgmlType::Q4_1: f.template operator()<BlockQ4_1>(); return true;
    case GgmlType::Q8_0: f.template operator()<BlockQ8_0>(); return true;
    case GgmlType::Q4_K: f.template operator()<BlockQ4_K>(); return true;
    case GgmlType::Q5_K: f.template operator()<BlockQ5_K>(); return true;
    case GgmlType::Q6_K: f.template operator()<BlockQ6_K>(); return true;
    default: return false;
  }
}

// The decoders written by hand: n values of `type` at s into y (rounded to f16 when `round`); false for the others.
bool decode_avx2(GgmlType type, const uint8_t* s, float* y, int64_t n, bool round) {
#if defined(__AVX512F__) && defined(__FMA__)
  if (type == GgmlType::Q4_K) {
    if (round) rows_q4_k_table<true>(s, y, n / QK_K);
    else rows_q4_k_table<false>(s, y, n / QK_K);
    return true;
  }
#endif
  return with_block_format(type, [&]<typename F>() {
    round ? rows_avx2<F, true>(s, y, n / F::kElems) : rows_avx2<F, false>(s, y, n / F::kElems);
  });
}

#if defined(__FMA__)
// The 16 lane sums of kernels.hpp in registers, taking decoded values straight from the decoder: value k of a block
// (k a multiple of 16 in take16) goes to lane k mod 16, fma(x, w, s) as the kernels take it.
#if defined(__AVX512F__)
struct LanesF64 {  // two __m512d: lanes 0..7 and 8..15
  __m512d s[2];
  const double* x;  // the block's inputs
  void take16(__m256 a, __m256 b, int k) {
    s[0] = _mm512_fmadd_pd(_mm512_loadu_pd(x + k), _mm512_cvtps_pd(a), s[0]);
    s[1] = _mm512_fmadd_pd(_mm512_loadu_pd(x + k + 8), _mm512_cvtps_pd(b), s[1]);
  }
  void load(const double* acc) {
    for (int i = 0; i < 2; ++i) s[i] = _mm512_loadu_pd(acc + 8 * i);
  }
  void store(double* acc) const {
    for (int i = 0; i < 2; ++i) _mm512_storeu_pd(acc + 8 * i, s[i]);
  }
};
#else
struct LanesF64 {  // four __m256d: lanes 0..3, 4..7, 8..11, 12..15
  __m256d s[4];
  const double* x;  // the block's inputs
  void take16(__m256 a, __m256 b, int k) {
    s[0] = _mm256_fmadd_pd(_mm256_loadu_pd(x + k), _mm256_cvtps_pd(_mm256_castps256_ps128(a)), s[0]);
    s[1] = _mm256_fmadd_pd(_mm256_loadu_pd(x + k + 4), _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)), s[1]);
    s[2] = _mm256_fmadd_pd(_mm256_loadu_pd(x + k + 8), _mm256_cvtps_pd(_mm256_castps256_ps128(b)), s[2]);
    s[3] = _mm256_fmadd_pd(_mm256_loadu_pd(x + k + 12), _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1)), s[3]);
  }
  void load(const double* acc) {
    for (int i = 0; i < 4; ++i) s[i] = _mm256_loadu_pd(acc + 4 * i);
  }
  void store(double* acc) const {
    for (int i = 0; i < 4; ++i) _mm256_storeu_pd(acc + 4 * i, s[i]);
  }
};
#endif
struct LanesF32 {
  __m256 s[2];
  const float* x;
  void take16(__m256 a, __m256 b, int k) {
    s[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), a, s[0]);
    s[1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), b, s[1]);
  }
  void load(const float* acc) {
    for (int i = 0; i < 2; ++i) s[i] = _mm256_loadu_ps(acc + 8 * i);
  }
  void store(float* acc) const {
    for (int i = 0; i < 2; ++i) _mm256_storeu_ps(acc + 8 * i, s[i]);
  }
};

// A row's lane sums over its blocks, kept in the registers of `lanes` from block to block.
template <typename Lanes, typename T, int kElems>
struct LaneBlocks {
  Lanes& lanes;
  const T* x;
  Lanes& at(int64_t i) {
    lanes.x = x + i * kElems;
    return lanes;
  }
};

template <typename F, bool kRound, typename Lanes, typename T>
void dot_avx2(const uint8_t* b, const T* x, int64_t n_blocks, T* acc) {
  Lanes lanes;
  lanes.load(acc);
  LaneBlocks<Lanes, T, F::kElems> outs{lanes, x};
  blocks_avx2<F, kRound>(b, n_blocks, outs);
  lanes.store(acc);
}

// F16 rows sixteen halves at a time (values exact; a signalling NaN comes out quiet, which the NaN result of the sum
// does not see: kernels.hpp gives every NaN sum one NaN).
template <typename Lanes, typename T>
void dot_f16_avx2(const uint8_t* s, const T* x, int64_t n, T* acc) {
  Lanes lanes;
  lanes.load(acc);
  lanes.x = x;
  for (int64_t k = 0; k < n; k += 16) {
    if (k % 32 == 0) __builtin_prefetch(s + 2 * k + kPrefetchAhead);
    const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * k)));
    const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * k + 16)));
    lanes.take16(a, b, static_cast<int>(k));
  }
  lanes.store(acc);
}

#if defined(__AVX512F__)
// Q4_K at one token in f32 with AVX-512, by table: a sub-block's 32 values are d * q - m for 4-bit codes q, so its 16
// possible values are made once (the same operations on q = 0..15, rounded to f16 where asked: the same floats bit
// for bit) and each value is looked up by its code with a permute (vpermps reads the low 4 bits of each index, so a
// code byte zero-extended is its own index for the low nibble and, shifted right by 4, for the high one); the 16
// lane sums in one __m512. Per 16 values a zero-extension, a permute and an fma, where BlockQ4_K's path takes a
// conversion, a product, a difference and the f16 rounding: 20% less time a 7B matrix than making the values 16 at
// a time in one __m512 (measured on the workstation, 2026-11-28). f64 takes the same tables widened (below).
// round_f16 of 16 values (kRound 1: as Rounded<1>; 2: values that cannot be NaN, as Rounded<2>; 0: none).
template <int kRound>
inline __m512 round16_f16(__m512 v) {
  if (kRound == 0) return v;
  const __m512 rounded = _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  if (kRound == 2) return rounded;
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512 nan = _mm512_castsi512_ps(_mm512_or_si512(sign, _mm512_set1_epi32(0x7fc00000)));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, nan);
}

template <int kRound>
[[gnu::always_inline]] inline __m512 q4_k_table(const float* d, const float* m) {
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return round16_f16<kRound>(_mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(*d), codes), _mm512_set1_ps(*m)));
}

// A Q4_K block's 256 values by table, 16 at a time in input order: f(k, v) with v the values k .. k + 15.
template <int kRound, typename F>
[[gnu::always_inline]] inline void q4_k_table_values(const uint8_t* b, F&& f) {
  alignas(32) float dsc[8], dm[8];
  scales_k4_avx2(b + 4, half_at(b), half_at(b + 2), dsc, dm);
  const uint8_t* q = b + 16;
  for (int is = 0, k = 0; is < 8; is += 2, q += 32, k += 64) {
    const __m512 t1 = q4_k_table<kRound>(dsc + is, dm + is), t2 = q4_k_table<kRound>(dsc + is + 1, dm + is + 1);
    const __m512i c0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i c1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    // values 0..31 (low nibbles), then 32..63 (high nibbles)
    f(k, _mm512_permutexvar_ps(c0, t1));
    f(k + 16, _mm512_permutexvar_ps(c1, t1));
    f(k + 32, _mm512_permutexvar_ps(_mm512_srli_epi32(c0, 4), t2));
    f(k + 48, _mm512_permutexvar_ps(_mm512_srli_epi32(c1, 4), t2));
  }
}

// Each of n_blocks Q4_K blocks at b in turn: f.template operator()<kRound>(block, i), the block's rounding chosen by
// its own scales (finite: no NaN to handle), or none.
template <bool kRound, typename F>
[[gnu::always_inline]] inline void q4_k_blocks(const uint8_t* b, int64_t n_blocks, F&& f) {
  for (int64_t i = 0; i < n_blocks; ++i, b += BlockQ4_K::kBytes) {
    prefetch_ahead(b, BlockQ4_K::kBytes);
    if (!kRound) {
      f.template operator()<0>(b, i);
    } else if (BlockQ4_K::finite(b)) {
      f.template operator()<2>(b, i);
    } else {
      f.template operator()<1>(b, i);
    }
  }
}

// The lane sums: each 16 values into lanes 0..15 by one fma.
template <bool kRound>
void dot_q4_k_table(const uint8_t* b, const float* x, int64_t n_blocks, float* acc) {
  __m512 s = _mm512_loadu_ps(acc);
  q4_k_blocks<kRound>(b, n_blocks, [&]<int R>(const uint8_t* block, int64_t i) {
    const float* xb = x + i * QK_K;
    q4_k_table_values<R>(block, [&](int k, __m512 v) { s = _mm512_fmadd_ps(_mm512_loadu_ps(xb + k), v, s); });
  });
  _mm512_storeu_ps(acc, s);
}

// Q4_K rows stored by the same tables (a prefill's decoded rows): each value looked up by its code and stored, not
// summed. The same floats as BlockQ4_K's path (each table entry is d * q - m for its code, one product and one
// difference, rounded as asked), per 16 values a zero-extension, a permute and a store.
template <bool kRound>
void rows_q4_k_table(const uint8_t* b, float* y, int64_t n_blocks) {
  q4_k_blocks<kRound>(b, n_blocks, [&]<int R>(const uint8_t* block, int64_t i) {
    float* yb = y + i * QK_K;
    q4_k_table_values<R>(block, [&](int k, __m512 v) { _mm512_storeu_ps(yb + k, v); });
  });
}
template void rows_q4_k_table<true>(const uint8_t*, float*, int64_t);
template void rows_q4_k_table<false>(const uint8_t*, float*, int64_t);

// The same values widened to doubles as they are looked up (an f64 prefill's rows): no float row to store and read
// back. Widening a float is exact, so these are rows_q4_k_table's values.
template <bool kRound>
void rows_q4_k_table_wide(const uint8_t* b, double* y, int64_t n_blocks) {
  q4_k_blocks<kRound>(b, n_blocks, [&]<int R>(const uint8_t* block, int64_t i) {
    double* yb = y + i * QK_K;
    q4_k_table_values<R>(block, [&](int k, __m512 v) {
      _mm512_storeu_pd(yb + k, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
      _mm512_storeu_pd(yb + k + 8, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
    });
  });
}
#define DIFFRUN_REF_WIDE_Q4_K 1

// f64: the same tables widened to doubles (two __m512d each, exact) and each 8 values looked up with vpermi2pd, whose
// index is the code in the low 4 bits of each 64-bit lane: 8 code bytes broadcast to every lane and shifted right by
// 8 i (low nibbles) or 8 i + 4 (high nibbles) for lane i. Per 8 values a shift, a permute and an fma, where
// BlockQ4_K's path takes a widening, a conversion, a product and a difference: 5-6% less CPU time a 7B decode step on
// the workstation (bench/NOTES.md); the same doubles, so the same lane sums bit for bit. (Tried there and no faster:
// the index by vpmovzxbq or vpmultishiftqb, the table in floats looked up 16 at a time with vpermps and widened, and
// the index bytes transposed once per block with vpermb and read back at byte offsets.)
//
// NR rows (1 or 2) in lockstep, one block each (b[r]) against the same x: their sub-blocks' tables side by side, each
// 8 inputs loaded once for every row's fmas. A decode step takes two rows at once (dot_q4_k_table_f64_x2): four
// chains of fmas instead of two (one row's two chains wait on the fma before: 4 cycles each), 15-20% less CPU time
// per matrix on the workstation (bench/NOTES.md). Each row's lane sums take the same values in the same order
// whatever NR: values 16 i .. 16 i + 7 to s[r][0], the next 8 to s[r][1].
template <int kRound, int NR>
[[gnu::always_inline]] inline void block_q4_k_table_f64(const uint8_t* const (&b)[NR], const double* x,
                                                        __m512d (&s)[NR][2]) {
  alignas(32) float dsc[NR][8], dm[NR][8];
  const uint8_t* q[NR];
  for (int r = 0; r < NR; ++r) {
    scales_k4_avx2(b[r] + 4, half_at(b[r]), half_at(b[r] + 2), dsc[r], dm[r]);
    q[r] = b[r] + 16;
  }
  const __m512i shift[2] = {_mm512_setr_epi64(0, 8, 16, 24, 32, 40, 48, 56),
                            _mm512_setr_epi64(4, 12, 20, 28, 36, 44, 52, 60)};
  const auto wide = [](__m512 t, int h) {
    return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), h)));
  };
  for (int is = 0; is < 8; is += 2, x += 64) {
    __m512d ta[NR][2], tb[NR][2];  // [row][low or high nibbles]: the table's entries 0..7 and 8..15
    for (int r = 0; r < NR; ++r) {
      for (int h = 0; h < 2; ++h) {
        const __m512 t = q4_k_table<kRound>(dsc[r] + is + h, dm[r] + is + h);
        ta[r][h] = wide(t, 0);
        tb[r][h] = wide(t, 1);
      }
    }
    // values 0..31 (low nibbles), then 32..63 (high nibbles)
    for (int h = 0; h < 2; ++h) {
      for (int g = 0; g < 4; ++g) {
        const __m512d xv = _mm512_loadu_pd(x + 32 * h + 8 * g);
        for (int r = 0; r < NR; ++r) {
          uint64_t v;
          std::memcpy(&v, q[r] + 8 * g, 8);
          const __m512i idx = _mm512_srlv_epi64(_mm512_set1_epi64(static_cast<long long>(v)), shift[h]);
          s[r][g % 2] = _mm512_fmadd_pd(xv, _mm512_permutex2var_pd(ta[r][h], idx, tb[r][h]), s[r][g % 2]);
        }
      }
    }
    for (int r = 0; r < NR; ++r) q[r] += 32;
  }
}

template <bool kRound>
void dot_q4_k_table_f64(const uint8_t* b, const double* x, int64_t n_blocks, double* acc) {
  __m512d s[1][2] = {{_mm512_loadu_pd(acc), _mm512_loadu_pd(acc + 8)}};
  q4_k_blocks<kRound>(b, n_blocks, [&]<int R>(const uint8_t* block, int64_t i) {
    const uint8_t* const rows[1] = {block};
    block_q4_k_table_f64<R, 1>(rows, x + i * QK_K, s);
  });
  _mm512_storeu_pd(acc, s[0][0]);
  _mm512_storeu_pd(acc + 8, s[0][1]);
}

// One Q4_K row against NT tokens (a prefill's or a draft's): each 16 values looked up once, as q4_k_table_values
// makes them (widened to doubles for f64: exact, rows_q4_k_table_wide's values), and taken into every token's lane
// sums, whose inputs are read where they are (x [NT, ldx], no packing). Token t's lanes take the same values in the
// same order as dot_q4_k_table's (f32) or dot_q4_k_table_f64's (f64) at that token alone, so the same bits; acc
// [NT, 16]. The NT tokens' sums are NT (f32) or 2 NT (f64) independent chains in registers.
template <bool kRound, int NT>
void dot_q4_k_table_tokens(const uint8_t* b, const float* x, int64_t ldx, int64_t n_blocks, float* acc) {
  __m512 s[NT];
  for (int t = 0; t < NT; ++t) s[t] = _mm512_loadu_ps(acc + 16 * t);
  q4_k_blocks<kRound>(b, n_blocks, [&]<int R>(const uint8_t* block, int64_t i) {
    const float* xb = x + i * QK_K;
    q4_k_table_values<R>(block, [&](int k, __m512 v) {
      for (int t = 0; t < NT; ++t) s[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + t * ldx + k), v, s[t]);
    });
  });
  for (int t = 0; t < NT; ++t) _mm512_storeu_ps(acc + 16 * t, s[t]);
}

template <bool kRound, int NT>
void dot_q4_k_table_tokens(const uint8_t* b, const double* x, int64_t ldx, int64_t n_blocks, double* acc) {
  __m512d s[NT][2];
  for (int t = 0; t < NT; ++t) {
    s[t][0] = _mm512_loadu_pd(acc + 16 * t);
    s[t][1] = _mm512_loadu_pd(acc + 16 * t + 8);
  }
  q4_k_blocks<kRound>(b, n_blocks, [&]<int R>(const uint8_t* block, int64_t i) {
    const double* xb = x + i * QK_K;
    q4_k_table_values<R>(block, [&](int k, __m512 v) {
      const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
      const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
      for (int t = 0; t < NT; ++t) {
        s[t][0] = _mm512_fmadd_pd(_mm512_loadu_pd(xb + t * ldx + k), lo, s[t][0]);
        s[t][1] = _mm512_fmadd_pd(_mm512_loadu_pd(xb + t * ldx + k + 8), hi, s[t][1]);
      }
    });
  });
  for (int t = 0; t < NT; ++t) {
    _mm512_storeu_pd(acc + 16 * t, s[t][0]);
    _mm512_storeu_pd(acc + 16 * t + 8, s[t][1]);
  }
}

// The other formats' decoders (BlockQ4_0 .. BlockQ6_K, blocks_avx2) against NT tokens: each 16 decoded values taken
// into every token's lane sums by one fma per lane, as LanesF32 / LanesF64 take them at one token, so each token's
// sums are decode_dot's bits. Lanes 0..15 in one __m512 (f32) or two __m512d (f64) per token.
template <typename T, int NT>
struct LanesTokens;
template <int NT>
struct LanesTokens<float, NT> {
  __m512 s[NT];
  const float* x;  // the block's inputs of token 0; token t's are ldx further on
  int64_t ldx;
  void take16(__m256 a, __m256 b, int k) {
    const __m512 v = _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_zextpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
    for (int t = 0; t < NT; ++t) s[t] = _mm512_fmadd_ps(_mm512_loadu_ps(x + t * ldx + k), v, s[t]);
  }
  void load(const float* acc) {
    for (int t = 0; t < NT; ++t) s[t] = _mm512_loadu_ps(acc + 16 * t);
  }
  void store(float* acc) const {
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(acc + 16 * t, s[t]);
  }
};
template <int NT>
struct LanesTokens<double, NT> {
  __m512d s[NT][2];
  const double* x;
  int64_t ldx;
  void take16(__m256 a, __m256 b, int k) {
    const __m512d lo = _mm512_cvtps_pd(a), hi = _mm512_cvtps_pd(b);
    for (int t = 0; t < NT; ++t) {
      s[t][0] = _mm512_fmadd_pd(_mm512_loadu_pd(x + t * ldx + k), lo, s[t][0]);
      s[t][1] = _mm512_fmadd_pd(_mm512_loadu_pd(x + t * ldx + k + 8), hi, s[t][1]);
    }
  }
  void load(const double* acc) {
    for (int t = 0; t < NT; ++t)
      for (int h = 0; h < 2; ++h) s[t][h] = _mm512_loadu_pd(acc + 16 * t + 8 * h);
  }
  void store(double* acc) const {
    for (int t = 0; t < NT; ++t)
      for (int h = 0; h < 2; ++h) _mm512_storeu_pd(acc + 16 * t + 8 * h, s[t][h]);
  }
};

template <typename F, bool kRound, int NT, typename T>
void dot_tokens_avx2(const uint8_t* b, const T* x, int64_t ldx, int64_t n_blocks, T* acc) {
  LanesTokens<T, NT> lanes;
  lanes.ldx = ldx;
  lanes.load(acc);
  LaneBlocks<LanesTokens<T, NT>, T, F::kElems> outs{lanes, x};
  blocks_avx2<F, kRound>(b, n_blocks, outs);
  lanes.store(acc);
}

// NT tokens of a row of `type` by its block decoder (with_block_format's formats; Q4_K takes its table, above).
template <int NT, typename T>
void dot_tokens_of(GgmlType type, const uint8_t* b, bool round, const T* x, int64_t ldx, int64_t n, T* acc) {
  with_block_format(type, [&]<typename F>() {
    round ? dot_tokens_avx2<F, true, NT>(b, x, ldx, n / F::kElems, acc)
          : dot_tokens_avx2<F, false, NT>(b, x, ldx, n / F::kElems, acc);
  });
}

// The formats decode_dot_tokens takes: those with a block decoder here.
bool dot_tokens_format(GgmlType type) {
  return with_block_format(type, []<typename>() {});
}

template <typename T>
void dot_tokens(GgmlType type, const uint8_t* b, bool round, const T* x, int64_t ldx, int nt, int64_t n, T* acc) {
  if (type == GgmlType::Q4_K) {  // the table kernel, every count of tokens in one pass
    auto run = [&]<int NT>() {
      round ? dot_q4_k_table_tokens<true, NT>(b, x, ldx, n / QK_K, acc)
            : dot_q4_k_table_tokens<false, NT>(b, x, ldx, n / QK_K, acc);
    };
    switch (nt) {
      case 1: run.template operator()<1>(); return;
      case 2: run.template operator()<2>(); return;
      case 3: run.template operator()<3>(); return;
      case 4: run.template operator()<4>(); return;
      case 5: run.template operator()<5>(); return;
      case 6: run.template operator()<6>(); return;
      case 7: run.template operator()<7>(); return;
      default: run.template operator()<8>(); return;
    }
  }
  // The other formats in groups of 8, 4, 2 and 1 tokens (each group decodes the row again; a draft's 8 tokens are one).
  for (int t = 0; t < nt;) {
    const int g = nt - t >= 8 ? 8 : nt - t >= 4 ? 4 : nt - t >= 2 ? 2 : 1;
    const T* xt = x + t * ldx;
    T* at = acc + 16 * t;
    g == 8   ? dot_tokens_of<8>(type, b, round, xt, ldx, n, at)
    : g == 4 ? dot_tokens_of<4>(type, b, round, xt, ldx, n, at)
    : g == 2 ? dot_tokens_of<2>(type, b, round, xt, ldx, n, at)
             : dot_tokens_of<1>(type, b, round, xt, ldx, n, at);
    t += g;
  }
}
#define DIFFRUN_REF_DOT_TOKENS 1

// dot_q4_k_table_f64 of two rows (b0, b1) against the same x: acc0 and acc1 [16] each.
void dot_q4_k_table_f64_x2(const uint8_t* b0, const uint8_t* b1, const double* x, int64_t n_blocks, double* acc0,
                           double* acc1) {
  __m512d s[2][2] = {{_mm512_loadu_pd(acc0), _mm512_loadu_pd(acc0 + 8)}, {_mm512_loadu_pd(acc1), _mm512_loadu_pd(acc1 + 8)}};
  for (int64_t i = 0; i < n_blocks; ++i, b0 += BlockQ4_K::kBytes, b1 += BlockQ4_K::kBytes) {
    prefetch_ahead(b0, BlockQ4_K::kBytes);
    prefetch_ahead(b1, BlockQ4_K::kBytes);
    const uint8_t* const rows[2] = {b0, b1};
    block_q4_k_table_f64<0, 2>(rows, x + i * QK_K, s);
  }
  for (int h = 0; h < 2; ++h) {
    _mm512_storeu_pd(acc0 + 8 * h, s[0][h]);
    _mm512_storeu_pd(acc1 + 8 * h, s[1][h]);
  }
}
#define DIFFRUN_REF_DOT_X2 1
#endif  // __AVX512F__

template <typename Lanes, typename T>
bool decode_dot_avx2(GgmlType type, const uint8_t* s, bool round, const T* x, int64_t n, T* acc) {
#if defined(__AVX512F__)
  if (type == GgmlType::Q4_K) {
    if constexpr (sizeof(T) == 4) {
      round ? dot_q4_k_table<true>(s, x, n / QK_K, acc) : dot_q4_k_table<false>(s, x, n / QK_K, acc);
    } else {
      round ? dot_q4_k_table_f64<true>(s, x, n / QK_K, acc) : dot_q4_k_table_f64<false>(s, x, n / QK_K, acc);
    }
    return true;
  }
#endif
  if (type == GgmlType::F16) {
    if (n % 16 != 0) return false;  // rows of whole groups of 16 only (a piece's k0 stays a multiple of 16)
    dot_f16_avx2<Lanes>(s, x, n, acc);
    return true;
  }
  return with_block_format(type, [&]<typename F>() {
    round ? dot_avx2<F, true, Lanes>(s, x, n / F::kElems, acc) : dot_avx2<F, false, Lanes>(s, x, n / F::kElems, acc);
  });
}
#define DIFFRUN_REF_FUSED_DOT 1
#endif  // __FMA__
#endif  // DIFFRUN_REF_AVX2_DECODE

#if defined(__F16C__)
// Eight converted halves to floats or (exactly) to doubles.
void store8(float* y, __m256 f) { _mm256_storeu_ps(y, f); }
void store8(double* y, __m256 f) {
  _mm256_storeu_pd(y, _mm256_cvtps_pd(_mm256_castps256_ps128(f)));
  _mm256_storeu_pd(y + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)));
}
#endif

// Halves to floats or doubles (every half is exact in both).
template <typename T>
void rows_f16(const uint8_t* __restrict s, T* __restrict y, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  // The hardware conversion is exact except that it quiets a signalling NaN: such lanes are redone by hand.
  for (; i + 8 <= n; i += 8) {
    if (i % 32 == 0) __builtin_prefetch(s + 2 * i + kPrefetchAhead);
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * i));
    store8(y + i, _mm256_cvtph_ps(h));
    const __m128i nan = _mm_cmpgt_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x7c00));
    if (!_mm_testz_si128(nan, nan)) {
      for (int64_t k = i; k < i + 8; ++k) y[k] = half_to_float(load_u16(s + 2 * k));
    }
  }
#endif
  for (; i < n; ++i) y[i] = half_to_float(load_u16(s + 2 * i));
}

void rows_bf16(const uint8_t* __restrict s, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = std::bit_cast<float>(static_cast<uint32_t>(load_u16(s + 2 * i)) << 16);
}

using RowsFn = void (*)(const uint8_t*, float*, int64_t);

// The decoder of a block format and its block size, or null where dequantize does it.
RowsFn rows_fn(GgmlType t, int64_t* block) {
  switch (t) {
    case GgmlType::Q4_0: *block = 32; return rows_q4_0;
    case GgmlType::Q4_1: *block = 32; return rows_q4_1;
    case GgmlType::Q8_0: *block = 32; return rows_q8_0;
    case GgmlType::Q4_K: *block = QK_K; return rows_q4_k;
    case GgmlType::Q5_K: *block = QK_K; return rows_q5_k;
    case GgmlType::Q6_K: *block = QK_K; return rows_q6_k;
    default: return nullptr;
  }
}

// n values of `type` at s into y; rounded to f16 as round_f16 rounds them when `round` (an F16 matrix's values are
// halves already: rounding them is the identity, skipped). The decoders written by hand for AVX2 run unless the
// portable kernels are selected (reference_cpu/kernels.hpp); they give the same values.
void decode(GgmlType type, const uint8_t* s, float* y, int64_t n, bool round = false) {
#if DIFFRUN_REF_AVX2_DECODE
  if (!portable_kernels() && decode_avx2(type, s, y, n, round)) return;
#endif
  int64_t block = 0;
  if (const RowsFn fn = rows_fn(type, &block)) {
    fn(s, y, n / block);
  } else if (type == GgmlType::F32) {
    std::memcpy(y, s, static_cast<size_t>(n) * 4);
  } else if (type == GgmlType::F16) {
    rows_f16(s, y, n);
  } else if (type == GgmlType::BF16) {
    rows_bf16(s, y, n);
  } else {
    dequantize(type, s, y, n);
  }
  if (round && type != GgmlType::F16) round_f16(y, n);
}

}  // namespace

void dequantize_rows(GgmlType type, const std::byte* src, float* dst, int64_t n) {
  decode(type, reinterpret_cast<const uint8_t*>(src), dst, n);
}

void dequantize_rows_f16(GgmlType type, const std::byte* src, float* dst, int64_t n) {
  decode(type, reinterpret_cast<const uint8_t*>(src), dst, n, true);
}

template <typename T>
bool decode_dot(GgmlType type, const std::byte* src, bool round, const T* x, int64_t n, T* acc) {
#if DIFFRUN_REF_FUSED_DOT
  if (!portable_kernels()) {
    using Lanes = std::conditional_t<sizeof(T) == 8, LanesF64, LanesF32>;
    return decode_dot_avx2<Lanes>(type, reinterpret_cast<const uint8_t*>(src), round, x, n, acc);
  }
#else
  (void)type, (void)src, (void)round, (void)x, (void)n, (void)acc;
#endif
  return false;
}

bool decode_dot_x2(GgmlType type, const std::byte* s0, const std::byte* s1, bool round, const double* x, int64_t n,
                   double* acc0, double* acc1) {
#if DIFFRUN_REF_DOT_X2
  if (type != GgmlType::Q4_K || round || portable_kernels()) return false;
  dot_q4_k_table_f64_x2(reinterpret_cast<const uint8_t*>(s0), reinterpret_cast<const uint8_t*>(s1), x, n / QK_K, acc0, acc1);
  return true;
#else
  (void)type, (void)s0, (void)s1, (void)round, (void)x, (void)n, (void)acc0, (void)acc1;
  return false;
#endif
}

template <typename T>
bool decode_dot_tokens(GgmlType type, const std::byte* src, bool round, const T* x, int64_t ldx, int nt, int64_t n,
                       T* acc) {
#if DIFFRUN_REF_DOT_TOKENS
  if (!dot_tokens_format(type) || nt < 1 || nt > kDotTokens || portable_kernels()) return false;
  dot_tokens(type, reinterpret_cast<const uint8_t*>(src), round, x, ldx, nt, n, acc);
  return true;
#else
  (void)type, (void)src, (void)round, (void)x, (void)ldx, (void)nt, (void)n, (void)acc;
  return false;
#endif
}

bool has_dot_tokens(GgmlType type) {
#if DIFFRUN_REF_DOT_TOKENS
  return dot_tokens_format(type) && !portable_kernels();
#else
  (void)type;
  return false;
#endif
}

template bool decode_dot_tokens<float>(GgmlType, const std::byte*, bool, const float*, int64_t, int, int64_t, float*);
template bool decode_dot_tokens<double>(GgmlType, const std::byte*, bool, const double*, int64_t, int, int64_t,
                                        double*);
template bool decode_dot<float>(GgmlType, const std::byte*, bool, const float*, int64_t, float*);
template bool decode_dot<double>(GgmlType, const std::byte*, bool, const double*, int64_t, double*);

void dequantize_rows(GgmlType type, const std::byte* src, double* dst, int64_t n) {
  decode_rows_wide(type, src, dst, n, false);
}

void decode_rows_wide(GgmlType type, const std::byte* src, double* dst, int64_t n, bool round) {
  const auto* s = reinterpret_cast<const uint8_t*>(src);
  if (type == GgmlType::F16) {  // halves straight to doubles, not through a float chunk (rounding them: the identity)
    rows_f16(s, dst, n);
    return;
  }
#if defined(DIFFRUN_REF_WIDE_Q4_K)
  if (type == GgmlType::Q4_K && !portable_kernels()) {
    round ? rows_q4_k_table_wide<true>(s, dst, n / QK_K) : rows_q4_k_table_wide<false>(s, dst, n / QK_K);
    return;
  }
#endif
  // Through a float chunk of whole blocks, widened (every dequantized value is a float).
  constexpr int64_t kChunk = 4 * QK_K;
  float tmp[kChunk];
  const int64_t chunk_bytes = kChunk / ggml_block_elements(type) * ggml_block_bytes(type);
  for (int64_t i = 0; i < n; i += kChunk, s += chunk_bytes) {
    const int64_t m = n - i < kChunk ? n - i : kChunk;
    decode(type, s, tmp, m, round);
    for (int64_t k = 0; k < m; ++k) dst[i + k] = tmp[k];
  }
}

void round_f16(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  // Eight at a time with the CPU's conversions (vcvtps2ph rounding to nearest even, vcvtph2ps), where
  // Eigen::half converts one value at a time in software: the same values, NaN made Eigen's quiet NaN
  // of the same sign (tests/test_reference_weights.cpp checks every case). 10x faster: the
  // f32-f16store reference rounds every weight it decodes.
  const __m256 quiet_nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 rounded = _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    const __m256 nan = _mm256_or_ps(_mm256_and_ps(v, sign), quiet_nan);
    _mm256_storeu_ps(x + i, _mm256_blendv_ps(rounded, nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
#endif
  for (; i < n; ++i) x[i] = static_cast<float>(Eigen::half(x[i]));
}

void round_f16(double* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<double>(static_cast<float>(Eigen::half(static_cast<float>(x[i]))));
}

}  // namespace diffrun::ref
