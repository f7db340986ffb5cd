// The fault catalog: named, switchable copies of real inference bugs, each with the checkpoint where it must show.
// D model width, H/Hkv heads, Dh head width, F feed-forward width, V real vocabulary, Vp padded vocabulary.
//
// Both backends honour the same FaultSet (`--inject NAME[,NAME]`): the CPU reference so the whole
// mechanism is testable without a GPU, the CUDA engine to prove that diffrun finds engine bugs.
// Each fault reproduces one mistake from the bug classes of the seed notes in code. Both backends
// resolve the set once, at construction, into a fault plan (faults/fault_plan.hpp): config
// edits, weight edits, op arguments (a wrong argument, a wrong operand order, a skipped op, or where
// no argument of a clean op can express it, a separate flawed variant of the op), the
// production-path faults of the fused kernels, and a few control-flow hooks; the clean ops carry no
// fault branch.
#pragma once

#include <bitset>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.hpp"
#include "model/gguf.hpp"

namespace diffrun {

enum class Fault : int {
  embd_transposed,         // token_embd read as [D, V]: table[i * V + id]
  qkv_bias_missing,        // q/k/v projections without their bias (qwen2)
  rope_pairing_swapped,    // rope_norm where the model needs rope_neox, and the reverse
  rope_theta_10000,        // RoPE base 10000 instead of the model's
  gqa_head_modulo,         // query head h reads KV head h % Hkv instead of h / (H / Hkv)
  kv_cache_not_read,       // attention over the step's own K/V only: decode sees only the current token
  kv_cache_pos0,           // the step's K/V written at cache row 0 instead of row n_past
  causal_mask_missing,     // prefill attends to every position, the future included
  attn_scale_missing,      // scores q·k without the 1/sqrt(Dh) scale
  rms_norm_weight_twice,   // RMSNorm output multiplied by its weight twice
  rms_eps_1e5,             // RMSNorm epsilon 1e-5 instead of the model's
  swiglu_gate_up_swapped,  // silu(up) · gate instead of silu(gate) · up
  attn_out_transposed,     // W_o read with the wrong leading dimension (a transposed operand)
  ffn_down_transposed,     // W_down read with the wrong leading dimension (a transposed operand)
  residual_skipped,        // ffn_inp = attn_out: the residual add after attention skipped
  lm_head_padded_vocab,    // logits over a padded vocabulary with uninitialised rows, argmax over them
  dequant_scale_offset,    // legacy block formats: the f16 scale d read 2 bytes into the block
  rms_norm_off_by_one,     // RMSNorm's sum of squares misses the row's last element (still divided by D)
  rms_eps_outside_sqrt,    // RMSNorm scale 1 / (sqrt(mean(x^2)) + eps) instead of 1 / sqrt(mean(x^2) + eps)
  rope_cache_unrotated,    // the fused RoPE + KV cache write stores K before RoPE; Krope itself is right
  softmax_f16_overflow,    // softmax exponentials in f16 without the max subtracted: Inf, then Inf/Inf = NaN
  weight_row_nan,          // one row of blk.0.attn_q.weight is NaN (a corrupted or never-written row)
  embd_scale_missing,      // gemma3: the embedding rows not multiplied by sqrt(D)
  post_norm_skipped,       // gemma3: the RMSNorm after attention skipped (attn_post_norm = attn_out)
  sliding_window_ignored,  // gemma3: local layers attend to every earlier position
  rope_local_theta_global, // gemma3: local layers rotate with the global rope_theta instead of their own base
  // In the production path only: the fused one-token kernels and the captured decode graph (the CPU
  // twins reproduce them on the same steps).
  swiglu_fused_gate_up_swapped,  // Wgate|Wup stored as Wup|Wgate: matmul_gate_up_swiglu computes silu(up) · gate
  rope_fused_position_off,       // matmul_qkv_rope rotates q and k at position n_past + 1
  embd_norm_fused_no_weight,     // embedding_rms_norm skips layer 0's attn_norm weight
  graph_position_frozen,         // the decode graph's RoPE reads the position baked in at capture
  argmax_ties_highest,           // the greedy argmax breaks exact ties toward the higher token id
  // Mixture of experts: the routing (reference_cpu/faults/ holds the CPU twin of each).
  moe_softmax_over_topk,         // the weights a softmax over the K selected logits, not the probabilities of all E
  moe_weights_not_renormalised,  // the K weights used without dividing by their sum
  moe_expert_id_off_by_one,      // expert id + 1 (mod E) selected in place of each chosen one
  moe_expert_gate_up_swapped,    // expert 0's gate and up matrices swapped in every layer (a converter's slip)
  moe_shared_expert_gate_skipped,  // qwen2moe's shared expert added without its sigmoid gate
};
inline constexpr int kFaultCount = 36;

struct FaultInfo {
  Fault id;
  const char* name;        // "rope_theta_10000", what --inject takes
  const char* what;        // one line
  const char* checkpoint;  // where it must first show: "Qrope-0"; for dequant_scale_offset see expected_checkpoint
  int step;                // the step where it must first show
  const char* applies;     // to which models, in words ("all", "qwen2 (q/k/v biases)", ...)
  const char* shows;       // how the diff shows it (and what it needs, e.g. T >= 2)
  const char* ops;         // the checkpoint kinds its flawed op computes, comma-separated: where isolation
                           // replay may show a local error (the expected checkpoint's kind among them); a
                           // fused op counts whole (the engine's rope_qk writes cache_k from its own RoPE)
};

// Every fault, in enum order.
const std::vector<FaultInfo>& fault_catalog();

// True for the faults that act only where the engine runs a fused one-token kernel or replays its
// captured decode graph (the production path). Isolation replay runs the unfused twins one by one,
// so it cannot show them: they are found by the plain run, whose recorded steps are the production
// path (DESIGN.md, "Observing the production path").
bool fault_in_production_path_only(Fault f);
const FaultInfo& fault_info(Fault f);

// Empty when the fault applies to this model; otherwise why it does not (e.g. "the model's RoPE
// theta is already 10000"). `file` is needed for dequant_scale_offset (which tensor formats).
std::string fault_not_applicable(Fault f, const ModelConfig& cfg, const GgufFile* file = nullptr);

// Empty when an engine of this precision ("f32", "f16") runs the code the fault flaws on this model; otherwise
// why it never does, so the fault changes nothing there: swiglu_fused_gate_up_swapped on an f32 CUDA engine whose
// ffn_gate|ffn_up are in a gemv_super_block format (model/dequant.hpp), which that engine keeps unfused
// (engine/ops/matmul.cu, gate_up_swiglu_impl; an f16 engine with DIFFRUN_QGEMV_MMA=0 does too; the f16 pair of the
// default run finds it), and
// graph_position_frozen on a mixture of experts, whose steps never run as a captured graph.
std::string fault_dormant(Fault f, const ModelConfig& cfg, const GgufFile* file, std::string_view engine_precision);

// The checkpoint name where the fault must first show for this model: the catalog's, except for
// dequant_scale_offset, whose first checkpoint is the first one computed from a tensor in a
// legacy block format (embd when token_embd is one). Throws InputError when it does not apply.
std::string expected_checkpoint(Fault f, const ModelConfig& cfg, const GgufFile* file = nullptr);

class FaultSet {
 public:
  FaultSet() = default;
  FaultSet(std::initializer_list<Fault> faults);
  bool has(Fault f) const { return bits_.test(static_cast<size_t>(f)); }
  bool empty() const { return bits_.none(); }
  void add(Fault f) { bits_.set(static_cast<size_t>(f)); }
  std::vector<Fault> list() const;  // enum order
  std::string names() const;        // "a,b" in enum order; "" when empty

  // Throws InputError naming the first fault that does not apply to this model and why.
  void check_applicable(const ModelConfig& cfg, const GgufFile* file = nullptr) const;

 private:
  std::bitset<kFaultCount> bits_;
};

// "rope_theta_10000,kv_cache_pos0" (spaces around names allowed; empty: no fault). Throws
// InputError naming an unknown fault and listing the catalog.
FaultSet parse_faults(std::string_view csv);
// The names of an --inject list, "a, b" -> {"a", "b"} (blanks around each dropped; "" or separators alone: none);
// InputError for an empty name between others. parse_faults and the tensor-parallel catalog
// (faults/tp_faults.hpp) read lists through it.
std::vector<std::string> fault_list(std::string_view csv);

// The catalog as a text table (`diffrun faults`).
std::string fault_table();

// --- Parameters of the faults that both backends must reproduce identically ---

// rms_eps_1e5 and rope_theta_10000: the wrong constants.
// The widest row the CUDA engine's fused embedding gather + RMSNorm (embedding_rms_norm) takes: 32 elements a thread
// in registers at 256 threads (engine/ops/launch.cuh, which asserts the same). A wider model gathers and normalises
// in two kernels, where embd_norm_fused_no_weight has nothing to act on.
inline constexpr int kFusedEmbeddingNormMaxWidth = 8192;
inline constexpr double kFaultRmsEps = 1e-5;
inline constexpr double kFaultRopeTheta = 10000.0;

// lm_head_padded_vocab: the vocabulary padded to the next multiple of 128 above V (always > V),
// and what the never-written rows hold: the bytes 0x7f (a stale-memory pattern), as f32 3.39e38.
int fault_padded_vocab(int n_vocab);
inline constexpr unsigned char kFaultUninitialisedByte = 0x7f;
inline constexpr float kFaultUninitialisedLogit = 3.39615136e38f;  // the f32 whose bytes are 0x7f7f7f7f

// weight_row_nan: the row of blk.0.attn_q.weight ([H·Dh, D], one row per output feature) set to NaN.
inline constexpr int kFaultNanWeightRow = 0;

// moe_expert_gate_up_swapped: the expert whose gate and up matrices are swapped, in every layer.
inline constexpr int kFaultSwappedExpert = 0;

// softmax_f16_overflow: each attention weight is e = f16(exp(q·k)) (the raw score, no max subtracted,
// rounded to f16: Inf once q·k > ln(65520) = 11.09), then e^(1/sqrt(Dh)) = exp(q·k / sqrt(Dh)) and
// normalised by the row's sum. Where nothing overflows this is the softmax up to f16 rounding; a row
// with an overflow becomes Inf / Inf = NaN there and 0 elsewhere.

// dequant_scale_offset: whether a format is one of the legacy block formats it corrupts (Q4_0,
// Q4_1, Q5_0, Q5_1, Q8_0: an f16 scale d at byte 0 of each block), and the raw tensor bytes as the
// faulty decoder sees them: each block's d read from bytes 2..3 (Q4_1/Q5_1: the min m; Q5_0: the
// high-bit mask; Q4_0/Q8_0: the first quants). The clean decoder of either backend then turns
// these bytes into exactly the values the faulty decoder would produce.
bool dequant_fault_format(GgmlType t);
std::vector<std::byte> dequant_fault_bytes(GgmlType t, std::span<const std::byte> raw);

}  // namespace diffrun
