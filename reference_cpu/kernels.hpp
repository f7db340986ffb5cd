// The reference's dot-product kernels: every matmul output is one sum taken in one fixed order (below), by vectorised
// kernels built for the host CPU (AVX-512, or AVX2 with FMA) or by portable loops that take the same sums in the same
// order.
// K inputs; a weight row w [K] (decoded floats, or the dense matrix's values), token rows x [T,K].
#pragma once

#include <cstdint>

namespace diffrun::ref {

// The summation order of out[t, n] = sum_k x[t, k] * w[n, k] (+ bias[n]), for f32 and f64 alike:
//   16 lane sums s[0..15], each starting at +0; for k = 0, 1, ..., K-1 in turn,
//     s[k mod 16] = fma(x[t, k], w[n, k], s[k mod 16])   (one rounding, in the arithmetic type T);
//   then a fixed tree: for h = 8, 4, 2, 1: s[j] = s[j] + s[j + h] for j < h;
//   out = s[0], then out = out + bias[n] where there is a bias;
//   a NaN out is returned as the positive quiet NaN without payload (which of two NaN operands an FMA or an add passes
//   on is the instruction's choice, not IEEE 754's, and differs between a kernel's register allocations).
// The weight is converted to T first (exact: a decoded weight is a float). The order depends on K alone, not on the
// thread count, the tiling, the number of tokens or the CPU, so decode and prefill, streamed and dense weights,
// vectorised and portable kernels all give the same value bit for bit.
inline constexpr int kLanes = 16;

// Selects the portable kernels (true) or the vectorised ones where the build has them (false, the default). Both
// give the same values bit for bit; set it between matmuls, not during one.
void set_portable_kernels(bool portable);
bool portable_kernels();

// "avx512", "avx2-fma" or "portable": the kernels the next matmul runs.
const char* kernels_name();

// The rows and tokens the kernels the next matmul runs take at once (their register blocking: each weight loaded
// serves that many tokens, each input that many rows); the matmuls group their loops by them. No value depends on it.
template <typename T>
int kernel_rows();
template <typename T>
int kernel_tokens();

// Lane sums of nr weight rows against nt tokens over n consecutive inputs k0 .. k0+n-1, added to acc: the lane sums
// of row r and token t at acc + r*lda + t*16, row r's weights from k0 at w + r*ldw (W float or T), token t's inputs
// from k0 at x + t*ldx. k0 must be a multiple of 16 unless this piece is the rows' last, so that piece after piece
// continues the same order (a row may be taken in any pieces of that kind).
template <typename T, typename W>
void lane_accumulate(T* acc /* [nr,lda] */, int64_t lda, const W* w /* [nr,ldw] */, int64_t ldw, int nr,
                     const T* x /* [nt,ldx] */, int64_t ldx, int nt, int64_t n);

// The same for one weight row: acc [nt, 16] (lane j of token t at acc[t*16 + j]), w [n] the row's weights from k0.
template <typename T, typename W>
void lane_accumulate(T* acc /* [nt,16] */, const W* w /* [n] */, const T* x /* [nt,ldx] */, int64_t ldx, int nt,
                     int64_t n);

// ---- A prefill's kernels with the tokens in the vector lanes (AVX-512 builds, vectorised kernels only) ----
// The lane sums of an output are 16 separate chains of fmas (chain j: the inputs k = j, j+16, ... in order); a
// vector can as well hold one chain of several tokens as several chains of one token. These kernels hold chain j of
// 8 (f64) or 16 (f32) tokens in a register and take each weight w[n, k] broadcast, so a weight row is read as the
// decoder wrote it and each input vector serves several rows: the same fmas in the same order, so the same values.
// The tokens are packed once per matmul: per group of token_lanes_group() tokens, xp[j][i][g] = x[t0 + g, 16 i + j]
// (zero beyond the tokens).
template <typename T>
bool token_lanes();  // whether the next matmul has these kernels
template <typename T>
int token_lanes_rows();  // the rows they take at once (a matmul's row groups)
template <typename T>
int token_lanes_group();  // tokens per packed group
template <typename T>
int64_t token_lanes_packed_size(int n_tokens, int K);
template <typename T>
void token_lanes_pack(T* xp, const T* x /* [T,K] */, int n_tokens, int K);
// Size of the lane sums of one row group against every token.
template <typename T>
int64_t token_lanes_sums_size(int n_tokens);
// Lane sums of nr (<= token_lanes_rows()) rows against every token over the inputs c0 .. c0+kc-1 (c0 a multiple of
// 16): row r's weights from c0 at w + r*ldw; sums (token_lanes_sums_size) started at zero when first, else
// continued.
template <typename T>
void token_lanes_accumulate(T* sums, bool first, const T* w, int64_t ldw, int nr, const T* xp, int n_tokens, int K,
                            int c0, int kc);
// out[t, n0 + r] for every token and the nr rows: the tree, the bias, the one NaN.
template <typename T>
void token_lanes_finish(T* out /* [T,N] */, int N, int n0, int nr, const T* sums, const T* bias, int n_tokens);

// The tree over the 16 lane sums of one output.
template <typename T>
T lane_total(const T* acc /* [16] */);

}  // namespace diffrun::ref
