// Shared run orchestration for the CLI: prompt options, backend choice, the prefill+decode loop, dump metadata.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "checkpoints/backend.hpp"
#include "checkpoints/sink.hpp"
#include "dump/dump.hpp"
#include "dump/dump_size.hpp"
#include "model/config.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"
#include "reference_cpu/reference.hpp"

namespace diffrun::cli {

// How the prompt is given: text (optionally through the chat template) or explicit ids.
struct PromptOptions {
  std::string prompt;
  bool chat = false;
  std::string system;
  std::string tmpl;    // chat template name; empty: detected from the model
  std::string tokens;  // "1,2,3"
  bool no_parse_special = false;
  bool no_bos = false;  // never prepend BOS, even where the model asks for it
  void add_options(CLI::App& app);  // --prompt --chat --system --template --tokens --no-parse-special --no-bos
};

// The prompt's ids. Throws InputError: empty prompt, both or neither of --prompt/--tokens, ids
// outside the vocabulary.
std::vector<int32_t> prompt_tokens(const GgufFile& file, const Tokenizer& tok, const PromptOptions& opt);

// The model's config (config_from_gguf); its notes (metadata llama.cpp does not apply either) are printed on stderr.
ModelConfig load_config(const GgufFile& file);

// The model's tokenizer; its warnings (e.g. an unknown pre-tokenizer) are printed on stderr.
std::unique_ptr<Tokenizer> load_tokenizer(const GgufFile& file);

// The text a run records as its prompt: the prompt as given (after the chat template), or the ids.
std::string prompt_text(const GgufFile& file, const PromptOptions& opt);

struct BackendOptions {
  std::string backend = "cpu";
  std::string precision = "f32";
  std::string inject;  // faults to inject, "name[,name]" (faults/faults.hpp); empty: none
  int tp = 1;          // cuda: tensor-parallel ranks, one GPU each (engine/tp_engine.hpp)
  // cpu: expert choices to follow (reference_cpu/reference.hpp); the job sets them on a reference it runs again
  // after a routing flip by drift (cli/cmd_main.cpp)
  std::shared_ptr<const ForcedRouting> forced_routing;
  void add_options(CLI::App& app);  // --backend --precision --inject --tp
};

// --tp N (cuda: tensor-parallel ranks), for the commands that take BackendOptions or an engine of their own.
void add_tp_option(CLI::App& app, int& tp);

// Every precision a backend takes: f16 (cuda), f32, f64, and the cpu's emulated storage specs
// (f32-f16store, f64-f16store, f32-f16residual, f64-f16residual; reference_cpu/storage.hpp).
std::vector<std::string> precision_choices();

// The reference an engine precision is compared against by default: the f16 engine against the
// reference that emulates its storage (f32-f16store), anything else against f64.
std::string default_reference_precision(const std::string& engine_precision);

// cpu → make_cpu_backend; cuda → make_cuda_backend when built with the CUDA engine, else
// Error("diffrun was built without the CUDA engine"). Both get the faults of opt.inject (InputError
// for an unknown fault or one that does not apply to the model).
std::unique_ptr<Backend> make_backend(const GgufFile& file, const ModelConfig& cfg, const BackendOptions& opt,
                                      int max_ctx);

// True when the CUDA engines among `engines` (each with a max_ctx-position cache and steps of up to
// `tokens` tokens) fit twice over in the device memory free now: the isolation replay's engine may
// then load beside the others from the start. False without a device or without CUDA.
bool cuda_engines_fit(const GgufFile& file, const ModelConfig& cfg, const std::vector<BackendOptions>& engines,
                      int max_ctx, int tokens);

// Everything make_backend would refuse (unknown backend, no CUDA, an unknown fault or one that does
// not apply to the model) and a --checkpoints pattern that matches no checkpoint of the model,
// checked before any compute. Throws InputError (Error for a missing CUDA engine or device).
// `to_compare`: the filter must also keep a checkpoint other than the token ids.
void check_run_options(const GgufFile& file, const ModelConfig& cfg, const BackendOptions& opt,
                       const CheckpointFilter& filter, bool to_compare = false);

// A backend's StepPath after each step, as the dump's root attributes step_graph and step_fused hold them.
struct StepPaths {
  std::vector<int32_t> graph, fused;
  void add(const StepPath& p) {
    graph.push_back(p.graph ? 1 : 0);
    fused.push_back(static_cast<int32_t>(p.fused));
  }
  void resize(size_t steps) {
    graph.resize(steps);
    fused.resize(steps);
  }
};

struct StepsResult {
  std::vector<int32_t> tokens;  // prompt then the fed tokens
  std::vector<int32_t> argmax;  // the backend's own argmax after each step [steps+1]
  std::vector<std::vector<float>> last_logits;  // [steps+1][V], only when keep_logits
  StepPaths paths;                              // the backend's StepPath after each step [steps+1]
};

// The root attributes a run's dump gets at its end: all_token_ids, argmax, and for a backend with
// several paths (the backend fact "fused_kernel_bits") step_graph and step_fused.
void set_run_attributes(DumpWriter& writer, const std::map<std::string, std::string>& facts,
                        const std::vector<int32_t>& tokens, const std::vector<int32_t>& argmax,
                        const StepPaths& paths);
void set_run_attributes(DumpWriter& writer, const StepsResult& r, const Backend& backend);

// Step 0 = prefill of `prompt`; then `steps` decode steps. forced empty: greedy (feeds its own
// argmax). Otherwise teacher forcing: decode step i (1-based) is fed forced[i-1]. Records every
// checkpoint into sink. Throws InputError if prompt + steps exceeds max_ctx (the backend's context)
// or forced is shorter than steps.
StepsResult run_steps(Backend& backend, std::span<const int32_t> prompt, int steps, std::span<const int32_t> forced,
                      Sink& sink, bool keep_logits = false,
                      const std::function<void(int step, int total)>& on_step = {});

// Root attributes for a dump written by `backend` (model path and fingerprint, config, prompt, ids,
// backend facts).
DumpMeta dump_meta(const GgufFile& file, const Backend& backend, const std::string& prompt,
                   std::span<const int32_t> prompt_ids);

// The size guard of a run's dumps: --max-dump-size, --softmax-rows, --token-rows, --logits-rows,
// --cache-rows; and how they are stored: --compress.
struct DumpSizeOptions {
  std::string max_dump_size = "4GB";  // 0: no limit
  int64_t softmax_rows = -1;          // -1: auto (every row unless the dump would pass the limit); 0: every row
  int64_t token_rows = -1;            // -1: auto (every row unless the dump would still pass the limit); 0: every row
  int64_t logits_rows = 64;           // 0: every row
  std::string cache_rows = "auto";    // "step": the rows written in the step; "all": every row, every step;
                                      // "auto": every row unless the dump would pass the limit
  int compress = 0;                   // gzip level 1..9; 0: not compressed
  void add_options(CLI::App& app);
};

// Estimates each dump of a run (dump/dump_size.hpp) and says so through `say`. With
// --cache-rows auto, a dump over the limit first keeps the cache rows each step wrote; with
// --softmax-rows auto, then only as many kq_soft_max rows as fit; with
// --token-rows auto, if that is not enough, every per-token checkpoint keeps as many last rows as
// fit. Throws InputError (exit 2) with the estimate and what to do when a dump would still pass the
// limit.
// With `whole_cache_bytes`, also the size of the same plan with every cache row in every step (what a
// run's checkpoints take in memory as recorded, the cache whole). writes = false (the main job's --dump none):
// the same cuts (they bound what the run holds, and keep its report the one a written run gives), said as what the
// comparison holds rather than what a file will take.
DumpWriterOptions plan_dump_size(const ModelConfig& cfg, int64_t prompt_tokens, int steps, const CheckpointFilter& filter,
                                 const DumpSizeOptions& opt, const std::function<void(const std::string&)>& say,
                                 uint64_t* whole_cache_bytes = nullptr, bool writes = true);

// Index of the largest value (the first one on ties).
int32_t argmax(std::span<const float> logits);

// A step's greedy token: the backend's own choice (Backend::last_argmax, so a wrong argmax is seen), else
// argmax(logits) of the logits it returned.
int32_t greedy_token(const Backend& backend, std::span<const float> logits);

// The references' drafts (Backend::set_draft): DIFFRUN_DRAFT=0 turns them off ("0"), =1 lets a CPU engine draft for
// the top-level job too ("1"); unset or anything else: "".
std::string draft_mode();
// Tokens known before the run (teacher forcing: `fed[s - 1]` is step s's) given to `backend` as its draft, unless
// DIFFRUN_DRAFT=0: a reference then computes the fed steps in passes, the same values (DESIGN.md, the run).
void draft_fed_tokens(Backend& backend, const std::vector<int32_t>& fed);

}  // namespace diffrun::cli
