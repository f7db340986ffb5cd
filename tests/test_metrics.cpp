// Unit tests of diff/metrics: each metric against values worked out by hand, non-finite handling, coordinates, logits.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>
#include <omp.h>

#include "diff/metrics.hpp"
#include "diff/report.hpp"

using namespace diffrun::diff;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

TensorMetrics metrics(const std::vector<float>& a, const std::vector<float>& b, ElementTolerance tol = {},
                      std::vector<int64_t> shape = {}, const char* layout = "", const DimSizes& dims = {}) {
  if (shape.empty()) shape = {static_cast<int64_t>(b.size())};
  return compute_metrics(a, b, shape, layout, dims, tol);
}

}  // namespace

TEST(Metrics, IdenticalTensorsAreExact) {
  std::vector<float> b = {1.0f, -2.0f, 3.5f};
  TensorMetrics m = metrics(b, b);
  EXPECT_EQ(m.n, 3);
  EXPECT_EQ(m.max_abs, 0.0);
  EXPECT_EQ(m.rel_l2, 0.0);
  EXPECT_EQ(m.nmse, 0.0);
  EXPECT_DOUBLE_EQ(m.cosine, 1.0);
  EXPECT_EQ(m.sqnr_db, kInf);
  EXPECT_EQ(m.n_fail, 0);
  EXPECT_EQ(m.min_atol, 0.0);
  EXPECT_EQ(m.min_rtol, 0.0);
}

TEST(Metrics, HandWorkedValues) {
  // a - b = (0, 1): ||d|| = 1, ||b|| = 5.
  TensorMetrics m = metrics({3.0f, 5.0f}, {3.0f, 4.0f});
  EXPECT_DOUBLE_EQ(m.max_abs, 1.0);
  EXPECT_DOUBLE_EQ(m.mean_abs, 0.5);
  EXPECT_DOUBLE_EQ(m.rel_l2, 0.2);
  EXPECT_DOUBLE_EQ(m.nmse, 0.04);
  EXPECT_DOUBLE_EQ(m.cosine, 29.0 / (std::sqrt(34.0) * 5.0));
  EXPECT_NEAR(m.sqnr_db, 10.0 * std::log10(25.0), 1e-12);
  EXPECT_EQ(m.worst.flat, 1);
  EXPECT_EQ(m.worst.a, 5.0);
  EXPECT_EQ(m.worst.b, 4.0);
}

TEST(Metrics, FailFractionAndSmallestPassingTolerances) {
  // |a-b| = 0.25 everywhere; with rtol 0.05 only |b| >= 5 passes.
  std::vector<float> b = {1.0f, 10.0f, 100.0f};
  std::vector<float> a = {1.25f, 10.25f, 100.25f};
  TensorMetrics m = metrics(a, b, {0.0, 0.05});
  EXPECT_EQ(m.n_fail, 1);
  EXPECT_DOUBLE_EQ(m.fail_frac, 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(m.min_atol, 0.25);
  EXPECT_DOUBLE_EQ(m.min_rtol, 0.25);  // the element with |b| = 1
  EXPECT_EQ(m.worst.flat, 0);           // 0.25 / 0.05 is the largest ratio
  // With atol 0.2 the remaining 0.05 over |b| = 1 needs rtol 0.05.
  TensorMetrics m2 = metrics(a, b, {0.2, 0.0});
  EXPECT_NEAR(m2.min_rtol, 0.05, 1e-12);
  EXPECT_EQ(m2.n_fail, 3);
  // The smallest tolerances pass, by definition.
  TensorMetrics m3 = metrics(a, b, {m.min_atol, 0.0});
  EXPECT_EQ(m3.n_fail, 0);
}

TEST(Metrics, WorstElementCoordinatesFollowTheLayout) {
  std::vector<float> b(2 * 3 * 4, 1.0f);
  std::vector<float> a = b;
  a[1 * 12 + 2 * 4 + 3] = 2.0f;  // T=1, H=2, Dh=3
  TensorMetrics m = metrics(a, b, {}, {2, 3, 4}, "T,H,Dh");
  EXPECT_EQ(format_coordinates(m.worst.coords), "T=1, H=2, Dh=3");
  // A combined stored dimension is split by the known sizes.
  TensorMetrics m2 = metrics(a, b, {}, {2, 12}, "T,H*Dh", {{"H", 3}, {"Dh", 4}});
  EXPECT_EQ(format_coordinates(m2.worst.coords), "T=1, H=2, Dh=3");
  // ...and left whole when they do not fit the extent.
  TensorMetrics m3 = metrics(a, b, {}, {2, 12}, "T,H*Dh", {{"H", 5}, {"Dh", 4}});
  EXPECT_EQ(format_coordinates(m3.worst.coords), "T=1, H*Dh=11");
  // A layout that does not match the rank names the dims by position.
  TensorMetrics m4 = metrics(a, b, {}, {2, 12}, "T,H,Dh");
  EXPECT_EQ(format_coordinates(m4.worst.coords), "d0=1, d1=11");
}

TEST(Metrics, NonFiniteWhereTheOtherSideIsFiniteAlwaysCounts) {
  TensorMetrics m = metrics({1.0f, kNaN, 3.0f}, {1.0f, 2.0f, 3.0f});
  EXPECT_EQ(m.nan_a, 1);
  EXPECT_EQ(m.nonfinite_mismatch, 1);
  EXPECT_EQ(m.n_fail, 1);
  EXPECT_EQ(m.worst.flat, 1);
  EXPECT_FALSE(m.finite());
  EXPECT_EQ(m.nonfinite(), 1);
  // Aggregates over non-finite data are undefined, never the finite pairs' 0 or 1.
  for (double x : {m.rel_l2, m.max_abs, m.mean_abs, m.nmse, m.cosine, m.sqnr_db, m.min_atol, m.min_rtol}) {
    EXPECT_TRUE(std::isnan(x)) << x;
  }
  // The same non-finite value on both sides agrees element-wise, but is still counted.
  TensorMetrics same = metrics({kNaN, INFINITY, 1.0f}, {kNaN, INFINITY, 1.0f});
  EXPECT_EQ(same.nonfinite_mismatch, 0);
  EXPECT_EQ(same.nan_a, 1);
  EXPECT_EQ(same.inf_b, 1);
  EXPECT_EQ(same.n_fail, 0);
  EXPECT_EQ(same.nonfinite(), 4);
  EXPECT_TRUE(std::isnan(same.rel_l2));
  EXPECT_TRUE(std::isnan(same.cosine));
  TensorMetrics opposite = metrics({INFINITY}, {-INFINITY});
  EXPECT_EQ(opposite.nonfinite_mismatch, 1);
}

TEST(Metrics, FirstNonFiniteOfEachSideIsLocatedByLayoutLetters) {
  // [T=2, H=2, Dh=3]: engine NaN at (1, 0, 2) and Inf later; reference -Inf at (0, 1, 1).
  std::vector<float> a(12, 1.0f), b(12, 1.0f);
  a[8] = kNaN;
  a[11] = INFINITY;
  b[4] = -INFINITY;
  TensorMetrics m = metrics(a, b, {}, {2, 2, 3}, "T,H,Dh");
  EXPECT_EQ(m.nan_a, 1);
  EXPECT_EQ(m.inf_a, 1);
  EXPECT_EQ(m.inf_b, 1);
  EXPECT_EQ(m.first_nonfinite_a.flat, 8);
  EXPECT_EQ(format_coordinates(m.first_nonfinite_a.coords), "T=1, H=0, Dh=2");
  EXPECT_TRUE(std::isnan(m.first_nonfinite_a.value));
  EXPECT_EQ(m.first_nonfinite_b.flat, 4);
  EXPECT_EQ(format_coordinates(m.first_nonfinite_b.coords), "T=0, H=1, Dh=1");
  EXPECT_EQ(m.first_nonfinite_b.value, -kInf);
  TensorMetrics clean = metrics({1.0f}, {1.0f});
  EXPECT_EQ(clean.first_nonfinite_a.flat, -1);
  EXPECT_EQ(clean.first_nonfinite_b.flat, -1);
}

TEST(Metrics, LogitMetricsOverNonFiniteRowsAreUndefined) {
  std::vector<float> b = {1, 2, 3, 4, 5, 6};
  std::vector<float> a = {1, 2, 3, kNaN, 5, 6};
  LogitMetrics lm = compute_logit_metrics(a, b, 2, 3);
  EXPECT_EQ(lm.kl[0], 0.0);
  EXPECT_TRUE(std::isnan(lm.kl[1]));
  for (double x : {lm.top1, lm.top5_overlap, lm.kl_mean, lm.kl_max}) EXPECT_TRUE(std::isnan(x)) << x;
  // All-NaN rows on both sides must not read as agreement.
  std::vector<float> nan_row = {kNaN, kNaN, kNaN};
  EXPECT_TRUE(std::isnan(compute_logit_metrics(nan_row, nan_row, 1, 3).top1));
}

TEST(Metrics, ZeroReference) {
  TensorMetrics both = metrics({0.0f, 0.0f}, {0.0f, 0.0f});
  EXPECT_EQ(both.rel_l2, 0.0);
  EXPECT_EQ(both.cosine, 1.0);
  TensorMetrics only_b = metrics({1e-3f, 0.0f}, {0.0f, 0.0f});
  EXPECT_EQ(only_b.rel_l2, kInf);
  EXPECT_EQ(only_b.cosine, 0.0);
  EXPECT_EQ(only_b.sqnr_db, -kInf);
  EXPECT_EQ(only_b.min_rtol, kInf);  // no rtol covers a difference where the reference is 0
}

TEST(Metrics, LogitAgreementTopFiveAndKl) {
  // Two rows over 6 entries; row 1 swaps the top two.
  std::vector<float> b = {5, 4, 3, 2, 1, 0, 0, 1, 2, 3, 4, 5};
  std::vector<float> a = {5, 4, 3, 2, 1, 0, 0, 1, 2, 3, 5, 4};
  LogitMetrics lm = compute_logit_metrics(a, b, 2, 6);
  ASSERT_EQ(lm.argmax_a.size(), 2u);
  EXPECT_EQ(lm.argmax_a[0], 0);
  EXPECT_EQ(lm.argmax_b[1], 5);
  EXPECT_EQ(lm.argmax_a[1], 4);
  EXPECT_DOUBLE_EQ(lm.top1, 0.5);
  EXPECT_DOUBLE_EQ(lm.top5_overlap, 1.0);  // same five in both rows
  EXPECT_EQ(lm.kl[0], 0.0);
  // KL(p_b || p_a) for row 1 by hand.
  double zb = 0;
  for (int v = 0; v < 6; ++v) zb += std::exp(static_cast<double>(b[6 + v]));
  double kl = 0;
  for (int v = 0; v < 6; ++v) {
    double pb = std::exp(static_cast<double>(b[6 + v])) / zb, pa = std::exp(static_cast<double>(a[6 + v])) / zb;  // same partition function
    kl += pb * std::log(pb / pa);
  }
  EXPECT_NEAR(lm.kl[1], kl, 1e-12);
  EXPECT_DOUBLE_EQ(lm.kl_max, lm.kl[1]);
  EXPECT_DOUBLE_EQ(lm.kl_mean, kl / 2);
  // A different top-5 set: one of five replaced.
  std::vector<float> c = {5, 4, 3, 2, -9, 1};
  std::vector<float> d = {5, 4, 3, 2, 1, -9};
  EXPECT_DOUBLE_EQ(compute_logit_metrics(c, d, 1, 6).top5_overlap, 0.8);
}

TEST(Metrics, ArgmaxSkipsNonFiniteAndTakesTheFirstTie) {
  std::vector<float> r = {1.0f, kNaN, 3.0f, 3.0f};
  EXPECT_EQ(argmax(r), 2);
  std::vector<float> none = {kNaN};
  EXPECT_EQ(argmax(none), -1);
}

TEST(Metrics, SparklineIsLogScaled) {
  std::vector<double> v = {1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1};
  EXPECT_EQ(sparkline(v), "▁▂▃▄▅▆▇█");
  std::vector<double> special = {0.0, kInf, std::nan(""), 1.0};
  EXPECT_EQ(sparkline(special), "·! ▁");
}

// Per-slice rel L2, computed in the same pass: an error confined to one row or one head is diluted in
// the tensor-wide rel L2 but not in its slice's.
TEST(Metrics, WorstRowHeadAndChannel) {
  // [T=4, H=3, Dh=2], all ones; the engine scales head 1 of token 2 by 1.5.
  std::vector<float> b(24, 1.0f), a = b;
  a[2 * 6 + 1 * 2 + 0] = 1.5f;
  a[2 * 6 + 1 * 2 + 1] = 1.5f;
  TensorMetrics m = metrics(a, b, {}, {4, 3, 2}, "T,H,Dh");
  EXPECT_NEAR(m.rel_l2, std::sqrt(0.5) / std::sqrt(24.0), 1e-12);
  EXPECT_EQ(m.row.dim, "T");
  EXPECT_EQ(m.row.extent, 4);
  EXPECT_EQ(m.row.index, 2);
  EXPECT_NEAR(m.row.rel_l2, std::sqrt(0.5) / std::sqrt(6.0), 1e-12);
  EXPECT_EQ(m.head.dim, "H");
  EXPECT_EQ(m.head.index, 1);
  EXPECT_NEAR(m.head.rel_l2, std::sqrt(0.5) / std::sqrt(8.0), 1e-12);
  EXPECT_EQ(m.channel.dim, "Dh");
  EXPECT_EQ(m.channel.index, 0);  // both channels equal: the first wins
  EXPECT_NEAR(m.channel.rel_l2, 0.5 / std::sqrt(12.0), 1e-12);
  // The same bytes as [T, H*Dh] with the sizes known: the same slices.
  TensorMetrics flat = metrics(a, b, {}, {4, 6}, "T,H*Dh", {{"H", 3}, {"Dh", 2}});
  EXPECT_EQ(flat.head.index, 1);
  EXPECT_DOUBLE_EQ(flat.head.rel_l2, m.head.rel_l2);
  EXPECT_EQ(flat.channel.dim, "Dh");
  // Attention probabilities [H, T, S]: rows are T, heads H, channels S (positions).
  std::vector<float> p(2 * 3 * 3, 0.5f), q = p;
  q[1 * 9 + 2 * 3 + 1] = 0.0f;  // head 1, token 2, position 1
  TensorMetrics att = metrics(q, p, {}, {2, 3, 3}, "H,T,S");
  EXPECT_EQ(att.row.dim, "T");
  EXPECT_EQ(att.row.index, 2);
  EXPECT_EQ(att.head.index, 1);
  EXPECT_EQ(att.channel.dim, "S");
  EXPECT_EQ(att.channel.index, 1);
  // A cache [S, Hkv, Dh]: rows are the cache rows S.
  std::vector<float> kb(5 * 2 * 2, 1.0f), ka = kb;
  for (int i = 0; i < 4; ++i) ka[4 * 4 + i] = 0.0f;  // cache row 4 all zero
  TensorMetrics cache = metrics(ka, kb, {}, {5, 2, 2}, "S,Hkv,Dh");
  EXPECT_EQ(cache.row.dim, "S");
  EXPECT_EQ(cache.row.index, 4);
  EXPECT_DOUBLE_EQ(cache.row.rel_l2, 1.0);
  EXPECT_EQ(cache.head.dim, "Hkv");
  // [T, D]: no head axis; an unnamed layout: no slices at all.
  TensorMetrics td = metrics(a, b, {}, {4, 6}, "T,D");
  EXPECT_EQ(td.head.extent, 0);
  EXPECT_EQ(td.row.index, 2);
  EXPECT_EQ(td.channel.dim, "D");
  TensorMetrics bare = metrics(a, b);
  EXPECT_EQ(bare.row.extent + bare.head.extent + bare.channel.extent, 0);
  // Over non-finite data the slices' rel L2 is undefined too.
  a[0] = kNaN;
  EXPECT_TRUE(std::isnan(metrics(a, b, {}, {4, 3, 2}, "T,H,Dh").row.rel_l2));
}

namespace {

// The documented summation order (DESIGN.md, "The comparison's sums"), one element at a time: the reference the
// vectorised compute_metrics must equal bit for bit. Whole-tensor and run-constant (row, head) sums in four lanes
// by position in the innermost run, added (0 + 1) + (2 + 3); channel sums in index order.
struct OrderReference {
  double d2 = 0, b2 = 0, a2 = 0, ab = 0, absd = 0, max_abs = 0, worst_score = -1, min_rtol = 0;
  int64_t worst = -1, n_fail = 0;
  std::vector<double> row_d2, row_b2, ch_d2, ch_b2;
};

OrderReference order_reference(const std::vector<float>& a, const std::vector<float>& b, int64_t rows, int64_t cols,
                               ElementTolerance tol) {
  OrderReference r;
  double l[5][4] = {};
  r.row_d2.assign(rows, 0.0);
  r.row_b2.assign(rows, 0.0);
  r.ch_d2.assign(cols, 0.0);
  r.ch_b2.assign(cols, 0.0);
  for (int64_t t = 0; t < rows; ++t) {
    double rl[2][4] = {};
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = t * cols + c;
      const double x = a[i], y = b[i];
      if (!std::isfinite(x) || !std::isfinite(y)) {
        const bool same = (std::isnan(x) && std::isnan(y)) || (std::isinf(x) && std::isinf(y) && (x > 0) == (y > 0));
        if (!same) {
          ++r.n_fail;
          r.min_rtol = kInf;
          if (kInf > r.worst_score) {
            r.worst_score = kInf;
            r.worst = i;
          }
        }
        continue;
      }
      const int lane = static_cast<int>(c % 4);
      const double d = x - y;
      l[0][lane] += d * d;
      l[1][lane] += x * x;
      l[2][lane] += y * y;
      l[3][lane] += x * y;
      l[4][lane] += std::abs(d);
      rl[0][lane] += d * d;
      rl[1][lane] += y * y;
      r.ch_d2[c] += d * d;
      r.ch_b2[c] += y * y;
      r.max_abs = std::max(r.max_abs, std::abs(d));
      const double bound = tol.atol + tol.rtol * std::abs(y);
      if (std::abs(d) > bound) ++r.n_fail;
      const double score = bound > 0 ? std::abs(d) / bound : std::abs(d);
      if (score > r.worst_score) {
        r.worst_score = score;
        r.worst = i;
      }
      if (std::abs(d) > tol.atol)
        r.min_rtol = std::max(r.min_rtol, std::abs(y) > 0 ? (std::abs(d) - tol.atol) / std::abs(y) : kInf);
    }
    r.row_d2[t] += (rl[0][0] + rl[0][1]) + (rl[0][2] + rl[0][3]);
    r.row_b2[t] += (rl[1][0] + rl[1][1]) + (rl[1][2] + rl[1][3]);
  }
  const auto total = [&](int q) { return (l[q][0] + l[q][1]) + (l[q][2] + l[q][3]); };
  r.d2 = total(0);
  r.a2 = total(1);
  r.b2 = total(2);
  r.ab = total(3);
  r.absd = total(4);
  return r;
}

double worst_rel(const std::vector<double>& d2, const std::vector<double>& b2, int64_t* index) {
  double worst = 0;
  *index = -1;
  for (size_t j = 0; j < d2.size(); ++j) {
    const double rel = b2[j] > 0 ? std::sqrt(d2[j]) / std::sqrt(b2[j]) : (d2[j] > 0 ? kInf : 0.0);
    if (*index < 0 || rel > worst) {
      worst = rel;
      *index = static_cast<int64_t>(j);
    }
  }
  return worst;
}

}  // namespace

// compute_metrics takes whole groups of four elements with SSE2, the rest (a group holding a NaN or an Inf, a run's
// last elements) one at a time, and skips the divisions that cannot set a new worst score or rtol. Whatever path an
// element takes, every figure must equal the documented order's bit for bit: random tensors of odd and even
// widths, errors from 1e-9 to 1e3 relative, zeros, subnormals, and NaN/Inf on either side or both.
// Both vector paths (AVX2 where the CPU has it, and SSE2) against the documented order.
TEST(Metrics, VectorisedPassEqualsTheDocumentedOrder) {
  for (const bool avx2 : {true, false}) {
  SCOPED_TRACE(avx2 ? "AVX2 allowed" : "SSE2 only");
  allow_metrics_avx2(avx2);
  std::mt19937 rng(2026);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 99);
  const float specials[] = {0.0f, -0.0f, 1e-40f, -1e-42f, kNaN, std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()};
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t rows = 1 + trial % 7, cols = 1 + (trial * 37) % 61;
    const float rel_err = std::pow(10.0f, -9.0f + static_cast<float>(trial % 13));
    std::vector<float> a(rows * cols), b(rows * cols);
    for (size_t i = 0; i < b.size(); ++i) {
      b[i] = normal(rng) * std::pow(10.0f, static_cast<float>(pick(rng) % 7) - 3.0f);
      a[i] = b[i] * (1.0f + rel_err * normal(rng));
      if (trial % 3 == 0 && pick(rng) < 3) (pick(rng) % 2 ? a[i] : b[i]) = specials[pick(rng) % 7];
      if (trial % 5 == 0 && pick(rng) < 2) a[i] = b[i] = specials[pick(rng) % 7];
    }
    for (const ElementTolerance tol : {ElementTolerance{1e-6, 1e-5}, ElementTolerance{0.0, 1e-3}, ElementTolerance{}}) {
      const DimSizes dims = {{"T", rows}, {"D", cols}};
      const TensorMetrics m = metrics(a, b, tol, {rows, cols}, "T,D", dims);
      const OrderReference r = order_reference(a, b, rows, cols, tol);
      SCOPED_TRACE(testing::Message() << "trial " << trial << ", atol " << tol.atol << ", rtol " << tol.rtol);
      EXPECT_EQ(m.n_fail, r.n_fail);
      EXPECT_EQ(m.worst.flat, r.worst);
      if (!m.finite()) continue;  // the other figures are NaN then (NonFiniteWhereTheOtherSideIsFiniteAlwaysCounts)
      EXPECT_EQ(m.max_abs, r.max_abs);
      EXPECT_EQ(m.min_rtol, r.min_rtol);
      EXPECT_EQ(m.rel_l2, r.b2 > 0 ? std::sqrt(r.d2) / std::sqrt(r.b2) : (r.d2 > 0 ? kInf : 0.0));
      EXPECT_EQ(m.mean_abs, r.absd / static_cast<double>(rows * cols));
      if (r.a2 > 0 && r.b2 > 0) {
        EXPECT_EQ(m.cosine, r.ab / std::sqrt(r.a2 * r.b2));
      }
      int64_t row = -1, channel = -1;
      EXPECT_EQ(m.row.rel_l2, worst_rel(r.row_d2, r.row_b2, &row));
      EXPECT_EQ(m.row.index, row);
      EXPECT_EQ(m.channel.rel_l2, worst_rel(r.ch_d2, r.ch_b2, &channel));
      EXPECT_EQ(m.channel.index, channel);
    }
  }
  }
  allow_metrics_avx2(true);
}

// The engine's last logits row's largest values (what compare's argmax check reads) are those a sort of the finite
// values by value descending, then index ascending, puts first: ties, non-finite values and a row shorter than the
// count included.
TEST(Metrics, LastRowTopValuesAreTheSortsFirst) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> level(0, 9);
  for (const int vocab : {3, 8, 40, 1000}) {
    std::vector<float> row(static_cast<size_t>(vocab));
    for (float& v : row) v = static_cast<float>(level(rng));  // many ties
    if (vocab > 3) row[1] = kNaN, row[2] = std::numeric_limits<float>::infinity();
    const LogitMetrics lm = compute_logit_metrics(row, row, 1, vocab);
    std::vector<int32_t> idx;
    for (int32_t i = 0; i < vocab; ++i)
      if (std::isfinite(row[static_cast<size_t>(i)])) idx.push_back(i);
    std::sort(idx.begin(), idx.end(), [&](int32_t x, int32_t y) {
      return row[static_cast<size_t>(x)] > row[static_cast<size_t>(y)] || (row[static_cast<size_t>(x)] == row[static_cast<size_t>(y)] && x < y);
    });
    idx.resize(std::min(idx.size(), LogitMetrics::kLastTop));
    ASSERT_EQ(lm.top_a_last.size(), idx.size()) << vocab;
    for (size_t k = 0; k < idx.size(); ++k) {
      EXPECT_EQ(lm.top_a_last[k].second, idx[k]) << vocab << " " << k;
      EXPECT_EQ(lm.top_a_last[k].first, row[static_cast<size_t>(idx[k])]);
    }
  }
}

// Logits in chunks (rows longer than one chunk, the chunks shared among threads): argmax, top-5 overlap and the
// last row's top values are the whole row's (ties across chunks included), KL is the row's within rounding, a row
// holding a NaN makes the aggregates NaN, and no figure depends on the thread count.
TEST(Metrics, ChunkedLogitsAreTheRowsAndDoNotDependOnThreads) {
  const int64_t rows = 3, vocab = 20000;  // three chunks a row
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> a(rows * vocab), b(rows * vocab);
  for (size_t i = 0; i < a.size(); ++i) {
    b[i] = normal(rng);
    a[i] = b[i] + 0.01f * normal(rng);
  }
  // Row 0: the largest value twice, in two chunks (the first index wins); row 2 of a: its argmax in the last chunk.
  a[100] = a[15000] = b[100] = b[15000] = 40.0f;
  a[2 * vocab + 19999] = 50.0f;
  const auto reference_top = [&](const std::vector<float>& x, int64_t t, size_t k) {
    std::vector<int32_t> idx(static_cast<size_t>(vocab));
    for (int32_t i = 0; i < vocab; ++i) idx[static_cast<size_t>(i)] = i;
    const float* r = x.data() + t * vocab;
    std::stable_sort(idx.begin(), idx.end(), [&](int32_t p, int32_t q) { return r[p] > r[q]; });
    idx.resize(k);
    return idx;
  };
  omp_set_num_threads(1);
  const LogitMetrics one = compute_logit_metrics(a, b, rows, vocab);
  omp_set_num_threads(4);
  const LogitMetrics four = compute_logit_metrics(a, b, rows, vocab);
  for (int64_t t = 0; t < rows; ++t) {
    EXPECT_EQ(one.argmax_a[static_cast<size_t>(t)], reference_top(a, t, 1)[0]);
    EXPECT_EQ(one.argmax_b[static_cast<size_t>(t)], reference_top(b, t, 1)[0]);
    double lse_a = 0, lse_b = 0, kl = 0;
    for (int64_t v = 0; v < vocab; ++v) {
      lse_a += std::exp(static_cast<double>(a[t * vocab + v]));
      lse_b += std::exp(static_cast<double>(b[t * vocab + v]));
    }
    lse_a = std::log(lse_a), lse_b = std::log(lse_b);
    for (int64_t v = 0; v < vocab; ++v) {
      const double la = a[t * vocab + v] - lse_a, lb = b[t * vocab + v] - lse_b;
      kl += std::exp(lb) * (lb - la);
    }
    EXPECT_NEAR(one.kl[static_cast<size_t>(t)], kl, 1e-9 * std::abs(kl) + 1e-12);  // row 0: KL ~ 0, its rounding
    EXPECT_EQ(one.kl[static_cast<size_t>(t)], four.kl[static_cast<size_t>(t)]);
  }
  EXPECT_EQ(one.argmax_a[0], 100);
  EXPECT_EQ(one.argmax_a[2], 19999);
  const std::vector<int32_t> last = reference_top(a, rows - 1, LogitMetrics::kLastTop);
  ASSERT_EQ(one.top_a_last.size(), last.size());
  for (size_t k = 0; k < last.size(); ++k) EXPECT_EQ(one.top_a_last[k].second, last[k]);
  EXPECT_EQ(one.top5_overlap, four.top5_overlap);
  EXPECT_EQ(one.kl_mean, four.kl_mean);
  b[vocab + 12345] = kNaN;
  const LogitMetrics nan = compute_logit_metrics(a, b, rows, vocab);
  EXPECT_TRUE(std::isnan(nan.kl[1]));
  EXPECT_FALSE(std::isnan(nan.kl[0]));
  EXPECT_TRUE(std::isnan(nan.kl_mean));
}
