// RoPE of q and k and the KV cache write in one launch: one thread per rotated pair of q's and then
// k's heads; a k pair's thread also writes its rotated values and the same two elements of v to the cache.
#include "engine/ops/rope_qk.cuh"

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"

namespace diffrun::engine {

namespace {

template <bool kNeox>
static __global__ void rope_qk_kernel(float* q_out, float* k_out, float* k_cache, float* v_cache, const float* q,
                                      const float* k, const float* v, int T, int H, int Hkv, int Dh,
                                      const int32_t* pos0, const int32_t* write_pos, float theta,
                                      const float* freq_factors) {
  pdl_wait();
  pdl_trigger();
  const int half = Dh / 2;
  const int64_t q_pairs = static_cast<int64_t>(T) * H * half;
  const int64_t total = q_pairs + static_cast<int64_t>(T) * Hkv * half;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const bool is_q = idx < q_pairs;
    const int64_t j = is_q ? idx : idx - q_pairs;
    const int n_head = is_q ? H : Hkv;
    const float* x = is_q ? q : k;
    float* out = is_q ? q_out : k_out;
    const int i = static_cast<int>(j % half);
    const int64_t head_row = j / half;  // t · n_head + h
    const int t = static_cast<int>(head_row / n_head);
    const int64_t i0 = head_row * Dh + (kNeox ? i : 2 * i);
    const int64_t i1 = kNeox ? i0 + half : i0 + 1;
    float y0, y1;
    rope_pair(x[i0], x[i1], *pos0 + t, i, Dh, theta, freq_factors, y0, y1);
    out[i0] = y0;
    out[i1] = y1;
    if (!is_q) {  // [T, Hkv·Dh] row t lands on cache row write_pos + t: offset write_pos · Hkv·Dh
      const int64_t row0 = static_cast<int64_t>(*write_pos) * Hkv * Dh;
      k_cache[row0 + i0] = y0;
      k_cache[row0 + i1] = y1;
      v_cache[row0 + i0] = v[i0];
      v_cache[row0 + i1] = v[i1];
    }
  }
}

}  // namespace

void rope_qk(float* q_out, float* k_out, float* k_cache, float* v_cache, const float* q, const float* k,
             const float* v, int T, int H, int Hkv, int Dh, const int32_t* pos0, const int32_t* write_pos, float theta,
             const float* freq_factors, bool neox, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(T) * (H + Hkv) * (Dh / 2);
  if (neox)
    launch_pdl(rope_qk_kernel<true>, op_grid(total), kOpThreads, 0, stream, q_out, k_out, k_cache, v_cache, q, k, v, T,
               H, Hkv, Dh, pos0, write_pos, theta, freq_factors);
  else
    launch_pdl(rope_qk_kernel<false>, op_grid(total), kOpThreads, 0, stream, q_out, k_out, k_cache, v_cache, q, k, v, T,
               H, Hkv, Dh, pos0, write_pos, theta, freq_factors);
  check_launch("rope_qk", stream);
}

}  // namespace diffrun::engine
