// The GGUF tensor table of every architecture (names, roles, shapes, the flags that ask for them) and the check of a file against it.
#include "model/tensor_table.hpp"

#include <string_view>
#include <unordered_map>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include "model/config.hpp"
#include "model/dequant.hpp"
#include "model/error.hpp"

namespace diffrun {

namespace {

using enum TensorDim;
using R = TensorRole;
using C = ModelConfig;

// An architecture is a set of feature flags (set_arch_features); its tensors are the rows its flags ask for.
// Order: the roles' order (tensor_spec indexes the table by role).
constexpr TensorSpec kTable[] = {
    {.role = R::token_embd, .name = "token_embd.weight", .rank = 2, .ne = {D, V}, .vocab_rows = true},
    {.role = R::output_norm, .name = "output_norm.weight", .ne = {D}},
    {.role = R::output, .name = "output.weight", .when = &C::tied_output, .when_is = false, .rank = 2, .ne = {D, V},
     .vocab_rows = true, .fallback = R::token_embd},
    {.role = R::attn_norm, .name = "attn_norm.weight", .per_layer = true, .ne = {D}},
    {.role = R::wq, .name = "attn_q.weight", .per_layer = true, .rank = 2, .ne = {D, Dq}},
    {.role = R::wk, .name = "attn_k.weight", .per_layer = true, .rank = 2, .ne = {D, Dkv}},
    {.role = R::wv, .name = "attn_v.weight", .per_layer = true, .rank = 2, .ne = {D, Dkv}},
    {.role = R::bq, .name = "attn_q.bias", .per_layer = true, .when = &C::qkv_bias, .ne = {Dq}},
    {.role = R::bk, .name = "attn_k.bias", .per_layer = true, .when = &C::qkv_bias, .ne = {Dkv}},
    {.role = R::bv, .name = "attn_v.bias", .per_layer = true, .when = &C::qkv_bias, .ne = {Dkv}},
    {.role = R::q_norm, .name = "attn_q_norm.weight", .per_layer = true, .when = &C::qk_norm, .ne = {Dh}},
    {.role = R::k_norm, .name = "attn_k_norm.weight", .per_layer = true, .when = &C::qk_norm, .ne = {Dh}},
    {.role = R::wo, .name = "attn_output.weight", .per_layer = true, .rank = 2, .ne = {Dq, D}},
    {.role = R::attn_post_norm, .name = "post_attention_norm.weight", .per_layer = true, .when = &C::post_norms,
     .ne = {D}},
    {.role = R::ffn_norm, .name = "ffn_norm.weight", .per_layer = true, .ne = {D}},
    {.role = R::w_gate, .name = "ffn_gate.weight", .per_layer = true, .when = &C::moe, .when_is = false, .rank = 2,
     .ne = {D, F}},
    {.role = R::w_up, .name = "ffn_up.weight", .per_layer = true, .when = &C::moe, .when_is = false, .rank = 2,
     .ne = {D, F}},
    {.role = R::w_down, .name = "ffn_down.weight", .per_layer = true, .when = &C::moe, .when_is = false, .rank = 2,
     .ne = {F, D}},
    {.role = R::ffn_post_norm, .name = "post_ffw_norm.weight", .per_layer = true, .when = &C::post_norms, .ne = {D}},
    {.role = R::ffn_gate_inp, .name = "ffn_gate_inp.weight", .per_layer = true, .when = &C::moe, .rank = 2,
     .ne = {D, E}},
    {.role = R::ffn_gate_exps, .name = "ffn_gate_exps.weight", .per_layer = true, .when = &C::moe, .rank = 3,
     .ne = {D, Fe, E}},
    {.role = R::ffn_up_exps, .name = "ffn_up_exps.weight", .per_layer = true, .when = &C::moe, .rank = 3,
     .ne = {D, Fe, E}},
    {.role = R::ffn_down_exps, .name = "ffn_down_exps.weight", .per_layer = true, .when = &C::moe, .rank = 3,
     .ne = {Fe, D, E}},
    {.role = R::ffn_gate_inp_shexp, .name = "ffn_gate_inp_shexp.weight", .per_layer = true, .when = &C::moe_shexp,
     .ne = {D}},
    {.role = R::ffn_gate_shexp, .name = "ffn_gate_shexp.weight", .per_layer = true, .when = &C::moe_shexp, .rank = 2,
     .ne = {D, Fs}},
    {.role = R::ffn_up_shexp, .name = "ffn_up_shexp.weight", .per_layer = true, .when = &C::moe_shexp, .rank = 2,
     .ne = {D, Fs}},
    {.role = R::ffn_down_shexp, .name = "ffn_down_shexp.weight", .per_layer = true, .when = &C::moe_shexp, .rank = 2,
     .ne = {Fs, D}},
};

constexpr bool table_in_role_order() {
  for (size_t i = 0; i < std::size(kTable); ++i)
    if (static_cast<size_t>(kTable[i].role) != i) return false;
  return true;
}
static_assert(table_in_role_order(), "kTable lists the roles in their enum order");
static_assert(static_cast<size_t>(R::ffn_down_shexp) + 1 == std::size(kTable), "every role has a row");

bool needed(const TensorSpec& s, const ModelConfig& c) { return !s.when || c.*s.when == s.when_is; }

int64_t size_of(TensorDim d, const ModelConfig& c) {
  switch (d) {
    case D: return c.n_embd;
    case V: return c.n_vocab;
    case F: return c.n_ff;
    case Dh: return c.head_dim;
    case Dq: return int64_t(c.n_head) * c.head_dim;
    case Dkv: return int64_t(c.n_head_kv) * c.head_dim;
    case E: return c.n_expert;
    case Fe: return c.n_ff_exp;
    case Fs: return c.n_ff_shexp;
  }
  return 0;
}

ExpectedTensor expand(const TensorSpec& s, int layer, const ModelConfig& c) {
  ExpectedTensor e;
  e.name = tensor_name(s.role, layer);
  for (int i = 0; i < s.rank; ++i) e.ne.push_back(size_of(s.ne[i], c));
  e.role = s.role;
  e.layer = s.per_layer ? layer : -1;
  e.vocab_rows = s.vocab_rows;
  return e;
}

std::string shape_str(const std::vector<int64_t>& ne) { return fmt::format("[{}]", fmt::join(ne, ", ")); }

// GGUF writers may keep trailing dimensions of 1 ([576, 1] for a [576] vector); they change nothing.
std::vector<int64_t> trim_trailing_ones(std::vector<int64_t> ne) {
  while (ne.size() > 1 && ne.back() == 1) ne.pop_back();
  return ne;
}

}  // namespace

std::span<const TensorSpec> tensor_specs() { return kTable; }

const TensorSpec& tensor_spec(TensorRole role) { return kTable[static_cast<size_t>(role)]; }

std::string layer_tensor(int layer, const char* suffix) { return fmt::format("blk.{}.{}", layer, suffix); }

std::string tensor_name(TensorRole role, int layer) {
  const TensorSpec& s = tensor_spec(role);
  return s.per_layer ? layer_tensor(layer, s.name) : std::string(s.name);
}

std::string first_layer_tensor(int layer) { return tensor_name(TensorRole::attn_norm, layer); }

std::vector<ExpectedTensor> expected_tensors(const ModelConfig& cfg) {
  std::vector<ExpectedTensor> t;
  for (const TensorSpec& s : kTable) {
    if (s.per_layer) continue;
    if (needed(s, cfg)) {
      t.push_back(expand(s, -1, cfg));
    } else if (s.fallback) {
      for (ExpectedTensor& e : t)
        if (e.role == *s.fallback) e.stands_in_for = s.role;
    }
  }
  for (int l = 0; l < cfg.n_layer; ++l)
    for (const TensorSpec& s : kTable)
      if (s.per_layer && needed(s, cfg)) t.push_back(expand(s, l, cfg));
  return t;
}

void validate_tensors(const GgufFile& file, const ModelConfig& cfg) {
  std::unordered_map<std::string_view, const TensorInfo*> by_name;
  for (const TensorInfo& t : file.tensors()) by_name.emplace(t.name, &t);
  // A hostile or broken block_count can ask for far more layers than the file holds tensors: name the
  // first missing layer before listing (and allocating) billions of expected names.
  if (static_cast<size_t>(cfg.n_layer) > file.tensors().size()) {
    int l = 0;
    while (by_name.count(first_layer_tensor(l))) ++l;
    throw ModelError(fmt::format("{}: missing tensor '{}' (expected shape [{}]; block_count is {} but the file "
                                 "holds only {} tensors)",
                                 file.path(), first_layer_tensor(l), cfg.n_embd, cfg.n_layer, file.tensors().size()));
  }
  for (const ExpectedTensor& e : expected_tensors(cfg)) {
    const auto it = by_name.find(e.name);
    const TensorInfo* t = it == by_name.end() ? nullptr : it->second;
    if (!t)
      throw ModelError(fmt::format("{}: missing tensor '{}' (expected shape {})", file.path(), e.name,
                                   shape_str(e.ne)));
    if (!dequant_supported(t->type))
      throw ModelError(fmt::format("{}: tensor '{}' has dtype {}, which diffrun cannot dequantize", file.path(),
                                   e.name, ggml_type_name(t->type)));
    const std::vector<int64_t> found = trim_trailing_ones(t->ne);
    bool ok = found == e.ne;
    // Embedding and lm head may carry padded vocabulary rows beyond the token list (ne[1] >= V);
    // the forward pass reads only the first V rows, and logits cover the real vocabulary.
    if (e.vocab_rows && found.size() == 2 && found[0] == e.ne[0] && found[1] >= e.ne[1]) ok = true;
    if (!ok)
      throw ModelError(fmt::format("{}: tensor '{}' has shape {}, expected {}{}", file.path(), e.name,
                                   shape_str(t->ne), shape_str(e.ne), e.vocab_rows ? " (or more vocab rows)" : ""));
  }
}

}  // namespace diffrun
