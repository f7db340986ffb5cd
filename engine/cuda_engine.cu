// The CUDA engine backend: one readable forward pass (one line per op, then its checkpoint), f16 or f32.
// T tokens of the step, S = n_past + T positions attended, D model width, H/Hkv heads, Dh head width,
// F feed-forward width, V real vocabulary; E experts, K experts used per token, Fe one expert's width, Fs the shared
// expert's.
//
// Decisions, written down here:
// - Activations are f32 except the inputs of GEMMs, which are W (f16 in the f16 engine): the
//   normed rows (xn), the attention context (kqv) and the SwiGLU output (act). Their checkpoints
//   are recorded with native dtype f16.
// - The KV cache is f32 in both precisions ([n_layer][max_ctx, Hkv*Dh]); K and V are small next
//   to the weights, and f32 keeps the f16 engine's error to the f16 weights and GEMM inputs.
// - n_past lives in device memory (d_n_past_) and every position-dependent kernel reads it there,
//   so a decode step (T = 1) is captured once as a CUDA graph and replayed at any position, recorded or
//   not (one graph per set of recorded checkpoints). The step's first kernel (step_inputs) reads the ids and n_past from mapped pinned
//   host memory and argmax writes the token there, so the graph holds no host copy nodes (each
//   cost ~2.5 us of a step; bench/NOTES.md v23). Prefill steps, isolation replay,
//   DIFFRUN_SYNC_CHECK=1 and DIFFRUN_CUDA_GRAPHS=0 launch the same kernels one by one.
// - Recording never changes which kernels run (DESIGN.md, "Observing the production path"): a recorded
//   step runs the kernels of an unrecorded one, fused ones included, in the same order, plus the
//   recording's gather kernels and copies; a recorded decode step is the production graph with those
//   nodes added. The fused kernels write the intermediates they hold to optional outputs that are
//   null in production (matmul_qkv_rope: q and k before the rotation). The checkpoints no production
//   kernel materialises come from side computations that feed nothing back, listed in the
//   "recomputed_checkpoints" fact. Only isolation replay, which replaces an op's inputs, runs the
//   unfused twins. Each step's path goes to the dump (StepPath: graph or not, fused kernels).
// - Every op kernel (not cuBLAS) is launched with Programmatic Dependent Launch on sm_90+: it waits
//   for the preceding grid first thing, so its launch overlaps the previous kernel's tail, in the
//   graph and out of it. DIFFRUN_PDL=0 turns it off (the "pdl" fact says which ran). The GEMVs of
//   matrices up to 32 MiB also ask L2 for their weight rows before that wait (gemv_prefetch_limit:
//   DIFFRUN_GEMV_PREFETCH=0|all|NM; the "gemv_prefetch" fact), so the weights stream in while the
//   preceding small kernel runs; a larger matrix's would overflow L2 before they are read. Where one
//   warp takes a row (N >= 4096, or rows of at most 128 16-byte chunks), each warp computes 2 rows (4 for
//   the lm head) with all their loads in flight together (gemv_rows_per_warp:
//   DIFFRUN_GEMV_ROWS_PER_WARP=1|2|4 sets it, matmul_argmax below keeps 4; the same values for each; the
//   "gemv_rows_per_warp" fact).
// - Every step computes the last token's logits; when result_output is recorded for a step of several
//   tokens, a side matmul computes the rows before the last (the last row is the step's own).
// - Nothing recorded: no copies, no synchronization, no extra kernels. Recorded: each tensor is staged
//   right after its op, and copied into a device arena by a batched gather kernel (CheckpointStager)
//   before the next op that overwrites one of the staged buffers (overwrites(buf) before an op that
//   writes in place, end_layer_copies() before the add_rms_norm that ends a layer, finish at the end
//   of the step), from there to pinned memory on a second stream, then delivered to the sink after the
//   step's one synchronization. DIFFRUN_CHECKPOINT_COPY=memcpy copies each with cudaMemcpyAsync right
//   after its op instead (the "checkpoint_copies" fact).
// - A one-token step (not isolation replay) alternates two activation sets by layer parity, recorded
//   or not: layer l reads set l-1 (the residual and its norm) and writes set l; the embedding writes
//   the odd set (alt_, one token, with its own attention probabilities). Nothing a layer stages is then
//   overwritten before the end of the next layer, so a recorded layer's gathers run on the copy stream
//   beside the next layer's compute (end_layer_copies), and the compute stream only waits on them
//   before the add_rms_norm that overwrites the previous layer's set: the recorded decode graph has no
//   gather kernel between two ops. The kernels and their order are production's; only the buffers
//   alternate. A recorded step's returned logits are its result_output copy (no second copy out).
// - Fused ops, each writing every checkpoint tensor of the twins it combines (so recording stays copies
//   only): matmul_cat (Wq|Wk|Wv and Wgate|Wup concatenated at load, one GEMV per group when T = 1),
//   rope_qk (q and k in one launch, with the KV cache write) and add_rms_norm (ffn_inp + ffn_norm;
//   l_out + the next layer's attn_norm or result_norm). One-token steps also fuse the
//   SwiGLU into the gate|up GEMV (matmul_gate_up_swiglu: each block computes a gate row and its up
//   row, then writes their act; bit-identical to matmul_cat + swiglu, which isolation replay runs
//   and the fused-vs-unfused tests compare; DIFFRUN_SWIGLU_IN_GEMV=0 turns it off, the
//   "swiglu_in_gate_up_gemv" fact says which; a quantized Wgate|Wup of two formats stays unfused), and
//   the RoPE and cache write into the qkv GEMV (matmul_qkv_rope: each block computes the two rows of
//   a rotated pair, then rotates them with rope_qk's arithmetic; not with q/k norms or the
//   rope_cache_unrotated fault; DIFFRUN_ROPE_IN_GEMV=0, the "rope_in_qkv_gemv" fact; in the f16 engine
//   also where Wv is another K-quant format than Wq|Wk, as in Q4_K_M and Q5_K_M files), and the
//   embedding gather into layer 0's attn_norm (embedding_rms_norm: dense token_embd, no embedding
//   scale; it reads the id from the mapped host memory and waits on step_inputs only at its end, so
//   the two run side by side; DIFFRUN_EMBEDDING_NORM_FUSED=0, the "embedding_rms_norm" fact). Every
//   step's last-token logits come from the dense lm head and argmax as one launch (matmul_argmax: the GEMV's rows, bit-identical, by
//   a grid that stays resident while the 272 MB of the 0.5B shape's lm head stream, each warp keeping
//   its best row for argmax's ending; no softcap, no lm_head_padded_vocab; DIFFRUN_LM_HEAD_ARGMAX=0,
//   the "lm_head_argmax" fact). The q/k norms of qwen3 and gemma3 run with the RoPE and the cache write in
//   one launch at every step length (qk_norm_rope: a warp a head, rms_norm's sums of squares in its order, then
//   rope_qk's arithmetic; bit-identical to the two norms and rope_qk; isolation replay, which replaces Qnorm and
//   Knorm in between, runs the norms unfused and then the kernel's rotation alone, qk_norm_rope_rotation, so Qrope's
//   local error is measured on the fused kernel's code and Qnorm's on rms_norm's (fused bit 32 names Qnorm and Knorm);
//   not under an RMSNorm flaw or rope_cache_unrotated; DIFFRUN_QK_NORM_IN_ROPE=0, the "qk_norm_in_rope" fact). A
//   one-token step does that work in its attention launch instead (attention_split_qk_norm_rope: every block norms
//   and rotates its head's q as qk_norm_rope does, the blocks over the current key its KV head's k, which they use
//   for that cache row; one block a head writes Qnorm and Qrope, one a KV head Knorm, Krope and the cache rows, into
//   q_norm and k_norm, so q and k keep Qcur and Kcur; bit-identical; neox, heads of 64, 128 or 256; not under
//   gqa_head_modulo or kv_cache_not_read, nor where qk_norm_rope is off; fused bit 64 names Qnorm and Knorm as bit
//   32 does; DIFFRUN_QK_NORM_IN_ATTENTION=0, the "qk_norm_in_attention" fact).
//   Decode T = 1 projections run our GEMV
//   kernel, prefill the cuBLAS GEMM (bench/NOTES.md has the figures). Quantized matrices stay GGUF
//   blocks on the device (engine/weights.cuh): the quantized GEMV at T = 1 (Q4_K/Q5_K/Q6_K on tensor
//   cores in the f16 engine; DIFFRUN_QGEMV_MMA=0, the "kquant_gemv" fact), at T > 1 their rows
//   dequantized into a scratch for the same cuBLAS GEMM; the "quantized_weights" fact lists them.
// - Mixture of experts (qwen3moe, qwen2moe, Mixtral; moe_ffn): the router's logits, softmax and top-k on the
//   device (moe_route). A one-token step (not an isolation replay) finds the K selected experts by their ids on the
//   device (each layer's table of expert addresses): K-quant experts in the f16 engine are read where they lie
//   (matmul_experts_*), others gathered first (gather_experts); all K gate|up rows run as one GEMV with the SwiGLU
//   fused, then the K down projections as one GEMV where a kernel takes it (in place: with their weighted sum,
//   matmul_experts_down_combine): nothing is read back, so decode steps are captured graphs like a dense model's.
//   Steps of several tokens and isolation replay (forced routing: the reference's ids replace ffn_moe_topk) copy the
//   ids to the host once a layer, where each expert's slots are grouped. K-quant experts in the f16 engine then run
//   all in one launch on tensor cores, read where they lie, on the slots' rows in place (matmul_experts_rows: each
//   row the one-token GEMV's value); otherwise the slots' rows are gathered in expert order (gather_rows), each
//   expert used runs one linear layer on its view of the stacked tensor (the one-token GEMV when one slot chose it,
//   else dequantization and cuBLAS), and the outputs are scattered back (scatter_rows). Only the selected experts
//   run. MoE steps do not alternate activation sets (the layers share moe_'s buffers); the "moe" fact says all this.
// - Isolation replay replaces the inputs an op reads, never recomputes an output by another code
//   path: a fused op runs on replaced inputs (rope_qk on the reference's Kcur and Vcur, add_rms_norm
//   on its attn_out and residual), each of its outputs is recorded as the op computed it, then
//   replaced. So a replaced Krope is not written to the cache again (the cache_k checkpoint replaces
//   the cache), and a replaced ffn_inp or l_out is not normed again (ffn_norm and attn_norm replace
//   the norm). Where the reference dump lacks the second output, the next op reads the fused op's
//   own, computed from the reference's inputs.
// - Steps of up to kAttentionSplitMaxT tokens (decode) run attention_split, which spreads each head's
//   keys over enough blocks to fill the GPU once there are enough keys (one split per
//   DIFFRUN_ATTENTION_SPLIT_MIN_KEYS keys, default kAttentionSplitMinKeys; 1 = every split at any
//   length, as before; the "attention_split_min_keys" fact) and always writes the probabilities into
//   attn_probs_ (its scores live there), so kq_soft_max costs only its copy; longer steps (prefill)
//   take their output from attention_tiled (K/V tiles in shared memory, online softmax) recorded or not,
//   and when kq_soft_max is recorded, attention writes the probabilities alone beside it
//   (DIFFRUN_TILED_ATTENTION=0: attention writes both, as before; the "prefill_attention" fact
//   says which). Both scratches are sized for max_ctx at construction,
//   so a captured decode graph stays valid at every position. attn_scale_missing hands the production
//   kernels scale 1 (a config edit) and gqa_head_modulo a cache expanded to H heads the wrong way round
//   (attention_kv); the other attention faults run the production kernels with another AttentionVariant
//   at every T (their fault is the flaw, found against the reference).
// - Fault injection (faults/faults.hpp, --inject) lives beside the forward, not inside it: the
//   fault plan (faults/fault_plan.hpp), resolved at construction, edits the config the forward
//   reads (cfg_; config() stays the model's), FaultState (engine/faults/fault_state.cuh) edits the
//   weights and resolves the positions and weights the fused kernels and the captured graph are handed,
//   and the forward passes the plan's op arguments (plan_.ops) to its ops, the entry points of
//   engine/faults/fault_ops.cuh running the clean kernel for production's argument. Two faults remain
//   control flow here, one line each (plan_.hooks: kv_cache_not_read, residual_skipped). The clean
//   kernels carry no fault branch, and without faults the step enqueues exactly what it did before.
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "engine/checkpoint_stager.cuh"
#include "engine/cublas_api.cuh"
#include "engine/cuda_check.cuh"
#include "engine/device_buffer.cuh"
#include "engine/engine.hpp"
#include "engine/tp_engine.hpp"
#include "engine/faults/fault_ops.cuh"
#include "engine/faults/fault_state.cuh"
#include "engine/gemm.cuh"
#include "engine/ops/add_rms_norm.cuh"
#include "engine/ops/argmax.cuh"
#include "engine/ops/attention.cuh"
#include "engine/ops/embedding.cuh"
#include "engine/ops/embedding_rms_norm.cuh"
#include "engine/ops/geglu.cuh"
#include "engine/ops/matmul.cuh"
#include "engine/ops/rms_norm.cuh"
#include "engine/ops/qk_norm_rope.cuh"
#include "engine/ops/rope_qk.cuh"
#include "engine/ops/scale.cuh"
#include "engine/tp_comm.cuh"
#include "engine/ops/step_inputs.cuh"
#include "engine/ops/swiglu.cuh"
#include "engine/ops/moe.cuh"
#include "engine/ops/add.cuh"
#include "engine/weights.cuh"
#include "faults/fault_plan.hpp"
#include "faults/faults.hpp"
#include "model/dequant.hpp"
#include "model/error.hpp"

namespace diffrun {

namespace {

using namespace diffrun::engine;

constexpr uint64_t kCublasWorkspaceBytes = uint64_t(32) << 20;

// The fused kernels a step ran (StepPath::fused; the "fused_kernel_bits" fact names them).
constexpr uint32_t kFusedEmbeddingRmsNorm = 1;
constexpr uint32_t kFusedMatmulQkvRope = 2;
constexpr uint32_t kFusedMatmulGateUpSwiglu = 4;
constexpr uint32_t kFusedMatmulArgmax = 8;
constexpr uint32_t kFusedExpertsDownCombine = 16;
constexpr uint32_t kFusedQkNormRope = 32;
constexpr uint32_t kFusedQkNormRopeInAttention = 64;
constexpr const char* kFusedKernelBits =
    "1 embedding_rms_norm, 2 matmul_qkv_rope, 4 matmul_gate_up_swiglu, 8 matmul_argmax, 16 matmul_experts_down_combine, "
    "32 qk_norm_rope, 64 attention_split_qk_norm_rope";
// What each fused kernel's epilogue writes, and what reads the position inside a graph replay (a value
// baked in at capture would show there): isolation replay, unfused and outside the graph, gives these
// no local error where the step ran the kernel or the graph (diff::add_isolation).
constexpr const char* kFusedKernelCheckpoints =
    "1 embd,attn_norm-0; 2 Qrope,Krope,cache_k,cache_v; 4 ffn_swiglu; 8 result_output; 16 ffn_moe_out; "
    "32 Qnorm,Knorm; 64 Qnorm,Knorm; graph Qrope,Krope,cache_k,cache_v";

bool env_is_zero(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "0") == 0;
}

// A positive integer from the environment, or `fallback` when the variable is unset or empty.
int env_positive_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < 1 || n > (1 << 30))
    throw InputError(std::string(name) + "=" + v + ": expected a positive integer");
  return static_cast<int>(n);
}

// Activations of one step, for up to `capacity` tokens; a longer step reallocates, decode reuses.
template <typename W>
struct Activations {
  Activations(const ModelConfig& c, int cap)
      : capacity(cap),
        x(size_t(cap) * c.n_embd, "activations"),
        xn(size_t(cap) * c.n_embd, "activations"),
        ffn_xn(size_t(cap) * c.n_embd, "activations"),
        q(size_t(cap) * c.n_head * c.head_dim, "activations"),
        k(size_t(cap) * c.n_head_kv * c.head_dim, "activations"),
        q_rope(size_t(cap) * c.n_head * c.head_dim, "activations"),
        k_rope(size_t(cap) * c.n_head_kv * c.head_dim, "activations"),
        v(size_t(cap) * c.n_head_kv * c.head_dim, "activations"),
        q_norm(c.qk_norm ? size_t(cap) * c.n_head * c.head_dim : 0, "activations"),
        k_norm(c.qk_norm ? size_t(cap) * c.n_head_kv * c.head_dim : 0, "activations"),
        kqv(size_t(cap) * c.n_head * c.head_dim, "activations"),
        attn_out(size_t(cap) * c.n_embd, "activations"),
        ffn_inp(size_t(cap) * c.n_embd, "activations"),
        gate(size_t(cap) * c.n_ff, "activations"),
        up(size_t(cap) * c.n_ff, "activations"),
        act(size_t(cap) * c.n_ff, "activations"),
        ffn_out(size_t(cap) * c.n_embd, "activations"),
        tokens(size_t(cap), "activations") {}

  static uint64_t bytes(const ModelConfig& c, int cap) {
    const uint64_t D = c.n_embd, Q = uint64_t(c.n_head) * c.head_dim, KV = uint64_t(c.n_head_kv) * c.head_dim,
                   F = c.n_ff;
    const uint64_t norms = c.qk_norm ? Q + KV : 0;  // q_norm, k_norm
    return uint64_t(cap) * (4 * (D + 2 * Q + 3 * KV + norms + 3 * D + 2 * F) + sizeof(W) * (2 * D + Q + F) +
                            sizeof(int32_t));
  }

  int capacity;
  DeviceBuffer<float> x;         // [T, D] residual stream
  DeviceBuffer<W> xn;            // [T, D] RMSNorm output (GEMM input): attn_norm, result_norm
  DeviceBuffer<W> ffn_xn;        // [T, D] ffn_norm (GEMM input)
  DeviceBuffer<float> q;         // [T, H*Dh] Qcur (Qnorm in place)
  DeviceBuffer<float> k;         // [T, Hkv*Dh]
  DeviceBuffer<float> q_rope;    // [T, H*Dh] rope_qk's output (the fused qkv GEMV rotates q and k in place)
  DeviceBuffer<float> k_rope;    // [T, Hkv*Dh]
  DeviceBuffer<float> v;         // [T, Hkv*Dh]
  DeviceBuffer<float> q_norm;    // [T, H*Dh] Qnorm where the attention launch norms q (qk_norm models; else empty)
  DeviceBuffer<float> k_norm;    // [T, Hkv*Dh] Knorm likewise
  DeviceBuffer<W> kqv;           // [T, H*Dh] attention context (GEMM input)
  DeviceBuffer<float> attn_out;  // [T, D]
  DeviceBuffer<float> ffn_inp;   // [T, D]
  DeviceBuffer<float> gate;      // [T, F]
  DeviceBuffer<float> up;        // [T, F]
  DeviceBuffer<W> act;           // [T, F] SwiGLU output (GEMM input)
  DeviceBuffer<float> ffn_out;   // [T, D]
  DeviceBuffer<int32_t> tokens;  // [T]
};

// Mixture-of-experts buffers for steps of up to `capacity` tokens (K slots a token), shared by the layers.
template <typename W>
struct MoeBuffers {
  MoeBuffers(const ModelConfig& c, int cap)
      : capacity(cap),
        logits(size_t(cap) * c.n_expert, "MoE activations"),
        probs(size_t(cap) * c.n_expert, "MoE activations"),
        topk(slots(c, cap), "MoE activations"),
        ids(slots(c, cap), "MoE activations"),
        weights(slots(c, cap), "MoE activations"),
        weights_norm(slots(c, cap), "MoE activations"),
        gate(slots(c, cap) * c.n_ff_exp, "MoE activations"),
        up(slots(c, cap) * c.n_ff_exp, "MoE activations"),
        act(slots(c, cap) * c.n_ff_exp, "MoE activations"),
        down(slots(c, cap) * c.n_embd, "MoE activations"),
        xs(slots(c, cap) * widest(c), "MoE activations"),
        ys(slots(c, cap) * widest(c), "MoE activations"),
        run_experts(run_cap(c)),
        run_scratch(size_t(run_experts > 1 ? run_experts : 0) * expert_elements(c), "MoE expert dequantization"),
        rows(slots(c, cap), "MoE activations"),
        moe_out(size_t(cap) * c.n_embd, "MoE activations"),
        shexp_gate_inp(size_t(cap), "MoE activations"),
        shexp_gate(size_t(cap), "MoE activations"),
        shexp_g(size_t(cap) * std::max(c.n_ff_shexp, 1), "MoE activations"),
        shexp_u(size_t(cap) * std::max(c.n_ff_shexp, 1), "MoE activations"),
        shexp_act(size_t(cap) * std::max(c.n_ff_shexp, 1), "MoE activations"),
        shexp(size_t(cap) * c.n_embd, "MoE activations"),
        shexp_out(size_t(cap) * c.n_embd, "MoE activations"),
        h_ids(slots(c, cap), "MoE expert ids"),
        h_rows(slots(c, cap), "MoE expert ids"),
        groups(size_t(std::max(c.n_expert, 1)), "MoE expert groups"),
        h_groups(size_t(std::max(c.n_expert, 1)), "MoE expert groups") {}

  static size_t slots(const ModelConfig& c, int cap) { return size_t(cap) * c.n_expert_used; }
  static size_t widest(const ModelConfig& c) { return size_t(std::max(c.n_embd, c.n_ff_exp)); }
  // One expert's matrix (gate, up: [Fe, D]; down: [D, Fe]) in values.
  static size_t expert_elements(const ModelConfig& c) { return size_t(c.n_ff_exp) * c.n_embd; }
  // How many adjacent experts a step of several tokens dequantizes in one launch: as many as kRunScratchBytes hold
  // (1: one at a time, into the weights' own scratch, and no run scratch).
  static constexpr uint64_t kRunScratchBytes = 64ull << 20;
  static int run_cap(const ModelConfig& c) {
    if (!c.moe || c.n_expert < 2) return 1;
    return static_cast<int>(
        std::clamp<uint64_t>(kRunScratchBytes / (expert_elements(c) * sizeof(W)), 1, uint64_t(c.n_expert)));
  }
  static uint64_t bytes(const ModelConfig& c, int cap) {
    if (!c.moe) return 0;
    const uint64_t S = slots(c, cap), E = c.n_expert, Fe = c.n_ff_exp, D = c.n_embd, Fs = std::max(c.n_ff_shexp, 1);
    const uint64_t run = run_cap(c) > 1 ? uint64_t(run_cap(c)) * expert_elements(c) * sizeof(W) : 0;
    // Per token: logits, probs, moe_out, shexp, shexp_out, the shared gate's two values, shexp_g, shexp_u (4 bytes
    // each), shexp_act (W). Per slot: topk, ids, weights, weights_norm, rows, gate, up, down, ys; act, xs (W).
    return uint64_t(cap) * (4 * (2 * E + 3 * D + 2 + 2 * Fs) + sizeof(W) * Fs) +
           S * (4 * (5 + 2 * Fe + D + widest(c)) + sizeof(W) * (Fe + widest(c))) + run +
           uint64_t(std::max(c.n_expert, 1)) * 2 * sizeof(ExpertRows);
  }

  int capacity;
  DeviceBuffer<float> logits;        // [T, E] ffn_moe_logits
  DeviceBuffer<float> probs;         // [T, E] ffn_moe_probs
  DeviceBuffer<int32_t> topk;        // [T, K] the selected experts
  DeviceBuffer<float> ids;           // [T, K] ffn_moe_topk: the ids as values
  DeviceBuffer<float> weights;       // [T, K] ffn_moe_weights
  DeviceBuffer<float> weights_norm;  // [T, K] ffn_moe_weights_norm
  DeviceBuffer<float> gate;          // [T, K, Fe] ffn_moe_gate
  DeviceBuffer<float> up;            // [T, K, Fe] ffn_moe_up
  DeviceBuffer<W> act;               // [T, K, Fe] ffn_moe_swiglu (GEMM input)
  DeviceBuffer<float> down;          // [T, K, D] ffn_moe_down
  DeviceBuffer<W> xs;                // [T·K, max(D, Fe)] the slots' input rows, grouped by expert
  DeviceBuffer<float> ys;            // [T·K, max(D, Fe)] their output rows
  int run_experts;                   // run_cap: adjacent experts dequantized in one launch
  DeviceBuffer<W> run_scratch;       // [run_experts, Fe·D] their dense values (none when run_experts is 1)
  DeviceBuffer<int32_t> rows;        // [T·K] the slots grouped by expert
  DeviceBuffer<float> moe_out;       // [T, D] ffn_moe_out where a shared expert is added after it
  DeviceBuffer<float> shexp_gate_inp;  // [T]
  DeviceBuffer<float> shexp_gate;      // [T]
  DeviceBuffer<float> shexp_g;         // [T, Fs] the shared expert's gate projection
  DeviceBuffer<float> shexp_u;         // [T, Fs] its up projection
  DeviceBuffer<W> shexp_act;           // [T, Fs] its SwiGLU (GEMM input)
  DeviceBuffer<float> shexp;           // [T, D] ffn_shexp
  DeviceBuffer<float> shexp_out;       // [T, D] ffn_shexp_out
  PinnedBuffer<float> h_ids;           // [T·K] the ids, read back
  PinnedBuffer<int32_t> h_rows;        // [T·K] rows, built on the host
  DeviceBuffer<ExpertRows> groups;     // [E] each expert used: its positions in rows (matmul_experts_rows)
  PinnedBuffer<ExpertRows> h_groups;   // built on the host with rows
  int n_groups = 0;
};

class Stream {
 public:
  Stream() { CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  operator cudaStream_t() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

template <typename W>
class CudaEngineImpl final : public CudaEngine {
  static constexpr bool kF16 = std::is_same_v<W, __half>;

 public:
  // tp: a tensor-parallel rank (its slice of the model and its communicator); world 1 for the whole model.
  CudaEngineImpl(const GgufFile& file, const ModelConfig& cfg, int max_ctx, const FaultSet& faults, const TpRank& tp)
      : tp_(tp),
        model_cfg_(cfg),
        plan_(plan_faults(faults, cfg)),
        cfg_(tp.cut.slice.world > 1 ? tp_local_config(plan_.config, tp.cut.slice) : plan_.config),
        max_ctx_(max_ctx),
        faults_(faults),
        cublas_(kF16 ? EnginePrecision::f16 : EnginePrecision::f32),
        weights_(file, cfg, stream_, plan_.weights.dequant_scale_offset, tp.cut.slice.world > 1 ? &tp_.cut : nullptr),
        k_cache_(size_t(cfg_.n_layer) * max_ctx * cfg_.n_head_kv * cfg_.head_dim, "the KV cache"),
        v_cache_(size_t(cfg_.n_layer) * max_ctx * cfg_.n_head_kv * cfg_.head_dim, "the KV cache"),
        alt_(cfg_, 1),
        d_n_past_(1, "step state"),
        fault_state_(plan_, weights_, cfg_, max_ctx, d_n_past_.get(), stream_),
        h_n_past_(1, "step state"),
        h_argmax_(1, "step state"),
        h_logits_(size_t(logit_columns()), "logits"),
        attn_splits_(attention_split_count(cfg_.n_head, sm_count())),
        attn_min_keys_(env_positive_int("DIFFRUN_ATTENTION_SPLIT_MIN_KEYS", kAttentionSplitMinKeys)),
        attn_probs_(attn_probs_floats(cfg_, max_ctx), "attention scratch"),
        attn_probs_alt_(size_t(cfg_.n_head) * max_ctx, "attention scratch"),
        attn_partial_(attn_partial_floats(cfg_, attn_splits_), "attention scratch"),
        attn_counters_(size_t(kAttentionSplitMaxT) * cfg_.n_head, "attention scratch"),
        argmax_scratch_(2, "step state"),
        names_(checkpoint_names(cfg)),
        graphs_enabled_(!sync_check_enabled() && !env_is_zero("DIFFRUN_CUDA_GRAPHS")),
        tiled_attention_(!env_is_zero("DIFFRUN_TILED_ATTENTION")),
        swiglu_in_gemv_(!env_is_zero("DIFFRUN_SWIGLU_IN_GEMV")),
        rope_in_gemv_(!env_is_zero("DIFFRUN_ROPE_IN_GEMV")),
        qk_norm_in_rope_(!env_is_zero("DIFFRUN_QK_NORM_IN_ROPE")),
        qk_norm_in_attention_(!env_is_zero("DIFFRUN_QK_NORM_IN_ATTENTION")),
        embd_norm_fused_(!env_is_zero("DIFFRUN_EMBEDDING_NORM_FUSED")),
        lm_head_argmax_(!env_is_zero("DIFFRUN_LM_HEAD_ARGMAX")) {
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    int runtime = 0, driver = 0, cublas_version = 0;
    CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
    CUDA_CHECK(cudaDriverGetVersion(&driver));
    CUBLAS_CHECK(cublas().get_version(cublas_.get(), &cublas_version));
    auto version = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
    facts_ = {
        {"device", prop.name},
        {"compute_capability", std::to_string(prop.major) + "." + std::to_string(prop.minor)},
        {"cuda_runtime", version(runtime)},
        {"cuda_driver", version(driver)},
        {"cublas_version", std::to_string(cublas_version)},
        {"cublas_math_mode", cublas_.math_mode_name()},
        {"cublas_compute_type", "CUBLAS_COMPUTE_32F"},
        {"tf32", cublas_.tf32_enabled() ? "on" : "off"},
        {"weights_dtype", kF16 ? "f16" : "f32"},
        {"quantized_weights", weights_.quantized_summary()},
        {"gemm_input_dtype", kF16 ? "f16" : "f32"},
        {"activations_dtype", "f32"},
        {"kv_cache_dtype", "f32"},
        {"cuda_graphs", graphs_enabled_ ? "decode steps, recorded or not (isolation replay: off)" : "off"},
        {"attention_splits", std::to_string(attn_splits_)},
        {"attention_split_min_keys", std::to_string(attn_min_keys_)},
        {"prefill_attention", tiled_attention_ ? "tiled" : "one block per (token, head)"},
        {"pdl", pdl_enabled() ? "on" : "off"},
        {"gemv_prefetch", gemv_prefetch_name()},
        {"gemv_rows_per_warp", gemv_rows_per_warp_name()},
        {"kquant_gemv", kF16 && qgemv_mma_enabled() ? "tensor cores (f16 weights, f32 sums)" : "simt"},
        {"swiglu_in_gate_up_gemv", swiglu_in_gemv_ ? "one-token steps, recorded or not" : "off"},
        {"rope_in_qkv_gemv", rope_in_gemv_ ? "one-token steps, recorded or not" : "off"},
        {"qk_norm_in_rope", qk_norm_in_rope_ ? "steps of any length, recorded or not (isolation replay: the norms "
                                               "unfused, then its rotation alone); heads of 64, 128, 192 or 256"
                                             : "off"},
        {"qk_norm_in_attention", qk_norm_in_attention_ ? "one-token steps, recorded or not: the q/k norms and RoPE in "
                                                         "attention_split's launch (neox; heads of 64, 128 or 256)"
                                                       : "off"},
        {"embedding_rms_norm", embd_norm_fused_ ? "one-token steps, recorded or not (dense token_embd)" : "off"},
        {"lm_head_argmax", lm_head_argmax_ ? "every step's last token, recorded or not (dense lm head)" : "off"},
        {"fused_kernel_bits", kFusedKernelBits},
        {"fused_kernel_checkpoints", kFusedKernelCheckpoints},
        {"recomputed_checkpoints",
         std::string(tiled_attention_ ? "kq_soft_max of steps over " + std::to_string(kAttentionSplitMaxT) +
                                            " tokens (attention writes the probabilities beside attention_tiled's "
                                            "output); "
                                      : "") +
             "result_output's rows before the last in steps of several tokens (a side matmul)"},
        {"checkpoint_copies", stager_.mode()},
    };
    if (!faults_.empty()) facts_["injected_faults"] = faults_.names();
    if (tp_.cut.slice.world > 1) {
      const TpSlice& t = tp_.cut.slice;
      facts_["tensor_parallel"] =
          "rank " + std::to_string(t.rank) + " of " + std::to_string(t.world) + " (NCCL " + nccl_version() +
          "): query heads " + std::to_string(t.h0) + ".." + std::to_string(t.h1 - 1) + ", KV heads " +
          std::to_string(t.kv0) + ".." + std::to_string(t.kv1 - 1) + ", FFN channels " + std::to_string(t.f0) + ".." +
          std::to_string(t.f1 - 1) + "; attn_out and ffn_out all-reduced (sum) after their checkpoint; embedding and "
          "lm head replicated";
      facts_["tp_all_reduce"] = tp_.no_all_reduce ? "none (DIFFRUN_TP_ALLREDUCE=none: the partial sums are never added; "
                                                    "wrong values, for timing the step without its communication)"
                                                  : "NCCL";
    }
    clear_kv_cache();
    CUDA_CHECK(cudaMemsetAsync(attn_counters_.get(), 0, attn_counters_.size() * sizeof(uint32_t), stream_));
    CUDA_CHECK(cudaMemsetAsync(argmax_scratch_.get(), 0, argmax_scratch_.size() * sizeof(unsigned long long), stream_));
    if (!cfg_.rope_freq_factors.empty()) {  // Llama 3's rope_freqs, uploaded once
      d_rope_freqs_ = DeviceBuffer<float>(cfg_.rope_freq_factors.size(), "rope frequency factors");
      CUDA_CHECK(cudaMemcpyAsync(d_rope_freqs_.get(), cfg_.rope_freq_factors.data(), d_rope_freqs_.bytes(),
                                 cudaMemcpyHostToDevice, stream_));
    }
    // The fused kernels that have no variant for one of the plan's op arguments stay off under it (the facts
    // above say what the environment asked).
    const auto& fusable = fault_state_.fusable();
    embd_norm_fused_ = embd_norm_fused_ && fusable.embedding_rms_norm;
    rope_in_gemv_ = rope_in_gemv_ && fusable.matmul_qkv_rope;
    qk_norm_in_rope_ = qk_norm_in_rope_ && fusable.qk_norm_rope;
    qk_norm_in_attention_ = qk_norm_in_attention_ && qk_norm_in_rope_ && !plan_.ops.gqa_head_modulo &&
                            !plan_.hooks.kv_cache_not_read;
    swiglu_in_gemv_ = swiglu_in_gemv_ && fusable.matmul_gate_up_swiglu;
    lm_head_argmax_ = lm_head_argmax_ && fusable.matmul_argmax;
    if (cfg_.moe) prepare_expert_gather();  // after swiglu_in_gemv_ is settled
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  ~CudaEngineImpl() override { drop_graphs(); }

  std::string name() const override { return "cuda"; }
  std::string precision() const override { return kF16 ? "f16" : "f32"; }
  const ModelConfig& config() const override { return model_cfg_; }
  std::map<std::string, std::string> facts() const override { return facts_; }
  int n_past() const override { return n_past_; }
  int max_ctx() const override { return max_ctx_; }
  // Empties the cache: n_past 0 and every row zero, as at construction (a reset engine is a fresh one:
  // a fault that reads rows it never wrote, kv_cache_pos0, reads zeros either way).
  void reset() override {
    n_past_ = 0;
    clear_kv_cache();
  }
  int32_t last_argmax() const override { return *h_argmax_.get(); }
  uint64_t weight_bytes() const override { return weights_.bytes(); }
  StepPath last_step_path() const override { return {last_graph_, step_fused_}; }

  // attention_split's probabilities/scores [H, T ≤ kAttentionSplitMaxT, S ≤ max_ctx] and partials.
  static size_t attn_probs_floats(const ModelConfig& c, int max_ctx) {
    return size_t(c.n_head) * kAttentionSplitMaxT * max_ctx;
  }
  static size_t attn_partial_floats(const ModelConfig& c, int splits) {
    return size_t(kAttentionSplitMaxT) * c.n_head * splits * (c.head_dim + 2);
  }

  std::vector<float> forward(int step, std::span<const int32_t> tokens, Sink& sink) override {
    std::vector<float> logits;
    run(step, tokens, sink, &logits);
    return logits;
  }

  int32_t forward_argmax(int step, std::span<const int32_t> tokens, Sink& sink) override {
    run(step, tokens, sink, nullptr);
    return *h_argmax_.get();
  }

 private:
  // One step; `logits` (when given) gets the last token's logits.
  void run(int step, std::span<const int32_t> tokens, Sink& sink, std::vector<float>* logits) {
    const bool copy_logits = logits != nullptr;
    const int n = static_cast<int>(tokens.size());
    if (n == 0) throw InputError("step " + std::to_string(step) + " has no tokens");
    if (n_past_ + n > max_ctx_)
      throw InputError("step " + std::to_string(step) + ": " + std::to_string(n_past_) + " cached + " +
                       std::to_string(n) + " new tokens exceed the context of " + std::to_string(max_ctx_));
    for (int t = 0; t < n; ++t)
      if (tokens[t] < 0 || tokens[t] >= cfg_.n_vocab)
        throw InputError("token id " + std::to_string(tokens[t]) + " at position " + std::to_string(t) +
                         " is outside the vocabulary [0, " + std::to_string(cfg_.n_vocab) + ")");
    if (sink.wants("tokens")) sink.record_ids(step, "tokens", tokens);

    prepare_buffers(step, n, sink);
    std::copy(tokens.begin(), tokens.end(), h_tokens_.get());
    *h_n_past_.get() = n_past_;
    fault_state_.at_step(n_past_);
    // A recorded step runs what an unrecorded one runs: the same kernels, fused ones included, and a
    // decode step the captured graph (with the recording's copy nodes). Only isolation replay, which
    // replaces inputs between ops, enqueues the unfused twins one by one.
    step_replaying_ = replaying(step, sink);
    try {
      std::vector<bool> wanted;
      bool records = false;
      if (n == 1 && graphs_enabled_ && !step_replaying_) {
        wanted = wanted_set(sink);
        records = std::find(wanted.begin(), wanted.end(), true) != wanted.end();
      }
      // The memcpy copy mode has no copies of a size read on the device: its recorded steps run eagerly.
      last_graph_ = n == 1 && graphs_enabled_ && !step_replaying_ && (stager_.gathers() || !records);
      if (last_graph_)
        launch_decode_graph(step, sink, copy_logits, std::move(wanted), records);
      else
        enqueue_step(step, n, sink, copy_logits);
      CUDA_CHECK(cudaStreamSynchronize(stream_));
    } catch (...) {
      stager_.discard();
      throw;
    }
    n_past_ += n;
    if (logits) {  // before deliver(), which ends the staged copies' step
      const float* staged = logits_from_recording(n, sink) ? stager_.last_staged_f32("result_output") : nullptr;
      if (logits_from_recording(n, sink) && staged == nullptr)
        throw Error("step " + std::to_string(step) + ": result_output was not the last checkpoint staged");
      const float* from = staged ? staged : h_logits_.get();
      logits->assign(from, from + logit_columns());
    }
    stager_.deliver(sink);
  }

  // The whole step on stream_: ids and n_past in, every op and its checkpoint, argmax, logits.
  void enqueue_step(int step, int n, Sink& sink, bool copy_logits) {
    const int D = cfg_.n_embd, V = cfg_.n_vocab;
    const OpArgs& args = plan_.ops;
    set_op_context(step, -1);
    step_inputs(act_->tokens.get(), d_n_past_.get(), h_tokens_.device(), h_n_past_.device(), n, stream_);
    alternate_ = n == 1 && !step_replaying_ && !cfg_.moe;  // MoE: the layers share moe_'s buffers
    flush_ticket_ = -1;
    Activations<W>& a = set_of(-1);  // the embedding's: what layer 0 reads

    step_fused_ = 0;
    // One token: the gather and layer 0's attn_norm in one kernel that reads the id from the host memory
    // itself, beside step_inputs (bit-identical; see the top). It writes embd (a.x) as well.
    const bool fused_start = embd_norm_fused_ && n == 1 && !step_replaying_ && !cfg_.embd_scale &&
                             !weights_.token_embd.quantized() && D <= embedding_rms_norm_max_width();
    if (fused_start) {
      // Its weight: layer 0's attn_norm, or what embd_norm_fused_no_weight hands it (engine/faults/fault_state.cuh).
      embedding_rms_norm(a.x.get(), a.xn.get(), h_tokens_.device(), weights_.token_embd.dense,
                         fault_state_.embd_norm_weight(), n, D, V, eps(), stream_);
      step_fused_ |= kFusedEmbeddingRmsNorm;
      cp(sink, step, "embd", -1, a.x.get(), {n, D});  // not replaying: records only
    } else {
      embedding(a.x.get(), act_->tokens.get(), weights_.token_embd, n, D, V, stream_);
      cp(sink, step, "embd", -1, a.x.get(), {n, D});
      if (cfg_.embd_scale) {  // gemma3: the embedding rows times sqrt(D)
        overwrites(a.x);  // the scale is in place (embd is a.x)
        scale(a.x.get(), a.x.get(), static_cast<float>(args.embd_scale), int64_t(n) * D, stream_);
        cp(sink, step, "inp_scaled", -1, a.x.get(), {n, D});
      }
      norm(a.xn.get(), a.x.get(), norm_opening(0), n, D, args.first_norm);  // layer 0's attn_norm
    }
    for (int l = 0; l < cfg_.n_layer; ++l) layer(step, l, n, sink);
    set_op_context(step, -1);

    const Activations<W>& out = set_of(cfg_.n_layer - 1);
    cp(sink, step, "result_norm", -1, out.xn.get(), {n, D});  // out.xn: from the last layer's add_rms_norm
    // The last token's logits, as every step computes them, recorded or not.
    const W* last_row = out.xn.get() + size_t(n - 1) * D;  // [D]
    const int Vp = logit_columns();  // V, or the padded vocabulary of lm_head_padded_vocab
    // The lm head and argmax in one launch (bit-identical; see the top). matmul_argmax launches nothing
    // and returns false for a head it does not take (then matmul, argmax).
    bool head_argmax = false;
    if (lm_head_argmax_ && !step_replaying_ && !(cfg_.final_logit_softcap > 0)) {
      head_argmax = matmul_argmax(logits_.get(), h_argmax_.device(), last_row, weights_.lm_head, D, V,
                                  argmax_scratch_.get(), stream_, args.argmax_ties);
      if (head_argmax) step_fused_ |= kFusedMatmulArgmax;
    }
    if (!head_argmax) matmul_padded(logits_.get(), last_row, weights_.lm_head, 1, D, V, Vp, cublas_, stream_);
    if (cfg_.final_logit_softcap > 0)
      softcap(logits_.get(), logits_.get(), static_cast<float>(cfg_.final_logit_softcap), Vp, stream_);
    if (sink.wants("result_output")) {
      if (n == 1) {
        cp(sink, step, "result_output", -1, logits_.get(), {1, Vp});
      } else {
        // Every token's logits: the rows before the last from a side matmul that feeds nothing (the
        // "recomputed_checkpoints" fact), the last row the step's own.
        float* rows = logits_all_.get();  // [n, Vp]
        matmul_padded(rows, out.xn.get(), weights_.lm_head, n - 1, D, V, Vp, cublas_, stream_);
        if (cfg_.final_logit_softcap > 0)
          softcap(rows, rows, static_cast<float>(cfg_.final_logit_softcap), int64_t(n - 1) * Vp, stream_);
        CUDA_CHECK(cudaMemcpyAsync(rows + size_t(n - 1) * Vp, logits_.get(), size_t(Vp) * sizeof(float),
                                   cudaMemcpyDeviceToDevice, stream_));
        cp(sink, step, "result_output", -1, rows, {n, Vp});
      }
    }
    if (alternate_) stager_.flush_beside(stream_);  // the step's last copies, straight to pinned memory
    stager_.finish(stream_);  // the step's last staged copies, and the wait for their copies out

    const float* last = logits_.get();  // [Vp]
    if (!head_argmax)  // straight to the host
      argmax(h_argmax_.device(), last, Vp, argmax_scratch_.get(), stream_, args.argmax_ties);
    // A one-token step that records result_output returns that copy (run()); others copy the row here.
    if (copy_logits && !logits_from_recording(n, sink))
      CUDA_CHECK(cudaMemcpyAsync(h_logits_.get(), last, size_t(Vp) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  }

  // Whether the step's returned logits are its recorded result_output's pinned copy.
  bool logits_from_recording(int n, const Sink& sink) const {
    return n == 1 && !step_replaying_ && sink.wants("result_output");
  }

  // The activation set layer l writes (l = -1: the embedding's): act_, or in an alternating step the
  // odd layers' alt_ (see the top).
  Activations<W>& set_of(int l) { return alternate_ && (l & 1) ? alt_ : *act_; }

  // One transformer block, llama.cpp's build_attn and build_ffn in turn: the residual stream and its
  // norm from set l-1 (in.x, in.xn) to set l (a.x, a.xn; the same set unless alternating). Each op is
  // followed by its checkpoint; an op that writes over a buffer in place says so first (overwrites()),
  // and the layer's end takes the copies of what the next layer writes over (end_layer_copies()).
  void layer(int step, int l, int n, Sink& sink) {
    set_op_context(step, l);
    const Activations<W>& in = set_of(l - 1);  // the residual stream and its norm, from the layer before
    Activations<W>& a = set_of(l);              // what this layer writes
    attention_block(step, l, n, sink, in, a);   // in.xn → a.attn_out
    ffn_block(step, l, n, sink, in, a);         // in.x + a.attn_out → a.ffn_inp → a.ffn_out
    end_layer_copies();
    const int D = cfg_.n_embd;
    // l_out, and the norm that opens the next layer (attn_norm, or result_norm after the last).
    add_norm(a.x.get(), a.xn.get(), a.ffn_inp.get(), a.ffn_out.get(), norm_opening(l + 1), n, D, plan_.ops.norm);
    cp(sink, step, "l_out", l, a.x.get(), {n, D});
  }

  // Attention: attn_norm (in.xn) → Q/K/V → their norms → RoPE and the KV cache → attention → attn_out.
  void attention_block(int step, int l, int n, Sink& sink, const Activations<W>& in, Activations<W>& a) {
    const DeviceLayerWeights<W>& w = weights_.layers[l];
    const OpArgs& args = plan_.ops;
    const int D = cfg_.n_embd, H = cfg_.n_head, Hkv = cfg_.n_head_kv, Dh = cfg_.head_dim, Q = H * Dh, KV = Hkv * Dh, S = n_past_ + n;
    const float theta = static_cast<float>(cfg_.layer_rope_theta(l));
    const bool neox = cfg_.rope_type != RopeType::norm;
    // The positions the RoPE and the cache write read: n_past in production (the faults' are fault_state's).
    const auto& pos = fault_state_.positions(capturing_);
    float* cache_k = k_cache_.get() + size_t(l) * max_ctx_ * KV;  // [max_ctx, Hkv*Dh]; rows 0..S-1 valid after
    float* cache_v = v_cache_.get() + size_t(l) * max_ctx_ * KV;  // [max_ctx, Hkv*Dh]

    // in.xn = rms_norm(in.x) · attn_norm, written by the op before the layer (rms_norm or add_rms_norm).
    cp(sink, step, "attn_norm", l, in.xn.get(), {n, D});
    // One token: the qkv GEMV applies the RoPE and writes the cache too (bit-identical). Recorded, it
    // also writes q and k before the rotation (Qcur, Kcur) into q_rope and k_rope, which it leaves free.
    GemvRope rope{cache_k, cache_v, pos.fused_rope, pos.write, d_rope_freqs_.get(), theta, H, Hkv, Dh, neox};
    if (sink.wants(checkpoint_name("Qcur", l)) || sink.wants(checkpoint_name("Kcur", l))) {
      rope.q_unrotated = a.q_rope.get();
      rope.k_unrotated = a.k_rope.get();
    }
    const bool fused_rope = rope_in_gemv_ && n == 1 && !step_replaying_ && !cfg_.qk_norm &&
                            matmul_qkv_rope(a.q.get(), a.k.get(), a.v.get(), w.bq, w.bk, w.bv, in.xn.get(), w.wq, D,
                                            rope, stream_);
    if (fused_rope) {
      step_fused_ |= kFusedMatmulQkvRope;
      cp(sink, step, "Qcur", l, a.q_rope.get(), {n, H, Dh});  // not replaying: records only
      cp(sink, step, "Kcur", l, a.k_rope.get(), {n, Hkv, Dh});
    } else {
      matmul_cat({{a.q.get(), w.bq, Q}, {a.k.get(), w.bk, KV}, {a.v.get(), w.bv, KV}}, in.xn.get(), w.wq, n, D,
                 cublas_, stream_);
      cp(sink, step, "Qcur", l, a.q.get(), {n, H, Dh});
      cp(sink, step, "Kcur", l, a.k.get(), {n, Hkv, Dh});
    }
    cp(sink, step, "Vcur", l, a.v.get(), {n, Hkv, Dh});
    // Rotated q and k: rope_qk's (or qk_norm_rope's), out of place (so Qcur/Qnorm stay for the recording copies), or
    // matmul_qkv_rope's, in place.
    float* q_rot = fused_rope ? a.q.get() : a.q_rope.get();
    float* k_rot = fused_rope ? a.k.get() : a.k_rope.get();
    bool norm_rope = false;  // qk_norm_rope ran: the norms, the rotation and the cache write in one launch
    // One token (not replaying): the norms, the rotation and the cache write in the attention launch (attend), into
    // q_norm and k_norm; q and k stay Qcur and Kcur.
    const bool prep = cfg_.qk_norm && qk_norm_in_attention_ && n == 1 && !step_replaying_ && split_attention(n) &&
                      attention_split_qk_norm_rope_supported(n, Dh, neox);
    AttentionQkPrep qk;
    if (prep) {
      qk = {a.q.get(), a.k.get(), a.v.get(), w.q_norm, w.k_norm, eps(), a.q_norm.get(), a.k_norm.get(),
            a.q_rope.get(), a.k_rope.get(), cache_k, cache_v, pos.rope, pos.write, theta, d_rope_freqs_.get(), neox};
    }
    if (cfg_.qk_norm && !prep) {  // qwen3, gemma3: q and k normalized in place
      overwrites(a.q);
      overwrites(a.k);
      // Not in an isolation replay, which replaces Qnorm and Knorm before the rotation: it runs the norms unfused,
      // then the fused kernel's rotation alone (below).
      norm_rope = qk_norm_in_rope_ && !step_replaying_ &&
                  qk_norm_rope(q_rot, k_rot, cache_k, cache_v, a.q.get(), a.k.get(), a.v.get(), w.q_norm, w.k_norm,
                               eps(), n, H, Hkv, Dh, pos.rope, pos.write, theta, d_rope_freqs_.get(), neox, stream_);
      if (norm_rope) {
        step_fused_ |= kFusedQkNormRope;
      } else {
        norm(a.q.get(), a.q.get(), w.q_norm, n * H, Dh, args.norm);
        norm(a.k.get(), a.k.get(), w.k_norm, n * Hkv, Dh, args.norm);
      }
      cp(sink, step, "Qnorm", l, a.q.get(), {n, H, Dh});
      cp(sink, step, "Knorm", l, a.k.get(), {n, Hkv, Dh});
    }
    // Fused: matmul_qkv_rope or qk_norm_rope rotated q and k and wrote the cache rows. An isolation replay of a step
    // qk_norm_rope runs rotates the replaced norms with that kernel's own rotation (qk_norm_rope_rotation, rope_qk's
    // twin), so that Qrope's local error is the rotation's and Qnorm's the norm's.
    const bool rotation_only = !prep && !fused_rope && !norm_rope && cfg_.qk_norm && qk_norm_in_rope_ &&
                               step_replaying_ &&
                               qk_norm_rope_rotation(q_rot, k_rot, cache_k, cache_v, a.q.get(), a.k.get(), a.v.get(), n,
                                                     H, Hkv, Dh, pos.rope, pos.write, theta, d_rope_freqs_.get(), neox,
                                                     stream_);
    if (!prep && !fused_rope && !norm_rope && !rotation_only)
      rope_qk(q_rot, k_rot, cache_k, cache_v, a.q.get(), a.k.get(), a.v.get(), n, H, Hkv, Dh, pos.rope, pos.write,
              theta, d_rope_freqs_.get(), neox, args.rope_cache_unrotated, stream_);
    // Under capture S is read on the device, so that the graph records every position (DeviceRows).
    // The cache rows stay as they are until the step ends: gathered beside the compute.
    const DeviceRows cache_rows = capturing_ ? DeviceRows{d_n_past_.get(), n, 0, max_ctx_, true} : DeviceRows{};
    const auto rotated = [&] {  // Qrope .. cache_v: after the op that wrote them
      cp(sink, step, "Qrope", l, q_rot, {n, H, Dh});
      cp(sink, step, "Krope", l, k_rot, {n, Hkv, Dh});  // replaced: the cache keeps rope_qk's rows (see the top)
      cp(sink, step, "cache_k", l, cache_k, {S, Hkv, Dh}, cache_rows);
      cp(sink, step, "cache_v", l, cache_v, {S, Hkv, Dh}, cache_rows);
    };
    if (prep) {
      step_fused_ |= kFusedQkNormRopeInAttention;
      // The attention launch writes them all (not replaying: the copies record only).
      attend(step, l, n, sink, a, q_rot, k_rot, cache_k, cache_v, &qk, [&] {
        cp(sink, step, "Qnorm", l, a.q_norm.get(), {n, H, Dh});
        cp(sink, step, "Knorm", l, a.k_norm.get(), {n, Hkv, Dh});
        rotated();
      });
    } else {
      rotated();
      attend(step, l, n, sink, a, q_rot, k_rot, cache_k, cache_v);  // kq_soft_max (recorded only), kqv_out
    }
    cp(sink, step, "kqv_out", l, a.kqv.get(), {n, H, Dh});

    matmul(a.attn_out.get(), a.kqv.get(), w.wo, nullptr, n, Q, D, cublas_, stream_);
    cp(sink, step, "attn_out", l, a.attn_out.get(), {n, D});  // a tensor-parallel rank's: its partial sum
    if (!tp_.skip_attn_allreduce) all_reduce(a.attn_out, n * D);
    if (cfg_.post_norms) {  // gemma3: RMSNorm of the attention output before the residual add, in place
      overwrites(a.attn_out);
      norm(a.attn_out.get(), a.attn_out.get(), w.attn_post_norm, n, D, args.attn_post_norm);
      cp(sink, step, "attn_post_norm", l, a.attn_out.get(), {n, D});
    }
  }

  // The attention kernels of a step of n tokens into a.kqv, and its kq_soft_max checkpoint: attention_split
  // (decode; its probabilities are its scores), or attention_tiled (prefill) with attention beside it for
  // the probabilities when they are recorded (the "recomputed_checkpoints" fact).
  // prep (a one-token step of a qk_norm model): the q/k norms and RoPE in the launch (attention_split_qk_norm_rope),
  // and `launched` records what it wrote before kq_soft_max is recorded.
  void attend(int step, int l, int n, Sink& sink, Activations<W>& a, const float* q_rot, const float* k_rot,
              const float* cache_k, const float* cache_v, const AttentionQkPrep* prep = nullptr,
              const std::function<void()>& launched = {}) {
    const OpArgs& args = plan_.ops;
    const int H = cfg_.n_head, Hkv = cfg_.n_head_kv, Dh = cfg_.head_dim, window = cfg_.layer_window(l);
    const float att_scale = static_cast<float>(cfg_.attention_scale());
    // kv_cache_not_read: attention over the step's own K/V, as if nothing had been cached.
    const bool read_cache = !plan_.hooks.kv_cache_not_read;
    const int S_att = read_cache ? n_past_ + n : n;
    const bool want_probs = sink.wants(checkpoint_name("kq_soft_max", l));
    const int32_t* past = read_cache ? d_n_past_.get() : fault_state_.zero();
    const AttentionKv kv = attention_kv(read_cache ? cache_k : k_rot, read_cache ? cache_v : a.v.get(), past, n,
                                        max_ctx_, H, Hkv, Dh, args.gqa_head_modulo, fault_state_.kv_scratch_k(),
                                        fault_state_.kv_scratch_v(), stream_);
    float* probs = nullptr;  // [H, T, S_att]
    if (split_attention(n)) {
      probs = alternate_ && (l & 1) ? attn_probs_alt_.get() : attn_probs_.get();
      const AttentionSplitScratch scratch{attn_partial_.get(), attn_counters_.get(), attn_splits_, attn_min_keys_};
      if (prep) {
        if (kv.k != cache_k || kv.v != cache_v ||
            !attention_split_qk_norm_rope(a.kqv.get(), probs, *prep, n, past, H, kv.heads, Dh, att_scale, window,
                                          scratch, stream_, args.attention))
          throw Error("cuda engine: layer " + std::to_string(l) + ": attention_split_qk_norm_rope refused the step");
      } else {
        attention_split(a.kqv.get(), probs, q_rot, kv.k, kv.v, n, past, H, kv.heads, Dh, att_scale, window, scratch,
                        stream_, args.attention);
      }
    } else {
      probs = want_probs ? probs_.get() : nullptr;
      if (!tiled_attention_) {
        attention(a.kqv.get(), probs, q_rot, kv.k, kv.v, n, past, H, kv.heads, Dh, att_scale, window, stream_,
                  args.attention);
      } else {  // the output from attention_tiled, recorded or not; the probabilities (when recorded) from attention
        if (probs)
          attention(static_cast<W*>(nullptr), probs, q_rot, kv.k, kv.v, n, past, H, kv.heads, Dh, att_scale,
                    window, stream_, args.attention);
        attention_tiled(a.kqv.get(), q_rot, kv.k, kv.v, n, past, H, kv.heads, Dh, att_scale, window, stream_,
                        args.attention);
      }
    }
    if (launched) launched();
    if (want_probs)
      record_only(step, "kq_soft_max", l, probs, {H, n, S_att},
                  capturing_ && read_cache ? DeviceRows{d_n_past_.get(), n, 2, max_ctx_} : DeviceRows{});
  }

  // The FFN: ffn_inp = in.x + attn_out and its ffn_norm → the dense FFN or the experts → ffn_out.
  void ffn_block(int step, int l, int n, Sink& sink, const Activations<W>& in, Activations<W>& a) {
    const DeviceLayerWeights<W>& w = weights_.layers[l];
    const OpArgs& args = plan_.ops;
    const int D = cfg_.n_embd;
    if (plan_.hooks.residual_skipped) {  // ffn_inp = attn_out: the residual add skipped, then a plain norm
      CUDA_CHECK(cudaMemcpyAsync(a.ffn_inp.get(), a.attn_out.get(), size_t(n) * D * sizeof(float),
                                 cudaMemcpyDeviceToDevice, stream_));
      cp(sink, step, "ffn_inp", l, a.ffn_inp.get(), {n, D});
      norm(a.ffn_xn.get(), a.ffn_inp.get(), w.ffn_norm, n, D, args.norm);
    } else {
      add_norm(a.ffn_inp.get(), a.ffn_xn.get(), in.x.get(), a.attn_out.get(), w.ffn_norm, n, D, args.norm);
      cp(sink, step, "ffn_inp", l, a.ffn_inp.get(), {n, D});
    }
    cp(sink, step, "ffn_norm", l, a.ffn_xn.get(), {n, D});
    if (cfg_.moe)
      moe_ffn(step, l, n, sink, a);
    else
      dense_ffn(step, l, n, sink, a);
    if (cfg_.post_norms) {  // gemma3: RMSNorm of the FFN output before the residual add, in place
      overwrites(a.ffn_out);
      norm(a.ffn_out.get(), a.ffn_out.get(), w.ffn_post_norm, n, D, args.norm);
      cp(sink, step, "ffn_post_norm", l, a.ffn_out.get(), {n, D});
    }
  }

  // The gated FFN on a.ffn_xn: gate and up → SwiGLU (GeGLU) → down → a.ffn_out.
  void dense_ffn(int step, int l, int n, Sink& sink, Activations<W>& a) {
    const DeviceLayerWeights<W>& w = weights_.layers[l];
    const OpArgs& args = plan_.ops;
    const int D = cfg_.n_embd, F = cfg_.n_ff;
    // Wgate|Wup's rows as stored: the GEMMs write each half where it belongs (swiglu_fused_gate_up_swapped stores
    // Wup|Wgate, which only the fused epilogue pairs the wrong way round).
    const auto [first, second] = in_order(a.gate.get(), a.up.get(), plan_.fused.gate_up_swapped);
    // One token: the gate|up GEMV writes gate, up and the SwiGLU (bit-identical; see the top).
    const bool fused_swiglu = swiglu_in_gemv_ && n == 1 && !step_replaying_ && cfg_.ffn_act != FfnAct::gelu_tanh &&
                              matmul_gate_up_swiglu(first, second, a.act.get(), a.ffn_xn.get(), w.w_gate, D, F, stream_);
    if (fused_swiglu) step_fused_ |= kFusedMatmulGateUpSwiglu;
    if (!fused_swiglu)
      matmul_cat({{first, nullptr, F}, {second, nullptr, F}}, a.ffn_xn.get(), w.w_gate, n, D, cublas_, stream_);
    cp(sink, step, "ffn_gate", l, a.gate.get(), {n, F});
    cp(sink, step, "ffn_up", l, a.up.get(), {n, F});
    const auto [act_in, act_mul] = in_order<const float*>(a.gate.get(), a.up.get(), args.act_swapped);  // [T, F] each
    if (fused_swiglu) {
      cp(sink, step, "ffn_swiglu", l, a.act.get(), {n, F});  // not replaying: records only
    } else if (cfg_.ffn_act == FfnAct::gelu_tanh) {
      geglu(a.act.get(), act_in, act_mul, int64_t(n) * F, stream_);
      cp(sink, step, "ffn_geglu", l, a.act.get(), {n, F});
    } else {
      swiglu(a.act.get(), act_in, act_mul, int64_t(n) * F, stream_);
      cp(sink, step, "ffn_swiglu", l, a.act.get(), {n, F});
    }
    matmul(a.ffn_out.get(), a.act.get(), w.w_down, nullptr, n, F, D, cublas_, stream_);
    cp(sink, step, "ffn_out", l, a.ffn_out.get(), {n, D});  // a tensor-parallel rank's: its partial sum
    all_reduce(a.ffn_out, n * D);
    if (tp_.ffn_allreduce_twice) all_reduce(a.ffn_out, n * D);
  }

  // A tensor-parallel rank: the row-parallel projection's partial sums in `buf` become the ranks' sum, in place
  // (after the staged copy of the partial checkpoint). One GPU: nothing.
  void all_reduce(DeviceBuffer<float>& buf, int count) {
    if (tp_.cut.slice.world <= 1 || tp_.no_all_reduce) return;
    overwrites(buf);
    all_reduce_sum(buf.get(), size_t(count), tp_.comm, stream_);
  }

  // The routed FFN on a.ffn_xn into a.ffn_out, as the reference's moe_ffn (llama.cpp's build_moe_ffn): the router's
  // softmax over E experts, the K most probable, each one's SwiGLU FFN on the token, the outputs summed with their
  // weights (renormalised where the model says). The ids are read back after their checkpoint, so an isolation
  // replay runs the experts the reference chose, with its weights (forced routing).
  void moe_ffn(int step, int l, int n, Sink& sink, Activations<W>& a) {
    const DeviceLayerWeights<W>& w = weights_.layers[l];
    const int D = cfg_.n_embd, E = cfg_.n_expert, K = cfg_.n_expert_used, Fe = cfg_.n_ff_exp;
    const int slots = n * K;
    MoeBuffers<W>& m = *moe_;
    matmul(m.logits.get(), a.ffn_xn.get(), w.ffn_gate_inp, nullptr, n, D, E, cublas_, stream_);
    cp(sink, step, "ffn_moe_logits", l, m.logits.get(), {n, E});
    // The ids also as values (ffn_moe_topk), written by the routing launch.
    moe_route_ids(m.probs.get(), m.topk.get(), m.ids.get(), m.weights.get(), m.weights_norm.get(), m.logits.get(), n, E,
                  K, cfg_.expert_weights_norm, plan_.ops.moe_routing, stream_);
    cp(sink, step, "ffn_moe_probs", l, m.probs.get(), {n, E});
    cp(sink, step, "ffn_moe_topk", l, m.ids.get(), {n, K});
    cp(sink, step, "ffn_moe_weights", l, m.weights.get(), {n, K});
    if (cfg_.expert_weights_norm) cp(sink, step, "ffn_moe_weights_norm", l, m.weights_norm.get(), {n, K});
    // Weighted by the recorded weights an isolation replay replaces: renormalised, or as selected (qwen2moe).
    const float* slot_weights = cfg_.expert_weights_norm ? m.weights_norm.get() : m.weights.get();
    float* out = cfg_.moe_shexp ? m.moe_out.get() : a.ffn_out.get();
    bool combined = false;  // the experts' down projections and their weighted sum in one launch
    if (n == 1 && !step_replaying_) {
      combined = gathered_experts(step, l, sink, a, slot_weights, out);
    } else {
      const std::vector<int> first = group_slots_by_expert(m, slots, E, l);
      const uint64_t* table = expert_tables_.get() + size_t(l) * 3 * E;  // gate, up, down: [E] each
      expert_matmul(m.gate.get(), a.ffn_xn.get(), K, w.ffn_gate_exps, table, first, D, Fe);
      cp(sink, step, "ffn_moe_gate", l, m.gate.get(), {n, K, Fe});
      expert_matmul(m.up.get(), a.ffn_xn.get(), K, w.ffn_up_exps, table + E, first, D, Fe);
      cp(sink, step, "ffn_moe_up", l, m.up.get(), {n, K, Fe});
      swiglu(m.act.get(), m.gate.get(), m.up.get(), int64_t(slots) * Fe, stream_);
      cp(sink, step, "ffn_moe_swiglu", l, m.act.get(), {n, K, Fe});
      expert_matmul(m.down.get(), m.act.get(), 1, w.ffn_down_exps, table + 2 * E, first, Fe, D);
    }
    cp(sink, step, "ffn_moe_down", l, m.down.get(), {n, K, D});
    if (!combined) moe_combine(out, m.down.get(), slot_weights, n, K, D, stream_);
    cp(sink, step, "ffn_moe_out", l, out, {n, D});
    if (cfg_.moe_shexp) shared_expert(step, l, n, sink, a, out);
  }

  // The experts of a one-token step (not an isolation replay), found by their ids on the device: read where they lie
  // (experts_in_place_), or gathered (gather_experts) into expert_scratch_ as [K gates][K ups][K downs]. Then Wgate|Wup
  // of all K as one matrix of 2·K·Fe rows (every slot reads the same row x: one GEMV, the SwiGLU fused as in
  // dense_ffn) and the K Wdown, each slot's on its own act row (one launch where a kernel takes it; in place, with
  // the slots' weighted sum into `out`: then it returns true and moe_combine is not run). Nothing is read back, so
  // the step stays one captured graph. Each row's sum is the one the per-expert GEMVs of a step of several tokens'
  // slots of one would make (rows are summed alike in any launch).
  bool gathered_experts(int step, int l, Sink& sink, Activations<W>& a, const float* slot_weights, float* out) {
    const DeviceLayerWeights<W>& w = weights_.layers[l];
    const int D = cfg_.n_embd, E = cfg_.n_expert, K = cfg_.n_expert_used, Fe = cfg_.n_ff_exp;
    MoeBuffers<W>& m = *moe_;
    const DeviceMatrix<W>& g0 = w.ffn_gate_exps[0];
    const DeviceMatrix<W>& u0 = w.ffn_up_exps[0];
    const DeviceMatrix<W>& d0 = w.ffn_down_exps[0];
    const uint64_t gb = expert_bytes(g0), ub = expert_bytes(u0), db = expert_bytes(d0);
    const uint64_t* table = expert_tables_.get() + size_t(l) * 3 * E;
    unsigned char* downs = nullptr;  // the gathered experts' Wdown (not in place)
    bool fused = true;
    if (experts_in_place_) {  // the K-quant experts read where they lie: nothing gathered
      if (!matmul_experts_gate_up_swiglu(m.gate.get(), m.up.get(), m.act.get(), a.ffn_xn.get(), g0, table, table + E,
                                         m.ids.get(), E, K, D, Fe, stream_))
        throw Error("cuda engine: layer " + std::to_string(l) + "'s experts have no in-place gate|up kernel");
    } else {
      unsigned char* gates = expert_scratch_.get();
      unsigned char* ups = gates + uint64_t(K) * gb;
      downs = ups + uint64_t(K) * ub;
      ExpertStacks st;
      st.n = 3;
      st.dst[0] = gates, st.dst[1] = ups, st.dst[2] = downs;
      st.table[0] = table, st.table[1] = table + E, st.table[2] = table + 2 * E;
      st.bytes[0] = gb, st.bytes[1] = ub, st.bytes[2] = db;
      gather_experts(st, m.ids.get(), K, E, stream_);
      DeviceMatrix<W> gate_up = expert_view(g0, gates, K * Fe);  // K·Fe gate rows, then K·Fe up rows
      append_rows(gate_up, expert_view(u0, ups, K * Fe));
      fused = swiglu_in_gemv_ && matmul_gate_up_swiglu(m.gate.get(), m.up.get(), m.act.get(), a.ffn_xn.get(), gate_up,
                                                       D, K * Fe, stream_);
      if (!fused)
        matmul_cat({{m.gate.get(), nullptr, K * Fe}, {m.up.get(), nullptr, K * Fe}}, a.ffn_xn.get(), gate_up, 1, D,
                   cublas_, stream_);
    }
    if (fused) step_fused_ |= kFusedMatmulGateUpSwiglu;
    cp(sink, step, "ffn_moe_gate", l, m.gate.get(), {1, K, Fe});
    cp(sink, step, "ffn_moe_up", l, m.up.get(), {1, K, Fe});
    if (!fused) swiglu(m.act.get(), m.gate.get(), m.up.get(), int64_t(K) * Fe, stream_);
    cp(sink, step, "ffn_moe_swiglu", l, m.act.get(), {1, K, Fe});
    // The K slots' down projections as one launch where a kernel takes it (each row the value of its slot's own).
    if (experts_in_place_) {
      if (matmul_experts_down_combine(m.down.get(), out, m.act.get(), d0, table + 2 * E, m.ids.get(), slot_weights, E,
                                      K, Fe, D, stream_)) {
        step_fused_ |= kFusedExpertsDownCombine;
        return true;
      }
      if (!matmul_experts_grouped(m.down.get(), m.act.get(), d0, table + 2 * E, m.ids.get(), E, K, Fe, D, stream_))
        throw Error("cuda engine: layer " + std::to_string(l) + "'s experts have no in-place down kernel");
    } else if (!matmul_grouped(m.down.get(), m.act.get(), expert_view(d0, downs, K * D), K, Fe, D, stream_)) {
      for (int k = 0; k < K; ++k)
        matmul(m.down.get() + size_t(k) * D, m.act.get() + size_t(k) * Fe,
               expert_view(d0, downs + uint64_t(k) * db, D), nullptr, 1, Fe, D, cublas_, stream_);
    }
    return false;
  }

  // Bytes of one expert's matrix in its stack (dense rows of W, or one segment of GGUF blocks).
  static uint64_t expert_bytes(const DeviceMatrix<W>& m) {
    if (!m.quantized()) return uint64_t(m.rows) * m.K * sizeof(W);
    const auto& s = m.segments[0];
    return uint64_t(s.rows) * (m.K / ggml_block_elements(s.type)) * ggml_block_bytes(s.type);
  }
  static uint64_t expert_address(const DeviceMatrix<W>& m) {
    return m.quantized() ? reinterpret_cast<uint64_t>(m.segments[0].raw) : reinterpret_cast<uint64_t>(m.dense);
  }
  // `rows` rows in the format of expert matrix `like` at `raw`.
  static DeviceMatrix<W> expert_view(const DeviceMatrix<W>& like, const unsigned char* raw, int rows) {
    DeviceMatrix<W> v;
    v.K = like.K;
    v.rows = rows;
    if (!like.quantized()) {
      v.dense = reinterpret_cast<const W*>(raw);
      return v;
    }
    v.n_segments = 1;
    v.segments[0] = {like.segments[0].type, raw, rows};
    v.scratch = like.scratch;
    return v;
  }
  // m's rows followed by `more`'s, which lie right after them in memory (one segment where the formats agree).
  static void append_rows(DeviceMatrix<W>& m, const DeviceMatrix<W>& more) {
    if (m.quantized() && m.segments[0].type != more.segments[0].type) m.segments[m.n_segments++] = more.segments[0];
    else if (m.quantized()) m.segments[m.n_segments - 1].rows += more.rows;
    m.rows += more.rows;
  }

  // MoE: each layer's expert addresses for gather_experts ([n_layer][gate, up, down][E], the views as the fault
  // edits left them) and the scratch the K selected experts are gathered into.
  void prepare_expert_gather() {
    const int E = cfg_.n_expert, K = cfg_.n_expert_used;
    std::vector<uint64_t> table(size_t(cfg_.n_layer) * 3 * E);
    uint64_t largest = 0;
    for (int l = 0; l < cfg_.n_layer; ++l) {
      const DeviceLayerWeights<W>& w = weights_.layers[l];
      const std::vector<DeviceMatrix<W>>* stacks[3] = {&w.ffn_gate_exps, &w.ffn_up_exps, &w.ffn_down_exps};
      uint64_t bytes = 0;
      for (int i = 0; i < 3; ++i) {
        for (int e = 0; e < E; ++e) table[(size_t(l) * 3 + i) * E + e] = expert_address(stacks[i]->at(size_t(e)));
        bytes += expert_bytes(stacks[i]->at(0));
      }
      largest = std::max(largest, bytes);
    }
    expert_tables_ = DeviceBuffer<uint64_t>(table.size(), "MoE expert addresses");
    CUDA_CHECK(cudaMemcpy(expert_tables_.get(), table.data(), table.size() * sizeof(uint64_t), cudaMemcpyHostToDevice));
    experts_in_place_ = experts_readable_in_place();
    if (!experts_in_place_)
      expert_scratch_ = DeviceBuffer<unsigned char>(size_t(largest) * K, "the selected experts' weights");
    facts_["moe"] = std::string("routing on the device; one-token steps ") +
                    (experts_in_place_ ? "read the selected K-quant experts where they lie, by their ids on the device"
                                       : "gather the selected experts' weights by their ids on the device") +
                    " (one graph); steps of several tokens, and isolation replay, read the ids back once a layer and "
                    "run each expert used on its tokens' rows" +
                    (experts_in_place_ ? std::string(", all experts in one launch on the slots' rows in place, each row "
                                                     "the one-token GEMV's value")
                                       : std::string()) +
                    "; only the selected experts run";
  }

  // Whether every layer's experts take the in-place kernels (matmul_experts_*): the f16 engine on the tensor-core
  // GEMV, gate and up in one K-quant format, down in one, the SwiGLU fused, D a whole number of 16-row tiles.
  bool experts_readable_in_place() const {
    if constexpr (!std::is_same_v<W, __half>) return false;
    if (!swiglu_in_gemv_ || !qgemv_mma_enabled() || cfg_.n_embd % 16 != 0) return false;
    for (const DeviceLayerWeights<W>& w : weights_.layers) {
      const DeviceMatrix<W>& g = w.ffn_gate_exps.at(0);
      const DeviceMatrix<W>& u = w.ffn_up_exps.at(0);
      const DeviceMatrix<W>& d = w.ffn_down_exps.at(0);
      for (const DeviceMatrix<W>* x : {&g, &u, &d})
        if (!x->quantized() || x->n_segments != 1 || !gemv_super_block(x->segments[0].type)) return false;
      if (g.segments[0].type != u.segments[0].type) return false;
    }
    return true;
  }

  // qwen2moe's shared expert on a.ffn_xn, added to the experts' sum `moe_out` into a.ffn_out: a SwiGLU FFN of width
  // Fs times sigmoid(ffn_gate_inp_shexp · x) per token. Its gate, up and SwiGLU are not recorded (the reference's
  // shared_expert says why).
  void shared_expert(int step, int l, int n, Sink& sink, Activations<W>& a, const float* moe_out) {
    const DeviceLayerWeights<W>& w = weights_.layers[l];
    const int D = cfg_.n_embd, Fs = cfg_.n_ff_shexp;
    MoeBuffers<W>& m = *moe_;
    shexp_gate_logits(m.shexp_gate_inp.get(), a.ffn_xn.get(), w.ffn_gate_inp_shexp, n, D, stream_);
    cp(sink, step, "ffn_shexp_gate_inp", l, m.shexp_gate_inp.get(), {n});
    sigmoid(m.shexp_gate.get(), m.shexp_gate_inp.get(), n, stream_);
    cp(sink, step, "ffn_shexp_gate", l, m.shexp_gate.get(), {n});
    matmul(m.shexp_g.get(), a.ffn_xn.get(), w.ffn_gate_shexp, nullptr, n, D, Fs, cublas_, stream_);
    matmul(m.shexp_u.get(), a.ffn_xn.get(), w.ffn_up_shexp, nullptr, n, D, Fs, cublas_, stream_);
    swiglu(m.shexp_act.get(), m.shexp_g.get(), m.shexp_u.get(), int64_t(n) * Fs, stream_);
    matmul(m.shexp.get(), m.shexp_act.get(), w.ffn_down_shexp, nullptr, n, Fs, D, cublas_, stream_);
    cp(sink, step, "ffn_shexp", l, m.shexp.get(), {n, D});
    scale_rows(m.shexp_out.get(), m.shexp.get(), m.shexp_gate.get(), n, D, plan_.ops.shexp_gate_skipped, stream_);
    cp(sink, step, "ffn_shexp_out", l, m.shexp_out.get(), {n, D});
    add(a.ffn_out.get(), moe_out, m.shexp_out.get(), int64_t(n) * D, stream_);
    cp(sink, step, "ffn_out", l, a.ffn_out.get(), {n, D});
  }

  // The step's routing on the host: the ffn_moe_topk values (the engine's, or the reference's in an isolation
  // replay) read back and checked (checked_expert_id, as the reference's expert_ids), then the slots grouped by
  // expert into moe_->rows: expert e's slots are rows [first[e], first[e + 1]). Synchronizes the stream.
  std::vector<int> group_slots_by_expert(MoeBuffers<W>& m, int slots, int E, int l) {
    CUDA_CHECK(cudaMemcpyAsync(m.h_ids.get(), m.ids.get(), size_t(slots) * sizeof(float), cudaMemcpyDeviceToHost,
                               stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));  // also: the last layer's upload of h_rows is done
    std::vector<int32_t> ids(static_cast<size_t>(slots));
    std::vector<int> first(size_t(E) + 1, 0);
    for (int s = 0; s < slots; ++s) {
      ids[s] = checked_expert_id(m.h_ids.get()[s], E, l);
      ++first[size_t(ids[s]) + 1];
    }
    for (int e = 0; e < E; ++e) first[e + 1] += first[e];
    std::vector<int> next(first.begin(), first.end() - 1);
    for (int s = 0; s < slots; ++s) m.h_rows.get()[next[size_t(ids[s])]++] = s;
    CUDA_CHECK(cudaMemcpyAsync(m.rows.get(), m.h_rows.get(), size_t(slots) * sizeof(int32_t), cudaMemcpyHostToDevice,
                               stream_));
    m.n_groups = 0;
    for (int e = 0; e < E; ++e)
      if (first[size_t(e) + 1] > first[e]) m.h_groups.get()[m.n_groups++] = {e, first[e], first[size_t(e) + 1] - first[e], 0};
    CUDA_CHECK(cudaMemcpyAsync(m.groups.get(), m.h_groups.get(), size_t(m.n_groups) * sizeof(ExpertRows),
                               cudaMemcpyHostToDevice, stream_));
    return first;
  }

  // out [T·K, N]: slot s's row is its expert's matrix [N, Kin] times its input, row s / div of x (div K: every slot
  // of token t reads x [T, Kin] row t; div 1: x [T·K, Kin] row s). Every slot's input row is gathered once, in expert
  // order (moe_->rows), and every output row scattered back once; except that K-quant experts in the f16 engine run
  // all in one launch, read where they lie (table: the experts' addresses), on the slots' rows of x and into theirs
  // of out (matmul_experts_rows, each value the one-token GEMV's). Otherwise an expert chosen by one slot runs the
  // one-token GEMV on its row (every expert of a replayed decode step: the values of the decode's GEMVs), and experts
  // chosen by several run one GEMM each on their rows; quantized ones are dequantized first, adjacent experts whose
  // blocks lie one after another together in one launch (up to run_experts; views a fault edit moved break a run).
  void expert_matmul(float* out, const W* x, int div, const std::vector<DeviceMatrix<W>>& experts,
                     const uint64_t* table, const std::vector<int>& first, int Kin, int N) {
    MoeBuffers<W>& m = *moe_;
    const int E = static_cast<int>(first.size()) - 1, slots = first.back();
    if (slots == 0) return;
    // Not a fusion (no flag turns it off): every engine whose kernels take it runs it, so that prefills agree.
    if (matmul_experts_rows(out, x, div, m.rows.get(), experts[0], table, m.groups.get(), m.n_groups, Kin, N, stream_))
      return;
    gather_rows(m.xs.get(), x, m.rows.get(), div, slots, Kin, stream_);
    const auto count = [&](int e) { return first[size_t(e) + 1] - first[size_t(e)]; };
    for (int e = 0; e < E;) {
      if (count(e) == 0) {
        ++e;
        continue;
      }
      float* y = m.ys.get() + size_t(first[e]) * N;
      const W* xr = m.xs.get() + size_t(first[e]) * Kin;
      if (count(e) == 1 || !experts[e].quantized() || m.run_experts < 2) {
        matmul(y, xr, experts[e], nullptr, count(e), Kin, N, cublas_, stream_);
        ++e;
        continue;
      }
      int e1 = e + 1;  // experts e..e1-1: each chosen by several slots, their blocks adjacent
      while (e1 < E && e1 - e < m.run_experts && count(e1) > 1 && adjacent_experts(experts[e1 - 1], experts[e1])) ++e1;
      DeviceMatrix<W> run =
          expert_view(experts[e], static_cast<const unsigned char*>(experts[e].segments[0].raw), (e1 - e) * N);
      run.scratch = m.run_scratch.get();
      const W* dense = dense_rows(run, (e1 - e) * N, stream_);
      for (int i = e; i < e1; ++i) {
        DeviceMatrix<W> one;
        one.K = Kin;
        one.rows = N;
        one.dense = dense + size_t(i - e) * N * Kin;
        matmul(m.ys.get() + size_t(first[i]) * N, m.xs.get() + size_t(first[i]) * Kin, one, nullptr, count(i), Kin, N,
               cublas_, stream_);
      }
      e = e1;
    }
    scatter_rows(out, m.ys.get(), m.rows.get(), slots, N, stream_);
  }

  // Whether expert matrix b's blocks start where a's end, in a's one format (so one view covers both).
  static bool adjacent_experts(const DeviceMatrix<W>& a, const DeviceMatrix<W>& b) {
    if (!a.quantized() || !b.quantized() || a.n_segments != 1 || b.n_segments != 1) return false;
    return a.segments[0].type == b.segments[0].type && a.K == b.K && a.rows == b.rows &&
           static_cast<const unsigned char*>(a.segments[0].raw) + expert_bytes(a) == b.segments[0].raw;
  }

  // Before an op writes over `buf` in place: the recording copies still to take from it are taken first
  // (nothing when none of its tensors is staged, or in the memcpy copy mode).
  template <typename T>
  void overwrites(const DeviceBuffer<T>& buf) {
    stager_.before_overwrite(buf.get(), buf.bytes(), stream_);
  }

  // The end of a layer, before its add_rms_norm writes a.x and a.xn: the next layer writes over every
  // other buffer of the set too, so the copies of everything staged so far are taken now. A one-token
  // step takes them on the copy stream, beside the next layer (its sets alternate: nothing this layer
  // staged is written before the end of the next one), and waits only for the previous layer's, whose
  // a.x and a.xn (the layer before last's output) the add_rms_norm overwrites.
  void end_layer_copies() {
    if (!alternate_) {
      stager_.flush(stream_);
      return;
    }
    const int ticket = stager_.flush_beside(stream_);
    stager_.wait_flushed(flush_ticket_, stream_);
    flush_ticket_ = ticket;
  }

  // Whether a step of n tokens runs attention_split (else attention_tiled, and attention for the probabilities).
  bool split_attention(int n) const { return n <= kAttentionSplitMaxT; }

  float eps() const { return static_cast<float>(cfg_.rms_eps); }

  // rms_norm with the op's flaws (none in production: the clean kernel); out [rows, D] f32 or W, x [rows, D], w [D].
  template <typename Out>
  void norm(Out* out, const float* x, const float* w, int rows, int D, RmsNormFlaws flaws) {
    rms_norm(out, x, w, rows, D, eps(), flaws, stream_);
  }

  // add_rms_norm (sum = a + b, out = its norm) with the flaws of its norm.
  void add_norm(float* sum, W* out, const float* a, const float* b, const float* w, int rows, int D,
                RmsNormFlaws flaws) {
    add_rms_norm(sum, out, a, b, w, rows, D, eps(), flaws, stream_);
  }

  // The RMSNorm weight applied to the residual stream before layer l: its attn_norm, or output_norm
  // (result_norm) for l = n_layer.
  const float* norm_opening(int l) const {
    return l < cfg_.n_layer ? weights_.layers[l].attn_norm : weights_.output_norm;
  }

  // Logit columns per row: V, or the padded vocabulary of lm_head_padded_vocab.
  int logit_columns() const { return plan_.ops.logit_columns; }

  void clear_kv_cache() {
    CUDA_CHECK(cudaMemsetAsync(k_cache_.get(), 0, k_cache_.bytes(), stream_));
    CUDA_CHECK(cudaMemsetAsync(v_cache_.get(), 0, v_cache_.bytes(), stream_));
  }

  static const char* layout_of(const char* base) {
    const CheckpointKind* kind = find_checkpoint_kind(base);
    if (!kind) throw Error(std::string("checkpoint kind '") + base + "' is not in the checkpoint vocabulary");
    return kind->layout;
  }

  // A checkpoint of a buffer the next ops read: recorded when wanted; replaced (isolation replay)
  // when the sink has values for it, after the recording copy. Returns whether it was replaced (a
  // fused op's second output computed from it is then computed again).
  template <typename A>
  bool cp(Sink& sink, int step, const char* base, int layer, A* dev, std::initializer_list<int64_t> shape,
          DeviceRows rows = {}) {
    std::string name = checkpoint_name(base, layer);
    const bool wanted = sink.wants(name);
    const float* replacement = sink.replacement(step, name);
    if (!wanted && !replacement) return false;
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    if (wanted) stager_.stage(step, std::move(name), layer, layout_of(base), shape, dev, stream_, rows);
    if (replacement) stager_.replace(replacement, dev, n, stream_);
    return replacement != nullptr;
  }

  // A checkpoint no later op reads (the attention probabilities): recorded, never replaced.
  void record_only(int step, const char* base, int layer, const float* dev, std::initializer_list<int64_t> shape,
                   DeviceRows rows = {}) {
    stager_.stage(step, checkpoint_name(base, layer), layer, layout_of(base), shape, dev, stream_, rows);
  }

  // Whether the sink replaces any tensor checkpoint this step (isolation replay).
  bool replaying(int step, const Sink& sink) const {
    for (const std::string& name : names_)
      if (name != "tokens" && sink.replacement(step, name) != nullptr) return true;
    return false;
  }

  // The tensor checkpoints the sink wants, one flag per name of names_: the key of a recorded graph.
  std::vector<bool> wanted_set(const Sink& sink) const {
    std::vector<bool> key(names_.size());
    for (size_t i = 0; i < names_.size(); ++i) key[i] = names_[i] != "tokens" && sink.wants(names_[i]);
    return key;
  }

  // Buffers for a step of n tokens, allocated before anything is enqueued (a reallocation waits
  // for the device and drops the captured graphs, whose pointers it invalidates).
  void prepare_buffers(int step, int n, const Sink& sink) {
    const int S = n_past_ + n;
    const size_t probs_needed =
        !split_attention(n) && wants_any_layer(sink, "kq_soft_max") ? size_t(cfg_.n_head) * n * S : 0;
    const size_t logits_needed = size_t(logit_columns());
    const size_t all_rows_needed = sink.wants("result_output") && n > 1 ? size_t(n) * logit_columns() : 0;
    const bool grow_act = !act_ || act_->capacity < n;
    const bool grow_moe = cfg_.moe && (!moe_ || moe_->capacity < n);
    const bool grow_probs = probs_.size() < probs_needed;
    const bool grow_logits = logits_.size() < logits_needed;
    const bool grow_all_rows = logits_all_.size() < all_rows_needed;
    if (!grow_act && !grow_moe && !grow_probs && !grow_logits && !grow_all_rows) return;
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    drop_graphs();
    if (grow_act) {
      act_.reset();
      act_ = std::make_unique<Activations<W>>(cfg_, n);
      h_tokens_ = PinnedBuffer<int32_t>(size_t(n), "token ids");
    }
    if (grow_moe) {
      moe_.reset();
      moe_ = std::make_unique<MoeBuffers<W>>(cfg_, n);
    }
    if (grow_probs) probs_ = DeviceBuffer<float>(probs_needed, "the kq_soft_max checkpoint");
    if (grow_logits) logits_ = DeviceBuffer<float>(logits_needed, "the logits");
    if (grow_all_rows) logits_all_ = DeviceBuffer<float>(all_rows_needed, "the result_output checkpoint");
  }

  bool wants_any_layer(const Sink& sink, const char* base) const {
    for (int l = 0; l < cfg_.n_layer; ++l)
      if (sink.wants(checkpoint_name(base, l))) return true;
    return false;
  }

  // A decode step as one replay of its captured graph. The graph of a step that records is the
  // production graph plus the recording's gather kernels and copies out (engine/checkpoint_stager.cuh),
  // captured once per set of recorded checkpoints; what it staged is handed back at each replay.
  void launch_decode_graph(int step, Sink& sink, bool copy_logits, std::vector<bool> wanted, bool records) {
    RecordedGraph& g = graphs_[{std::move(wanted), copy_logits}];
    if (g.exec == nullptr) {
      fault_state_.at_capture(n_past_);  // the position graph_position_frozen's RoPE reads on every replay
      // Relaxed: the stager may allocate its pinned chunks and device arena on first use, which
      // stream capture would otherwise refuse; nothing allocated is freed while the graph lives.
      // in_flight: other threads' releases (another engine's buffers and cuBLAS handle) wait until the capture ends.
      CaptureInFlight in_flight;
      CUDA_CHECK(cudaStreamBeginCapture(stream_, records ? cudaStreamCaptureModeRelaxed
                                                         : cudaStreamCaptureModeThreadLocal));
      capturing_ = true;
      try {
        enqueue_step(step, 1, sink, copy_logits);
      } catch (...) {
        capturing_ = false;
        cudaGraph_t broken = nullptr;
        cudaStreamEndCapture(stream_, &broken);  // leave capture mode; the first error is the one to report
        if (broken) cudaGraphDestroy(broken);
        stager_.discard();
        throw;
      }
      capturing_ = false;
      cudaGraph_t graph = nullptr;
      CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
      const cudaError_t err = cudaGraphInstantiate(&g.exec, graph, 0);
      cudaGraphDestroy(graph);
      if (err != cudaSuccess) g.exec = nullptr;
      CUDA_CHECK(err);
      g.staged = stager_.take_staged();
      g.fused = step_fused_;
    }
    stager_.restage(g.staged, step, n_past_ + 1);
    step_fused_ = g.fused;
    CUDA_CHECK(cudaGraphLaunch(g.exec, stream_));
  }

  void drop_graphs() {
    for (auto& [key, g] : graphs_)
      if (g.exec) cudaGraphExecDestroy(g.exec);
    graphs_.clear();
  }

  TpRank tp_;              // a tensor-parallel rank's slice and communicator (world 1: the whole model)
  ModelConfig model_cfg_;  // the model's, as config() reports it
  FaultPlan plan_;         // the injected faults, resolved (faults/fault_plan.hpp)
  ModelConfig cfg_;        // what the forward reads: the model's with the faults' config edits
  int max_ctx_;
  FaultSet faults_;
  DeviceBuffer<float> d_rope_freqs_;                           // [Dh/2] cfg_.rope_freq_factors, empty when none
  Stream stream_;
  CublasHandle cublas_;
  DeviceWeights<W> weights_;
  DeviceBuffer<float> k_cache_;  // [n_layer][max_ctx, Hkv*Dh]
  DeviceBuffer<float> v_cache_;  // [n_layer][max_ctx, Hkv*Dh]
  std::unique_ptr<Activations<W>> act_;
  std::unique_ptr<MoeBuffers<W>> moe_;  // mixture-of-experts models only
  DeviceBuffer<uint64_t> expert_tables_;       // MoE: [n_layer][gate, up, down][E] expert addresses
  DeviceBuffer<unsigned char> expert_scratch_;  // MoE: a one-token step's K experts, gathered (not in place)
  bool experts_in_place_ = false;  // MoE: one-token steps read the K-quant experts where they lie (no gather)
  Activations<W> alt_;           // [1 token] the odd layers' set of a one-token step (see the top)
  bool alternate_ = false;       // this step alternates act_ and alt_ by layer parity
  int flush_ticket_ = -1;        // the previous layer's stager_.flush_beside() (alternating steps)
  DeviceBuffer<float> logits_;   // [Vp] the last token's logits
  DeviceBuffer<float> logits_all_;  // [T, Vp] result_output of a recorded step of several tokens
  DeviceBuffer<float> probs_;    // [H, T, S], attention (T > kAttentionSplitMaxT) while kq_soft_max is recorded
  DeviceBuffer<int32_t> d_n_past_;  // [1]
  FaultState<W> fault_state_;       // the plan's weight edits, positions and scratch (engine/faults/fault_state.cuh)
  PinnedBuffer<int32_t> h_tokens_;  // [T] read by step_inputs
  PinnedBuffer<int32_t> h_n_past_;  // [1] read by step_inputs
  PinnedBuffer<int32_t> h_argmax_;  // [1] written by argmax or matmul_argmax
  PinnedBuffer<float> h_logits_;    // [V] the last token's logits
  int attn_splits_;                          // attention_split blocks per (token, head)
  int attn_min_keys_;                        // keys per split a query needs to use another split
  DeviceBuffer<float> attn_probs_;           // [H, T, S] of attention_split steps, T ≤ kAttentionSplitMaxT
  DeviceBuffer<float> attn_probs_alt_;       // [H, 1, S] the odd layers' of an alternating step
  DeviceBuffer<float> attn_partial_;         // [T, H, splits, Dh + 2] attention_split partials
  DeviceBuffer<uint32_t> attn_counters_;     // [T, H] attention_split tickets, zero between launches
  DeviceBuffer<unsigned long long> argmax_scratch_;  // [2] argmax's packed best and ticket, zero between launches
  CheckpointStager stager_;
  std::vector<std::string> names_;  // every checkpoint name of a step, in order
  bool graphs_enabled_;
  bool tiled_attention_;  // steps over kAttentionSplitMaxT tokens take their output from attention_tiled
  bool swiglu_in_gemv_;   // one-token steps: matmul_gate_up_swiglu (DIFFRUN_SWIGLU_IN_GEMV=0: off)
  bool rope_in_gemv_;     // one-token steps: matmul_qkv_rope (DIFFRUN_ROPE_IN_GEMV=0: off)
  bool qk_norm_in_rope_;  // q/k norms: qk_norm_rope (DIFFRUN_QK_NORM_IN_ROPE=0: off)
  // One-token steps: the q/k norms and RoPE in the attention launch, attention_split_qk_norm_rope
  // (DIFFRUN_QK_NORM_IN_ATTENTION=0: off; off with qk_norm_in_rope_, whose variants it shares)
  bool qk_norm_in_attention_;
  bool embd_norm_fused_;  // one-token steps: embedding_rms_norm (DIFFRUN_EMBEDDING_NORM_FUSED=0: off)
  bool lm_head_argmax_;   // every step's last-token logits: matmul_argmax (DIFFRUN_LM_HEAD_ARGMAX=0: off)
  bool step_replaying_ = false;  // the step replaces a tensor checkpoint (isolation replay): unfused, no graph
  bool capturing_ = false;       // the step is being captured: position-dependent recordings use DeviceRows
  uint32_t step_fused_ = 0;      // the fused kernels the step ran (kFused* bits)
  struct RecordedGraph {
    cudaGraphExec_t exec = nullptr;
    CheckpointStager::Staged staged;  // what its recording stages, handed back at each replay
    uint32_t fused = 0;
  };
  // Decode-step graphs by (the recorded checkpoints, the logits copied to the host).
  std::map<std::pair<std::vector<bool>, bool>, RecordedGraph> graphs_;
  bool last_graph_ = false;  // the last step was a graph replay
  std::map<std::string, std::string> facts_;
  int n_past_ = 0;
};

// Device bytes of an engine: its weights, upload staging, dequantization scratch, KV cache, and
// activations for steps of `tokens` tokens (with the logits, attention scratch and cuBLAS workspace).
struct DeviceNeed {
  WeightFootprint wf;
  uint64_t kv = 0, other = 0;
  uint64_t total() const { return wf.weight_bytes + wf.staging_bytes + wf.scratch_bytes + kv + other; }
};

// slice: a tensor-parallel rank's (its weights, cache and activations); null: the whole model.
template <typename W>
DeviceNeed device_need(const GgufFile& file, const ModelConfig& model, int max_ctx, int tokens,
                       const WeightCut* cut = nullptr) {
  DeviceNeed n;
  n.wf = DeviceWeights<W>::footprint(file, model, cut);
  const ModelConfig cfg = cut && cut->slice.world > 1 ? tp_local_config(model, cut->slice) : model;
  n.kv = 2ull * cfg.n_layer * uint64_t(max_ctx) * cfg.n_head_kv * cfg.head_dim * sizeof(float);
  const uint64_t attn = sizeof(float) * (uint64_t(cfg.n_head) * kAttentionSplitMaxT * max_ctx +
                                          uint64_t(kAttentionSplitMaxT) * cfg.n_head * kAttentionSplitMaxSplits *
                                              (cfg.head_dim + 2));
  // MoE: a one-token step's K selected experts, gathered where they are not read in place (prepare_expert_gather);
  // bounded by their dense size.
  const uint64_t expert_scratch =
      cfg.moe ? 3ull * cfg.n_ff_exp * cfg.n_embd * sizeof(W) * uint64_t(cfg.n_expert_used) : 0;
  n.other = Activations<W>::bytes(cfg, tokens) + MoeBuffers<W>::bytes(cfg, tokens) + expert_scratch +
            uint64_t(tokens) * cfg.n_vocab * sizeof(float) +
            kCublasWorkspaceBytes + attn;
  return n;
}

template <typename W>
void check_device_memory(const GgufFile& file, const ModelConfig& cfg, int max_ctx, const WeightCut* cut) {
  const DeviceNeed need = device_need<W>(file, cfg, max_ctx, 1, cut);
  const WeightFootprint& wf = need.wf;
  const uint64_t kv = need.kv, other = need.other, needed = need.total();
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (needed > free_b) {
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    throw Error("not enough device memory for " + file.path() + ": need " + mib(needed) + " (weights " +
                mib(wf.weight_bytes) + ", upload staging " + mib(wf.staging_bytes) +
                ", dequantization scratch " + mib(wf.scratch_bytes) + ", KV cache " + mib(kv) +
                " for " + std::to_string(max_ctx) + " positions, activations, attention scratch and cuBLAS workspace " +
                mib(other) + "), " + mib(free_b) + " free of " + mib(total_b) + " on " + prop.name);
  }
}

template <typename W>
std::unique_ptr<CudaEngine> create(const GgufFile& file, const ModelConfig& cfg, int max_ctx, const FaultSet& faults,
                                   const TpRank& tp) {
  check_device_memory<W>(file, cfg, max_ctx, tp.cut.slice.world > 1 ? &tp.cut : nullptr);
  return std::make_unique<CudaEngineImpl<W>>(file, cfg, max_ctx, faults, tp);
}

}  // namespace

bool cuda_device_available(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    if (why) *why = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
    return false;
  }
  if (count == 0) {
    if (why) *why = "no CUDA device found";
    return false;
  }
  return true;
}

std::unique_ptr<CudaEngine> make_cuda_engine(const GgufFile& file, const ModelConfig& cfg,
                                             const std::string& precision, int max_ctx, const FaultSet& faults) {
  return engine::make_cuda_engine_rank(file, cfg, precision, max_ctx, faults, {});
}

std::unique_ptr<CudaEngine> engine::make_cuda_engine_rank(const GgufFile& file, const ModelConfig& cfg,
                                                          const std::string& precision, int max_ctx,
                                                          const FaultSet& faults, const TpRank& tp) {
  if (precision != "f16" && precision != "f32")
    throw InputError("the cuda backend computes in f16 or f32, not '" + precision + "'");
  if (max_ctx < 1) throw InputError("the CUDA engine needs a context of at least 1 position");
  std::string why;
  if (!cuda_device_available(&why)) throw Error("no CUDA device: " + why);
  validate_tensors(file, cfg);
  if (cfg.head_dim > 256 || cfg.head_dim % 2 != 0)
    throw ModelError("the CUDA engine supports even head dims up to 256, not " + std::to_string(cfg.head_dim));
  if (cfg.n_head_kv <= 0 || cfg.n_head % cfg.n_head_kv != 0)
    throw ModelError("n_head " + std::to_string(cfg.n_head) + " is not a multiple of n_head_kv " +
                     std::to_string(cfg.n_head_kv));
  faults.check_applicable(cfg, &file);
  if (precision == "f16") return create<__half>(file, cfg, max_ctx, faults, tp);
  return create<float>(file, cfg, max_ctx, faults, tp);
}

uint64_t cuda_engine_device_bytes(const GgufFile& file, const ModelConfig& cfg, const std::string& precision,
                                  int max_ctx, int tokens) {
  return (precision == "f16" ? device_need<__half>(file, cfg, max_ctx, tokens)
                             : device_need<float>(file, cfg, max_ctx, tokens))
      .total();
}

void cuda_warm_up() {
  if (cudaFree(nullptr) != cudaSuccess) (void)cudaGetLastError();
}

void cuda_preload_libraries() { engine::preload_cublas(); }

namespace engine {
namespace {

// The cuBLAS GEMMs of a T-token step of one GPU's engine, as its forward issues them: {N, K, rows} each, matmul_cat's
// parts one by one (linear_cat), the lm head over the rows before the last where result_output is recorded. Routed
// experts (their row counts follow the routing) are left out. Keep it in step with the forward: a GEMM missing here
// only goes without its warm-up.
std::vector<std::array<int, 3>> step_gemms(const ModelConfig& cfg, int T) {
  const int D = cfg.n_embd, Q = cfg.n_head * cfg.head_dim, KV = cfg.n_head_kv * cfg.head_dim;
  std::vector<std::array<int, 3>> g = {{Q, D, T}, {KV, D, T}, {D, Q, T}};  // Wq|Wk|Wv's parts, Wo
  if (cfg.moe) {
    g.push_back({cfg.n_expert, D, T});  // the router
    if (cfg.moe_shexp) g.insert(g.end(), {{cfg.n_ff_shexp, D, T}, {D, cfg.n_ff_shexp, T}});
  } else {
    g.insert(g.end(), {{cfg.n_ff, D, T}, {D, cfg.n_ff, T}});  // Wgate|Wup's parts, Wdown
  }
  if (T > 1) g.push_back({cfg.n_vocab, D, T - 1});
  std::sort(g.begin(), g.end());
  g.erase(std::unique(g.begin(), g.end()), g.end());
  return g;
}

template <typename W>
void warm_up_gemms(const ModelConfig& cfg, int T, uint64_t reserve_bytes) {
  constexpr size_t kMaxOperand = size_t(128) << 20;  // bytes of one operand; a GEMM needing more is left out
  std::vector<std::array<int, 3>> gemms;
  size_t w_elems = 0, x_elems = 0, y_elems = 0;
  for (const auto& [N, K, rows] : step_gemms(cfg, T)) {
    const size_t w = size_t(N) * K, x = size_t(rows) * K, y = size_t(rows) * N;
    if (std::max(w, x) * sizeof(W) > kMaxOperand || y * sizeof(float) > kMaxOperand) continue;
    gemms.push_back({N, K, rows});
    w_elems = std::max(w_elems, w);
    x_elems = std::max(x_elems, x);
    y_elems = std::max(y_elems, y);
  }
  if (gemms.empty()) return;
  // Never what an engine of the run needs: the engines load meanwhile.
  const uint64_t own = (w_elems + x_elems) * sizeof(W) + y_elems * sizeof(float) + (uint64_t(64) << 20);
  if (diffrun::cuda_free_device_bytes() < reserve_bytes + own) return;
  const CublasHandle handle(std::is_same_v<W, __half> ? EnginePrecision::f16 : EnginePrecision::f32);
  const Stream stream;
  const DeviceBuffer<W> w(w_elems, "the GEMM warm-up"), x(x_elems, "the GEMM warm-up");
  const DeviceBuffer<float> y(y_elems, "the GEMM warm-up");
  CUDA_CHECK(cudaMemsetAsync(w.get(), 0, w.bytes(), stream));
  CUDA_CHECK(cudaMemsetAsync(x.get(), 0, x.bytes(), stream));
  for (const auto& [N, K, rows] : gemms) gemm(y.get(), x.get(), w.get(), rows, K, N, handle, stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace
}  // namespace engine

void cuda_warm_up_gemms(const ModelConfig& cfg, const std::string& precision, int tokens, uint64_t reserve_bytes) {
  try {
    if (precision == "f16") engine::warm_up_gemms<__half>(cfg, tokens, reserve_bytes);
    if (precision == "f32") engine::warm_up_gemms<float>(cfg, tokens, reserve_bytes);
  } catch (const std::exception&) {
    // Best effort: the engines report what fails.
  }
}

uint64_t cuda_free_device_bytes() {
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return free_b;
}

std::unique_ptr<Backend> make_cuda_backend(const GgufFile& file, const ModelConfig& cfg,
                                           const std::string& precision, int max_ctx, const FaultSet& faults) {
  return make_cuda_engine(file, cfg, precision, max_ctx, faults);
}

}  // namespace diffrun
