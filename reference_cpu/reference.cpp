// The CPU reference backend: one readable forward pass (one line per op, then its checkpoint), f32 or f64.
// T tokens of the step, S = n_past + T positions attended, D model width, H/Hkv heads, Dh head width,
// F feed-forward width, V real vocabulary, E experts, K experts used per token, Fe one expert's width.
#include "reference_cpu/reference.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <omp.h>

#include "checkpoints/step_batch.hpp"
#include "faults/fault_plan.hpp"
#include "faults/faults.hpp"
#include "model/error.hpp"
#include "reference_cpu/faults/fault_ops.hpp"
#include "reference_cpu/faults/fault_weights.hpp"
#include "reference_cpu/kv_cache.hpp"
#include "reference_cpu/ops/add.hpp"
#include "reference_cpu/ops/argmax.hpp"
#include "reference_cpu/ops/attention.hpp"
#include "reference_cpu/ops/embedding.hpp"
#include "reference_cpu/ops/geglu.hpp"
#include "reference_cpu/ops/matmul.hpp"
#include "reference_cpu/ops/moe.hpp"
#include "reference_cpu/ops/rms_norm.hpp"
#include "reference_cpu/ops/rope.hpp"
#include "reference_cpu/ops/scale.hpp"
#include "reference_cpu/ops/swiglu.hpp"
#include "reference_cpu/recorder.hpp"
#include "reference_cpu/storage.hpp"
#include "reference_cpu/weights.hpp"

namespace diffrun {

namespace {

using namespace diffrun::ref;

template <typename T>
const T* bias_or_null(const Vector<T>& b /* [N] or empty */) {
  return b.size() ? b.data() : nullptr;
}

template <typename T>
class CpuBackend final : public Backend {
  static constexpr const T* kNoBias = nullptr;

 public:
  CpuBackend(const GgufFile& file, const ModelConfig& cfg, int max_ctx, const FaultSet& faults,
             const std::string& precision, const StoragePlan& storage, WeightHolding holding,
             std::shared_ptr<const ForcedRouting> forced)
      : model_cfg_(cfg), plan_(plan_faults(faults, cfg)), cfg_(plan_.config), max_ctx_(max_ctx),
        w_(Weights<T>::load(file, cfg, faults, storage.weights_f16, holding)),
        cache_(cfg.n_layer, max_ctx, cfg.n_head_kv * cfg.head_dim), faults_(faults), precision_(precision),
        storage_(storage), forced_(std::move(forced)) {
    if (w_.token_embd.rows() < cfg_.n_vocab || w_.lm_head().rows() < cfg_.n_vocab) {
      throw ModelError("token_embd/output have fewer rows than the vocabulary of " + std::to_string(cfg_.n_vocab));
    }
    edit_weights(w_, cfg_, plan_.weights);  // the faults' weight edits, before any step
  }

  std::string name() const override { return "cpu"; }
  std::string precision() const override { return precision_; }
  const ModelConfig& config() const override { return model_cfg_; }
  std::map<std::string, std::string> facts() const override {
    std::map<std::string, std::string> f{{"cpu_threads", std::to_string(omp_get_max_threads())},
            {"eigen_version", std::to_string(EIGEN_WORLD_VERSION) + "." + std::to_string(EIGEN_MAJOR_VERSION) + "." +
                                  std::to_string(EIGEN_MINOR_VERSION)},
            {"eigen_simd", Eigen::SimdInstructionSetsInUse()}};
    if (!faults_.empty()) f["injected_faults"] = faults_.names();
    if (forced_ && !forced_->rows.empty()) f["routing_followed"] = followed_fact(*forced_);
    if (storage_.any()) {
      f["weights_dtype"] = storage_.weights_f16 ? "f16" : precision_.substr(0, 3);
      f["emulated_f16_storage"] = storage_.gemm_inputs_f16 ? "attn_norm,ffn_norm,result_norm,kqv_out,ffn_swiglu/ffn_geglu"
                                                           : "ffn_inp,l_out";
    }
    return f;
  }
  int n_past() const override { return n_past_; }
  int max_ctx() const override { return max_ctx_; }
  // Empties the cache: n_past 0 and every row zero, as at construction (the engine's twin).
  void reset() override {
    n_past_ = 0;
    ahead_.reset();
    off_draft_ = false;
    for (auto& m : cache_.k) m.setZero();
    for (auto& m : cache_.v) m.setZero();
  }

  void set_draft(std::shared_ptr<const Draft> draft) override { draft_ = std::move(draft); }
  int steps_from_draft() const override { return from_draft_; }
  void prepare(int step, const Sink& sink) override {
    if (step < 1 || !on_draft() || ahead_) return;
    const std::vector<int32_t> draft = draft_->tokens();
    if (static_cast<int>(draft.size()) >= step) compute_ahead(step, draft[step - 1], sink);
  }

  std::vector<float> forward(int step, std::span<const int32_t> tokens, Sink& sink) override {
    if (tokens.size() == 1 && step >= 1 && on_draft()) {
      if (!ahead_) compute_ahead(step, tokens[0], sink);
      if (ahead_) {
        const int j = step - ahead_->first_step();
        if (j >= 0 && j < ahead_->size() && n_past_ == ahead_base_ + j && ahead_tokens_[j] == tokens[0])
          return replay_ahead(j, step, sink);
        ahead_.reset();  // fed another token than the draft's: one step at a time from here
        off_draft_ = true;
      }
    }
    return run(step, tokens, sink);
  }

  int32_t last_argmax() const override { return last_argmax_; }

 private:
  // Whether steps may come out of passes over the draft: one is given, no fed token has left it, and no fault is
  // injected (a fault may act on one-token steps only, FaultPlan::one_token).
  bool on_draft() const { return draft_ && !off_draft_ && faults_.empty(); }

  // At most this many steps a pass: its checkpoints are held until replayed (as a step of that many tokens records
  // them), and an interrupt is seen between steps.
  static constexpr int kMaxDraftPass = 16;

  // The draft's steps from `step` on, as one pass, when the draft agrees with the fed token and has more (ahead_: each
  // step's records, replayed as it is fed). Without faults a one-token step runs the ops of a step of several
  // (FaultPlan: one_token is ops; forced routing finds each step's rows in the pass, follow_routing), every matmul
  // output is summed in one order whatever the token rows, and attention, RMSNorm, RoPE and routing take each row
  // alone: a step of the pass records what it records alone.
  void compute_ahead(int step, int32_t token, const Sink& sink) {
    const std::vector<int32_t> draft = draft_->tokens();  // step s's token at [s - 1]; empty until published
    if (static_cast<int>(draft.size()) >= step && draft[step - 1] != token) {
      off_draft_ = true;  // the draft's later tokens followed another token: one step at a time from here
      return;
    }
    if (static_cast<int>(draft.size()) < step + 1) return;
    const int k = std::min({static_cast<int>(draft.size()) - step + 1, max_ctx_ - n_past_, kMaxDraftPass});
    if (k < 2) return;
    ahead_tokens_.assign(draft.begin() + (step - 1), draft.begin() + (step - 1) + k);
    ahead_base_ = n_past_;
    ahead_ = std::make_unique<StepBatch>(sink, step, n_past_, k, std::vector<std::string>{std::string(kLogitsCheckpoint)});
    pass_first_ = step;
    try {
      run(step, ahead_tokens_, *ahead_);
    } catch (...) {
      ahead_.reset();
      n_past_ = ahead_base_;
      pass_first_ = -1;
      throw;
    }
    pass_first_ = -1;
    n_past_ = ahead_base_;
  }

  // Step j of the pass ahead, as forward() of that step alone records and returns it.
  std::vector<float> replay_ahead(int j, int step, Sink& sink) {
    step_ = step;
    ahead_->replay(j, step, sink);
    std::vector<float> last = ahead_->values(j, kLogitsCheckpoint);
    n_past_ = ahead_base_ + j + 1;
    ++from_draft_;
    last_argmax_ = argmax(last.data(), static_cast<int>(last.size()), plan_.one_token.argmax_ties);
    if (j + 1 == ahead_->size()) ahead_.reset();
    return last;
  }

  std::vector<float> run(int step, std::span<const int32_t> tokens, Sink& sink) {
    const int n = static_cast<int>(tokens.size());
    const int D = cfg_.n_embd, V = cfg_.n_vocab;
    if (n == 0) throw InputError("step " + std::to_string(step) + " has no tokens");
    if (n_past_ + n > max_ctx_) {
      throw InputError("step " + std::to_string(step) + ": " + std::to_string(n_past_) + " cached + " +
                       std::to_string(n) + " new tokens exceed the context of " + std::to_string(max_ctx_));
    }
    Recorder<T> cp(sink, step);
    step_ = step;
    cp.ids("tokens", tokens);
    if (n == 1 && frozen_pos_ < 0) frozen_pos_ = n_past_;
    // The engine runs its fused kernels on one-token steps, where the production-path faults act (fault_plan.hpp).
    const OpArgs& args = n == 1 ? plan_.one_token : plan_.ops;

    std::vector<T> x(static_cast<size_t>(n) * D);  // [T,D] residual stream
    embedding(x.data(), tokens.data(), w_.token_embd, n, D, V);                   cp("embd", -1, {n, D}, x.data());
    if (cfg_.embd_scale) {
      scale(x.data(), x.data(), T(args.embd_scale), nD_of(n));                    cp("inp_scaled", -1, {n, D}, x.data());
    }
    // Layer 0's attn_norm; each layer ends with the norm that opens the next one, or result_norm (as the engine).
    std::vector<T> xn(x.size());                   // [T,D]
    norm(xn.data(), x.data(), opening_norm(0), n, D, args.first_norm);
    store_gemm_input(xn.data(), nD_of(n));
    for (int l = 0; l < cfg_.n_layer; ++l) layer(l, x, xn, n, args, cp);
    cp("result_norm", -1, {n, D}, xn.data(), gemm_f16());

    const int rows = cp.wants("result_output") ? n : 1;  // every token's logits only when recorded
    const T* last_rows = xn.data() + static_cast<size_t>(n - rows) * D;  // [rows,D]
    const int Vp = args.logit_columns;  // V, or the padded vocabulary of lm_head_padded_vocab
    std::vector<T> logits(static_cast<size_t>(rows) * Vp);  // [rows,Vp]
    matmul_padded(logits.data(), last_rows, w_.lm_head(), rows, D, V, Vp);
    if (cfg_.final_logit_softcap > 0) softcap(logits.data(), logits.data(), T(cfg_.final_logit_softcap), int64_t(logits.size()));
    if (rows == n) cp("result_output", -1, {n, Vp}, logits.data());

    n_past_ += n;
    std::vector<float> last(logits.end() - Vp, logits.end());
    last_argmax_ = argmax(last.data(), Vp, args.argmax_ties);
    return last;
  }

  // One transformer block on x [T,D] in place. xn [T,D] holds its attn_norm on entry, and on return the norm that
  // opens the next layer (result_norm after the last).
  void layer(int l, std::vector<T>& x /* [T,D] */, std::vector<T>& xn /* [T,D] */, int n, const OpArgs& args,
             Recorder<T>& cp) {
    const LayerWeights<T>& w = w_.layers[l];
    const int D = cfg_.n_embd, H = cfg_.n_head, Hkv = cfg_.n_head_kv, Dh = cfg_.head_dim;
    const int Q = H * Dh, KV = Hkv * Dh, S = n_past_ + n, pos0 = n_past_;
    const T theta = T(cfg_.layer_rope_theta(l));
    const auto rope = cfg_.rope_type == RopeType::neox ? rope_neox<T> : rope_norm<T>;
    const std::vector<T> freq_factors(cfg_.rope_freq_factors.begin(), cfg_.rope_freq_factors.end());  // [Dh/2] or empty
    const T* ff = freq_factors.empty() ? nullptr : freq_factors.data();
    const size_t nD = static_cast<size_t>(n) * D;
    T* cache_k = cache_.k[l].data();  // [C,Hkv*Dh]; rows 0..S-1 valid after this step
    T* cache_v = cache_.v[l].data();  // [C,Hkv*Dh]

    cp("attn_norm", l, {n, D}, xn.data(), gemm_f16());  // xn: the norm that opened the layer

    std::vector<T> q(static_cast<size_t>(n) * Q);          // [T,H*Dh]
    std::vector<T> k(static_cast<size_t>(n) * KV);         // [T,Hkv*Dh]
    std::vector<T> v(static_cast<size_t>(n) * KV);         // [T,Hkv*Dh]
    matmul(q.data(), xn.data(), w.wq, bias_or_null(w.bq), n, D, Q);             cp("Qcur", l, {n, H, Dh}, q.data());
    matmul(k.data(), xn.data(), w.wk, bias_or_null(w.bk), n, D, KV);            cp("Kcur", l, {n, Hkv, Dh}, k.data());
    matmul(v.data(), xn.data(), w.wv, bias_or_null(w.bv), n, D, KV);            cp("Vcur", l, {n, Hkv, Dh}, v.data());
    if (cfg_.qk_norm) {
      norm(q.data(), q.data(), w.q_norm.data(), n * H, Dh, args.norm);           cp("Qnorm", l, {n, H, Dh}, q.data());
      norm(k.data(), k.data(), w.k_norm.data(), n * Hkv, Dh, args.norm);         cp("Knorm", l, {n, Hkv, Dh}, k.data());
    }
    const CachedKeys<T> k_cached(k, args.rope_cache_unrotated);  // what the cache write stores of K
    // graph_position_frozen: one-token steps rotate at the position of the first (where the engine captures its graph).
    const int rope_pos = (n == 1 && plan_.fused.graph_position_frozen ? frozen_pos_ : pos0) + args.rope_position_offset;
    rope(q.data(), q.data(), n, H, Dh, rope_pos, theta, ff);                      cp("Qrope", l, {n, H, Dh}, q.data());
    rope(k.data(), k.data(), n, Hkv, Dh, rope_pos, theta, ff);                    cp("Krope", l, {n, Hkv, Dh}, k.data());

    const int write_pos = plan_.hooks.kv_cache_pos0 ? 0 : pos0;  // kv_cache_pos0: row 0 every step
    std::copy_n(k_cached.rows(k), k.size(), cache_k + static_cast<size_t>(write_pos) * KV); cp("cache_k", l, {S, Hkv, Dh}, cache_k);
    std::copy(v.begin(), v.end(), cache_v + static_cast<size_t>(write_pos) * KV); cp("cache_v", l, {S, Hkv, Dh}, cache_v);

    // kv_cache_not_read: attention over the step's own K/V, as if nothing had been cached.
    const bool read_cache = !plan_.hooks.kv_cache_not_read;
    const int past = read_cache ? pos0 : 0, S_att = past + n;
    std::vector<T> probs(static_cast<size_t>(H) * n * S_att);  // [H,T,S]
    std::vector<T> kqv(static_cast<size_t>(n) * Q);        // [T,H*Dh]
    const AttentionKv<T> kv(read_cache ? cache_k : k.data(), read_cache ? cache_v : v.data(), S_att, H, Hkv, Dh,
                            args.gqa_head_modulo);
    attention(kqv.data(), probs.data(), q.data(), kv.k(), kv.v(), n, past, H, kv.heads(), Dh,
              T(cfg_.attention_scale()), cfg_.layer_window(l), args.attention);
    cp("kq_soft_max", l, {H, n, S_att}, std::as_const(probs).data());  // read by no later op: never replaced
    store_gemm_input(kqv.data(), kqv.size());                                     cp("kqv_out", l, {n, H, Dh}, kqv.data(), gemm_f16());

    std::vector<T> attn_out(nD);                           // [T,D]
    matmul(attn_out.data(), kqv.data(), w.wo, kNoBias, n, Q, D);                  cp("attn_out", l, {n, D}, attn_out.data());
    if (cfg_.post_norms) {
      norm(attn_out.data(), attn_out.data(), w.attn_post_norm.data(), n, D, args.attn_post_norm);
      cp("attn_post_norm", l, {n, D}, attn_out.data());
    }
    std::vector<T> ffn_inp(nD);                            // [T,D]
    if (plan_.hooks.residual_skipped) {  // residual_skipped: ffn_inp = attn_out
      std::copy(attn_out.begin(), attn_out.end(), ffn_inp.begin());
    } else {
      add(ffn_inp.data(), x.data(), attn_out.data(), static_cast<int64_t>(nD));
    }
    store_residual(ffn_inp.data(), nD);                                           cp("ffn_inp", l, {n, D}, ffn_inp.data(), residual_f16());
    norm(xn.data(), ffn_inp.data(), w.ffn_norm.data(), n, D, args.norm);
    store_gemm_input(xn.data(), nD);                                              cp("ffn_norm", l, {n, D}, xn.data(), gemm_f16());

    std::vector<T> ffn_out(nD);                            // [T,D]
    if (cfg_.moe) moe_ffn(ffn_out.data(), xn.data(), w, l, n, args, cp);
    else dense_ffn(ffn_out.data(), xn.data(), w, l, n, args, cp);
    if (cfg_.post_norms) {
      norm(ffn_out.data(), ffn_out.data(), w.ffn_post_norm.data(), n, D, args.norm); cp("ffn_post_norm", l, {n, D}, ffn_out.data());
    }
    add(x.data(), ffn_inp.data(), ffn_out.data(), static_cast<int64_t>(nD));
    store_residual(x.data(), nD);                                                 cp("l_out", l, {n, D}, x.data(), residual_f16());
    norm(xn.data(), x.data(), opening_norm(l + 1), n, D, args.norm);             // the next layer's attn_norm
    store_gemm_input(xn.data(), nD);
  }

  // The gated FFN on xn [T,D] (the layer's ffn_norm) into out [T,D].
  void dense_ffn(T* out /* [T,D] */, const T* xn /* [T,D] */, const LayerWeights<T>& w, int l, int n,
                 const OpArgs& args, Recorder<T>& cp) {
    const int D = cfg_.n_embd, F = cfg_.n_ff;
    std::vector<T> gate(static_cast<size_t>(n) * F);       // [T,F]
    std::vector<T> up(static_cast<size_t>(n) * F);         // [T,F]
    matmul(gate.data(), xn, w.w_gate, kNoBias, n, D, F);                          cp("ffn_gate", l, {n, F}, gate.data());
    matmul(up.data(), xn, w.w_up, kNoBias, n, D, F);                              cp("ffn_up", l, {n, F}, up.data());
    const auto act = cfg_.ffn_act == FfnAct::gelu_tanh ? geglu<T> : swiglu<T>;
    const auto [act_in, act_mul] = in_order<const T*>(gate.data(), up.data(), args.act_swapped);
    act(gate.data(), act_in, act_mul, static_cast<int64_t>(gate.size()));
    store_gemm_input(gate.data(), gate.size());
    cp(cfg_.ffn_act == FfnAct::gelu_tanh ? "ffn_geglu" : "ffn_swiglu", l, {n, F}, gate.data(), gemm_f16());
    matmul(out, gate.data(), w.w_down, kNoBias, n, F, D);                         cp("ffn_out", l, {n, D}, out);
  }

  // The routed FFN on xn [T,D] into out [T,D], as llama.cpp's build_moe_ffn: the router's softmax over E experts,
  // the K most probable, each one's SwiGLU FFN on the token, the outputs summed with their renormalised weights.
  // Slot s = t·K + j is token t's j-th expert. An isolation replay replaces the ids and weights too: the experts
  // then run with the reference's routing (forced routing).
  void moe_ffn(T* out /* [T,D] */, const T* xn /* [T,D] */, const LayerWeights<T>& w, int l, int n,
               const OpArgs& args, Recorder<T>& cp) {
    const int D = cfg_.n_embd, E = cfg_.n_expert, K = cfg_.n_expert_used, Fe = cfg_.n_ff_exp;
    const size_t slots = static_cast<size_t>(n) * K;
    std::vector<T> logits(static_cast<size_t>(n) * E), probs(logits.size());   // [T,E]
    std::vector<int32_t> topk(slots);                                           // [T,K]
    std::vector<T> weights(slots), weights_norm(slots);                         // [T,K]
    matmul(logits.data(), xn, w.ffn_gate_inp, kNoBias, n, D, E);                  cp("ffn_moe_logits", l, {n, E}, logits.data());
    moe_route(probs.data(), topk.data(), weights.data(), weights_norm.data(), logits.data(), n, E, K,
              cfg_.expert_weights_norm, args.moe_routing);
    if (forced_) follow_routing(topk, weights, weights_norm, probs, l, n);
    cp("ffn_moe_probs", l, {n, E}, probs.data());
    std::vector<T> ids(topk.begin(), topk.end());          // [T,K] the ids as values, as the dump holds them
    cp("ffn_moe_topk", l, {n, K}, ids.data());
    expert_ids(topk, ids, E, l);
    cp("ffn_moe_weights", l, {n, K}, weights.data());
    if (cfg_.expert_weights_norm) cp("ffn_moe_weights_norm", l, {n, K}, weights_norm.data());  // not qwen2moe

    std::vector<T> gate(slots * Fe), up(slots * Fe);       // [T,K,Fe]
    std::vector<T> down(slots * D);                        // [T,K,D]
    expert_matmul(gate.data(), xn, false, w.ffn_gate_exps, topk, n, K, D, Fe);   cp("ffn_moe_gate", l, {n, K, Fe}, gate.data());
    expert_matmul(up.data(), xn, false, w.ffn_up_exps, topk, n, K, D, Fe);       cp("ffn_moe_up", l, {n, K, Fe}, up.data());
    swiglu(gate.data(), gate.data(), up.data(), static_cast<int64_t>(gate.size()));
    store_gemm_input(gate.data(), gate.size());                                   cp("ffn_moe_swiglu", l, {n, K, Fe}, gate.data(), gemm_f16());
    expert_matmul(down.data(), gate.data(), true, w.ffn_down_exps, topk, n, K, Fe, D); cp("ffn_moe_down", l, {n, K, D}, down.data());
    // Weighted by the recorded weights an isolation replay replaces: renormalised, or as selected (qwen2moe).
    const T* slot_weights = cfg_.expert_weights_norm ? weights_norm.data() : weights.data();
    moe_combine(out, down.data(), slot_weights, n, K, D);                         cp("ffn_moe_out", l, {n, D}, out);
    if (cfg_.moe_shexp) shared_expert(out, xn, w, l, n, args, cp);
  }

  // qwen2moe's shared expert on xn [T,D], added to out [T,D] (ffn_moe_out) as llama.cpp's qwen2moe graph: a SwiGLU
  // FFN of width Fs, times sigmoid(xn · ffn_gate_inp_shexp) per token. Its gate, up and SwiGLU are not recorded
  // (llama.cpp names them as the dense FFN's, ffn_gate etc., which qwen2moe's dumps do not hold).
  void shared_expert(T* out /* [T,D] */, const T* xn /* [T,D] */, const LayerWeights<T>& w, int l, int n,
                     const OpArgs& args, Recorder<T>& cp) {
    const int D = cfg_.n_embd, Fs = cfg_.n_ff_shexp;
    const size_t nD = static_cast<size_t>(n) * D;
    std::vector<T> gate_inp(n), gate(n);                   // [T]
    shexp_gate_logits(gate_inp.data(), xn, w.ffn_gate_inp_shexp.data(), n, D);   cp("ffn_shexp_gate_inp", l, {n}, gate_inp.data());
    sigmoid(gate.data(), gate_inp.data(), n);                                     cp("ffn_shexp_gate", l, {n}, gate.data());
    std::vector<T> g(static_cast<size_t>(n) * Fs), u(g.size());  // [T,Fs]
    std::vector<T> shexp(nD);                              // [T,D]
    matmul(g.data(), xn, w.ffn_gate_shexp, kNoBias, n, D, Fs);
    matmul(u.data(), xn, w.ffn_up_shexp, kNoBias, n, D, Fs);
    swiglu(g.data(), g.data(), u.data(), static_cast<int64_t>(g.size()));
    store_gemm_input(g.data(), g.size());
    matmul(shexp.data(), g.data(), w.ffn_down_shexp, kNoBias, n, Fs, D);         cp("ffn_shexp", l, {n, D}, shexp.data());
    scale_rows(shexp.data(), shexp.data(), gate.data(), n, D, args.shexp_gate_skipped); cp("ffn_shexp_out", l, {n, D}, shexp.data());
    add(out, out, shexp.data(), static_cast<int64_t>(nD));                        cp("ffn_out", l, {n, D}, out);
  }

  // out [T·K, N]: slot s's row is expert topk[s]'s matrix [N, Kin] times its input, x's row t (per_slot false: every
  // slot of token t reads x [T, Kin]) or row s (per_slot: x [T·K, Kin]). Each expert's slots go through one matmul,
  // whose sums are the same for any number of rows (reference_cpu/kernels.hpp).
  void expert_matmul(T* out /* [T*K,N] */, const T* x /* [T,Kin] or [T*K,Kin] */, bool per_slot,
                     const std::vector<WeightMatrix<T>>& W /* E x [N,Kin] */, const std::vector<int32_t>& topk /* [T,K] */,
                     int n, int K, int Kin, int N) const {
    std::vector<size_t> mine;
    std::vector<T> xs, ys;
    for (size_t e = 0; e < W.size(); ++e) {
      mine.clear();
      for (size_t s = 0; s < topk.size(); ++s)
        if (topk[s] == static_cast<int32_t>(e)) mine.push_back(s);
      if (mine.empty()) continue;
      const int m = static_cast<int>(mine.size());
      xs.resize(static_cast<size_t>(m) * Kin);
      ys.resize(static_cast<size_t>(m) * N);
      for (int i = 0; i < m; ++i)
        std::copy_n(x + (per_slot ? mine[i] : mine[i] / K) * Kin, Kin, xs.data() + static_cast<size_t>(i) * Kin);
      matmul(ys.data(), xs.data(), W[e], kNoBias, m, Kin, N);
      for (int i = 0; i < m; ++i) std::copy_n(ys.data() + static_cast<size_t>(i) * N, N, out + mine[i] * N);
    }
  }

  // The rows of forced_ at this step and layer: their experts in place of the top K, weighed by this reference's
  // probabilities of them. In a pass over the draft's steps (pass_first_ >= 0), token row t is step pass_first_ + t's
  // only token.
  void follow_routing(std::vector<int32_t>& topk /* [T,K] */, std::vector<T>& weights /* [T,K] */,
                      std::vector<T>& weights_norm /* [T,K] */, const std::vector<T>& probs /* [T,E] */, int l,
                      int n) const {
    const int E = cfg_.n_expert, K = cfg_.n_expert_used;
    for (const ForcedRouting::Row& r : forced_->rows) {
      const bool pass = pass_first_ >= 0;
      if (r.layer != l || (pass ? r.step < pass_first_ || r.step >= pass_first_ + n : r.step != step_)) continue;
      const std::string where = "forced routing at step " + std::to_string(r.step) + ", layer " + std::to_string(l) +
                                ", token " + std::to_string(r.token);
      const int tokens_of_step = pass ? 1 : n;
      if (r.token < 0 || r.token >= tokens_of_step)
        throw InputError(where + ": the step has " + std::to_string(tokens_of_step) + " token(s)");
      const int64_t t = pass ? r.step - pass_first_ : r.token;  // its row in this forward's tokens
      if (static_cast<int>(r.ids.size()) != K)
        throw InputError(where + ": " + std::to_string(r.ids.size()) + " expert ids, the model uses " +
                         std::to_string(K) + " per token");
      for (int j = 0; j < K; ++j) {
        if (r.ids[j] < 0 || r.ids[j] >= E)
          throw InputError(where + ": expert id " + std::to_string(r.ids[j]) + " outside 0.." + std::to_string(E - 1));
        if (std::find(r.ids.begin(), r.ids.begin() + j, r.ids[j]) != r.ids.begin() + j)
          throw InputError(where + ": expert " + std::to_string(r.ids[j]) + " chosen twice");
      }
      const size_t row = static_cast<size_t>(t) * K;
      std::copy(r.ids.begin(), r.ids.end(), topk.begin() + row);
      moe_weigh(weights.data() + row, weights_norm.data() + row, probs.data() + static_cast<size_t>(t) * E,
                r.ids.data(), K, cfg_.expert_weights_norm);
    }
  }

  // The fact routing_followed: "step 0 layer 1 token 8: 1,0; ..." over the rows.
  static std::string followed_fact(const ForcedRouting& forced) {
    std::string s;
    for (const ForcedRouting::Row& r : forced.rows) {
      if (!s.empty()) s += "; ";
      s += fmt::format("step {} layer {} token {}:", r.step, r.layer, r.token);
      for (size_t j = 0; j < r.ids.size(); ++j) s += fmt::format("{}{}", j ? "," : " ", r.ids[j]);
    }
    return s;
  }

  // The selected ids back from their recorded values (an isolation replay's, the reference's, where it replaced
  // them): checked_expert_id each.
  static void expert_ids(std::vector<int32_t>& topk /* [T,K] */, const std::vector<T>& ids /* [T,K] */, int E, int l) {
    for (size_t s = 0; s < ids.size(); ++s) topk[s] = checked_expert_id(double(ids[s]), E, l);
  }

  // Emulated storage (reference_cpu/storage.hpp): the rounding points of the f16 engine's GEMM inputs
  // and of a residual stream kept in f16, each applied right after the op that writes the tensor.
  bool gemm_f16() const { return storage_.gemm_inputs_f16; }
  bool residual_f16() const { return storage_.residual_f16; }
  void store_gemm_input(T* x, size_t n) const {
    if (storage_.gemm_inputs_f16) round_f16(x, static_cast<int64_t>(n));
  }
  void store_residual(T* x, size_t n) const {
    if (storage_.residual_f16) round_f16(x, static_cast<int64_t>(n));
  }
  size_t nD_of(int n) const { return static_cast<size_t>(n) * cfg_.n_embd; }

  // RMSNorm of R rows of width D with the model's epsilon and the op's flaws (none in production).
  void norm(T* out /* [R,D] */, const T* x /* [R,D] */, const T* w /* [D] */, int n_rows, int D,
            RmsNormFlaws flaws) const {
    rms_norm(out, x, w, n_rows, D, T(cfg_.rms_eps), flaws);
  }

  // The RMSNorm weight applied to the residual stream before layer l: its attn_norm, or output_norm (result_norm)
  // for l = n_layer.
  const T* opening_norm(int l) const {
    return l < cfg_.n_layer ? w_.layers[l].attn_norm.data() : w_.output_norm.data();
  }

  ModelConfig model_cfg_;  // the model's, as config() reports it
  FaultPlan plan_;         // the injected faults, resolved (faults/fault_plan.hpp)
  ModelConfig cfg_;        // what the forward reads: the model's with the faults' config edits
  int max_ctx_;
  Weights<T> w_;
  KvCache<T> cache_;
  FaultSet faults_;
  std::string precision_;  // the spec it was made with: "f32", "f64-f16store", ...
  StoragePlan storage_;
  int32_t last_argmax_ = -1;
  int n_past_ = 0;
  int step_ = 0;                                  // the step forward() runs
  std::shared_ptr<const ForcedRouting> forced_;  // expert choices to follow (null: none)
  // graph_position_frozen: n_past at the first one-token step since construction (where the engine
  // captures its decode graph; a reset keeps the graph, so it keeps this too); -1 before it.
  int frozen_pos_ = -1;
  std::shared_ptr<const Draft> draft_;  // set_draft (null: none)
  std::unique_ptr<StepBatch> ahead_;    // the draft's steps computed in one pass, not yet all fed (compute_ahead)
  std::vector<int32_t> ahead_tokens_;   // their tokens
  int ahead_base_ = 0;                  // n_past before the pass
  bool off_draft_ = false;              // a fed token left the draft: one step at a time until reset()
  int from_draft_ = 0;                  // steps replayed from passes since construction
  int pass_first_ = -1;                 // while a pass runs: its first step (follow_routing), else -1
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const GgufFile& file, const ModelConfig& cfg, const std::string& precision,
                                          int max_ctx, const FaultSet& faults, WeightHolding holding,
                                          std::shared_ptr<const ForcedRouting> forced) {
  if (max_ctx < 1) throw InputError("the CPU reference needs a context of at least 1 position");
  if (forced && !forced->rows.empty() && !cfg.moe)
    throw InputError("forced routing needs a mixture-of-experts model; this one has no experts");
  validate_tensors(file, cfg);
  faults.check_applicable(cfg, &file);
  const size_t dash = precision.find('-');
  const std::string arith = precision.substr(0, dash);
  const std::string plan = dash == std::string::npos ? "" : precision.substr(dash + 1);
  StoragePlan storage;
  if (plan == "f16store") {
    storage.weights_f16 = storage.gemm_inputs_f16 = true;
  } else if (plan == "f16residual") {
    storage.residual_f16 = true;
  } else if (plan == "f16store-f16residual") {  // the f16 engine's storage with its residual stream in f16 too
    storage.weights_f16 = storage.gemm_inputs_f16 = storage.residual_f16 = true;
  } else if (!plan.empty() || (arith != "f32" && arith != "f64")) {
    throw InputError("the cpu backend's precision is f32 or f64, optionally with emulated storage "
                     "(f32-f16store, f64-f16store, f32-f16residual, f64-f16residual, f32-f16store-f16residual), not '" + precision + "'");
  }
  if (arith == "f32") return std::make_unique<CpuBackend<float>>(file, cfg, max_ctx, faults, precision, storage, holding, forced);
  return std::make_unique<CpuBackend<double>>(file, cfg, max_ctx, faults, precision, storage, holding, std::move(forced));
}

}  // namespace diffrun
