// ModelConfig from GGUF metadata for every architecture of model/config_names.cpp (the tensor table and its check: model/tensor_table.cpp).
#include "model/config.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string_view>
#include <unordered_set>

#include <fmt/core.h>

#include "model/dequant.hpp"
#include "model/error.hpp"

namespace diffrun {

namespace {

// A positive integer that fits in int, else ModelError naming the key.
int positive_int(const GgufFile& file, const std::string& key, int64_t v) {
  if (v <= 0 || v > std::numeric_limits<int>::max())
    throw ModelError(fmt::format("{}: metadata key '{}' = {} is not a positive int", file.path(), key, v));
  return static_cast<int>(v);
}

// A float that is finite and within (lo, hi] (hi included), else ModelError naming the key: +inf, NaN
// or an absurd value would run without a word and make every activation meaningless.
double bounded_float(const GgufFile& file, const std::string& key, double v, double lo, double hi, const char* range) {
  if (!(v > lo && v <= hi))
    throw ModelError(fmt::format("{}: metadata key '{}' = {} must be a finite number {}", file.path(), key, v, range));
  return v;
}

// Gemma 3's metadata as llama.cpp's gemma3 model reads it: a sliding window on every layer but each
// 6th (or the layers attention.sliding_window_pattern names), local layers with rope.freq_base_swa
// (default 10000), q·k scaled by 1/sqrt(key_length) (1/sqrt(D/H) for the 62-layer 27B), and
// final_logit_softcapping when present. Gemma 3 has no attention softcapping.
void read_gemma3(const GgufFile& file, ModelConfig& c, const std::function<std::string(const char*)>& key) {
  const int64_t window = file.get_int(key("attention.sliding_window"), 0);
  if (window < 0 || window > std::numeric_limits<int>::max())
    throw ModelError(fmt::format("{}: {} = {} is not a window size", file.path(), key("attention.sliding_window"),
                                 window));
  c.sliding_window = static_cast<int>(window);
  if (c.sliding_window > 0) {
    c.swa_layers.assign(c.n_layer, 0);
    const std::string pk = key("attention.sliding_window_pattern");
    const GgufValue* pattern = file.find(pk);
    if (pattern && pattern->type == GgufValueType::ARRAY) {
      const auto& items = pattern->as_array(pk).items;
      if (items.size() != static_cast<size_t>(c.n_layer))
        throw ModelError(fmt::format("{}: {} holds {} entries for {} layers", file.path(), pk, items.size(),
                                     c.n_layer));
      for (int l = 0; l < c.n_layer; ++l) c.swa_layers[l] = items[l].as_bool(pk) ? 1 : 0;
    } else {
      const int64_t n = pattern ? file.get_int(pk) : 6;
      if (n < 0) throw ModelError(fmt::format("{}: {} = {} is negative", file.path(), pk, n));
      for (int l = 0; l < c.n_layer; ++l) c.swa_layers[l] = n == 0 || l % n < n - 1 ? 1 : 0;
    }
    c.rope_theta_swa = file.get_float(key("rope.freq_base_swa"), 10000.0);
    if (!(c.rope_theta_swa > 0) || !std::isfinite(c.rope_theta_swa))
      throw ModelError(fmt::format("{}: {} = {} must be positive", file.path(), key("rope.freq_base_swa"),
                                   c.rope_theta_swa));
  }
  c.final_logit_softcap = file.get_float(key("final_logit_softcapping"), 0.0);
  if (c.final_logit_softcap < 0 || !std::isfinite(c.final_logit_softcap))
    throw ModelError(fmt::format("{}: {} = {} must be a positive number", file.path(), key("final_logit_softcapping"),
                                 c.final_logit_softcap));
  c.attn_scale = c.n_layer == 62 ? 1.0 / std::sqrt(double(c.n_embd / c.n_head)) : 1.0 / std::sqrt(double(c.head_dim));
}

// The largest expert count llama.cpp accepts (LLAMA_MAX_EXPERTS); diffrun refuses more too.
constexpr int64_t kMaxExperts = 512;

// qwen2moe's one shared expert as llama.cpp's qwen2moe model reads it: its width is
// expert_shared_feed_forward_length, n_ff where the key is absent. llama.cpp builds exactly one shared expert and
// never reads expert_shared_count; a count other than 1 (a file that means something else) is refused.
void read_shared_expert(const GgufFile& file, ModelConfig& c, const std::function<std::string(const char*)>& key) {
  const int64_t shared = file.get_int(key("expert_shared_count"), c.moe_shexp ? 1 : 0);
  if (!c.moe_shexp) {
    if (shared != 0)
      throw ModelError(fmt::format("{}: {} = {}: shared experts are supported only for qwen2moe", file.path(),
                                   key("expert_shared_count"), shared));
    return;
  }
  if (shared != 1)
    throw ModelError(fmt::format("{}: {} = {}: qwen2moe is built with exactly one shared expert", file.path(),
                                 key("expert_shared_count"), shared));
  c.n_ff_shexp = positive_int(file, key("expert_shared_feed_forward_length"),
                              file.get_int(key("expert_shared_feed_forward_length"), c.n_ff));
}

// Mixture of experts as llama.cpp reads it for qwen3moe, qwen2moe and llama (Mixtral: llama with expert_count > 0):
// expert_count experts, expert_used_count of them per token, each of width expert_feed_forward_length (qwen3moe,
// qwen2moe; n_ff / expert_used_count where the key is absent) or feed_forward_length (llama). llama.cpp builds them
// with a softmax router whatever expert_gating_func says, the top-k weights renormalised for qwen3moe and llama and
// not for qwen2moe whatever expert_weights_norm says: followed here, and said in a note where the file says
// otherwise. qwen2moe adds its shared expert (read_shared_expert). A scale of the weights is refused.
void read_moe(const GgufFile& file, ModelConfig& c, const std::function<std::string(const char*)>& key) {
  const int64_t n_expert = file.get_int(key("expert_count"), 0);
  if (n_expert < 0 || n_expert > kMaxExperts)
    throw ModelError(fmt::format("{}: {} = {} is outside 0..{}", file.path(), key("expert_count"), n_expert,
                                 kMaxExperts));
  if (n_expert == 0) {
    if (c.moe)  // qwen3moe, qwen2moe: routed by their architecture
      throw ModelError(fmt::format("{}: {} is {}; a {} model needs experts", file.path(), key("expert_count"),
                                   file.find(key("expert_count")) ? "0" : "absent", arch_name(c.arch)));
    read_shared_expert(file, c, key);  // refuses a shared expert count without experts
    return;
  }
  if (!c.moe && c.arch != Arch::llama)
    throw ModelError(fmt::format("{}: {} = {}, but diffrun runs experts only for qwen3moe, qwen2moe and llama "
                                 "(Mixtral)",
                                 file.path(), key("expert_count"), n_expert));
  c.moe = true;
  c.n_expert = static_cast<int>(n_expert);
  c.n_expert_used = positive_int(file, key("expert_used_count"), file.get_int(key("expert_used_count")));
  if (c.n_expert_used > c.n_expert)
    throw ModelError(fmt::format("{}: {} = {} exceeds {} = {}", file.path(), key("expert_used_count"),
                                 c.n_expert_used, key("expert_count"), c.n_expert));
  c.n_ff_exp = c.arch == Arch::llama ? c.n_ff
                                     : positive_int(file, key("expert_feed_forward_length"),
                                                    file.get_int(key("expert_feed_forward_length"),
                                                                 c.n_ff / c.n_expert_used));
  read_shared_expert(file, c, key);
  if (const double scale = file.get_float(key("expert_weights_scale"), 0.0); scale != 0.0 && scale != 1.0)
    throw ModelError(fmt::format("{}: {} = {:g}: a scale of the expert weights is not supported", file.path(),
                                 key("expert_weights_scale"), scale));
  const std::string arch = arch_name(c.arch);
  if (const GgufValue* g = file.find(key("expert_gating_func")); g && file.get_int(key("expert_gating_func")) != 1)
    c.notes.push_back(fmt::format("{} = {} is not applied: llama.cpp's {} architecture routes with a softmax, and "
                                  "so does diffrun",
                                  key("expert_gating_func"), g->to_display(), arch));
  c.expert_weights_norm = !c.moe_shexp;  // llama.cpp's build_moe_ffn norm_w: false for qwen2moe
  if (const GgufValue* n = file.find(key("expert_weights_norm"));
      n && n->as_bool(key("expert_weights_norm")) != c.expert_weights_norm)
    c.notes.push_back(fmt::format("{} = {} is not applied: llama.cpp's {} architecture {} the top-k weights, and "
                                  "so does diffrun",
                                  key("expert_weights_norm"), n->to_display(), arch,
                                  c.expert_weights_norm ? "renormalises" : "does not renormalise"));
}

// Llama 3 RoPE scaling as llama.cpp applies it (ggml_rope_ext with freq_factors and freq_scale): pair i's
// angle is pos · theta^(-2i/Dh) / rope_freqs[i] · (1 / rope.scaling.factor). Fills c.rope_freq_factors with
// both folded together; leaves it empty when the file has neither. YaRN and LongRoPE are refused.
void rope_scaling(const GgufFile& file, const std::string& arch, ModelConfig& c) {
  const std::string type_key = arch + ".rope.scaling.type";
  const std::string type = file.find(type_key) ? file.get_string(type_key) : "";
  if (!type.empty() && type != "none" && type != "linear")
    throw ModelError(fmt::format("{}: {} = '{}' is not supported; diffrun supports none and linear scaling and "
                                 "Llama 3's rope_freqs.weight",
                                 file.path(), type_key, printable(type)));
  std::string factor_key = arch + ".rope.scaling.factor";
  if (!file.find(factor_key)) factor_key = arch + ".rope.scale_linear";  // the older key llama.cpp also reads
  const double factor = file.find(factor_key) ? file.get_float(factor_key) : 0.0;
  if (!(std::isfinite(factor) && factor >= 0))
    throw ModelError(fmt::format("{}: {} = {} must be a finite non-negative number", file.path(), factor_key,
                                 factor));
  const float scale = factor == 0.0 ? 1.0f : static_cast<float>(factor);  // 0 means none, as in llama.cpp

  const int half = c.head_dim / 2;
  if (const TensorInfo* t = file.find_tensor(kRopeFreqsTensor)) {
    if (t->n_elements != half || t->rows() != 1)
      throw ModelError(fmt::format("{}: tensor '{}' has {} elements in {} rows, expected one row of "
                                   "{} (one factor per rotary pair, head dim {} / 2)",
                                   file.path(), kRopeFreqsTensor, t->n_elements, t->rows(), half, c.head_dim));
    if (!dequant_supported(t->type))
      throw ModelError(fmt::format("{}: tensor '{}' has dtype {}, which diffrun cannot dequantize",
                                   file.path(), kRopeFreqsTensor, ggml_type_name(t->type)));
    c.rope_freq_factors.resize(half);
    dequantize(t->type, file.tensor_data(*t).data(), c.rope_freq_factors.data(), half);
    for (int i = 0; i < half; ++i) {
      if (!(std::isfinite(c.rope_freq_factors[i]) && c.rope_freq_factors[i] > 0))
        throw ModelError(fmt::format("{}: tensor '{}' element {} is {}; every factor must be finite "
                                     "and positive",
                                     file.path(), kRopeFreqsTensor, i, c.rope_freq_factors[i]));
    }
  }
  if (scale != 1.0f) {
    if (c.rope_freq_factors.empty()) c.rope_freq_factors.assign(half, 1.0f);
    for (float& f : c.rope_freq_factors) f *= scale;
  }
}

// The file must hold the tensors of every block block_count declares, checked before anything sizes
// itself from the count (the dump size estimate, the checkpoint names, Gemma 3's per-layer flags): a
// header claiming 100000000 blocks is refused here, in time bounded by the file's tensor count.
void check_block_count(const GgufFile& file, const std::string& key, int n_layer) {
  const size_t n_tensors = file.tensors().size();
  std::unordered_set<std::string_view> names;
  for (const TensorInfo& t : file.tensors()) names.insert(t.name);
  int l = 0;
  const int limit = static_cast<int>(std::min<size_t>(static_cast<size_t>(n_layer), n_tensors));
  while (l < limit && names.count(first_layer_tensor(l))) ++l;
  if (l < n_layer)
    throw ModelError(fmt::format("{}: missing tensor '{}' ({} is {} but the file holds the tensors of {} block{}, "
                                 "{} tensors in all)",
                                 file.path(), first_layer_tensor(l), key, n_layer, l, l == 1 ? "" : "s",
                                 n_tensors));
}

}  // namespace

ModelConfig config_from_gguf(const GgufFile& file) {
  ModelConfig c;
  const std::string arch = file.get_string("general.architecture");
  const std::optional<Arch> known = arch_from_name(arch);
  if (!known)
    throw ModelError(fmt::format("{}: unsupported architecture '{}'; diffrun supports {}", file.path(),
                                 printable(arch), arch_names()));
  c.arch = *known;
  set_arch_features(c);
  auto key = [&](const char* suffix) { return arch + "." + suffix; };
  auto req = [&](const char* suffix) {
    const std::string k = key(suffix);
    return positive_int(file, k, file.get_int(k));
  };
  auto opt = [&](const char* suffix, int64_t fallback) {
    const std::string k = key(suffix);
    return positive_int(file, k, file.get_int(k, fallback));
  };

  c.n_layer = req("block_count");
  check_block_count(file, key("block_count"), c.n_layer);
  c.n_embd = req("embedding_length");
  c.n_ff = req("feed_forward_length");
  c.n_head = req("attention.head_count");
  c.n_head_kv = opt("attention.head_count_kv", c.n_head);
  c.n_ctx = req("context_length");
  if (!file.find(key("attention.key_length")) && c.n_embd % c.n_head != 0)
    throw ModelError(fmt::format("{}: {} = {} is not a multiple of {} = {} and {} is absent", file.path(),
                                 key("embedding_length"), c.n_embd, key("attention.head_count"), c.n_head,
                                 key("attention.key_length")));
  c.head_dim = opt("attention.key_length", c.n_embd / c.n_head);
  if (c.n_head % c.n_head_kv != 0)
    throw ModelError(fmt::format("{}: head_count {} is not a multiple of head_count_kv {}", file.path(), c.n_head,
                                 c.n_head_kv));
  if (const int64_t v = file.get_int(key("attention.value_length"), c.head_dim); v != c.head_dim)
    throw ModelError(fmt::format("{}: {} = {} differs from the head dim {}; diffrun needs them equal", file.path(),
                                 key("attention.value_length"), v, c.head_dim));
  if (const int64_t r = file.get_int(key("rope.dimension_count"), c.head_dim); r != c.head_dim)
    throw ModelError(fmt::format("{}: {} = {} differs from the head dim {}; partial RoPE is not supported",
                                 file.path(), key("rope.dimension_count"), r, c.head_dim));
  if (c.head_dim % 2 != 0)
    throw ModelError(fmt::format("{}: head dim {} is odd; RoPE needs pairs", file.path(), c.head_dim));
  c.rope_theta = bounded_float(file, key("rope.freq_base"), file.get_float(key("rope.freq_base"), 10000.0), 1.0, 1e12,
                               "above 1 and at most 1e12");
  c.rms_eps = bounded_float(file, key("attention.layer_norm_rms_epsilon"),
                            file.get_float(key("attention.layer_norm_rms_epsilon")), 0.0, 0.1,
                            "above 0 and at most 0.1");
  rope_scaling(file, arch, c);
  const GgufValue& tokens = file.get("tokenizer.ggml.tokens");
  c.n_vocab = positive_int(file, "tokenizer.ggml.tokens",
                           static_cast<int64_t>(tokens.as_array("tokenizer.ggml.tokens").items.size()));
  // llama.cpp takes the vocabulary size from this key when present: one that disagrees with the token
  // list would size the logits differently there than here.
  if (file.find(key("vocab_size"))) {
    if (const int64_t v = file.get_int(key("vocab_size")); v != c.n_vocab)
      throw ModelError(fmt::format("{}: {} = {} disagrees with the {} entries of tokenizer.ggml.tokens", file.path(),
                                   key("vocab_size"), v, c.n_vocab));
  }
  c.tied_output = file.find_tensor(tensor_name(TensorRole::output)) == nullptr;
  if (c.arch == Arch::gemma3) read_gemma3(file, c, key);
  read_moe(file, c, key);
  // llama.cpp reads attention.sliding_window only for architectures with local layers (gemma3 here);
  // its llama, qwen2 and qwen3 attend every earlier position whatever the key says, and its converter
  // never writes the key for Mistral. Followed here, and said.
  if (c.arch != Arch::gemma3)
    if (const GgufValue* w = file.find(key("attention.sliding_window")))
      c.notes.push_back(fmt::format("{} = {} is not applied: llama.cpp's {} architecture attends every earlier "
                                    "position, and so does diffrun",
                                    key("attention.sliding_window"), w->to_display(), arch));
  return c;
}

namespace {
std::string gemma_text(const ModelConfig& cfg) {
  std::string s;
  if (cfg.embd_scale) s += ", embeddings scaled by sqrt(D)";
  if (cfg.post_norms) s += ", post-attention and post-FFN norms";
  if (cfg.ffn_act == FfnAct::gelu_tanh) s += ", GeGLU (tanh) FFN";
  if (cfg.sliding_window > 0) {
    int local = 0;
    for (uint8_t v : cfg.swa_layers) local += v;
    s += fmt::format(", sliding window {} on {} of {} layers (rope theta {:g})", cfg.sliding_window, local,
                     cfg.n_layer, cfg.rope_theta_swa);
  }
  if (cfg.attn_scale > 0) s += fmt::format(", attention scale {:g}", cfg.attn_scale);
  if (cfg.final_logit_softcap > 0) s += fmt::format(", final logit softcap {:g}", cfg.final_logit_softcap);
  if (cfg.moe)
    s += fmt::format(", {} experts (E) of width {} (Fe), {} used per token (K){}", cfg.n_expert, cfg.n_ff_exp,
                     cfg.n_expert_used, cfg.expert_weights_norm ? " with renormalised weights" : "");
  if (cfg.moe_shexp) s += fmt::format(", a shared expert of width {} gated by a sigmoid", cfg.n_ff_shexp);
  return s;
}
}  // namespace

std::string describe(const ModelConfig& cfg) {
  std::string s = fmt::format(
      "arch {}: {} layers, n_embd (D) {}, heads (H) {}, kv heads (Hkv) {}, head dim (Dh) {}, n_ff (F) {}, "
      "vocab (V) {}, context {}, rope {} theta {:g}{}, rms eps {:g}, output {}{}{}{}",
      arch_name(cfg.arch), cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff, cfg.n_vocab,
      cfg.n_ctx, rope_type_name(cfg.rope_type), cfg.rope_theta,
      cfg.rope_freq_factors.empty()
          ? std::string()
          : fmt::format(" with freq factors {:g}..{:g}",
                        *std::min_element(cfg.rope_freq_factors.begin(), cfg.rope_freq_factors.end()),
                        *std::max_element(cfg.rope_freq_factors.begin(), cfg.rope_freq_factors.end())),
      cfg.rms_eps,
      cfg.tied_output ? "tied to token_embd" : "untied", cfg.qkv_bias ? ", q/k/v biases" : "",
      cfg.qk_norm ? ", q/k norms" : "", gemma_text(cfg));
  for (const std::string& note : cfg.notes) s += "\n  note: " + note;
  return s;
}

}  // namespace diffrun
