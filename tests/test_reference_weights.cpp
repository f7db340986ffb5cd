// The reference's streamed weights against the dense ones, bit for bit: row dequantization against model/dequant on
// random blocks of every format, the matmul over GGUF bytes against the matmul over dequantized matrices (f32 and
// f64, one and several tokens, 1 to 3 threads, with and without f16 rounding), and whole forward passes (every tiny
// fixture, every precision, every fault that applies, SmolLM2) recorded at every checkpoint of three steps. The
// vectorised kernels against the portable ones (reference_cpu/kernels.hpp) in the same places, and both against the
// summation order written out here from its documentation.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "checkpoints/sink.hpp"
#include "faults/faults.hpp"
#include "model/config.hpp"
#include "model/dequant.hpp"
#include "model/gguf.hpp"
#include "reference_cpu/dequant_rows.hpp"
#include "reference_cpu/kernels.hpp"
#include "reference_cpu/ops/matmul.hpp"
#include "reference_cpu/reference.hpp"
#include "reference_cpu/storage.hpp"
#include "reference_cpu/weights.hpp"
#include "tests/test_util.hpp"

namespace diffrun {
namespace {

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

const std::vector<GgmlType> kFormats = {GgmlType::F32,  GgmlType::F16,  GgmlType::BF16, GgmlType::Q4_0,
                                        GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0,
                                        GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K,
                                        GgmlType::Q6_K};

// Runs the body with the vectorised kernels, then with the portable ones, restoring the selection after.
class KernelChoice {
 public:
  explicit KernelChoice(bool portable) : before_(ref::portable_kernels()) { ref::set_portable_kernels(portable); }
  ~KernelChoice() { ref::set_portable_kernels(before_); }
  KernelChoice(const KernelChoice&) = delete;
  KernelChoice& operator=(const KernelChoice&) = delete;

 private:
  bool before_;
};

// Random bytes as blocks: every scale field takes random half bit patterns, NaN, infinities and subnormals included.
// With the decoders written by hand for AVX2 and with the portable ones.
TEST(DequantRows, MatchDequantizeOnRandomBlocksOfEveryFormat) {
  for (bool portable : {false, true}) {
    const KernelChoice choice(portable);
    std::mt19937 rng(20261123);
    for (GgmlType type : kFormats) {
      SCOPED_TRACE(std::string(ggml_type_name(type)) + (portable ? " portable" : " vector"));
      const int64_t n = 64 * 256;  // whole blocks of every format, and more than one f64 chunk
      std::vector<std::byte> bytes(static_cast<size_t>(n / ggml_block_elements(type) * ggml_block_bytes(type)));
      for (std::byte& b : bytes) b = static_cast<std::byte>(rng() & 0xff);
      std::vector<float> want32(n), got32(n);
      std::vector<double> want64(n), got64(n);
      dequantize(type, bytes.data(), want32.data(), n);
      dequantize(type, bytes.data(), want64.data(), n);
      ref::dequantize_rows(type, bytes.data(), got32.data(), n);
      ref::dequantize_rows(type, bytes.data(), got64.data(), n);
      EXPECT_TRUE(same_bits(want32, got32));
      EXPECT_TRUE(same_bits(want64, got64));
      // Rounded to f16 as the decoder goes: round_f16 of the same values (F16 rows stay as they are).
      std::vector<float> rounded(n);
      ref::dequantize_rows_f16(type, bytes.data(), rounded.data(), n);
      if (type != GgmlType::F16) ref::round_f16(want32.data(), n);
      EXPECT_TRUE(same_bits(want32, rounded));
      // Straight to doubles (decode_rows_wide, Q4_K by table with AVX-512): the floats widened, rounded or not.
      for (bool round : {false, true}) {
        std::vector<double> wide(n), widened(n);
        ref::decode_rows_wide(type, bytes.data(), wide.data(), n, round);
        std::vector<float> floats(n);
        if (round) ref::dequantize_rows_f16(type, bytes.data(), floats.data(), n);
        else ref::dequantize_rows(type, bytes.data(), floats.data(), n);
        for (int64_t i = 0; i < n; ++i) widened[i] = floats[i];
        EXPECT_TRUE(same_bits(widened, wide)) << (round ? "rounded" : "not rounded");
      }
    }
  }
}

// Decoding and dot product in one pass (vectorised) against the decoded values taken by lane_accumulate: the same
// lane sums on random blocks of every format that has it, in f32 and f64, rounded to f16 or not, with finite scales
// (every lane equal) and with any scales (NaN and infinities: a lane is NaN in both or equal); with the portable
// kernels decode_dot declines.
template <typename T>
void expect_decode_dot_equals_decode_then_accumulate(GgmlType type, std::vector<int> half_offsets) {
  std::mt19937 rng(4);
  std::normal_distribution<double> normal;
  const int64_t n = 64 * 256;
  const int64_t block_bytes = ggml_block_bytes(type), block_elements = ggml_block_elements(type);
  for (bool finite : {true, false}) {
    std::vector<std::byte> bytes(static_cast<size_t>(n / block_elements * block_bytes));
    for (std::byte& b : bytes) b = static_cast<std::byte>(rng() & 0xff);
    if (finite) {  // every scale's exponent below 31
      for (size_t i = 0; i < bytes.size(); i += static_cast<size_t>(block_bytes)) {
        for (int o : half_offsets) bytes[i + o + 1] &= std::byte{0xbf};
      }
    }
    std::vector<T> x(n);
    for (T& v : x) v = static_cast<T>(normal(rng));
    for (bool round : {false, true}) {
      SCOPED_TRACE(std::string(ggml_type_name(type)) + (round ? " f16" : " wide") +
                   (finite ? " finite scales" : " any scales"));
      std::vector<float> values(n);
      if (round) {
        ref::dequantize_rows_f16(type, bytes.data(), values.data(), n);
      } else {
        ref::dequantize_rows(type, bytes.data(), values.data(), n);
      }
      T want[ref::kLanes] = {}, got[ref::kLanes] = {};
      ref::lane_accumulate(want, values.data(), x.data(), n, 1, n);
      if (!ref::decode_dot(type, bytes.data(), round, x.data(), n, got)) {
        GTEST_SKIP() << "no fused decoders in this build (" << ref::kernels_name() << ")";
      }
      for (int j = 0; j < ref::kLanes; ++j) {
        if (!finite && std::isnan(want[j]) && std::isnan(got[j])) continue;
        EXPECT_EQ(std::memcmp(&want[j], &got[j], sizeof(T)), 0) << "lane " << j << ": " << want[j] << " " << got[j];
      }
      const KernelChoice portable(true);
      T declined[ref::kLanes] = {};
      EXPECT_FALSE(ref::decode_dot(type, bytes.data(), round, x.data(), n, declined));
    }
  }
}

TEST(DequantRows, FusedDecodeDotEqualsDecodeThenAccumulate) {
  const std::vector<std::pair<GgmlType, std::vector<int>>> formats = {
      {GgmlType::Q4_0, {0}},    {GgmlType::Q4_1, {0, 2}}, {GgmlType::Q8_0, {0}}, {GgmlType::Q4_K, {0, 2}},
      {GgmlType::Q5_K, {0, 2}}, {GgmlType::Q6_K, {208}},  {GgmlType::F16, {0}}};
  for (const auto& [type, halves] : formats) {
    expect_decode_dot_equals_decode_then_accumulate<float>(type, halves);
    expect_decode_dot_equals_decode_then_accumulate<double>(type, halves);
  }
}

TEST(DequantRows, F16TakesEveryHalfExactly) {
  std::vector<uint16_t> all(65536);
  for (uint32_t h = 0; h < 65536; ++h) all[h] = static_cast<uint16_t>(h);
  std::vector<float> want(all.size()), got(all.size());
  dequantize(GgmlType::F16, all.data(), want.data(), static_cast<int64_t>(all.size()));
  ref::dequantize_rows(GgmlType::F16, reinterpret_cast<const std::byte*>(all.data()), got.data(),
                       static_cast<int64_t>(all.size()));
  for (uint32_t h = 0; h < 65536; ++h) {
    ASSERT_EQ(std::memcmp(&want[h], &got[h], 4), 0) << "half 0x" << std::hex << h;
  }
  // Into doubles (halves converted straight, eight at a time, NaN lanes by hand), from offsets that
  // leave a tail of every length.
  std::vector<double> want64(all.size()), got64(all.size());
  dequantize(GgmlType::F16, all.data(), want64.data(), static_cast<int64_t>(all.size()));
  for (int64_t start : {0, 1, 3, 7}) {
    const int64_t n = static_cast<int64_t>(all.size()) - 2 * start;  // tails of 0, 6, 2 and 2 values
    std::fill(got64.begin(), got64.end(), 0.0);
    ref::dequantize_rows(GgmlType::F16, reinterpret_cast<const std::byte*>(all.data() + start), got64.data() + start, n);
    for (int64_t h = start; h < start + n; ++h) {
      ASSERT_EQ(std::memcmp(&want64[h], &got64[h], 8), 0) << "half 0x" << std::hex << h;
    }
  }
}

// round_f16 (eight values at a time where the CPU converts halves) against Eigen::half one value at a
// time: every half, its float neighbours and the midpoints to the next half (ties), overflow, NaN,
// and random bit patterns, in a length that leaves a tail.
TEST(RoundF16, EqualsEigenHalfValueByValue) {
  std::vector<float> in;
  for (uint32_t h = 0; h < 65536; ++h) {
    const float v = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(static_cast<uint16_t>(h)));
    uint32_t b;
    std::memcpy(&b, &v, 4);
    for (uint32_t d : {0u, 1u, 0xfffu, 0x1000u, 0x1001u, 0x1fffu}) {
      for (uint32_t bits : {b + d, b - d}) {
        float f;
        std::memcpy(&f, &bits, 4);
        in.push_back(f);
      }
    }
  }
  std::mt19937 rng(11);
  for (int i = 0; i < (1 << 20); ++i) {
    const uint32_t bits = rng();
    float f;
    std::memcpy(&f, &bits, 4);
    in.push_back(f);
  }
  for (float f : {65504.0f, 65519.99f, 65520.0f, 1e30f, -65520.0f, 5.96e-8f, 2.98e-8f, 2.99e-8f, 0.0f, -0.0f}) in.push_back(f);
  in.push_back(1.0f);  // an odd count: the last values go through the one-at-a-time tail
  std::vector<float> got = in;
  std::vector<double> got64(in.begin(), in.end());
  ref::round_f16(got.data(), static_cast<int64_t>(got.size()));
  ref::round_f16(got64.data(), static_cast<int64_t>(got64.size()));
  for (size_t i = 0; i < in.size(); ++i) {
    const float want = static_cast<float>(Eigen::half(in[i]));
    const double want64 = static_cast<double>(want);
    ASSERT_EQ(std::memcmp(&want, &got[i], 4), 0) << "value " << i << " " << in[i];
    ASSERT_EQ(std::memcmp(&want64, &got64[i], 8), 0) << "value " << i << " " << in[i];
  }
}

// Every matrix of a tiny fixture: out = x · Wᵀ streamed from the GGUF bytes and from the dequantized matrix, the
// same values at every thread count.
template <typename T>
void expect_streamed_matmul_equals_dense(const GgufFile& file, const TensorInfo& info, bool round_to_f16) {
  const int K = static_cast<int>(info.ne[0]);
  const int N = static_cast<int>(info.rows());
  const ref::WeightMatrix<T> streamed(info.type, file.tensor_data(info).data(), N, K, round_to_f16);
  std::vector<T> dense = dequantize_tensor<T>(file, info);
  if (round_to_f16) ref::round_f16(dense.data(), static_cast<int64_t>(dense.size()));
  std::mt19937 rng(7);
  std::normal_distribution<double> normal;
  std::vector<T> bias(N);
  for (T& b : bias) b = static_cast<T>(normal(rng));
  const int threads_before = omp_get_max_threads();
  for (int n_tokens : {1, 7, 8, 40}) {  // 2 .. 8 tokens: decode_dot_tokens where the format has it
    std::vector<T> x(static_cast<size_t>(n_tokens) * K);
    for (T& v : x) v = static_cast<T>(normal(rng));
    std::vector<T> first;  // the values at 1 thread, vectorised: every thread count and both kernels give them
    for (int threads : {1, 2, 3}) {
      for (bool portable : {false, true}) {
        SCOPED_TRACE(info.name + " tokens " + std::to_string(n_tokens) + " threads " + std::to_string(threads) +
                     (round_to_f16 ? " f16" : "") + (portable ? " portable" : " vector"));
        const KernelChoice choice(portable);
        omp_set_num_threads(threads);
        std::vector<T> want(static_cast<size_t>(n_tokens) * N), got(want.size());
        ref::matmul(want.data(), x.data(), dense.data(), bias.data(), n_tokens, K, N);
        ref::matmul(got.data(), x.data(), streamed, bias.data(), n_tokens, K, N);
        EXPECT_TRUE(same_bits(want, got));
        if (first.empty()) first = want;
        EXPECT_TRUE(same_bits(first, want));
      }
    }
  }
  omp_set_num_threads(threads_before);
}

// out[t, n] = sum_k x[t, k] * w[n, k] + bias[n] in the order reference_cpu/kernels.hpp documents, written out here
// one value at a time: 16 lane sums of std::fma in input order, the tree h = 8, 4, 2, 1, then the bias.
template <typename T>
std::vector<T> documented_order(const std::vector<T>& x, const std::vector<T>& w, const std::vector<T>& bias,
                                int n_tokens, int K, int N) {
  std::vector<T> out(static_cast<size_t>(n_tokens) * N);
  for (int t = 0; t < n_tokens; ++t) {
    for (int n = 0; n < N; ++n) {
      T s[16] = {};
      for (int k = 0; k < K; ++k) s[k % 16] = std::fma(x[t * K + k], w[n * K + k], s[k % 16]);
      for (int h = 8; h >= 1; h /= 2) {
        for (int j = 0; j < h; ++j) s[j] = s[j] + s[j + h];
      }
      out[t * N + n] = s[0] + bias[n];
    }
  }
  return out;
}

// The vectorised and the portable kernels give the documented order's values bit for bit, for every remainder of K
// by 16, one token and groups of tokens that leave every remainder too, at 1 and 3 threads. The inputs span many
// binades, so another order (a plain running sum, another tree, no fma) gives other values, which the test checks.
template <typename T>
void expect_documented_order() {
  std::mt19937 rng(37);
  std::normal_distribution<double> normal;
  std::uniform_int_distribution<int> exponent(-12, 12);
  auto value = [&] { return static_cast<T>(std::ldexp(normal(rng), exponent(rng))); };
  const int threads_before = omp_get_max_threads();
  int order_mattered = 0;
  for (int K : {1, 5, 16, 17, 31, 64, 100, 515, 1040, 4099}) {
    for (int n_tokens : {1, 2, 3, 4, 5, 7, 9, 16, 33}) {
      const int N = 37;
      std::vector<T> x(static_cast<size_t>(n_tokens) * K), w(static_cast<size_t>(N) * K), bias(N);
      for (T& v : x) v = value();
      for (T& v : w) v = value();
      for (T& v : bias) v = value();
      const std::vector<T> want = documented_order(x, w, bias, n_tokens, K, N);
      for (int threads : {1, 3}) {
        for (bool portable : {false, true}) {
          SCOPED_TRACE("K " + std::to_string(K) + " tokens " + std::to_string(n_tokens) + " threads " +
                       std::to_string(threads) + (portable ? " portable" : " vector"));
          const KernelChoice choice(portable);
          omp_set_num_threads(threads);
          std::vector<T> got(want.size());
          ref::matmul(got.data(), x.data(), w.data(), bias.data(), n_tokens, K, N);
          EXPECT_TRUE(same_bits(want, got));
        }
      }
      // A plain running sum in input order, for comparison.
      for (int t = 0; t < n_tokens; ++t) {
        for (int n = 0; n < N; ++n) {
          T s = 0;
          for (int k = 0; k < K; ++k) s += x[t * K + k] * w[n * K + k];
          s += bias[n];
          if (std::memcmp(&s, &want[t * N + n], sizeof(T)) != 0) ++order_mattered;
        }
      }
    }
  }
  omp_set_num_threads(threads_before);
  EXPECT_GT(order_mattered, 1000);
}

TEST(Kernels, VectorisedAndPortableFollowTheDocumentedOrder) {
  expect_documented_order<float>();
  expect_documented_order<double>();
}

// Two rows at once (a decode step's Q4_K rows in f64) give each row's decode_dot bit for bit, with finite scales and
// with any (a NaN lane is NaN in both); with the portable kernels, and for other formats, they decline.
TEST(DequantRows, TwoRowDecodeDotEqualsOneRowEach) {
  std::mt19937 rng(9);
  std::normal_distribution<double> normal;
  const int64_t n = 16 * 256;
  const int64_t row_bytes = n / 256 * ggml_block_bytes(GgmlType::Q4_K);
  for (bool finite : {true, false}) {
    SCOPED_TRACE(finite ? "finite scales" : "any scales");
    std::vector<std::byte> bytes(static_cast<size_t>(2 * row_bytes));
    for (std::byte& b : bytes) b = static_cast<std::byte>(rng() & 0xff);
    if (finite) {
      for (size_t i = 0; i < bytes.size(); i += static_cast<size_t>(ggml_block_bytes(GgmlType::Q4_K)))
        for (int o : {0, 2}) bytes[i + o + 1] &= std::byte{0xbf};
    }
    std::vector<double> x(n);
    for (double& v : x) v = normal(rng);
    double want[2][ref::kLanes] = {}, got[2][ref::kLanes] = {};
    for (int r = 0; r < 2; ++r) {
      if (!ref::decode_dot(GgmlType::Q4_K, bytes.data() + r * row_bytes, false, x.data(), n, want[r]))
        GTEST_SKIP() << "no fused decoders in this build (" << ref::kernels_name() << ")";
    }
    if (!ref::decode_dot_x2(GgmlType::Q4_K, bytes.data(), bytes.data() + row_bytes, false, x.data(), n, got[0], got[1]))
      GTEST_SKIP() << "no two-row decoder in this build (" << ref::kernels_name() << ")";
    for (int r = 0; r < 2; ++r) {
      for (int j = 0; j < ref::kLanes; ++j) {
        if (!finite && std::isnan(want[r][j]) && std::isnan(got[r][j])) continue;
        EXPECT_EQ(std::memcmp(&want[r][j], &got[r][j], sizeof(double)), 0) << "row " << r << " lane " << j;
      }
    }
    double declined[2][ref::kLanes] = {};
    EXPECT_FALSE(ref::decode_dot_x2(GgmlType::Q4_K, bytes.data(), bytes.data() + row_bytes, true, x.data(), n,
                                    declined[0], declined[1]));  // rounded to f16: one row at a time
    EXPECT_FALSE(ref::decode_dot_x2(GgmlType::Q6_K, bytes.data(), bytes.data() + row_bytes, false, x.data(), n,
                                    declined[0], declined[1]));
    const KernelChoice portable(true);
    EXPECT_FALSE(ref::decode_dot_x2(GgmlType::Q4_K, bytes.data(), bytes.data() + row_bytes, false, x.data(), n,
                                    declined[0], declined[1]));
    for (int r = 0; r < 2; ++r)
      for (double v : declined[r]) EXPECT_EQ(v, 0.0);
  }
}

// One row against 1 .. kDotTokens tokens at once (a draft's or a short prompt's rows) gives each token's decode_dot
// bit for bit, added to what each token's sums held: every format that has it, f32 and f64, rounded to f16 or not,
// finite scales or any, the inputs at a stride; with the portable kernels, another format or too many tokens, it
// declines.
template <typename T>
void expect_tokens_decode_dot_equals_one_token_each(GgmlType type, const std::vector<int>& half_offsets) {
  std::mt19937 rng(13);
  std::normal_distribution<double> normal;
  const int64_t n = 4 * 256, ldx = n + 40;
  const int64_t block_bytes = ggml_block_bytes(type), block_elements = ggml_block_elements(type);
  const int nmax = ref::kDotTokens;
  for (bool finite : {true, false}) {
    std::vector<std::byte> bytes(static_cast<size_t>(n / block_elements * block_bytes));
    for (std::byte& b : bytes) b = static_cast<std::byte>(rng() & 0xff);
    if (finite) {  // every scale's exponent below 31
      for (size_t i = 0; i < bytes.size(); i += static_cast<size_t>(block_bytes))
        for (int o : half_offsets) bytes[i + o + 1] &= std::byte{0xbf};
    }
    std::vector<T> x(static_cast<size_t>(nmax * ldx)), start(static_cast<size_t>(nmax * ref::kLanes));
    for (T& v : x) v = static_cast<T>(normal(rng));
    for (T& v : start) v = static_cast<T>(normal(rng));
    for (bool round : {false, true}) {
      for (int nt = 1; nt <= nmax; ++nt) {
        SCOPED_TRACE(std::string(ggml_type_name(type)) + (sizeof(T) == 8 ? " f64" : " f32") +
                     (finite ? " finite" : " any") + (round ? " f16" : "") + " tokens " + std::to_string(nt));
        std::vector<T> want(start.begin(), start.begin() + nt * ref::kLanes), got = want;
        for (int t = 0; t < nt; ++t) {
          if (!ref::decode_dot(type, bytes.data(), round, x.data() + t * ldx, n, want.data() + t * ref::kLanes))
            GTEST_SKIP() << "no fused decoders in this build (" << ref::kernels_name() << ")";
        }
        if (!ref::decode_dot_tokens(type, bytes.data(), round, x.data(), ldx, nt, n, got.data()))
          GTEST_SKIP() << "no decoder for several tokens in this build (" << ref::kernels_name() << ")";
        for (size_t j = 0; j < want.size(); ++j) {
          if (!finite && std::isnan(want[j]) && std::isnan(got[j])) continue;
          ASSERT_EQ(std::memcmp(&want[j], &got[j], sizeof(T)), 0) << "token " << j / ref::kLanes << " lane "
                                                                  << j % ref::kLanes;
        }
      }
    }
    std::vector<T> declined(static_cast<size_t>((nmax + 1) * ref::kLanes));
    EXPECT_FALSE(ref::decode_dot_tokens(type, bytes.data(), false, x.data(), ldx, 0, n, declined.data()));
    EXPECT_FALSE(ref::decode_dot_tokens(type, bytes.data(), false, x.data(), ldx, nmax + 1, n, declined.data()));
    {
      const KernelChoice portable(true);
      EXPECT_FALSE(ref::decode_dot_tokens(type, bytes.data(), false, x.data(), ldx, 2, n, declined.data()));
      EXPECT_FALSE(ref::has_dot_tokens(type));
    }
    for (T v : declined) EXPECT_EQ(v, T(0));
  }
}

TEST(DequantRows, TokensDecodeDotEqualsOneTokenEach) {
  const std::vector<std::pair<GgmlType, std::vector<int>>> formats = {
      {GgmlType::Q4_0, {0}},    {GgmlType::Q4_1, {0, 2}}, {GgmlType::Q8_0, {0}},
      {GgmlType::Q4_K, {0, 2}}, {GgmlType::Q5_K, {0, 2}}, {GgmlType::Q6_K, {208}}};
  for (const auto& [type, halves] : formats) {
    expect_tokens_decode_dot_equals_one_token_each<float>(type, halves);
    expect_tokens_decode_dot_equals_one_token_each<double>(type, halves);
  }
  // Formats without a several-token decoder decline (the matmul takes its other paths).
  std::vector<std::byte> bytes(static_cast<size_t>(ggml_block_bytes(GgmlType::Q5_0) * 8));
  std::vector<float> x(256 * 2), acc(2 * ref::kLanes);
  EXPECT_FALSE(ref::decode_dot_tokens(GgmlType::Q5_0, bytes.data(), false, x.data(), 256, 2, 256, acc.data()));
  EXPECT_FALSE(ref::has_dot_tokens(GgmlType::Q5_0));
  EXPECT_FALSE(ref::has_dot_tokens(GgmlType::F16));
}

TEST(StreamedMatmul, EqualsDenseMatmulBitForBit) {
  const std::vector<std::string> formats = {"f32",  "f16",  "bf16", "q8_0", "q4_0", "q4_1", "q5_0",
                                            "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "kmix"};
  if (!std::filesystem::exists(test::fixture_path("tiny-llama-f32.gguf"))) {
    GTEST_SKIP() << "tiny fixtures not generated in " << test::fixture_path("") << " (ctest fixture tiny_models)";
  }
  int checked = 0;
  for (const std::string& fmt : formats) {
    const auto file = GgufFile::open(test::fixture_path("tiny-llama-" + fmt + ".gguf"));
    for (const char* name : {"token_embd.weight", "blk.0.attn_k.weight", "blk.1.ffn_down.weight"}) {
      const TensorInfo& info = file->tensor(name);
      for (bool f16 : {false, true}) {
        expect_streamed_matmul_equals_dense<float>(*file, info, f16);
        expect_streamed_matmul_equals_dense<double>(*file, info, f16);
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 3 * static_cast<int>(formats.size()));
}

// Every float checkpoint and every id, keyed by (step, name).
class MemorySink final : public Sink {
 public:
  bool wants(std::string_view) const override { return true; }
  void record(int step, std::string_view name, int, std::string_view, std::span<const int64_t>, NativeDType,
              std::span<const float> data) override {
    values[{step, std::string(name)}] = {data.begin(), data.end()};
  }
  void record_ids(int step, std::string_view name, std::span<const int32_t> ids) override {
    values[{step, std::string(name)}] = std::vector<float>(ids.begin(), ids.end());
  }
  std::map<std::pair<int, std::string>, std::vector<float>> values;
};

// A prefill and two decode steps (fixed tokens, so a fault's logits cannot pick an id outside the vocabulary).
MemorySink run_three_steps(const GgufFile& file, const ModelConfig& cfg, const std::string& precision,
                           const FaultSet& faults, WeightHolding holding, std::vector<std::vector<float>>& logits) {
  auto backend = make_cpu_backend(file, cfg, precision, 16, faults, holding);
  MemorySink sink;
  logits.push_back(backend->forward(0, std::vector<int32_t>{1, 5, 9, 2, 7}, sink));
  logits.push_back(backend->forward(1, std::vector<int32_t>{3}, sink));
  logits.push_back(backend->forward(2, std::vector<int32_t>{11}, sink));
  return sink;
}

// Streamed and dense runs agree at every checkpoint of every step, bit for bit; returns the checkpoints compared.
int expect_same_run(const GgufFile& file, const ModelConfig& cfg, const std::string& precision,
                    const FaultSet& faults = {}) {
  std::vector<std::vector<float>> logits_streamed, logits_dense;
  const MemorySink streamed = run_three_steps(file, cfg, precision, faults, WeightHolding::streamed, logits_streamed);
  const MemorySink dense = run_three_steps(file, cfg, precision, faults, WeightHolding::dense, logits_dense);
  EXPECT_EQ(streamed.values.size(), dense.values.size());
  for (const auto& [key, want] : dense.values) {
    const auto it = streamed.values.find(key);
    if (it == streamed.values.end()) {
      ADD_FAILURE() << "step " << key.first << " " << key.second << " missing from the streamed run";
      continue;
    }
    EXPECT_TRUE(same_bits(want, it->second)) << "step " << key.first << " " << key.second;
  }
  for (size_t s = 0; s < logits_dense.size(); ++s) EXPECT_TRUE(same_bits(logits_dense[s], logits_streamed[s]));
  return static_cast<int>(dense.values.size());
}

TEST(StreamedReference, EqualsDenseOnEveryTinyFixtureAndPrecision) {
  if (!std::filesystem::exists(test::fixture_path("tiny-llama-f32.gguf"))) {
    GTEST_SKIP() << "tiny fixtures not generated in " << test::fixture_path("") << " (ctest fixture tiny_models)";
  }
  // Each fixture in one precision, taken in turn, so that each architecture meets every precision (the matmul test
  // above covers every format in f32 and f64, with and without f16 rounding).
  const std::vector<std::string> precisions = {"f32", "f64", "f32-f16store", "f64-f16residual"};
  int runs = 0;
  for (const std::string arch : {"llama", "llama-tied", "qwen2", "qwen3"}) {
    for (const std::string fmt : {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k",
                                  "q4_k", "q5_k", "q6_k", "kmix"}) {
      const auto file = GgufFile::open(test::fixture_path("tiny-" + arch + "-" + fmt + ".gguf"));
      const ModelConfig cfg = config_from_gguf(*file);
      const std::string& precision = precisions[runs % precisions.size()];
      SCOPED_TRACE("tiny-" + arch + "-" + fmt + " " + precision);
      EXPECT_GT(expect_same_run(*file, cfg, precision), 3 * 2 * 10);
      ++runs;
    }
  }
  EXPECT_EQ(runs, 4 * 14);
}

// The whole forward pass with the portable kernels (and decoders) gives the vectorised run's checkpoints bit for bit:
// the formats with decoders of their own and the rest, each in f32, f64 and the f16-storage precisions.
TEST(StreamedReference, PortableKernelsGiveTheVectorisedRun) {
  if (!std::filesystem::exists(test::fixture_path("tiny-llama-f32.gguf"))) {
    GTEST_SKIP() << "tiny fixtures not generated in " << test::fixture_path("") << " (ctest fixture tiny_models)";
  }
  int runs = 0;
  for (const std::string fmt : {"f32", "f16", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "kmix"}) {
    const auto file = GgufFile::open(test::fixture_path("tiny-llama-" + fmt + ".gguf"));
    const ModelConfig cfg = config_from_gguf(*file);
    for (const std::string precision : {"f32", "f64", "f32-f16store", "f64-f16store"}) {
      SCOPED_TRACE("tiny-llama-" + fmt + " " + precision);
      std::vector<std::vector<float>> logits_vector, logits_portable;
      const MemorySink vector = run_three_steps(*file, cfg, precision, {}, WeightHolding::streamed, logits_vector);
      MemorySink portable;
      {
        const KernelChoice choice(true);
        portable = run_three_steps(*file, cfg, precision, {}, WeightHolding::streamed, logits_portable);
      }
      ASSERT_EQ(vector.values.size(), portable.values.size());
      for (const auto& [key, want] : vector.values) {
        EXPECT_TRUE(same_bits(want, portable.values.at(key))) << "step " << key.first << " " << key.second;
      }
      for (size_t s = 0; s < logits_vector.size(); ++s) EXPECT_TRUE(same_bits(logits_vector[s], logits_portable[s]));
      ++runs;
    }
  }
  EXPECT_EQ(runs, 9 * 4);
}

// The faults that edit or reinterpret weights hold those matrices dense; every fault that applies gives the same run.
TEST(StreamedReference, EqualsDenseUnderEveryApplicableFault) {
  const std::string path = test::fixture_path("tiny-llama-q4_0.gguf");
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " not generated (ctest fixture tiny_models)";
  const auto file = GgufFile::open(path);
  const ModelConfig cfg = config_from_gguf(*file);
  std::set<Fault> ran;
  for (const FaultInfo& info : fault_catalog()) {
    if (!fault_not_applicable(info.id, cfg, file.get()).empty()) continue;
    const char* precision = ran.size() % 2 ? "f64-f16store" : "f32";
    SCOPED_TRACE(std::string(info.name) + " " + precision);
    expect_same_run(*file, cfg, precision, FaultSet{info.id});
    ran.insert(info.id);
  }
  for (Fault f : {Fault::embd_transposed, Fault::weight_row_nan, Fault::attn_out_transposed, Fault::ffn_down_transposed,
                  Fault::dequant_scale_offset, Fault::lm_head_padded_vocab, Fault::rms_norm_weight_twice}) {
    EXPECT_EQ(ran.count(f), 1u) << fault_info(f).name;
  }
}

TEST(StreamedReference, EqualsDenseOnSmolLM2) {
  if (!std::filesystem::exists(test::smollm2_path())) {
    GTEST_SKIP() << "SmolLM2 not found at " << test::smollm2_path() << " (fetch it with scripts/fetch_models)";
  }
  const auto file = GgufFile::open(test::smollm2_path());
  const ModelConfig cfg = config_from_gguf(*file);
  for (const char* precision : {"f32", "f64"}) {
    SCOPED_TRACE(precision);
    expect_same_run(*file, cfg, precision);
  }
}

}  // namespace
}  // namespace diffrun
