// diffrun_llamacpp: runs a GGUF through llama.cpp on the token ids of a reference dump and writes every graph node its eval callback sees to a raw dump.
//
//   diffrun_llamacpp --model M.gguf --reference REF.h5 --out RAW.h5 [--threads N] [--cache-type f32|f16] [--list]
//
// Teacher forcing, as diffrun's own run: step 0 is the prefill of the reference's step-0 `tokens`,
// each later step decodes the one token the reference fed at that step. llama.cpp runs on the CPU
// with flash attention off, one sequence, every token's logits requested (so no row is skipped),
// and a context of the run's length. The raw dump holds one dataset per graph node, named by its
// ggml name, the k-th repeat of a name within a step suffixed "#k" (k = 2, 3, ...), shape
// reversed(ne) row-major; its meta is the reference's, with backend "llama.cpp" and llama.cpp's
// facts. `diffrun compare RAW.h5 REF.h5 --names llamacpp` maps the names to the vocabulary.
// Exit codes: 0 written, 2 bad input or llama.cpp failure (message names the file or step).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/core.h>
#include <llama.h>

#include "capture.hpp"
#include "diffrun/dump_writer.h"
#include "dump/dump.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"

namespace {

using diffrun::llamacpp::CapturedNode;
using diffrun::llamacpp::Capture;

struct Options {
  std::string model;
  std::string reference;
  std::string out;
  int threads = 0;
  std::string cache_type = "f32";
  bool list = false;
  bool verbose = false;
};

// A raw dump being written through the C API; discarded unless finished.
class RawDump {
 public:
  RawDump(const std::string& path, const std::string& reference) : path_(path) {
    if (diffrun_dump_open(path.c_str(), &d_) != DIFFRUN_DUMP_OK) fail("cannot create " + path);
    check(diffrun_dump_copy_meta(d_, reference.c_str()), "cannot copy the meta of " + reference);
  }
  ~RawDump() {
    if (d_) diffrun_dump_abort(d_);
  }
  RawDump(const RawDump&) = delete;
  RawDump& operator=(const RawDump&) = delete;

  void set_string(const char* key, const std::string& value) {
    check(diffrun_dump_set_string(d_, key, value.c_str()), std::string("attribute '") + key + "'");
  }
  void set_ids(const char* key, const std::vector<int32_t>& ids) {
    check(diffrun_dump_set_ids(d_, key, ids.data(), ids.size()), std::string("attribute '") + key + "'");
  }
  // Starts `step` and records its tokens.
  void step(int step, const std::vector<int32_t>& ids) {
    check(diffrun_dump_step(d_, step), "step " + std::to_string(step));
    const int64_t dims[1] = {static_cast<int64_t>(ids.size())};
    check(diffrun_dump_put(d_, "tokens", -1, dims, 1, DIFFRUN_I32, ids.data()),
          "step " + std::to_string(step) + " tokens");
  }
  void node(const CapturedNode& n) {
    check(diffrun_dump_put_foreign(d_, n.name.c_str(), n.shape.data(), static_cast<int>(n.shape.size()), DIFFRUN_F32,
                                   n.values.data(), n.native),
          "dataset '" + n.name + "'");
  }
  void finish() {
    diffrun_dump* d = std::exchange(d_, nullptr);
    if (diffrun_dump_close(d) != DIFFRUN_DUMP_OK) fail("cannot finish " + path_);
  }

 private:
  void check(int rc, const std::string& what) {
    if (rc != DIFFRUN_DUMP_OK) fail(path_ + ": " + what);
  }
  [[noreturn]] void fail(const std::string& what) {
    const char* detail = diffrun_dump_last_error(d_);
    throw diffrun::Error(what + (detail && *detail ? ": " + std::string(detail) : std::string()));
  }

  std::string path_;
  diffrun_dump* d_ = nullptr;
};

void quiet_log(ggml_log_level level, const char* text, void*) {
  if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

int32_t argmax(const float* logits, int n) { return static_cast<int32_t>(std::max_element(logits, logits + n) - logits); }

// What the run needs from the reference dump: each step's token ids and the model it was run on.
struct Reference {
  std::vector<std::vector<int32_t>> ids;  // [step] -> the ids fed at that step
  int64_t n_tokens = 0;
  std::string model_fingerprint;
  std::string model_path;
};

// Reads the reference and closes it (the C API opens it again to copy its meta).
Reference read_reference(const std::string& path) {
  const diffrun::DumpReader ref(path);
  Reference r;
  r.model_fingerprint = ref.meta().model_fingerprint;
  r.model_path = ref.meta().model_path;
  const std::vector<int> steps = ref.steps();
  if (steps.empty()) throw diffrun::InputError(path + ": no steps to replay");
  for (int s : steps) {
    if (s != static_cast<int>(r.ids.size()))
      throw diffrun::InputError(path + ": steps are not contiguous from 0 (missing step " + std::to_string(r.ids.size()) +
                                ")");
    r.ids.push_back(ref.read_ids(s, "tokens"));
    if (r.ids.back().empty()) throw diffrun::InputError(path + ": step " + std::to_string(s) + " has no tokens");
    if (s > 0 && r.ids.back().size() != 1)
      throw diffrun::InputError(path + ": decode step " + std::to_string(s) + " feeds " +
                                std::to_string(r.ids.back().size()) + " tokens (expected 1)");
    r.n_tokens += static_cast<int64_t>(r.ids.back().size());
  }
  return r;
}

int run(const Options& opt) {
  const Reference ref = read_reference(opt.reference);
  const std::vector<std::vector<int32_t>>& ids = ref.ids;
  const int64_t n_tokens = ref.n_tokens;

  // The reference must be of this very model: the raw dump carries the reference's fingerprint.
  const std::string fingerprint = diffrun::GgufFile::open(opt.model)->fingerprint();
  if (fingerprint != ref.model_fingerprint)
    throw diffrun::InputError(opt.model + ": model fingerprint " + fingerprint + " differs from the reference's (" +
                              ref.model_fingerprint + ", " + ref.model_path + ")");

  if (!opt.verbose) llama_log_set(quiet_log, nullptr);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  llama_model* model = llama_model_load_from_file(opt.model.c_str(), mp);
  if (!model) throw diffrun::InputError(opt.model + ": llama.cpp cannot load this model");
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  for (size_t s = 0; s < ids.size(); ++s)
    for (int32_t id : ids[s])
      if (id < 0 || id >= n_vocab)
        throw diffrun::InputError(opt.reference + ": step " + std::to_string(s) + ": token id " + std::to_string(id) +
                                  " outside the model's vocabulary [0, " + std::to_string(n_vocab) + ")");

  std::unique_ptr<RawDump> dump;
  if (!opt.list) dump = std::make_unique<RawDump>(opt.out, opt.reference);
  int step = 0;
  Capture capture([&](const CapturedNode& n) {
    if (dump) {
      dump->node(n);
    } else {
      std::string shape;
      for (int64_t d : n.shape) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
      fmt::print("{:>4}  {:<40} [{}] {}\n", step, n.name, shape, n.native);
    }
  });

  const int threads = opt.threads > 0 ? opt.threads : std::max(1u, std::thread::hardware_concurrency());
  const auto prefill = static_cast<uint32_t>(ids[0].size());
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(n_tokens);  // llama.cpp pads it (kq_soft_max and the cache show the padding)
  cp.n_batch = std::max<uint32_t>(prefill, 1);
  cp.n_ubatch = cp.n_batch;  // the prefill is one graph, as diffrun's step 0
  cp.n_seq_max = 1;
  cp.n_threads = threads;
  cp.n_threads_batch = threads;
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  cp.type_k = cp.type_v = opt.cache_type == "f16" ? GGML_TYPE_F16 : GGML_TYPE_F32;
  cp.offload_kqv = false;
  cp.op_offload = false;
  cp.no_perf = true;
  cp.cb_eval = &Capture::eval_callback;
  cp.cb_eval_user_data = &capture;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) throw diffrun::Error(opt.model + ": llama.cpp cannot create a context");
  if (dump) {
    // The reference's meta (model, config, prompt, ids) is copied; what differs is set here, before step 0.
    dump->set_string("backend", "llama.cpp");
    dump->set_string("precision", "f32");  // llama.cpp computes activations in f32 on the CPU
    dump->set_string("model_path", opt.model);
    dump->set_string("flash_attn", "off");  // the llamacpp name map reads the V cache as transposed
    dump->set_string("llamacpp_cache_type", opt.cache_type);
    dump->set_string("cpu_threads", std::to_string(threads));
    dump->set_string("llamacpp_system_info", llama_print_system_info());
  }

  std::vector<int32_t> argmaxes;
  int32_t pos = 0;
  for (; step < static_cast<int>(ids.size()); ++step) {
    const std::vector<int32_t>& t = ids[static_cast<size_t>(step)];
    llama_batch batch = llama_batch_init(static_cast<int32_t>(t.size()), 0, 1);
    for (size_t i = 0; i < t.size(); ++i) {
      batch.token[i] = t[i];
      batch.pos[i] = pos + static_cast<int32_t>(i);
      batch.n_seq_id[i] = 1;
      batch.seq_id[i][0] = 0;
      batch.logits[i] = 1;  // every row: otherwise llama.cpp drops rows before the last layer's FFN
    }
    batch.n_tokens = static_cast<int32_t>(t.size());
    capture.begin_step();
    if (dump) dump->step(step, t);
    const int32_t rc = llama_decode(ctx, batch);
    llama_batch_free(batch);
    capture.rethrow_if_failed();
    if (rc != 0) throw diffrun::Error("llama_decode failed at step " + std::to_string(step) + " (code " +
                                      std::to_string(rc) + ")");
    argmaxes.push_back(argmax(llama_get_logits_ith(ctx, -1), n_vocab));
    pos += static_cast<int32_t>(t.size());
  }

  if (dump) {
    dump->set_ids("argmax", argmaxes);
    dump->finish();
  }
  for (const auto& [what, count] : capture.skipped())
    fmt::print(stderr, "diffrun_llamacpp: not captured: {} x{}\n", what, count);
  if (dump)
    fmt::print(stderr, "diffrun_llamacpp: wrote {}: {} steps, {} graph nodes\n", opt.out, ids.size(), capture.captured());
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  CLI::App app("Run a GGUF through llama.cpp on a reference dump's tokens; write every graph node to a raw dump",
               "diffrun_llamacpp");
  app.add_option("-m,--model", opt.model, "GGUF model")->required();
  app.add_option("-r,--reference", opt.reference, "diffrun dump whose step tokens are replayed (teacher forcing)")
      ->required();
  app.add_option("-o,--out", opt.out, "Raw dump to write (HDF5)");
  app.add_option("--threads", opt.threads, "CPU threads (default: all cores)");
  app.add_option("--cache-type", opt.cache_type, "KV cache type: f32 (default) or f16 (llama.cpp's own default)")
      ->check(CLI::IsMember({"f32", "f16"}));
  app.add_flag("--list", opt.list, "Print every graph node (step, name, shape, type) instead of writing a dump");
  app.add_flag("-v,--verbose", opt.verbose, "Show llama.cpp's log");
  try {
    app.parse(argc, argv);
    if (!opt.list && opt.out.empty()) throw CLI::RequiredError("--out");
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    return run(opt);
  } catch (const std::exception& e) {
    fmt::print(stderr, "diffrun_llamacpp: {}\n", e.what());
    return 2;
  }
}
