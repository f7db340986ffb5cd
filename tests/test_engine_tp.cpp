// The tensor-parallel engine (--tp N, engine/tp_engine.hpp) on the GPU host: N ranks against the one-GPU engine,
// both f32, on the tiny fixtures that split; the ranks' shards against the merge; the production path recorded;
// the refusals. The tests of N >= 2 skip (with the reason) without 2 GPUs; one rank runs on any GPU host.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "checkpoints/tensor_parallel.hpp"
#include "engine/engine.hpp"
#include "engine/tp_engine.hpp"
#include "model/config.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"
#include "tests/test_engine_common.hpp"
#include "tests/test_util.hpp"

namespace diffrun {
namespace {

using test::MemorySink;
using test::prompt_ids;
using test::rel_l2;

#define REQUIRE_GPUS(n)                                                                                   \
  do {                                                                                                    \
    DIFFRUN_REQUIRE_CUDA();                                                                               \
    if (cuda_device_count() < (n))                                                                        \
      GTEST_SKIP() << "needs " << (n) << " GPUs; this host has " << cuda_device_count();                 \
  } while (0)

// The fixtures of every architecture the engine splits, in formats whose blocks the ranks' Wo columns respect.
std::vector<std::string> tp_fixtures() {
  std::vector<std::string> out;
  for (const char* arch : {"llama", "qwen2", "qwen3"})
    for (const char* fmt : {"f32", "f16", "q8_0", "q4_0"}) out.push_back(std::string("tiny-") + arch + "-" + fmt + ".gguf");
  out.push_back("tiny-gemma3-f32.gguf");
  out.push_back("tiny-gemma3-q8_0.gguf");
  return out;
}

// Whether `world` ranks can run the model (the same checks make_tp_cuda_engine makes); the reason where not.
bool splits(const GgufFile& file, const ModelConfig& cfg, int world, std::string* why) {
  try {
    check_tp(file, cfg, world, false);
    return true;
  } catch (const InputError& e) {
    *why = e.what();
    return false;
  }
}

// Prefill of 7 tokens, then 3 decode steps fed the one-GPU engine's argmax: every checkpoint of the TP engine's
// merge within 1e-5 of the one-GPU engine's (f32; only the all-reduce's summation order differs), the same argmax
// each step, and the decode steps run as captured graphs on every rank.
TEST(EngineTp, MergedRanksMatchOneGpuOnTinyFixtures) {
  REQUIRE_GPUS(2);
  int runs = 0;
  for (int world : {2, 4}) {
    if (cuda_device_count() < world) {
      std::printf("TP = %d: skipped, this host has %d GPUs\n", world, cuda_device_count());
      continue;
    }
    for (const std::string& name : tp_fixtures()) {
      const std::string path = test::fixture_path(name);
      ASSERT_TRUE(std::filesystem::exists(path)) << "missing fixture " << path;
      SCOPED_TRACE(name + " at TP = " + std::to_string(world));
      auto file = GgufFile::open(path);
      const ModelConfig cfg = config_from_gguf(*file);
      std::string why;
      if (!splits(*file, cfg, world, &why)) {
        std::printf("%s at TP = %d: not split (%s)\n", name.c_str(), world, why.c_str());
        continue;
      }
      auto one = make_cuda_engine(*file, cfg, "f32", 16);
      auto tp = make_tp_cuda_engine(*file, cfg, "f32", 16, world);
      EXPECT_NE(tp->facts().at("tensor_parallel").find(std::to_string(world) + " ranks"), std::string::npos);
      if (runs == 0) std::printf("all-reduce: %s\n", tp->rank(0).facts().at("tp_all_reduce").c_str());
      std::vector<int32_t> tokens = prompt_ids(cfg.n_vocab, 7);
      double worst = 0;
      std::string worst_name;
      for (int step = 0; step <= 3; ++step) {
        MemorySink a, b;
        one->forward(step, tokens, a);
        tp->forward(step, tokens, b);
        ASSERT_EQ(a.order[step], b.order[step]) << "step " << step << ": the merge's checkpoints, in order";
        for (const auto& [cp, r] : a.tensors[step]) {
          const test::Recorded& t = b.tensors[step].at(cp);
          ASSERT_EQ(t.shape, r.shape) << cp << " step " << step;
          const double rel = rel_l2(t.data, r.data);
          EXPECT_LT(rel, 1e-5) << cp << " step " << step;
          if (rel > worst) worst = rel, worst_name = cp;
        }
        EXPECT_EQ(tp->last_argmax(), one->last_argmax()) << "step " << step;
        if (step > 0) {
          EXPECT_TRUE(tp->last_step_path().graph) << "decode step " << step << " ran as a graph";
        }
        tokens = {one->last_argmax()};
      }
      std::printf("%s TP = %d: worst rel L2 against one GPU %.2e (%s)\n", name.c_str(), world, worst,
                  worst_name.c_str());
      ++runs;
    }
  }
  EXPECT_GT(runs, 0);
}

// One rank (make_tp_cuda_engine at N = 1, runnable on any GPU host): the rank thread, its collector and the merge
// hand back exactly what the one-GPU engine computes, every checkpoint bit for bit.
TEST(EngineTp, OneRankIsTheOneGpuEngine) {
  DIFFRUN_REQUIRE_CUDA();
  for (const char* name : {"tiny-llama-q8_0.gguf", "tiny-qwen3moe-q8_0.gguf"}) {
    SCOPED_TRACE(name);
    auto file = GgufFile::open(test::fixture_path(name));
    const ModelConfig cfg = config_from_gguf(*file);
    auto one = make_cuda_engine(*file, cfg, "f32", 16);
    auto tp = make_tp_cuda_engine(*file, cfg, "f32", 16, 1);
    std::vector<int32_t> tokens = prompt_ids(cfg.n_vocab, 6);
    for (int step = 0; step <= 3; ++step) {
      MemorySink a, b;
      const std::vector<float> la = one->forward(step, tokens, a);
      const std::vector<float> lb = tp->forward(step, tokens, b);
      EXPECT_EQ(la, lb) << "step " << step;
      ASSERT_EQ(a.order[step], b.order[step]);
      for (const auto& [cp, r] : a.tensors[step]) EXPECT_EQ(b.tensors[step].at(cp).data, r.data) << cp;
      EXPECT_EQ(tp->last_step_path().graph, one->last_step_path().graph);
      tokens = {one->last_argmax()};
    }
  }
}

// Each rank's own sink holds its Megatron shard: split pieces are the merge's slices, partial sums add up to it,
// replicated ones equal it bit for bit.
TEST(EngineTp, RankSinksHoldTheMegatronShards) {
  REQUIRE_GPUS(2);
  const std::string path = test::fixture_path("tiny-qwen2-f32.gguf");
  auto file = GgufFile::open(path);
  const ModelConfig cfg = config_from_gguf(*file);
  auto tp = make_tp_cuda_engine(*file, cfg, "f32", 16, 2);
  const std::vector<int32_t> tokens = prompt_ids(cfg.n_vocab, 5);
  MemorySink merged, r0, r1;
  tp->forward(0, tokens, merged);
  tp->reset();
  RankSinks ranks({&r0, &r1});
  tp->forward(0, tokens, ranks);
  int split = 0, partial = 0, replicated = 0;
  for (const auto& [cp, whole] : merged.tensors[0]) {
    const MemorySink* per[2] = {&r0, &r1};
    const ShardSpec spec = megatron_shard(cp, tp->slice(0));
    if (spec.partial) {
      const auto& a = r0.tensors[0].at(cp).data;
      const auto& b = r1.tensors[0].at(cp).data;
      std::vector<float> sum(a.size());
      for (size_t i = 0; i < a.size(); ++i) sum[i] = static_cast<float>(double(a[i]) + double(b[i]));
      EXPECT_EQ(sum, whole.data) << cp;
      ++partial;
    } else if (spec.split.empty()) {
      for (const MemorySink* s : per) EXPECT_EQ(s->tensors.at(0).at(cp).data, whole.data) << cp;
      ++replicated;
    } else {
      const std::vector<std::string> dims = layout_dims(whole.layout);
      const size_t d = size_t(std::find(dims.begin(), dims.end(), spec.split) - dims.begin());
      ASSERT_LT(d, dims.size()) << cp;
      int64_t outer = 1, inner = 1;
      for (size_t k = 0; k < d; ++k) outer *= whole.shape[k];
      for (size_t k = d + 1; k < whole.shape.size(); ++k) inner *= whole.shape[k];
      for (int r = 0; r < 2; ++r) {
        const ShardSpec s = megatron_shard(cp, tp->slice(r));
        const auto& piece = per[r]->tensors.at(0).at(cp);
        EXPECT_EQ(piece.shape[d], s.extent) << cp << " rank " << r;
        for (int64_t o = 0; o < outer; ++o)
          for (int64_t i = 0; i < s.extent * inner; ++i)
            ASSERT_EQ(piece.data[size_t(o * s.extent * inner + i)],
                      whole.data[size_t((o * whole.shape[d] + s.offset) * inner + i)])
                << cp << " rank " << r;
      }
      ++split;
    }
  }
  EXPECT_GT(split, 0);
  EXPECT_GT(partial, 0);
  EXPECT_GT(replicated, 0);
}

// Recording runs the production path at TP = 2: the logits of recorded steps equal those of unrecorded ones bit
// for bit, decode steps as graphs both ways.
TEST(EngineTp, RecordingRunsTheProductionPath) {
  REQUIRE_GPUS(2);
  for (const char* name : {"tiny-llama-q8_0.gguf", "tiny-qwen3-f16.gguf"}) {
    for (const char* precision : {"f32", "f16"}) {
      SCOPED_TRACE(std::string(name) + " " + precision);
      auto file = GgufFile::open(test::fixture_path(name));
      const ModelConfig cfg = config_from_gguf(*file);
      auto tp = make_tp_cuda_engine(*file, cfg, precision, 16, 2);
      std::vector<std::vector<float>> plain, recorded;
      for (int pass = 0; pass < 2; ++pass) {
        tp->reset();
        std::vector<int32_t> tokens = prompt_ids(cfg.n_vocab, 6);
        for (int step = 0; step <= 3; ++step) {
          MemorySink rec;
          NullSink none;
          std::vector<float> logits = tp->forward(step, tokens, pass == 0 ? static_cast<Sink&>(none) : rec);
          if (step > 0) {
            EXPECT_TRUE(tp->last_step_path().graph);
          }
          (pass == 0 ? plain : recorded).push_back(logits);
          tokens = {tp->last_argmax()};
        }
      }
      EXPECT_EQ(plain, recorded);
    }
  }
}

TEST(EngineTp, RefusesWhatItCannotRun) {
  DIFFRUN_REQUIRE_CUDA();
  auto file = GgufFile::open(test::fixture_path("tiny-qwen2-f32.gguf"));
  const ModelConfig cfg = config_from_gguf(*file);
  const int more = cuda_device_count() + 1;
  try {
    make_tp_cuda_engine(*file, cfg, "f32", 16, more);
    ADD_FAILURE() << "no error for more ranks than GPUs";
  } catch (const InputError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("needs " + std::to_string(more) + " GPUs"), std::string::npos) << msg;
    EXPECT_NE(msg.find("has " + std::to_string(more - 1)), std::string::npos) << msg;
  }
  EXPECT_THROW(make_tp_cuda_engine(*file, cfg, "f32", 16, 1, {}, {TpFault::attn_allreduce_skipped}), InputError)
      << "a tensor-parallel fault on one GPU";
  if (cuda_device_count() < 2) return;
  auto kq = GgufFile::open(test::fixture_path("tiny-llama-q4_k.gguf"));  // Wo's 128 columns a rank: half a block
  EXPECT_THROW(make_tp_cuda_engine(*kq, config_from_gguf(*kq), "f32", 16, 2), InputError);
  EXPECT_THROW(make_tp_cuda_engine(*file, cfg, "f32", 16, 2, {}, {TpFault::kv_head_wrong_rank}), InputError)
      << "tiny qwen2's 2 KV heads are not copied at N = 2";
}

}  // namespace
}  // namespace diffrun
