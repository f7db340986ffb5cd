// Tests of the dump size estimate against the size of dumps DumpWriter really writes, and of size parsing.
#include <gtest/gtest.h>

#include <filesystem>

#include "dump/dump.hpp"
#include "dump/dump_size.hpp"
#include "model/error.hpp"
#include "tests/test_util.hpp"

namespace diffrun {
namespace {

namespace fs = std::filesystem;

ModelConfig config(int n_layer, int n_embd, int n_head, int n_head_kv, int n_ff, int n_vocab, bool qk_norm) {
  ModelConfig c;
  c.arch = qk_norm ? Arch::qwen3 : Arch::llama;
  c.n_layer = n_layer;
  c.n_embd = n_embd;
  c.n_head = n_head;
  c.n_head_kv = n_head_kv;
  c.head_dim = n_embd / n_head;
  c.n_ff = n_ff;
  c.n_vocab = n_vocab;
  c.n_ctx = 4096;
  c.rope_theta = 10000.0;
  c.rope_type = qk_norm ? RopeType::neox : RopeType::norm;
  c.rms_eps = 1e-5;
  c.qk_norm = qk_norm;
  return c;
}

// Writes what a run of `plan` records (every checkpoint of every step, zeros) and returns the file's size.
uint64_t write_dump(const fs::path& path, const ModelConfig& cfg, const DumpPlan& plan, DumpWriterOptions opt = {}) {
  DumpMeta meta;
  meta.backend = "cpu";
  meta.precision = "f32";
  meta.model_path = "model.gguf";
  meta.model_fingerprint = "size=1;fnv1a64=0123456789abcdef";
  meta.config = cfg;
  meta.prompt = "a prompt";
  meta.token_ids.assign(static_cast<size_t>(plan.prompt_tokens), 7);
  opt.softmax_rows = plan.softmax_rows;
  opt.logits_rows = plan.logits_rows;
  opt.token_rows = plan.token_rows;
  opt.cache_all_rows = plan.cache_all_rows;
  DumpWriter writer(path.string(), meta, plan.filter, opt);
  for (int64_t s = 0; s <= plan.steps; ++s) {
    const int64_t t = s == 0 ? plan.prompt_tokens : 1;
    for (const auto& name : checkpoint_names(cfg)) {
      const ParsedCheckpointName p = parse_checkpoint_name(name);
      const CheckpointKind* k = find_checkpoint_kind(p.base);
      const std::vector<int64_t> shape = checkpoint_shape(cfg, *k, t, plan.prompt_tokens + s);
      size_t n = 1;
      for (int64_t d : shape) n *= static_cast<size_t>(d);
      if (p.base == "tokens") {
        writer.record_ids(static_cast<int>(s), name, std::vector<int32_t>(n, 3));
      } else {
        writer.record(static_cast<int>(s), name, p.layer, k->layout, shape, NativeDType::f32, std::vector<float>(n, 0.5f));
      }
    }
  }
  const std::vector<int32_t> all(static_cast<size_t>(plan.prompt_tokens + plan.steps), 3);
  writer.set_attribute("all_token_ids", all);
  writer.set_attribute("argmax", std::vector<int32_t>(static_cast<size_t>(plan.steps + 1), 3));
  writer.finish();
  return fs::file_size(path);
}

class DumpSizeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_scratch_dir("test-dump-size");
  }
  void TearDown() override { fs::remove_all(dir_); }
  // The estimate within `tolerance` (relative) of the written size.
  void expect_close(const ModelConfig& cfg, const DumpPlan& plan, double tolerance, DumpWriterOptions opt = {}) {
    const uint64_t real = write_dump(dir_ / "d.h5", cfg, plan, opt);
    const uint64_t est = estimate_dump_size(cfg, plan);
    const double rel = (static_cast<double>(est) - static_cast<double>(real)) / static_cast<double>(real);
    EXPECT_LE(std::abs(rel), tolerance) << "estimate " << est << " bytes, written " << real << " bytes";
  }
  fs::path dir_;
};

TEST_F(DumpSizeTest, EstimateMatchesWrittenDump) {
  // A SmolLM2-like slice: data dominates.
  const ModelConfig cfg = config(4, 128, 8, 4, 256, 1000, false);
  DumpPlan plan;
  plan.prompt_tokens = 60;
  plan.steps = 4;
  expect_close(cfg, plan, 0.03);
}

TEST_F(DumpSizeTest, EstimateMatchesWhenOverheadDominates) {
  // A tiny model: HDF5's per-dataset overhead dominates.
  const ModelConfig cfg = config(2, 8, 2, 1, 12, 17, true);
  DumpPlan plan;
  plan.prompt_tokens = 3;
  plan.steps = 5;
  expect_close(cfg, plan, 0.03);
}

TEST_F(DumpSizeTest, EstimateFollowsTheFilter) {
  const ModelConfig cfg = config(4, 128, 8, 4, 256, 1000, false);
  DumpPlan plan;
  plan.prompt_tokens = 60;
  plan.steps = 2;
  plan.filter = CheckpointFilter("attn_norm-*,kq_soft_max-*,result_*");
  expect_close(cfg, plan, 0.03);
  DumpPlan all = plan;
  all.filter = CheckpointFilter();
  EXPECT_LT(estimate_dump_size(cfg, plan), estimate_dump_size(cfg, all) / 2);
}

TEST_F(DumpSizeTest, SoftmaxRowsCutTheEstimateAndTheDump) {
  const ModelConfig cfg = config(4, 64, 8, 4, 128, 500, false);
  DumpPlan plan;
  plan.prompt_tokens = 200;
  plan.steps = 2;
  const uint64_t full = estimate_dump_size(cfg, plan);
  plan.softmax_rows = 16;
  expect_close(cfg, plan, 0.03);
  const uint64_t cut = estimate_dump_size(cfg, plan);
  // kq_soft_max of the prefill is [H, T, S] = 8 x 200 x 200 floats a layer: 16 rows keep 8%.
  EXPECT_LT(cut, full * 55 / 100);
  EXPECT_EQ(full - cut, 4ull * 4 * 8 * (200 - 16) * 200);
}

TEST_F(DumpSizeTest, SoftmaxRowsWithinALimit) {
  const ModelConfig cfg = config(4, 64, 8, 4, 128, 500, false);
  DumpPlan plan;
  plan.prompt_tokens = 200;
  plan.steps = 2;
  const uint64_t full = estimate_dump_size(cfg, plan);
  EXPECT_EQ(softmax_rows_within(cfg, plan, full), 0);  // fits: every row
  const int64_t rows = softmax_rows_within(cfg, plan, full * 6 / 10);
  ASSERT_GT(rows, 0);
  ASSERT_LT(rows, 200);
  plan.softmax_rows = rows;
  EXPECT_LE(estimate_dump_size(cfg, plan), full * 6 / 10);
  plan.softmax_rows = rows + 1;
  EXPECT_GT(estimate_dump_size(cfg, plan), full * 6 / 10);
  plan.softmax_rows = 0;
  EXPECT_EQ(softmax_rows_within(cfg, plan, 1000), -1);  // not even one row fits
}

TEST_F(DumpSizeTest, TokenLogitsAndCacheRowsCutTheEstimateAndTheDump) {
  const ModelConfig cfg = config(4, 64, 8, 4, 128, 500, false);
  DumpPlan plan;
  plan.prompt_tokens = 200;
  plan.steps = 6;
  plan.logits_rows = 0;
  plan.cache_all_rows = true;
  expect_close(cfg, plan, 0.03);
  const uint64_t all = estimate_dump_size(cfg, plan);
  // The cache rows each step wrote: decode steps store 1 of S rows, [1, Hkv, Dh] a layer and kind.
  plan.cache_all_rows = false;
  expect_close(cfg, plan, 0.03);
  uint64_t cache_saved = 0;
  for (int s = 1; s <= 6; ++s) cache_saved += 4ull * 2 * 4 * (200 + s - 1) * 4 * 8;  // layers, kinds, bytes, rows, Hkv, Dh
  EXPECT_EQ(all - estimate_dump_size(cfg, plan), cache_saved);
  // The prefill's logits: the last 64 rows of [200, 500].
  const uint64_t before = estimate_dump_size(cfg, plan);
  plan.logits_rows = 64;
  expect_close(cfg, plan, 0.03);
  EXPECT_EQ(before - estimate_dump_size(cfg, plan), 4ull * (200 - 64) * 500);
  // Every per-token checkpoint's last 10 rows, and the largest count within a limit.
  plan.token_rows = 10;
  expect_close(cfg, plan, 0.05);
  EXPECT_LT(estimate_dump_size(cfg, plan), before / 5);
  plan.token_rows = 0;
  const uint64_t limit = estimate_dump_size(cfg, plan) / 4;
  const int64_t rows = token_rows_within(cfg, plan, limit);
  ASSERT_GT(rows, 0);
  plan.token_rows = rows;
  EXPECT_LE(estimate_dump_size(cfg, plan), limit);
  plan.token_rows = rows + 1;
  EXPECT_GT(estimate_dump_size(cfg, plan), limit);
}

TEST(DumpSize, ParseAndFormatBytes) {
  EXPECT_EQ(parse_bytes("4GB"), 4000000000ull);
  EXPECT_EQ(parse_bytes("4G"), 4000000000ull);
  EXPECT_EQ(parse_bytes("500M"), 500000000ull);
  EXPECT_EQ(parse_bytes("1.5 GiB"), 1610612736ull);
  EXPECT_EQ(parse_bytes("123456"), 123456ull);
  EXPECT_EQ(parse_bytes("0"), 0ull);
  EXPECT_THROW(parse_bytes("lots"), InputError);
  EXPECT_THROW(parse_bytes("4 parsecs"), InputError);
  EXPECT_THROW(parse_bytes("-1G"), InputError);
  EXPECT_EQ(format_bytes(4000000000ull), "4.0 GB");
  EXPECT_EQ(format_bytes(86100000ull), "86.1 MB");
  EXPECT_EQ(format_bytes(999ull), "999 B");
}

}  // namespace
}  // namespace diffrun
