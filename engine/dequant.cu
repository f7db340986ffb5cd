// Device dequantization kernels, transliterated from ggml's dequantize_row_* (ggml-quants.c) and
// checked bit-for-bit against model/dequant.cpp. Blocks are read byte by byte (block sizes such as
// 18 or 22 bytes leave fields unaligned). __fmul_rn/__fadd_rn/__fsub_rn keep nvcc from fusing
// a*b+c into an FMA, which would round once where the CPU rounds twice.
#include "engine/dequant.cuh"

#include <string>

#include "engine/cuda_check.cuh"
#include "model/error.hpp"

namespace diffrun::engine {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ uint16_t read_u16(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
}

// IEEE half to float by bit manipulation: exact for every input, subnormals and -0 included.
__device__ __forceinline__ float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = __fmul_rn(static_cast<float>(mant), 5.9604644775390625e-8f);  // mant * 2^-24, exact
    return sign ? -v : v;
  }
  if (exp == 31) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
  return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

__device__ __forceinline__ float read_half(const uint8_t* p) { return half_bits_to_float(read_u16(p)); }

__device__ __forceinline__ void store(float* dst, int64_t i, float v) { dst[i] = v; }
__device__ __forceinline__ void store(__half* dst, int64_t i, float v) { dst[i] = __float2half_rn(v); }

// Q4_K / Q5_K 6-bit scale and min of sub-block j (ggml's get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
  }
}

// ---- element formats: one thread per element ----

template <typename Out>
static __global__ void dequant_f32(const uint8_t* src, Out* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint8_t* p = src + 4 * i;
    store(dst, i, __uint_as_float(p[0] | (p[1] << 8) | (p[2] << 16) | (uint32_t(p[3]) << 24)));
  }
}

template <typename Out>
static __global__ void dequant_f16(const uint8_t* src, Out* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store(dst, i, read_half(src + 2 * i));
}

template <typename Out>
static __global__ void dequant_bf16(const uint8_t* src, Out* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store(dst, i, __uint_as_float(uint32_t(read_u16(src + 2 * i)) << 16));
}

// ---- 32-element block formats: one thread per block ----

template <typename Out>
static __global__ void dequant_q4_0(const uint8_t* src, Out* dst, int64_t nb) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= nb) return;
  const uint8_t* p = src + 18 * b;
  const float d = read_half(p);
  const uint8_t* qs = p + 2;
  Out* y = dst + 32 * b;
  for (int j = 0; j < 16; ++j) {
    const int x0 = (qs[j] & 0x0F) - 8;
    const int x1 = (qs[j] >> 4) - 8;
    store(y, j, __fmul_rn(static_cast<float>(x0), d));
    store(y, j + 16, __fmul_rn(static_cast<float>(x1), d));
  }
}

template <typename Out>
static __global__ void dequant_q4_1(const uint8_t* src, Out* dst, int64_t nb) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= nb) return;
  const uint8_t* p = src + 20 * b;
  const float d = read_half(p);
  const float m = read_half(p + 2);
  const uint8_t* qs = p + 4;
  Out* y = dst + 32 * b;
  for (int j = 0; j < 16; ++j) {
    const int x0 = qs[j] & 0x0F;
    const int x1 = qs[j] >> 4;
    store(y, j, __fadd_rn(__fmul_rn(static_cast<float>(x0), d), m));
    store(y, j + 16, __fadd_rn(__fmul_rn(static_cast<float>(x1), d), m));
  }
}

template <typename Out>
static __global__ void dequant_q5_0(const uint8_t* src, Out* dst, int64_t nb) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= nb) return;
  const uint8_t* p = src + 22 * b;
  const float d = read_half(p);
  const uint32_t qh = p[2] | (p[3] << 8) | (p[4] << 16) | (uint32_t(p[5]) << 24);
  const uint8_t* qs = p + 6;
  Out* y = dst + 32 * b;
  for (int j = 0; j < 16; ++j) {
    const uint8_t xh_0 = ((qh >> (j + 0)) << 4) & 0x10;
    const uint8_t xh_1 = ((qh >> (j + 12))) & 0x10;
    const int32_t x0 = ((qs[j] & 0x0F) | xh_0) - 16;
    const int32_t x1 = ((qs[j] >> 4) | xh_1) - 16;
    store(y, j, __fmul_rn(static_cast<float>(x0), d));
    store(y, j + 16, __fmul_rn(static_cast<float>(x1), d));
  }
}

template <typename Out>
static __global__ void dequant_q5_1(const uint8_t* src, Out* dst, int64_t nb) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= nb) return;
  const uint8_t* p = src + 24 * b;
  const float d = read_half(p);
  const float m = read_half(p + 2);
  const uint32_t qh = p[4] | (p[5] << 8) | (p[6] << 16) | (uint32_t(p[7]) << 24);
  const uint8_t* qs = p + 8;
  Out* y = dst + 32 * b;
  for (int j = 0; j < 16; ++j) {
    const uint8_t xh_0 = ((qh >> (j + 0)) << 4) & 0x10;
    const uint8_t xh_1 = ((qh >> (j + 12))) & 0x10;
    const int x0 = (qs[j] & 0x0F) | xh_0;
    const int x1 = (qs[j] >> 4) | xh_1;
    store(y, j, __fadd_rn(__fmul_rn(static_cast<float>(x0), d), m));
    store(y, j + 16, __fadd_rn(__fmul_rn(static_cast<float>(x1), d), m));
  }
}

template <typename Out>
static __global__ void dequant_q8_0(const uint8_t* src, Out* dst, int64_t nb) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= nb) return;
  const uint8_t* p = src + 34 * b;
  const float d = read_half(p);
  const int8_t* qs = reinterpret_cast<const int8_t*>(p + 2);
  Out* y = dst + 32 * b;
  for (int j = 0; j < 32; ++j) store(y, j, __fmul_rn(static_cast<float>(qs[j]), d));
}

// ---- 256-element K-quant super-blocks: one thread per super-block ----

template <typename Out>
static __global__ void dequant_q2_k(const uint8_t* src, Out* dst, int64_t nb) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= nb) return;
  const uint8_t* p = src + 84 * b;  // scales[16], qs[64], d, dmin
  const uint8_t* scales = p;
  const uint8_t* q = p + 16;
  const float d = read_half(p + 80);
  const float min = read_half(p + 82);
  Out* y = dst + 256 * b;
  int64_t o = 0;
  int is = 0;
  for (int n = 0; n < 256; n += 128) {
    int shift = 0;
    for (int j = 0; j < 4; ++j) {
      uint8_t sc = scales[is++];
      float dl = __fmul_rn(d, static_cast<float>(sc & 0xF));
      float ml = __fmul_rn(min, static_cast<float>(sc >> 4));
      for (int l = 0; l < 16; ++l)
        store(y, o++, __fsub_rn(__fmul_rn(dl, static_cast<float>(static_cast<int8_t>((q[l] >> shift) & 3))), ml));
      sc = scales[is++];
      dl = __fmul_rn(d, static_cast<float>(sc & 0xF));
      ml = __fmul_rn(min, static_cast<float>(sc >> 4));
      for (int l = 0; l < 16; ++l)
        store(y, o++,
              __fsub_rn(__fmul_rn(dl, static_cast<float>(static_cast<int8_t>((q[l + 16] >> shift) & 3))), ml));
      shift += 2;
    }
    q += 32;
  }
}

template <typename Out>
static __global__ void dequant_q3_k(const uint8_t* src, Out* dst, int64_t nb) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= nb) return;
  const uint8_t* p = src + 110 * b;  // hmask[32], qs[64], scales[12], d
  const uint8_t* hm = p;
  const uint8_t* q = p + 32;
  const uint8_t* sraw = p + 96;
  const float d_all = read_half(p + 108);

  constexpr uint32_t kmask1 = 0x03030303u;
  constexpr uint32_t kmask2 = 0x0f0f0f0fu;
  uint32_t aux[4];
  for (int i = 0; i < 3; ++i)
    aux[i] = sraw[4 * i] | (sraw[4 * i + 1] << 8) | (sraw[4 * i + 2] << 16) | (uint32_t(sraw[4 * i + 3]) << 24);
  const uint32_t tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
  aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
  aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
  aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
  int8_t scales[16];
  for (int i = 0; i < 16; ++i) scales[i] = static_cast<int8_t>((aux[i / 4] >> (8 * (i % 4))) & 0xFF);

  Out* y = dst + 256 * b;
  int64_t o = 0;
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < 256; n += 128) {
    int shift = 0;
    for (int j = 0; j < 4; ++j) {
      float dl = __fmul_rn(d_all, static_cast<float>(scales[is++] - 32));
      for (int l = 0; l < 16; ++l) {
        const int v = static_cast<int8_t>((q[l + 0] >> shift) & 3) - ((hm[l + 0] & m) ? 0 : 4);
        store(y, o++, __fmul_rn(dl, static_cast<float>(v)));
      }
      dl = __fmul_rn(d_all, static_cast<float>(scales[is++] - 32));
      for (int l = 0; l < 16; ++l) {
        const int v = static_cast<int8_t>((q[l + 16] >> shift) & 3) - ((hm[l + 16] & m) ? 0 : 4);
        store(y, o++, __fmul_rn(dl, static_cast<float>(v)));
      }
      shift += 2;
      m <<= 1;
    }
    q += 32;
  }
}

template <typename Out>
static __global__ void dequant_q4_k(const uint8_t* src, Out* dst, int64_t nb) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= nb) return;
  const uint8_t* p = src + 144 * b;  // d, dmin, scales[12], qs[128]
  const float d = read_half(p);
  const float min = read_half(p + 2);
  const uint8_t* scales = p + 4;
  const uint8_t* q = p + 16;
  Out* y = dst + 256 * b;
  int64_t o = 0;
  int is = 0;
  uint8_t sc, m;
  for (int j = 0; j < 256; j += 64) {
    scale_min_k4(is + 0, scales, &sc, &m);
    const float d1 = __fmul_rn(d, static_cast<float>(sc));
    const float m1 = __fmul_rn(min, static_cast<float>(m));
    scale_min_k4(is + 1, scales, &sc, &m);
    const float d2 = __fmul_rn(d, static_cast<float>(sc));
    const float m2 = __fmul_rn(min, static_cast<float>(m));
    for (int l = 0; l < 32; ++l) store(y, o++, __fsub_rn(__fmul_rn(d1, static_cast<float>(q[l] & 0xF)), m1));
    for (int l = 0; l < 32; ++l) store(y, o++, __fsub_rn(__fmul_rn(d2, static_cast<float>(q[l] >> 4)), m2));
    q += 32;
    is += 2;
  }
}

template <typename Out>
static __global__ void dequant_q5_k(const uint8_t* src, Out* dst, int64_t nb) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= nb) return;
  const uint8_t* p = src + 176 * b;  // d, dmin, scales[12], qh[32], qs[128]
  const float d = read_half(p);
  const float min = read_half(p + 2);
  const uint8_t* scales = p + 4;
  const uint8_t* qh = p + 16;
  const uint8_t* ql = p + 48;
  Out* y = dst + 256 * b;
  int64_t o = 0;
  int is = 0;
  uint8_t sc, m;
  uint8_t u1 = 1, u2 = 2;
  for (int j = 0; j < 256; j += 64) {
    scale_min_k4(is + 0, scales, &sc, &m);
    const float d1 = __fmul_rn(d, static_cast<float>(sc));
    const float m1 = __fmul_rn(min, static_cast<float>(m));
    scale_min_k4(is + 1, scales, &sc, &m);
    const float d2 = __fmul_rn(d, static_cast<float>(sc));
    const float m2 = __fmul_rn(min, static_cast<float>(m));
    for (int l = 0; l < 32; ++l)
      store(y, o++, __fsub_rn(__fmul_rn(d1, static_cast<float>((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0))), m1));
    for (int l = 0; l < 32; ++l)
      store(y, o++, __fsub_rn(__fmul_rn(d2, static_cast<float>((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0))), m2));
    ql += 32;
    is += 2;
    u1 <<= 2;
    u2 <<= 2;
  }
}

template <typename Out>
static __global__ void dequant_q6_k(const uint8_t* src, Out* dst, int64_t nb) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= nb) return;
  const uint8_t* p = src + 210 * b;  // ql[128], qh[64], scales[16] (int8), d
  const uint8_t* ql = p;
  const uint8_t* qh = p + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
  const float d = read_half(p + 208);
  Out* y = dst + 256 * b;
  for (int n = 0; n < 256; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int8_t q1 = static_cast<int8_t>((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int8_t q2 = static_cast<int8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int8_t q3 = static_cast<int8_t>((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int8_t q4 = static_cast<int8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      store(y, n + l + 0, __fmul_rn(__fmul_rn(d, static_cast<float>(sc[is + 0])), static_cast<float>(q1)));
      store(y, n + l + 32, __fmul_rn(__fmul_rn(d, static_cast<float>(sc[is + 2])), static_cast<float>(q2)));
      store(y, n + l + 64, __fmul_rn(__fmul_rn(d, static_cast<float>(sc[is + 4])), static_cast<float>(q3)));
      store(y, n + l + 96, __fmul_rn(__fmul_rn(d, static_cast<float>(sc[is + 6])), static_cast<float>(q4)));
    }
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

unsigned grid_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

unsigned grid_stride_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 * 16 ? blocks : 65535 * 16);
}

template <typename Out>
void launch(GgmlType t, const void* src_v, Out* dst, int64_t n, cudaStream_t stream) {
  const int64_t be = ggml_block_elements(t);
  if (n % be != 0)
    throw ModelError(std::string("dequantize_device: ") + std::to_string(n) + " elements is not a multiple of the " +
                     ggml_type_name(t) + " block size " + std::to_string(be));
  if (n == 0) return;
  const auto* src = static_cast<const uint8_t*>(src_v);
  const int64_t nb = n / be;
  switch (t) {
    case GgmlType::F32: dequant_f32<<<grid_stride_for(n), kThreads, 0, stream>>>(src, dst, n); break;
    case GgmlType::F16: dequant_f16<<<grid_stride_for(n), kThreads, 0, stream>>>(src, dst, n); break;
    case GgmlType::BF16: dequant_bf16<<<grid_stride_for(n), kThreads, 0, stream>>>(src, dst, n); break;
    case GgmlType::Q4_0: dequant_q4_0<<<grid_for(nb), kThreads, 0, stream>>>(src, dst, nb); break;
    case GgmlType::Q4_1: dequant_q4_1<<<grid_for(nb), kThreads, 0, stream>>>(src, dst, nb); break;
    case GgmlType::Q5_0: dequant_q5_0<<<grid_for(nb), kThreads, 0, stream>>>(src, dst, nb); break;
    case GgmlType::Q5_1: dequant_q5_1<<<grid_for(nb), kThreads, 0, stream>>>(src, dst, nb); break;
    case GgmlType::Q8_0: dequant_q8_0<<<grid_for(nb), kThreads, 0, stream>>>(src, dst, nb); break;
    case GgmlType::Q2_K: dequant_q2_k<<<grid_for(nb), kThreads, 0, stream>>>(src, dst, nb); break;
    case GgmlType::Q3_K: dequant_q3_k<<<grid_for(nb), kThreads, 0, stream>>>(src, dst, nb); break;
    case GgmlType::Q4_K: dequant_q4_k<<<grid_for(nb), kThreads, 0, stream>>>(src, dst, nb); break;
    case GgmlType::Q5_K: dequant_q5_k<<<grid_for(nb), kThreads, 0, stream>>>(src, dst, nb); break;
    case GgmlType::Q6_K: dequant_q6_k<<<grid_for(nb), kThreads, 0, stream>>>(src, dst, nb); break;
    default:
      throw ModelError(std::string("no device dequantization for GGUF type ") + ggml_type_name(t));
  }
  check_launch("dequantize", stream);
}

}  // namespace

bool device_dequant_supported(GgmlType t) {
  switch (t) {
    case GgmlType::F32: case GgmlType::F16: case GgmlType::BF16:
    case GgmlType::Q4_0: case GgmlType::Q4_1: case GgmlType::Q5_0: case GgmlType::Q5_1: case GgmlType::Q8_0:
    case GgmlType::Q2_K: case GgmlType::Q3_K: case GgmlType::Q4_K: case GgmlType::Q5_K: case GgmlType::Q6_K:
      return true;
    default:
      return false;
  }
}

void dequantize_device(GgmlType t, const void* src, float* dst, int64_t n, cudaStream_t stream) {
  launch(t, src, dst, n, stream);
}

void dequantize_device(GgmlType t, const void* src, __half* dst, int64_t n, cudaStream_t stream) {
  launch(t, src, dst, n, stream);
}

}  // namespace diffrun::engine
