// q/k norms and RoPE in one launch: a warp per head row (the T·H rows of q, then the T·Hkv rows of k). Lane l holds
// elements l + 32j; the row's sum of squares is rms_norm's: its block of kOpThreads threads holds element i in
// thread i (Dh <= kOpThreads), each warp's squares summed by warp_sum, the warps' sums added in warp order
// (block_sum; the warps past the row add +0, which changes nothing), so warp_sum over j = 0, 1, ... in turn is the
// same sum. The normalised row is stored in place and into shared memory, where the lanes take the rotated pairs
// as rope_qk's threads take them (rope_pair, the same expression). qk_norm_rope_rotation runs the same kernel with
// the norm left out (kNorm false): the rotation alone.
#include "engine/ops/qk_norm_rope.cuh"

#include "engine/cuda_check.cuh"
#include "engine/ops/launch.cuh"

namespace diffrun::engine {

namespace {

constexpr int kRowsPerBlock = kOpThreads / 32;
constexpr int kMaxDh = 256;

// kNorm false: the rows are rotated as they are (qk_norm_rope_rotation): no sums, nothing stored in place.
template <int kPer, bool kNeox, bool kNorm>
static __global__ void __launch_bounds__(kOpThreads)
qk_norm_rope_kernel(float* q_out, float* k_out, float* k_cache, float* v_cache, float* q, float* k, const float* v,
                    const float* q_w, const float* k_w, float eps, int T, int H, int Hkv, int Dh, const int32_t* pos0,
                    const int32_t* write_pos, float theta, const float* freq_factors) {
  // Dh (32 · kPer) is also an argument, so that the float arithmetic on it (rms_scale, rope_pair) is rms_norm's and
  // rope_qk's, which take it at run time (a constant divisor could be folded otherwise).
  constexpr int kDh = 32 * kPer, half = kDh / 2;
  __shared__ float rows[kRowsPerBlock][kDh];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t q_rows = int64_t(T) * H, row = int64_t(blockIdx.x) * kRowsPerBlock + warp;
  const bool is_q = row < q_rows;
  const int64_t head_row = is_q ? row : row - q_rows;  // t · n_head + h
  const float* w = is_q ? q_w : k_w;
  float wv[kPer];  // the weights are constant: loaded before the wait
#pragma unroll
  for (int j = 0; j < kPer; ++j) wv[j] = kNorm ? w[lane + 32 * j] : 1.0f;
  pdl_wait();
  pdl_trigger();
  if (row >= q_rows + int64_t(T) * Hkv) return;  // no block barrier follows: a warp past the rows leaves
  float* x = (is_q ? q : k) + head_row * kDh;
  float xv[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) xv[j] = x[lane + 32 * j];
  float* r = rows[warp];
  if constexpr (kNorm) {
    float y[kPer];
    warp_rms_norm_row<kPer>(xv, wv, Dh, eps, y);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      x[lane + 32 * j] = y[j];  // Qnorm / Knorm, in place
      r[lane + 32 * j] = y[j];
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPer; ++j) r[lane + 32 * j] = xv[j];
  }
  __syncwarp();
  const int n_head = is_q ? H : Hkv;
  const int t = static_cast<int>(head_row / n_head);
  float* out = (is_q ? q_out : k_out) + head_row * kDh;
  const int64_t cache0 = is_q ? 0 : int64_t(*write_pos) * Hkv * kDh + head_row * kDh;
  const float* vr = v + head_row * kDh;
#pragma unroll
  for (int j = 0; j < kPer / 2; ++j) {
    const int i = lane + 32 * j;  // the pair's index, 0..Dh/2 - 1
    const int i0 = kNeox ? i : 2 * i, i1 = kNeox ? i + half : 2 * i + 1;
    float y0, y1;
    rope_pair(r[i0], r[i1], *pos0 + t, i, Dh, theta, freq_factors, y0, y1);
    out[i0] = y0;
    out[i1] = y1;
    if (!is_q) {  // [T, Hkv·Dh] row t lands on cache row write_pos + t, as rope_qk writes it
      k_cache[cache0 + i0] = y0;
      k_cache[cache0 + i1] = y1;
      v_cache[cache0 + i0] = vr[i0];
      v_cache[cache0 + i1] = vr[i1];
    }
  }
}

}  // namespace

bool qk_norm_rope_supported(int Dh) { return Dh > 0 && Dh % 64 == 0 && Dh <= kMaxDh; }

namespace {

template <bool kNorm>
bool launch_qk_norm_rope(float* q_out, float* k_out, float* k_cache, float* v_cache, float* q, float* k,
                         const float* v, const float* q_w, const float* k_w, float eps, int T, int H, int Hkv, int Dh,
                         const int32_t* pos0, const int32_t* write_pos, float theta, const float* freq_factors,
                         bool neox, cudaStream_t stream) {
  if (!qk_norm_rope_supported(Dh)) return false;
  const int64_t rows = int64_t(T) * (H + Hkv);
  if (rows <= 0) return true;
  const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  const auto launch = [&](auto kernel) {
    launch_pdl(kernel, blocks, kOpThreads, 0, stream, q_out, k_out, k_cache, v_cache, q, k, v, q_w, k_w, eps, T, H,
               Hkv, Dh, pos0, write_pos, theta, freq_factors);
  };
  switch (Dh / 32) {
    case 2: neox ? launch(qk_norm_rope_kernel<2, true, kNorm>) : launch(qk_norm_rope_kernel<2, false, kNorm>); break;
    case 4: neox ? launch(qk_norm_rope_kernel<4, true, kNorm>) : launch(qk_norm_rope_kernel<4, false, kNorm>); break;
    case 6: neox ? launch(qk_norm_rope_kernel<6, true, kNorm>) : launch(qk_norm_rope_kernel<6, false, kNorm>); break;
    default: neox ? launch(qk_norm_rope_kernel<8, true, kNorm>) : launch(qk_norm_rope_kernel<8, false, kNorm>); break;
  }
  check_launch(kNorm ? "qk_norm_rope" : "qk_norm_rope_rotation", stream);
  return true;
}

}  // namespace

bool qk_norm_rope(float* q_out, float* k_out, float* k_cache, float* v_cache, float* q, float* k, const float* v,
                  const float* q_w, const float* k_w, float eps, int T, int H, int Hkv, int Dh, const int32_t* pos0,
                  const int32_t* write_pos, float theta, const float* freq_factors, bool neox, cudaStream_t stream) {
  return launch_qk_norm_rope<true>(q_out, k_out, k_cache, v_cache, q, k, v, q_w, k_w, eps, T, H, Hkv, Dh, pos0,
                                   write_pos, theta, freq_factors, neox, stream);
}

bool qk_norm_rope_rotation(float* q_out, float* k_out, float* k_cache, float* v_cache, const float* q, const float* k,
                           const float* v, int T, int H, int Hkv, int Dh, const int32_t* pos0, const int32_t* write_pos,
                           float theta, const float* freq_factors, bool neox, cudaStream_t stream) {
  // The kernel writes q and k only when it normalises them: here it reads them alone.
  return launch_qk_norm_rope<false>(q_out, k_out, k_cache, v_cache, const_cast<float*>(q), const_cast<float*>(k), v,
                                    nullptr, nullptr, 0.0f, T, H, Hkv, Dh, pos0, write_pos, theta, freq_factors, neox,
                                    stream);
}

}  // namespace diffrun::engine
