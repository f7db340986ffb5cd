// Linear layer out = x · Wᵀ (+ bias). T tokens, K inputs, N outputs; W is [N,K] row-major.
#include "reference_cpu/ops/matmul.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "model/error.hpp"
#include "reference_cpu/dequant_rows.hpp"
#include "reference_cpu/kernels.hpp"
#include "reference_cpu/weights.hpp"

namespace diffrun::ref {

namespace {

// Every output below is one sum in the order of reference_cpu/kernels.hpp (16 lane sums of fma in input order, a
// fixed tree, then the bias): a function of x, the row and K alone. How the work is cut (rows per thread, tiles,
// pieces of a row, groups of tokens) and which kernels run (vectorised or portable) change no value.

// Inputs a one-token step decodes at a time: 4 KB of floats, whole blocks of every format (block sizes 1, 32, 256).
constexpr int kPiece = 1024;

// Rows a one-token step hands a thread at a time (consecutive rows: the weights' bytes are read in order, which the
// hardware prefetchers follow; taking a piece of x against several rows at a time was 10% slower on the 7B shape).
constexpr int kDecodeRows = 16;

// Inputs a few-token matmul (decode_dot_tokens) takes against a group's rows before the next ones: whole blocks of
// every format (32 or 256 values), kDotTokens f64 tokens' inputs 16 KB, in L1.
constexpr int kTokensPiece = 256;

// Up to kDotTokens tokens take decode_dot_tokens where the format has it (on the 16-core GPU host, 8 tokens of a 7B
// Q4_K matrix on one thread: f64 0.047 -> 0.036 s, f32-f16store 0.039 -> 0.021 s against the token-lane kernels; at
// 16 tokens and more the token lanes are faster: bench/NOTES.md). DIFFRUN_REF_DOT_TOKENS=0 turns it off (the same
// values either way).
bool dot_tokens_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("DIFFRUN_REF_DOT_TOKENS");
    return !(e && std::string(e) == "0");
  }();
  return on;
}

// Inputs a prefill takes against the rows of a tile before the next ones: a group of tokens' inputs (16 KB for 4 f64
// tokens) stays in L1 across the tile's rows. Rows of up to kChunkWhole inputs are taken whole.
constexpr int kChunk = 512;
constexpr int kChunkWhole = 1024;

// Rows a prefill decodes into a tile and then takes against every token: about 256 KB of floats (in L2), at least 8.
int tile_rows(int K) { return static_cast<int>(std::max<int64_t>(8, 262144 / (static_cast<int64_t>(K) * 4))); }

template <typename T>
T finish(const T* acc /* [16] */, const T* bias /* [N] or null */, int n) {
  const T s = bias ? lane_total(acc) + bias[n] : lane_total(acc);
  return s == s ? s : std::numeric_limits<T>::quiet_NaN();  // kernels.hpp: one NaN for every NaN
}

// out[t, n0 + r] for every token t and the rows r of a tile w [rows,K] (W float or T): per group of tokens, the
// inputs a chunk at a time against every row of the tile, the lane sums kept in acc between chunks; the groups of
// tokens and of rows those the kernels take at once.
template <typename T, typename W>
void tile_outputs(T* out /* [T,N] */, const T* x /* [T,K] */, const W* w /* [rows,K] */, const T* bias, int n_tokens,
                  int K, int N, int n0, int rows, std::vector<T>& acc /* [rows,G,16] */) {
  const int G = kernel_tokens<T>(), R = kernel_rows<T>();
  const int64_t lda = static_cast<int64_t>(G) * kLanes;
  acc.resize(static_cast<size_t>(rows * lda));
  for (int t0 = 0; t0 < n_tokens; t0 += G) {
    const int g = std::min(G, n_tokens - t0);
    std::fill(acc.begin(), acc.end(), T(0));
    const int chunk = K <= kChunkWhole ? K : kChunk;
    for (int k0 = 0; k0 < K; k0 += chunk) {
      const int m = std::min(chunk, K - k0);
      for (int r0 = 0; r0 < rows; r0 += R) {
        lane_accumulate(&acc[static_cast<size_t>(r0 * lda)], lda, w + static_cast<int64_t>(r0) * K + k0, K,
                        std::min(R, rows - r0), x + static_cast<int64_t>(t0) * K + k0, K, g, m);
      }
    }
    for (int r = 0; r < rows; ++r) {
      for (int t = 0; t < g; ++t) {
        out[static_cast<int64_t>(t0 + t) * N + n0 + r] = finish(&acc[static_cast<size_t>(r * lda + t * kLanes)], bias,
                                                                n0 + r);
      }
    }
  }
}

// Prefills of at least this many tokens take the token-lane kernels (kernels.hpp) where the build has them.
constexpr int kTokenLanesMin = 8;

// Inputs the token-lane kernels take against a tile's rows before the next ones: whole blocks of every format, and
// for a row group of 6 f64 rows 24 KB of weights, which stay in L1 across the 16 chains.
constexpr int kLanesChunk = 512;

// out = x · Wᵀ with the token-lane kernels: tiles of 4 row groups shared among the threads; per tile and piece of
// kLanesChunk inputs, rows(n0, n, c0, kc, buffer) gives the tile's weights ([n, kc] as T, its row stride returned
// through ldw), which every row group takes against every token.
template <typename T, typename Rows>
void matmul_token_lanes(T* out, const T* x, const T* bias, int n_tokens, int K, int N, Rows&& rows) {
  std::vector<T> xp(static_cast<size_t>(token_lanes_packed_size<T>(n_tokens, K)));
  token_lanes_pack(xp.data(), x, n_tokens, K);
  const int NR = token_lanes_rows<T>(), R = 4 * NR;
  const int64_t ss = token_lanes_sums_size<T>(n_tokens);
  const int n_tiles = (N + R - 1) / R;
#pragma omp parallel
  {
    std::vector<T> sums(static_cast<size_t>(4 * ss));
    std::vector<float> buffer;
#pragma omp for schedule(dynamic) nowait
    for (int b = 0; b < n_tiles; ++b) {
      const int n0 = b * R, n = std::min(N, n0 + R) - n0;
      for (int c0 = 0; c0 < K; c0 += kLanesChunk) {
        const int kc = std::min(kLanesChunk, K - c0);
        int64_t ldw = 0;
        const T* w = rows(n0, n, c0, kc, buffer, ldw);
        for (int g = 0; g * NR < n; ++g) {
          token_lanes_accumulate(&sums[static_cast<size_t>(g * ss)], c0 == 0, w + g * NR * ldw, ldw,
                                 std::min(NR, n - g * NR), xp.data(), n_tokens, K, c0, kc);
        }
      }
      for (int g = 0; g * NR < n; ++g) {
        token_lanes_finish(out, N, n0 + g * NR, std::min(NR, n - g * NR), &sums[static_cast<size_t>(g * ss)], bias,
                           n_tokens);
      }
    }
  }
}

}  // namespace

template <typename T>
void matmul(T* out /* [T,N] */, const T* x /* [T,K] */, const T* W /* [N,K] */, const T* bias /* [N] or null */,
            int n_tokens, int K, int N) {
  if (n_tokens == 1) {
    // Decode: the threads take rows in turn.
#pragma omp parallel for schedule(dynamic, kDecodeRows)
    for (int n = 0; n < N; ++n) {
      T acc[kLanes] = {};
      lane_accumulate(acc, W + static_cast<int64_t>(n) * K, x, K, 1, K);
      out[n] = finish(acc, bias, n);
    }
    return;
  }
  if (n_tokens >= kTokenLanesMin && token_lanes<T>()) {
    matmul_token_lanes(out, x, bias, n_tokens, K, N,
                       [&](int n0, int, int c0, int, std::vector<float>&, int64_t& ldw) -> const T* {
                         ldw = K;
                         return W + static_cast<int64_t>(n0) * K + c0;
                       });
    return;
  }
  // Prefill: tiles of rows shared among the threads, each against every token.
  const int rows = tile_rows(K);
  const int n_tiles = (N + rows - 1) / rows;
#pragma omp parallel
  {
    std::vector<T> acc;
#pragma omp for schedule(dynamic) nowait
    for (int b = 0; b < n_tiles; ++b) {
      const int n0 = b * rows, n1 = std::min(N, n0 + rows);
      tile_outputs(out, x, W + static_cast<int64_t>(n0) * K, bias, n_tokens, K, N, n0, n1 - n0, acc);
    }
  }
}

template <typename T>
void matmul(T* out /* [T,N] */, const T* x /* [T,K] */, const WeightMatrix<T>& W /* [>=N,K] */,
            const T* bias /* [N] or null */, int n_tokens, int K, int N) {
  if (W.cols() != K || W.rows() < N) {
    throw ModelError("matmul: a [" + std::to_string(W.rows()) + ", " + std::to_string(W.cols()) +
                     "] weight cannot give " + std::to_string(N) + " outputs of " + std::to_string(K) + " inputs");
  }
  if (W.dense()) {
    matmul(out, x, W.data(), bias, n_tokens, K, N);
    return;
  }
  if (n_tokens == 1) {
    // Decode: the weights' bytes are read once, in order. A thread takes kDecodeRows rows at a time and, a piece of
    // a row at a time, decodes it into a buffer of floats (in L1) and takes it into the row's lane sums, or does both
    // in registers where the format has a fused decoder (Q4_K), two rows at once where it has a two-row one (f64).
    const int n_groups = (N + kDecodeRows - 1) / kDecodeRows;
#pragma omp parallel
    {
      std::vector<float> piece(static_cast<size_t>(std::min(kPiece, K)));  // [kPiece]
#pragma omp for schedule(dynamic) nowait
      for (int i = 0; i < n_groups; ++i) {
        const int n0 = i * kDecodeRows, n1 = std::min(N, n0 + kDecodeRows);
        int n = n0;
        // Two rows at once where the format has a two-row decoder (each row's sums as one row's alone).
        for (; n + 1 < n1; n += 2) {
          T acc0[kLanes] = {}, acc1[kLanes] = {};
          if (!W.decode_dot_x2(acc0, acc1, n, 0, std::min(kPiece, K), x)) break;  // none: one row at a time
          for (int k0 = kPiece; k0 < K; k0 += kPiece) W.decode_dot_x2(acc0, acc1, n, k0, std::min(kPiece, K - k0), x + k0);
          out[n] = finish(acc0, bias, n);
          out[n + 1] = finish(acc1, bias, n + 1);
        }
        for (; n < n1; ++n) {
          T acc[kLanes] = {};
          for (int k0 = 0; k0 < K; k0 += kPiece) {
            const int m = std::min(kPiece, K - k0);
            if (W.decode_dot(acc, n, k0, m, x + k0)) continue;  // decoded in registers
            W.decode_floats(piece.data(), n, 1, k0, m);
            lane_accumulate(acc, piece.data(), x + k0, K, 1, m);
          }
          out[n] = finish(acc, bias, n);
        }
      }
    }
    return;
  }
  if (n_tokens <= kDotTokens && dot_tokens_enabled() && W.dots_for_tokens()) {
    // A few tokens (a draft's 8 steps, a short prompt): a group of kDecodeRows rows a thread, a block of inputs at a
    // time; each row's values looked up once, in registers, and taken into every token's lane sums (acc, kept across
    // the pieces); the inputs read in place (a piece of the tokens' inputs stays in L1 across the group's rows).
    const int n_groups = (N + kDecodeRows - 1) / kDecodeRows;
#pragma omp parallel
    {
      std::vector<T> acc(static_cast<size_t>(kDecodeRows) * n_tokens * kLanes);  // [rows, T, 16]
#pragma omp for schedule(dynamic) nowait
      for (int i = 0; i < n_groups; ++i) {
        const int n0 = i * kDecodeRows, n1 = std::min(N, n0 + kDecodeRows);
        std::fill(acc.begin(), acc.end(), T(0));
        for (int k0 = 0; k0 < K; k0 += kTokensPiece) {
          const int m = std::min(kTokensPiece, K - k0);
          for (int n = n0; n < n1; ++n) {
            W.decode_dot_tokens(&acc[static_cast<size_t>(n - n0) * n_tokens * kLanes], n, k0, m, x + k0, K, n_tokens);
          }
        }
        for (int n = n0; n < n1; ++n) {
          for (int t = 0; t < n_tokens; ++t) {
            const T* lanes = &acc[(static_cast<size_t>(n - n0) * n_tokens + t) * kLanes];
            out[static_cast<int64_t>(t) * N + n] = finish(lanes, bias, n);
          }
        }
      }
    }
    return;
  }
  if (n_tokens >= kTokenLanesMin && token_lanes<T>()) {
    // A tile's piece decoded once (f64: straight to doubles, WeightMatrix::decode_wide), taken against every token.
    matmul_token_lanes(out, x, bias, n_tokens, K, N,
                       [&](int n0, int n, int c0, int kc, std::vector<float>& buffer, int64_t& ldw) -> const T* {
                         const size_t size = static_cast<size_t>(n) * kc;
                         ldw = kc;
                         if constexpr (sizeof(T) == sizeof(float)) {
                           buffer.resize(size);
                           W.decode_floats(buffer.data(), n0, n, c0, kc);
                           return buffer.data();
                         } else {
                           buffer.resize(2 * size + 1);
                           T* wide = reinterpret_cast<T*>(buffer.data() + (reinterpret_cast<uintptr_t>(buffer.data()) % 8 ? 1 : 0));
                           W.decode_wide(wide, n0, n, c0, kc);
                           return wide;
                         }
                       });
    return;
  }
  // Prefill: each tile of rows decoded once, into a per-thread buffer of floats, and taken against every token.
  const int rows = tile_rows(K);
  const int n_tiles = (N + rows - 1) / rows;
#pragma omp parallel
  {
    std::vector<float> tile(static_cast<size_t>(rows) * K);  // [rows,K]
    std::vector<T> acc;
#pragma omp for schedule(dynamic) nowait
    for (int b = 0; b < n_tiles; ++b) {
      const int n0 = b * rows, n1 = std::min(N, n0 + rows);
      W.decode_floats(tile.data(), n0, n1 - n0, 0, K);
      tile_outputs(out, x, tile.data(), bias, n_tokens, K, N, n0, n1 - n0, acc);
    }
  }
}

template void matmul<float>(float*, const float*, const float*, const float*, int, int, int);
template void matmul<double>(double*, const double*, const double*, const double*, int, int, int);
template void matmul<float>(float*, const float*, const WeightMatrix<float>&, const float*, int, int, int);
template void matmul<double>(double*, const double*, const WeightMatrix<double>&, const double*, int, int, int);

}  // namespace diffrun::ref
