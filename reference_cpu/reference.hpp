// The CPU reference backend: an Eigen forward pass in f32 or f64 for every architecture of model/config_names.cpp.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "checkpoints/backend.hpp"
#include "faults/faults.hpp"
#include "model/config.hpp"
#include "model/gguf.hpp"

namespace diffrun {

// How the reference holds its weight matrices. streamed: as the GGUF's bytes (quantized, in the mmap), each
// matmul decoding the rows it reads; memory is a few MB of decoded rows a thread on top of the
// mapped file. dense: every matrix dequantized once at load (4 or 8 bytes per weight). Both compute the same
// values bit for bit (tests/test_reference_weights.cpp); dense is the oracle and the benchmark's baseline.
enum class WeightHolding { streamed, dense };

// Expert choices a reference follows instead of its own (mixtures of experts): at step `step`, layer `layer`, token
// `token` (the row of that step's ffn_moe_topk) the K experts `ids`, most probable first, weighted by the reference's
// own probabilities of them (moe_weigh). The job follows an engine's choice where the two chose otherwise across a
// near tie (a routing flip by drift, diff/routing.hpp), so that what comes after compares the same experts' outputs
// (cli/cmd_main.cpp). The reference records the experts it ran (ffn_moe_topk holds `ids` there) and lists the rows
// in its fact routing_followed.
struct ForcedRouting {
  struct Row {
    int step = 0;
    int layer = 0;
    int64_t token = 0;
    std::vector<int32_t> ids;
  };
  std::vector<Row> rows;
};

// Validates the tensors and maps the weights for `precision`: "f32" | "f64", the arithmetic,
// optionally with emulated storage "-f16store" (the f16 engine's f16 weights and GEMM inputs) or
// "-f16residual" (the residual stream in f16); reference_cpu/storage.hpp lists the rounding points.
// The KV cache holds max_ctx positions. `faults` (faults/faults.hpp) are resolved into the backend's fault
// plan at construction (faults/fault_plan.hpp) and so injected into the forward pass.
// `forced` (may be null): expert choices to follow (ForcedRouting); forward() throws InputError naming the row when
// one does not fit the model or the step (a layer, token or expert id out of range, not K distinct ids).
// Throws InputError for another precision, max_ctx < 1, a fault that does not apply to the model or forced
// routing on a model without experts, ModelError for a missing or malformed tensor.
// The file must outlive the backend.
std::unique_ptr<Backend> make_cpu_backend(const GgufFile& file, const ModelConfig& cfg, const std::string& precision,
                                          int max_ctx, const FaultSet& faults = {},
                                          WeightHolding holding = WeightHolding::streamed,
                                          std::shared_ptr<const ForcedRouting> forced = nullptr);

}  // namespace diffrun
