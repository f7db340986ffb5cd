// Shared run orchestration: prompt ids from text/template/--tokens, backend choice, the step loop, dump metadata.
#include "cli/run.hpp"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <memory>
#include <string>

#include <fmt/core.h>

#include "checkpoints/dump_schema_names.hpp"
#include "checkpoints/vocabulary.hpp"
#include "cli/options.hpp"
#include "faults/faults.hpp"
#include "model/chat_template.hpp"
#include "faults/tp_faults.hpp"
#include "model/error.hpp"
#include "reference_cpu/reference.hpp"
#ifdef DIFFRUN_HAVE_CUDA
#include "engine/engine.hpp"
#include "engine/tp_engine.hpp"
#endif

namespace diffrun::cli {

ModelConfig load_config(const GgufFile& file) {
  ModelConfig cfg = config_from_gguf(file);
  for (const std::string& n : cfg.notes) fmt::print(stderr, "diffrun: note: {}\n", n);
  return cfg;
}

std::unique_ptr<Tokenizer> load_tokenizer(const GgufFile& file) {
  auto tok = Tokenizer::from_gguf(file);
  for (const std::string& w : tok->warnings()) fmt::print(stderr, "diffrun: warning: {}\n", w);
  return tok;
}

void PromptOptions::add_options(CLI::App& app) {
  app.add_option("--prompt", prompt, "Prompt text");
  app.add_flag("--chat", chat, "Wrap the prompt in the model's chat template (one user turn)");
  app.add_option("--system", system, "System message for --chat (default: the template's own)");
  app.add_option("--template", tmpl, "Chat template: chatml, zephyr, llama2, llama3, gemma (default: detected)");
  app.add_option("--tokens", tokens, "Prompt as token ids instead of text, e.g. 1,2,3");
  app.add_flag("--no-parse-special", no_parse_special,
               "Tokenize special tokens (<|im_start|>...) as plain text");
  app.add_flag("--no-bos", no_bos, "Do not prepend BOS to the prompt (by default it is, where the model asks for it)");
}

namespace {

std::vector<int32_t> parse_ids(const std::string& spec, int n_vocab) {
  std::vector<int32_t> ids;
  size_t pos = 0;
  while (pos <= spec.size()) {
    size_t end = spec.find(',', pos);
    if (end == std::string::npos) end = spec.size();
    std::string item = spec.substr(pos, end - pos);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    int64_t id = 0;
    auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), id);
    if (item.empty() || ec != std::errc() || ptr != item.data() + item.size()) {
      throw InputError("--tokens: '" + item + "' is not a token id (expected e.g. 1,2,3)");
    }
    if (id < 0 || id >= n_vocab) {
      throw InputError("--tokens: id " + std::to_string(id) + " is outside the vocabulary [0, " +
                       std::to_string(n_vocab) + ")");
    }
    ids.push_back(static_cast<int32_t>(id));
    pos = end + 1;
  }
  return ids;
}

std::string templated(const GgufFile& file, const PromptOptions& opt) {
  if (!opt.chat) return opt.prompt;
  const ChatTemplate t = opt.tmpl.empty() ? detect_chat_template(file) : parse_chat_template(opt.tmpl);
  return apply_chat_template(t, file, opt.system, opt.prompt);
}

void check_prompt_choice(const PromptOptions& opt) {
  const bool has_text = !opt.prompt.empty();
  const bool has_ids = !opt.tokens.empty();
  if (has_text && has_ids) throw InputError("give either --prompt or --tokens, not both");
  if (!has_text && !has_ids) throw InputError("empty prompt: give --prompt TEXT or --tokens 1,2,3");
  if (has_ids && opt.chat) throw InputError("--chat applies to --prompt text, not to --tokens");
}

}  // namespace

std::vector<int32_t> prompt_tokens(const GgufFile& file, const Tokenizer& tok, const PromptOptions& opt) {
  check_prompt_choice(opt);
  if (!opt.tokens.empty()) return parse_ids(opt.tokens, tok.n_vocab());
  std::vector<int32_t> ids = tok.encode(templated(file, opt), /*add_bos=*/!opt.no_bos, !opt.no_parse_special);
  if (ids.empty()) throw InputError("empty prompt: the text tokenizes to no tokens");
  return ids;
}

std::string prompt_text(const GgufFile& file, const PromptOptions& opt) {
  check_prompt_choice(opt);
  return opt.tokens.empty() ? templated(file, opt) : opt.tokens;
}

std::vector<std::string> precision_choices() {
  return {"f16",           "f32",           "f64",           "f32-f16store",
          "f64-f16store",  "f32-f16residual", "f64-f16residual", "f32-f16store-f16residual"};
}

std::string default_reference_precision(const std::string& engine_precision) {
  return engine_precision == "f16" ? "f32-f16store" : "f64";
}

void BackendOptions::add_options(CLI::App& app) {
  app.add_option("--backend", backend, "Backend: cpu (the Eigen reference) or cuda (the engine)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--precision", precision,
                 "Compute precision: f32 or f64 (cpu; -f16store emulates the f16 engine's storage, -f16residual a "
                 "residual stream in f16), f32 or f16 (cuda)")
      ->check(CLI::IsMember(precision_choices()));
  app.add_option("--inject", inject, "Inject faults from the catalog (diffrun faults), e.g. rope_theta_10000,kv_cache_pos0");
  add_tp_option(app, tp);
}

void add_tp_option(CLI::App& app, int& tp) {
  app.add_option("--tp", tp,
                 "cuda: run the engine tensor-parallel over N GPUs of this host (NCCL, Megatron layout; dump writes "
                 "one rank dump per GPU into the --out directory)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
}


namespace {

// --inject split into the one-GPU catalog's faults and the tensor-parallel ones (faults/tp_faults.hpp).
struct Injected {
  FaultSet faults;
  std::vector<TpFault> tp;
};
Injected injected(const BackendOptions& opt) {
  std::string one_gpu;
  std::vector<TpFault> tp = take_tp_faults(opt.inject, &one_gpu);
  return {parse_faults(one_gpu), std::move(tp)};
}

}  // namespace

std::unique_ptr<Backend> make_backend(const GgufFile& file, const ModelConfig& cfg, const BackendOptions& opt,
                                      int max_ctx) {
  const auto [faults, tp_faults] = injected(opt);
  if (opt.backend == "cpu")
    return make_cpu_backend(file, cfg, opt.precision, max_ctx, faults, WeightHolding::streamed, opt.forced_routing);
  if (opt.forced_routing) throw Error("forced routing is the CPU reference's, not the " + opt.backend + " backend's");
  if (opt.backend == "cuda") {
#ifdef DIFFRUN_HAVE_CUDA
    std::string why;
    if (!cuda_device_available(&why)) throw Error("no usable CUDA device: " + why);
    if (opt.tp > 1 || !tp_faults.empty())
      return make_tp_cuda_engine(file, cfg, opt.precision, max_ctx, opt.tp, faults, tp_faults);
    return make_cuda_backend(file, cfg, opt.precision, max_ctx, faults);
#else
    throw Error("diffrun was built without the CUDA engine");
#endif
  }
  throw InputError("unknown backend '" + opt.backend + "' (expected cpu or cuda)");
}

bool cuda_engines_fit(const GgufFile& file, const ModelConfig& cfg, const std::vector<BackendOptions>& engines,
                      int max_ctx, int tokens) {
#ifdef DIFFRUN_HAVE_CUDA
  uint64_t need = 0;
  for (const BackendOptions& e : engines) {
    if (e.backend == "cuda") need += cuda_engine_device_bytes(file, cfg, e.precision, max_ctx, tokens);
  }
  return need > 0 && 2 * need <= cuda_free_device_bytes();
#else
  (void)file, (void)cfg, (void)engines, (void)max_ctx, (void)tokens;
  return false;
#endif
}

void check_run_options(const GgufFile& file, const ModelConfig& cfg, const BackendOptions& opt,
                       const CheckpointFilter& filter, bool to_compare) {
  const auto [faults, tp_faults] = injected(opt);
  faults.check_applicable(cfg, &file);
  if (opt.tp > 1 && opt.backend != "cuda")
    throw InputError("--tp " + std::to_string(opt.tp) + " runs the cuda backend over several GPUs, not the " +
                     opt.backend + " backend");
  if (!tp_faults.empty() && opt.backend != "cuda")
    throw InputError(std::string("--inject ") + tp_fault_info(tp_faults.front()).name +
                     ": the tensor-parallel faults are the cuda engine's at --tp 2 or more, not the " + opt.backend +
                     " backend's");
  if (opt.backend == "cuda") {
    for (Fault f : faults.list()) {
      if (const std::string why = fault_dormant(f, cfg, &file, opt.precision); !why.empty())
        fmt::print(stderr, "diffrun: note: --inject {} changes nothing in the cuda/{} engine: {}\n", fault_info(f).name,
                   opt.precision, why);
    }
#ifdef DIFFRUN_HAVE_CUDA
    std::string why;
    if (!cuda_device_available(&why)) throw Error("no usable CUDA device: " + why);
    if (opt.tp > 1 || !tp_faults.empty()) check_tp(file, cfg, opt.tp, !faults.empty(), tp_faults);
#else
    throw Error("diffrun was built without the CUDA engine");
#endif
  } else if (opt.backend != "cpu") {
    throw InputError("unknown backend '" + opt.backend + "' (expected cpu or cuda)");
  }
  if (filter.all()) return;
  const std::vector<std::string> names = checkpoint_names(cfg);
  const std::string& spec = filter.spec();
  for (size_t start = 0; start <= spec.size();) {
    const size_t comma = std::min(spec.find(',', start), spec.size());
    const CheckpointFilter one(spec.substr(start, comma - start));
    start = comma + 1;
    if (std::none_of(names.begin(), names.end(), [&](const std::string& n) { return one.matches(n); })) {
      throw InputError(fmt::format("--checkpoints: pattern '{}' matches no checkpoint of this model (names such as "
                                   "{}, {}, {}; diffrun vocab lists them)",
                                   one.spec(), names[std::min<size_t>(1, names.size() - 1)],
                                   names[std::min<size_t>(2, names.size() - 1)], names.back()));
    }
  }
  if (to_compare && std::none_of(names.begin(), names.end(),
                                 [&](const std::string& n) { return n != "tokens" && filter.matches(n); })) {
    throw InputError("--checkpoints '" + spec + "' keeps only the token ids: nothing to compare");
  }
}

int32_t argmax(std::span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

std::string draft_mode() {
  const char* v = std::getenv("DIFFRUN_DRAFT");
  const std::string mode = v ? v : "";
  return mode == "0" || mode == "1" ? mode : "";
}

void draft_fed_tokens(Backend& backend, const std::vector<int32_t>& fed) {
  if (fed.size() < 2 || draft_mode() == "0") return;
  backend.set_draft(std::make_shared<Draft>(fed));
}

int32_t greedy_token(const Backend& backend, std::span<const float> logits) {
  const int32_t own = backend.last_argmax();
  return own >= 0 ? own : argmax(logits);
}

StepsResult run_steps(Backend& backend, std::span<const int32_t> prompt, int steps, std::span<const int32_t> forced,
                      Sink& sink, bool keep_logits, const std::function<void(int step, int total)>& on_step) {
  if (prompt.empty()) throw InputError("empty prompt: nothing to prefill");
  if (steps < 0) throw InputError("the number of decode steps cannot be negative");
  if (!forced.empty() && static_cast<int>(forced.size()) < steps) {
    throw InputError("teacher forcing: " + std::to_string(forced.size()) + " forced tokens for " +
                     std::to_string(steps) + " decode steps");
  }
  const int64_t needed = backend.n_past() + static_cast<int64_t>(prompt.size()) + steps;
  if (needed > backend.max_ctx()) {
    throw InputError("the prompt (" + std::to_string(prompt.size()) + " tokens) plus " + std::to_string(steps) +
                     " decode steps needs " + std::to_string(needed) + " positions; the context holds " +
                     std::to_string(backend.max_ctx()));
  }
  StepsResult r;
  r.tokens.assign(prompt.begin(), prompt.end());
  std::vector<float> logits = backend.forward(0, prompt, sink);
  for (int step = 0;; ++step) {
    r.argmax.push_back(greedy_token(backend, logits));
    r.paths.add(backend.last_step_path());
    if (keep_logits) r.last_logits.push_back(logits);
    if (on_step) on_step(step, steps);
    if (step == steps) break;
    const int32_t next = forced.empty() ? r.argmax.back() : forced[step];
    r.tokens.push_back(next);
    logits = backend.forward(step + 1, std::span<const int32_t>(&next, 1), sink);
  }
  return r;
}

void set_run_attributes(DumpWriter& writer, const std::map<std::string, std::string>& facts,
                        const std::vector<int32_t>& tokens, const std::vector<int32_t>& argmax,
                        const StepPaths& paths) {
  writer.set_attribute(attr::all_token_ids, tokens);
  writer.set_attribute(attr::argmax, argmax);
  if (facts.count("fused_kernel_bits")) {
    writer.set_attribute(attr::step_graph, paths.graph);
    writer.set_attribute(attr::step_fused, paths.fused);
  }
}

void set_run_attributes(DumpWriter& writer, const StepsResult& r, const Backend& backend) {
  set_run_attributes(writer, backend.facts(), r.tokens, r.argmax, r.paths);
}

DumpMeta dump_meta(const GgufFile& file, const Backend& backend, const std::string& prompt,
                   std::span<const int32_t> prompt_ids) {
  DumpMeta meta;
  meta.backend = backend.name();
  meta.precision = backend.precision();
  meta.model_path = file.path();
  meta.model_fingerprint = file.fingerprint();
  meta.config = backend.config();
  meta.prompt = prompt;
  meta.token_ids.assign(prompt_ids.begin(), prompt_ids.end());
  meta.facts = backend.facts();
  return meta;
}

void DumpSizeOptions::add_options(CLI::App& app) {
  app.add_option("--max-dump-size", max_dump_size,
                 "Refuse to start when a dump would be larger (e.g. 4GB, 500MB; 0 = no limit)")
      ->capture_default_str();
  app.add_option("--softmax-rows", softmax_rows,
                 "Record kq_soft_max for the last N query rows of each step only (0 = every row; default: every row "
                 "unless the dump would pass --max-dump-size, then as many as fit)")
      ->check(count_in(0));
  app.add_option("--token-rows", token_rows,
                 "Record every per-token checkpoint for the last N rows of each step only (0 = every row; default: "
                 "every row unless the dump would pass --max-dump-size with --softmax-rows, then as many as fit)")
      ->check(count_in(0));
  app.add_option("--logits-rows", logits_rows,
                 "Record result_output for the last N rows of each step only (the prefill has one per prompt token; "
                 "0 = every row)")
      ->capture_default_str()
      ->check(count_in(0));
  app.add_option("--cache-rows", cache_rows,
                 "cache_k/cache_v: 'step' records the rows each step wrote (readers put the cache back together), "
                 "'all' every valid row at every step, 'auto' every row unless the dump would pass --max-dump-size")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "step", "all"}));
  app.add_option("--compress", compress,
                 "Off unless given (datasets stored contiguous, not compressed). --compress alone stores them chunked "
                 "and gzip-compressed at level 4 (the 4 shown), --compress N at level N (1-9; 0 = off); plain h5py "
                 "reads them")
      ->expected(0, 1)
      ->default_str("4")
      ->check(CLI::Range(0, 9));
}

DumpWriterOptions plan_dump_size(const ModelConfig& cfg, int64_t prompt_tokens, int steps, const CheckpointFilter& filter,
                                 const DumpSizeOptions& opt, const std::function<void(const std::string&)>& say,
                                 uint64_t* whole_cache_bytes, bool writes) {
  const uint64_t limit = parse_bytes(opt.max_dump_size);
  DumpPlan plan;
  plan.prompt_tokens = prompt_tokens;
  plan.steps = steps;
  plan.filter = filter;
  plan.softmax_rows = std::max<int64_t>(opt.softmax_rows, 0);
  plan.token_rows = std::max<int64_t>(opt.token_rows, 0);
  plan.logits_rows = opt.logits_rows;
  plan.cache_all_rows = opt.cache_rows != "step";
  const uint64_t full = estimate_dump_size(cfg, plan);
  if (opt.cache_rows == "auto" && limit > 0 && full > limit) {
    plan.cache_all_rows = false;
    say(fmt::format("a full dump would take about {}: cache_k/cache_v keep the rows each step wrote (readers put the "
                    "cache back together) to stay within --max-dump-size {} (--cache-rows all keeps every row)",
                    format_bytes(full), format_bytes(limit)));
  }
  if (opt.softmax_rows < 0 && limit > 0 && estimate_dump_size(cfg, plan) > limit) {
    const int64_t rows = softmax_rows_within(cfg, plan, limit);
    if (rows > 0) {
      plan.softmax_rows = rows;
      say(fmt::format("a full dump would take about {}: kq_soft_max keeps its last {} rows of each step to stay within "
                      "--max-dump-size {} (--softmax-rows 0 keeps every row)",
                      format_bytes(full), rows, format_bytes(limit)));
    }
  }
  if (opt.token_rows < 0 && limit > 0 && estimate_dump_size(cfg, plan) > limit) {
    // Every kq_soft_max row that could go is gone: the other per-token checkpoints keep their last rows.
    DumpPlan cut = plan;
    if (opt.softmax_rows < 0) cut.softmax_rows = 0;  // token_rows cuts kq_soft_max too
    const int64_t rows = token_rows_within(cfg, cut, limit);
    if (rows > 0) {
      plan = cut;
      plan.token_rows = rows;
      say(fmt::format("a full dump would take about {}: every per-token checkpoint keeps its last {} rows of each step "
                      "(the cache keeps every row) to stay within --max-dump-size {} (--token-rows 0 keeps every row)",
                      format_bytes(full), rows, format_bytes(limit)));
    }
  }
  const uint64_t size = estimate_dump_size(cfg, plan);
  if (limit > 0 && size > limit) {
    DumpPlan one = plan;
    one.softmax_rows = 1;
    const uint64_t softmax = estimate_softmax_bytes(cfg, plan);
    throw InputError(fmt::format(
        "each dump would take about {}, over --max-dump-size {} ({} prompt tokens, {} decode steps; kq_soft_max {}, "
        "{} with --softmax-rows 1). Record fewer checkpoints with --checkpoints (e.g. 'attn_norm-*,ffn_out-*,result_*'), "
        "fewer --steps, or raise --max-dump-size (0 = no limit)",
        format_bytes(size), format_bytes(limit), prompt_tokens, steps, format_bytes(softmax),
        format_bytes(estimate_dump_size(cfg, one))));
  }
  if (whole_cache_bytes) {
    DumpPlan whole = plan;
    whole.cache_all_rows = true;
    *whole_cache_bytes = estimate_dump_size(cfg, whole);
  }
  const std::string rows =
      fmt::format("{}{}", plan.softmax_rows > 0 ? fmt::format(" (kq_soft_max: last {} rows)", plan.softmax_rows) : "",
                  plan.token_rows > 0 ? fmt::format(" (per-token checkpoints: last {} rows)", plan.token_rows) : "");
  if (writes)
    say(fmt::format("each dump will take about {}{}{}", format_bytes(size), rows,
                    opt.compress > 0 ? " before compression" : ""));
  else
    say(fmt::format("no dump is written (--dump none); each side's checkpoints take about {}{}, as a dump would "
                    "(the cuts above apply to what is compared)",
                    format_bytes(size), rows));
  DumpWriterOptions w;
  w.softmax_rows = plan.softmax_rows;
  w.token_rows = plan.token_rows;
  w.logits_rows = plan.logits_rows;
  w.cache_all_rows = plan.cache_all_rows;
  w.compress = opt.compress;
  return w;
}

}  // namespace diffrun::cli
