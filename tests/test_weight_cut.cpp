// engine/weight_cut (host code): what a tensor-parallel rank uploads of each weight. On tiny fixtures of several
// formats, each rank's cut of every split tensor, gathered block by block and dequantized, equals the same rows and
// columns of the whole tensor dequantized.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "checkpoints/tensor_parallel.hpp"
#include "engine/weight_cut.hpp"
#include "model/config.hpp"
#include "model/dequant.hpp"
#include "model/gguf.hpp"
#include "model/tensor_table.hpp"
#include "tests/test_util.hpp"

namespace diffrun::engine {
namespace {

TEST(WeightCut, EachRanksCutIsTheWholeTensorsSlice) {
  int checked = 0;
  for (const char* name : {"tiny-llama-f32.gguf", "tiny-llama-f16.gguf", "tiny-llama-q8_0.gguf", "tiny-llama-q4_0.gguf",
                           "tiny-qwen2-q8_0.gguf", "tiny-qwen2-q5_1.gguf", "tiny-gemma3-q8_0.gguf"}) {
    SCOPED_TRACE(name);
    auto file = GgufFile::open(test::fixture_path(name));
    const ModelConfig cfg = config_from_gguf(*file);
    const int64_t unit = 64;
    ASSERT_EQ(tp_refusal(cfg, 2, unit), "");
    for (int r = 0; r < 2; ++r) {
      const TpSlice s = tp_slice(cfg, r, 2, unit);
      const WeightCut wc{s, s, s};
      for (const ExpectedTensor& e : expected_tensors(cfg)) {
        if (e.layer != 0) continue;
        Cut cut = cut_of(e.role, cfg, &wc);
        const TensorInfo& t = file->tensor(e.name);
        const int64_t cols = t.ne[0], rows = t.rows();
        if (cut.r1 < 0) cut.r1 = rows;
        if (cut.c1 < 0) cut.c1 = cols;
        if (cut.r0 == 0 && cut.r1 == rows && cut.c0 == 0 && cut.c1 == cols) continue;  // whole
        SCOPED_TRACE(e.name + " rank " + std::to_string(r));
        const int64_t bs = ggml_block_elements(t.type);
        ASSERT_EQ(cut.c0 % bs, 0);
        std::vector<std::byte> gathered;
        const std::span<const std::byte> bytes = cut_bytes(*file, t, cut, gathered);
        const int64_t n = (cut.r1 - cut.r0) * (cut.c1 - cut.c0);
        ASSERT_EQ(int64_t(bytes.size()), n / bs * int64_t(ggml_block_bytes(t.type)));
        std::vector<float> got(static_cast<size_t>(n));
        dequantize(t.type, bytes.data(), got.data(), n);
        const std::vector<float> whole = dequantize_tensor<float>(*file, t);
        for (int64_t i = cut.r0; i < cut.r1; ++i)
          for (int64_t j = cut.c0; j < cut.c1; ++j)
            ASSERT_EQ(got[size_t((i - cut.r0) * (cut.c1 - cut.c0) + (j - cut.c0))], whole[size_t(i * cols + j)])
                << "row " << i << " column " << j;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 40);
}

}  // namespace
}  // namespace diffrun::engine
