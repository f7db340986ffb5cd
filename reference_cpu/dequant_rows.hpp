// Row dequantization for the reference's streamed weights, built for the host CPU like the rest of reference_cpu/:
// the values of model/dequant.hpp's dequantize bit for bit, a few times faster for the formats models ship in.
#pragma once

#include <cstddef>
#include <cstdint>

#include "model/gguf.hpp"

namespace diffrun::ref {

// dst[0..n) = the n values (whole blocks) of type `type` at src, exactly as diffrun::dequantize gives them.
// F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K are decoded here; the other formats by dequantize.
void dequantize_rows(GgmlType type, const std::byte* src, float* dst, int64_t n);
void dequantize_rows(GgmlType type, const std::byte* src, double* dst, int64_t n);

// The same n values rounded to f16 (round_f16 of reference_cpu/storage.hpp; an F16 row is left as it is), in one
// pass where the format's decoder rounds as it goes.
void dequantize_rows_f16(GgmlType type, const std::byte* src, float* dst, int64_t n);

// dequantize_rows (round false) or dequantize_rows_f16 (true), each float widened to a double (exactly): Q4_K by table
// straight to doubles with AVX-512 (unless the portable kernels are selected), the others through a float chunk. An
// f64 prefill's pieces of rows.
void decode_rows_wide(GgmlType type, const std::byte* src, double* dst, int64_t n, bool round);

// Decoding and dot product in one pass, where a format has it (Q4_K with AVX2 and FMA, unless the portable kernels are
// selected): acc [16] takes the lane sums (reference_cpu/kernels.hpp) of the n values at src (whole blocks, rounded
// to f16 when `round`) against x [n], exactly as lane_accumulate takes dequantize_rows(_f16)'s values; returns false,
// touching nothing, where it does not (the caller decodes into a buffer instead).
template <typename T>
bool decode_dot(GgmlType type, const std::byte* src, bool round, const T* x, int64_t n, T* acc);
// decode_dot of two rows of the same type (s0, s1) against the same x, in f64 without rounding: acc0 and acc1 take
// what decode_dot would give each; false, touching nothing, where there is no two-row kernel (Q4_K with AVX-512 only).
bool decode_dot_x2(GgmlType type, const std::byte* s0, const std::byte* s1, bool round, const double* x, int64_t n,
                   double* acc0, double* acc1);

// Tokens a decode_dot_tokens call takes at once, at most.
constexpr int kDotTokens = 8;
// decode_dot of one row against nt (1 .. kDotTokens) tokens' inputs x [nt, ldx]: acc [nt, 16] takes, per token, what
// decode_dot would give it (the row's values looked up once for all of them); false, touching nothing, where there is
// no such kernel (has_dot_tokens: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K with AVX-512, unless the portable
// kernels are selected).
template <typename T>
bool decode_dot_tokens(GgmlType type, const std::byte* src, bool round, const T* x, int64_t ldx, int nt, int64_t n,
                       T* acc);
bool has_dot_tokens(GgmlType type);

}  // namespace diffrun::ref
