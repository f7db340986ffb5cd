// checkpoints/tensor_parallel: the Megatron split of a model over N ranks, and what each rank's checkpoints hold.
#include <vector>

#include <gtest/gtest.h>

#include "checkpoints/tensor_parallel.hpp"
#include "model/config.hpp"
#include "model/error.hpp"

namespace diffrun {
namespace {

ModelConfig shape(int n_head, int n_head_kv, int head_dim, int n_ff) {
  ModelConfig c;
  c.arch = Arch::llama;
  c.n_layer = 2;
  c.n_embd = n_head * head_dim;
  c.n_head = n_head;
  c.n_head_kv = n_head_kv;
  c.head_dim = head_dim;
  c.n_ff = n_ff;
  c.n_vocab = 256;
  return c;
}

TEST(TensorParallel, RefusesModelsThatDoNotSplit) {
  const ModelConfig smol = shape(9, 3, 64, 1536);  // SmolLM2-135M
  EXPECT_NE(tp_refusal(smol, 2, 64).find("9 attention heads do not split evenly over 2 ranks"), std::string::npos);
  EXPECT_EQ(tp_refusal(smol, 3, 64), "");
  const ModelConfig kv3 = shape(12, 3, 64, 1536);
  EXPECT_NE(tp_refusal(kv3, 2, 64).find("3 KV heads"), std::string::npos);
  EXPECT_NE(tp_refusal(shape(8, 8, 64, 1000), 2, 256).find("not a multiple"), std::string::npos);
  EXPECT_NE(tp_refusal(shape(8, 8, 64, 512), 4, 256).find("fewer than the 4 ranks"), std::string::npos);
  ModelConfig moe = shape(8, 8, 64, 512);
  moe.moe = true;
  EXPECT_NE(tp_refusal(moe, 2, 64).find("experts"), std::string::npos);
  EXPECT_EQ(tp_refusal(smol, 1, 64), "");
  EXPECT_NE(tp_refusal(smol, 0, 64), "");
}

TEST(TensorParallel, SlicesCoverTheModelOnBlockBoundaries) {
  const ModelConfig llama7b = shape(32, 32, 128, 11008);  // F = 43 blocks of 256
  ASSERT_EQ(tp_refusal(llama7b, 2, 256), "");
  const TpSlice r0 = tp_slice(llama7b, 0, 2, 256), r1 = tp_slice(llama7b, 1, 2, 256);
  EXPECT_EQ(r0.h0, 0);
  EXPECT_EQ(r0.h1, 16);
  EXPECT_EQ(r1.h0, 16);
  EXPECT_EQ(r1.h1, 32);
  EXPECT_EQ(r0.f0, 0);
  EXPECT_EQ(r0.f1, 5376);  // 21 blocks
  EXPECT_EQ(r1.f0, 5376);
  EXPECT_EQ(r1.f1, 11008);  // 22 blocks
  for (int world : {2, 4}) {
    int64_t f = 0;
    for (int r = 0; r < world; ++r) {
      const TpSlice s = tp_slice(llama7b, r, world, 256);
      EXPECT_EQ(s.f0, f);
      EXPECT_EQ(s.f0 % 256, 0);
      f = s.f1;
      const ModelConfig local = tp_local_config(llama7b, s);
      EXPECT_EQ(local.n_head, 32 / world);
      EXPECT_EQ(local.n_head_kv, 32 / world);
      EXPECT_EQ(local.n_ff, s.f1 - s.f0);
    }
    EXPECT_EQ(f, 11008);
  }
  // Hkv < N: each rank one KV head, head r·Hkv/N, the query heads of its group.
  const ModelConfig qwen05b = shape(14, 2, 64, 4864);
  ASSERT_EQ(tp_refusal(qwen05b, 2, 64), "");
  const ModelConfig gqa = shape(8, 2, 64, 512);
  for (int r = 0; r < 4; ++r) {
    const TpSlice s = tp_slice(gqa, r, 4, 64);
    EXPECT_EQ(s.kv0, r / 2);
    EXPECT_EQ(s.kv1 - s.kv0, 1);
    EXPECT_EQ(s.h0 / (gqa.n_head / gqa.n_head_kv), s.kv0) << "rank " << r << "'s query heads belong to its KV head";
  }
}

TEST(TensorParallel, MegatronShardOfEachCheckpoint) {
  const ModelConfig c = shape(8, 2, 64, 512);
  const TpSlice s = tp_slice(c, 3, 4, 64);
  const ShardSpec q = megatron_shard("Qcur-1", s);
  EXPECT_EQ(q.split, "H");
  EXPECT_EQ(q.offset, 6);
  EXPECT_EQ(q.extent, 2);
  EXPECT_FALSE(q.partial);
  EXPECT_EQ(megatron_shard("kq_soft_max-0", s).split, "H");
  EXPECT_EQ(megatron_shard("kqv_out-0", s).split, "H");
  const ShardSpec k = megatron_shard("cache_k-0", s);
  EXPECT_EQ(k.split, "Hkv");
  EXPECT_EQ(k.offset, 1);
  EXPECT_EQ(k.extent, 1);
  const ShardSpec f = megatron_shard("ffn_swiglu-1", s);
  EXPECT_EQ(f.split, "F");
  EXPECT_EQ(f.offset, 384);
  EXPECT_EQ(f.extent, 128);
  EXPECT_TRUE(megatron_shard("attn_out-0", s).partial);
  EXPECT_TRUE(megatron_shard("ffn_out-1", s).partial);
  for (const char* replicated : {"tokens", "embd", "attn_norm-0", "ffn_inp-0", "ffn_norm-1", "l_out-1", "result_norm",
                                 "result_output"}) {
    const ShardSpec r = megatron_shard(replicated, s);
    EXPECT_EQ(r.split, "") << replicated;
    EXPECT_FALSE(r.partial) << replicated;
  }
  EXPECT_EQ(megatron_shard("Qcur-0", tp_slice(c, 0, 1, 64)).split, "") << "one rank holds everything";
}

// The merge primitives: pieces placed along (and taken back out of, take_slice) a middle dimension reproduce the whole; Hkv copies placed lowest rank
// last present rank 0's; partial sums in float64, rounded once; pieces that do not fit are refused.
TEST(TensorParallel, MergePrimitives) {
  const std::vector<int64_t> shape = {2, 4, 3};  // [T, H, Dh], split along H
  std::vector<float> whole(24), merged(24, -1.0f);
  for (size_t i = 0; i < whole.size(); ++i) whole[i] = float(i);
  for (int64_t h0 : {0, 1}) {  // uneven slices: H 0..0 and 1..3
    const int64_t h1 = h0 == 0 ? 1 : 4;
    std::vector<float> piece;
    for (int64_t t = 0; t < 2; ++t)
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t d = 0; d < 3; ++d) piece.push_back(whole[size_t((t * 4 + h) * 3 + d)]);
    place_shard(merged, shape, 1, h0, piece);
    EXPECT_EQ(take_slice(whole, shape, 1, h0, h1), piece);  // its inverse
  }
  EXPECT_EQ(merged, whole);
  EXPECT_EQ(take_slice(whole, shape, 0, 1, 2), std::vector<float>(whole.begin() + 12, whole.end()));
  EXPECT_TRUE(take_slice(whole, shape, 2, 1, 1).empty());
  EXPECT_THROW(take_slice(whole, shape, 1, 2, 5), Error);  // past H
  EXPECT_THROW(take_slice(whole, shape, 3, 0, 1), Error);
  std::vector<float> copy(6, 7.0f), mine(6, 1.0f), out(6);
  const std::vector<int64_t> one_head = {2, 1, 3};
  place_shard(out, one_head, 1, 0, copy);
  place_shard(out, one_head, 1, 0, mine);  // rank 0 placed last
  EXPECT_EQ(out, mine);
  EXPECT_THROW(place_shard(merged, shape, 1, 3, std::vector<float>(12)), Error);  // 2 heads from H 3: past the end
  EXPECT_THROW(place_shard(merged, shape, 3, 0, std::vector<float>(6)), Error);

  const std::vector<float> a = {1.0f, 1e8f, 0.1f}, b = {1e-8f, -1e8f, 0.2f};
  const std::vector<float> sum = add_partials({a, b});
  EXPECT_EQ(sum[0], 1.0f);
  EXPECT_EQ(sum[1], 0.0f);
  EXPECT_EQ(sum[2], static_cast<float>(double(0.1f) + double(0.2f)));  // float64, rounded once
  EXPECT_THROW(add_partials({a, std::vector<float>(2)}), Error);
}

}  // namespace
}  // namespace diffrun
