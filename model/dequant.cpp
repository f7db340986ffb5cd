// CPU dequantization of ggml block formats, value for value as ggml's dequantize_row_* (ggml-quants.c).
#include "model/dequant.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <thread>

#include <fmt/core.h>

#include "model/error.hpp"

// ggml rounds d*q and then adds m. With these formats' bit widths the products are exact, so a fused
// multiply-add could not change a value today; contraction is still off so that the operation order
// is ggml's by construction, whatever -march the build uses.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace diffrun {

namespace {

constexpr int QK_K = 256;

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

uint32_t f16_bits_to_f32_bits(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return sign;
    // Subnormal half: normalize into an f32 normal (every half subnormal is an f32 normal).
    uint32_t e = 127 - 15 + 1;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    return sign | (e << 23) | ((mant & 0x3ffu) << 13);
  }
  if (exp == 31) return sign | 0x7f800000u | (mant << 13);  // inf, and NaN with its payload
  return sign | ((exp + 127 - 15) << 23) | (mant << 13);
}

struct HalfTable {
  float v[65536];
  HalfTable() {
    for (uint32_t h = 0; h < 65536; ++h) v[h] = std::bit_cast<float>(f16_bits_to_f32_bits(static_cast<uint16_t>(h)));
  }
};

const float* half_table() {
  static const HalfTable table;
  return table.v;
}

float half_at(const uint8_t* p) { return half_table()[load_u16(p)]; }

// ---- one block of each format into 32 or 256 floats ----

void block_q4_0(const uint8_t* b, float* y) {  // d f16 | qs[16]
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    const int x0 = (qs[j] & 0x0f) - 8;
    const int x1 = (qs[j] >> 4) - 8;
    y[j] = static_cast<float>(x0) * d;
    y[j + 16] = static_cast<float>(x1) * d;
  }
}

void block_q4_1(const uint8_t* b, float* y) {  // d f16 | m f16 | qs[16]
  const float d = half_at(b);
  const float m = half_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    const int x0 = qs[j] & 0x0f;
    const int x1 = qs[j] >> 4;
    y[j] = static_cast<float>(x0) * d + m;
    y[j + 16] = static_cast<float>(x1) * d + m;
  }
}

void block_q5_0(const uint8_t* b, float* y) {  // d f16 | qh u32 | qs[16]
  const float d = half_at(b);
  const uint32_t qh = load_u32(b + 2);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const uint8_t xh_0 = static_cast<uint8_t>(((qh >> (j + 0)) << 4) & 0x10);
    const uint8_t xh_1 = static_cast<uint8_t>((qh >> (j + 12)) & 0x10);
    const int x0 = ((qs[j] & 0x0f) | xh_0) - 16;
    const int x1 = ((qs[j] >> 4) | xh_1) - 16;
    y[j] = static_cast<float>(x0) * d;
    y[j + 16] = static_cast<float>(x1) * d;
  }
}

void block_q5_1(const uint8_t* b, float* y) {  // d f16 | m f16 | qh u32 | qs[16]
  const float d = half_at(b);
  const float m = half_at(b + 2);
  const uint32_t qh = load_u32(b + 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const uint8_t xh_0 = static_cast<uint8_t>(((qh >> (j + 0)) << 4) & 0x10);
    const uint8_t xh_1 = static_cast<uint8_t>((qh >> (j + 12)) & 0x10);
    const int x0 = (qs[j] & 0x0f) | xh_0;
    const int x1 = (qs[j] >> 4) | xh_1;
    y[j] = static_cast<float>(x0) * d + m;
    y[j + 16] = static_cast<float>(x1) * d + m;
  }
}

void block_q8_0(const uint8_t* b, float* y) {  // d f16 | qs int8[32]
  const float d = half_at(b);
  const auto* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

void block_q2_k(const uint8_t* b, float* y) {  // scales[16] | qs[64] | d f16 | dmin f16
  const uint8_t* scales = b;
  const uint8_t* q = b + 16;
  const float d = half_at(b + 80);
  const float min = half_at(b + 82);
  int is = 0;
  for (int n = 0; n < QK_K; n += 128) {
    int shift = 0;
    for (int j = 0; j < 4; ++j) {
      uint8_t sc = scales[is++];
      float dl = d * static_cast<float>(sc & 0xf);
      float ml = min * static_cast<float>(sc >> 4);
      for (int l = 0; l < 16; ++l) *y++ = dl * static_cast<float>((q[l] >> shift) & 3) - ml;
      sc = scales[is++];
      dl = d * static_cast<float>(sc & 0xf);
      ml = min * static_cast<float>(sc >> 4);
      for (int l = 0; l < 16; ++l) *y++ = dl * static_cast<float>((q[l + 16] >> shift) & 3) - ml;
      shift += 2;
    }
    q += 32;
  }
}

void block_q3_k(const uint8_t* b, float* y) {  // hmask[32] | qs[64] | scales[12] | d f16
  const uint8_t* hm = b;
  const uint8_t* q = b + 32;
  const uint8_t* packed = b + 96;
  const float d_all = half_at(b + 108);
  // 16 6-bit scales: low 4 bits from bytes 0..7 (low nibbles, then high), high 2 bits from bytes 8..11.
  int8_t scales[16];
  for (int i = 0; i < 16; ++i) {
    const int low = (i < 8 ? packed[i] : packed[i - 8] >> 4) & 0x0f;
    const int high = (packed[8 + (i % 4)] >> (2 * (i / 4))) & 0x03;
    scales[i] = static_cast<int8_t>((low | (high << 4)) - 32);
  }
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < QK_K; n += 128) {
    int shift = 0;
    for (int j = 0; j < 4; ++j) {
      float dl = d_all * static_cast<float>(scales[is++]);
      for (int l = 0; l < 16; ++l)
        *y++ = dl * static_cast<float>(((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
      dl = d_all * static_cast<float>(scales[is++]);
      for (int l = 0; l < 16; ++l)
        *y++ = dl * static_cast<float>(((q[l + 16] >> shift) & 3) - ((hm[l + 16] & m) ? 0 : 4));
      shift += 2;
      m = static_cast<uint8_t>(m << 1);
    }
    q += 32;
  }
}

// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block (ggml's get_scale_min_k4).
void scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = static_cast<uint8_t>((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

void block_q4_k(const uint8_t* b, float* y) {  // d f16 | dmin f16 | scales[12] | qs[128]
  const float d = half_at(b);
  const float min = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  int is = 0;
  for (int j = 0; j < QK_K; j += 64) {
    uint8_t sc, m;
    scale_min_k4(is + 0, scales, &sc, &m);
    const float d1 = d * static_cast<float>(sc);
    const float m1 = min * static_cast<float>(m);
    scale_min_k4(is + 1, scales, &sc, &m);
    const float d2 = d * static_cast<float>(sc);
    const float m2 = min * static_cast<float>(m);
    for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0xf) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    q += 32;
    is += 2;
  }
}

void block_q5_k(const uint8_t* b, float* y) {  // d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
  const float d = half_at(b);
  const float min = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  int is = 0;
  uint8_t u1 = 1, u2 = 2;
  for (int j = 0; j < QK_K; j += 64) {
    uint8_t sc, m;
    scale_min_k4(is + 0, scales, &sc, &m);
    const float d1 = d * static_cast<float>(sc);
    const float m1 = min * static_cast<float>(m);
    scale_min_k4(is + 1, scales, &sc, &m);
    const float d2 = d * static_cast<float>(sc);
    const float m2 = min * static_cast<float>(m);
    for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>((ql[l] & 0xf) + (qh[l] & u1 ? 16 : 0)) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
    ql += 32;
    is += 2;
    u1 = static_cast<uint8_t>(u1 << 2);
    u2 = static_cast<uint8_t>(u2 << 2);
  }
}

void block_q6_k(const uint8_t* b, float* y) {  // ql[128] | qh[64] | scales int8[16] | d f16
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int n = 0; n < QK_K; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l + 0] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l + 0] = d * static_cast<float>(sc[is + 0]) * static_cast<float>(q1);
      y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
      y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
      y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

using BlockFn = void (*)(const uint8_t*, float*);

BlockFn block_fn(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0: return block_q4_0;
    case GgmlType::Q4_1: return block_q4_1;
    case GgmlType::Q5_0: return block_q5_0;
    case GgmlType::Q5_1: return block_q5_1;
    case GgmlType::Q8_0: return block_q8_0;
    case GgmlType::Q2_K: return block_q2_k;
    case GgmlType::Q3_K: return block_q3_k;
    case GgmlType::Q4_K: return block_q4_k;
    case GgmlType::Q5_K: return block_q5_k;
    case GgmlType::Q6_K: return block_q6_k;
    default: return nullptr;
  }
}

void check_args(GgmlType t, int64_t n) {
  if (!dequant_supported(t))
    throw ModelError(fmt::format("cannot dequantize dtype {}: supported are F32, F16, BF16, Q4_0, Q4_1, Q5_0, "
                                 "Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K",
                                 ggml_type_name(t)));
  if (n < 0 || n % ggml_block_elements(t) != 0)
    throw ModelError(fmt::format("cannot dequantize {} values of {}: not a whole number of {}-value blocks", n,
                                 ggml_type_name(t), ggml_block_elements(t)));
}

template <typename T>
void dequantize_impl(GgmlType t, const void* src, T* dst, int64_t n) {
  check_args(t, n);
  const auto* s = static_cast<const uint8_t*>(src);
  switch (t) {
    case GgmlType::F32:
      if constexpr (std::is_same_v<T, float>) {
        std::memcpy(dst, s, static_cast<size_t>(n) * 4);
      } else {
        for (int64_t i = 0; i < n; ++i) {
          float f;
          std::memcpy(&f, s + 4 * i, 4);
          dst[i] = f;
        }
      }
      return;
    case GgmlType::F16: {
      const float* table = half_table();
      for (int64_t i = 0; i < n; ++i) dst[i] = table[load_u16(s + 2 * i)];
      return;
    }
    case GgmlType::BF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(load_u16(s + 2 * i));
      return;
    default: break;
  }
  const BlockFn fn = block_fn(t);
  const int64_t be = ggml_block_elements(t);
  const int64_t bb = ggml_block_bytes(t);
  const int64_t n_blocks = n / be;
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = 0; i < n_blocks; ++i) fn(s + i * bb, dst + i * be);
  } else {
    float tmp[QK_K];
    for (int64_t i = 0; i < n_blocks; ++i) {
      fn(s + i * bb, tmp);
      for (int64_t j = 0; j < be; ++j) dst[i * be + j] = tmp[j];
    }
  }
}

}  // namespace

bool dequant_supported(GgmlType t) {
  return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16 || block_fn(t) != nullptr;
}

bool gemv_super_block(GgmlType t) { return t == GgmlType::Q4_K || t == GgmlType::Q5_K || t == GgmlType::Q6_K; }

void dequantize(GgmlType t, const void* src, float* dst, int64_t n) { dequantize_impl(t, src, dst, n); }
void dequantize(GgmlType t, const void* src, double* dst, int64_t n) { dequantize_impl(t, src, dst, n); }

template <typename T>
std::vector<T> dequantize_tensor(const GgufFile& file, const TensorInfo& t) {
  check_args(t.type, t.n_elements);
  std::vector<T> out(static_cast<size_t>(t.n_elements));
  const auto* src = reinterpret_cast<const uint8_t*>(file.tensor_data(t).data());
  // Split large tensors into whole-block chunks, one per hardware thread.
  const int64_t be = ggml_block_elements(t.type);
  const int64_t bb = ggml_block_bytes(t.type);
  const int64_t n_blocks = t.n_elements / be;
  constexpr int64_t kMinChunkElements = int64_t{1} << 20;
  const int64_t max_threads = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t n_threads = std::clamp<int64_t>(t.n_elements / kMinChunkElements, 1, max_threads);
  if (n_threads == 1) {
    dequantize(t.type, src, out.data(), t.n_elements);
    return out;
  }
  const int64_t per = (n_blocks + n_threads - 1) / n_threads;
  std::vector<std::jthread> workers;
  for (int64_t k = 0; k < n_threads; ++k) {
    const int64_t b0 = k * per;
    const int64_t b1 = std::min(n_blocks, b0 + per);
    if (b0 >= b1) break;
    workers.emplace_back([&, b0, b1] { dequantize(t.type, src + b0 * bb, out.data() + b0 * be, (b1 - b0) * be); });
  }
  return out;
}

template std::vector<float> dequantize_tensor<float>(const GgufFile&, const TensorInfo&);
template std::vector<double> dequantize_tensor<double>(const GgufFile&, const TensorInfo&);

float f16_to_f32(uint16_t h) { return half_table()[h]; }

float bf16_to_f32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

uint16_t f32_to_f16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a & 0x7fffffu) >> 13));  // quiet NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  const uint32_t e = a >> 23;
  if (a < 0x38800000u) {  // below the smallest normal half 2^-14: a subnormal half or zero
    const uint32_t shift = 126 - e;  // the half's unit is 2^-24
    if (e == 0 || shift > 24) return sign;
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t h = ((e - 112) << 10) | ((a & 0x7fffffu) >> 13);
  const uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) ++h;
  return static_cast<uint16_t>(sign | h);
}

}  // namespace diffrun
