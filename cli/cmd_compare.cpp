// `diffrun compare ENGINE.h5 REFERENCE.h5` (or `compare RUN_DIR`, or `compare RANK0.h5 RANK1.h5 .. REFERENCE.h5`): the
// first divergence between existing dumps from any writer.
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/command.hpp"
#include "cli/diff_report.hpp"
#include "cli/progress.hpp"
#include "cli/run.hpp"
#include "dump/dump.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"

namespace diffrun::cli {
namespace {

namespace fs = std::filesystem;

struct CompareCommand {
  // The engine side (one dump, a tensor-parallel run's rank dumps or their directory), then the reference dump; or
  // one --out directory of a top-level run.
  std::vector<std::string> dumps;
  std::string isolated;
  std::string model;  // decodes the token ids of the token table
  std::string steps;  // "0,3-5"
  ReportOptions report;
};

// "0,3-5" -> {0, 3, 4, 5}. InputError naming the part that is not a step or a range of steps.
std::vector<int> parse_steps(const std::string& text) {
  std::vector<int> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    const std::string part = text.substr(pos, end - pos);
    pos = end + 1;
    const auto number = [&](const std::string& s) {
      char* stop = nullptr;
      const long v = std::strtol(s.c_str(), &stop, 10);
      if (s.empty() || *stop != '\0' || v < 0 || v > 1'000'000) {
        throw InputError(fmt::format("--steps '{}': '{}' is not a step (0 is the prefill) or a range A-B", text, part));
      }
      return static_cast<int>(v);
    };
    const size_t dash = part.find('-');
    const int lo = number(part.substr(0, dash));
    const int hi = dash == std::string::npos ? lo : number(part.substr(dash + 1));
    if (hi < lo) throw InputError(fmt::format("--steps '{}': the range '{}' is empty", text, part));
    for (int s = lo; s <= hi; ++s) out.push_back(s);
  }
  return out;
}

// The pairs of a top-level run's --out directory: DIR/engine.h5 against DIR/reference.h5, or, for
// the two-pair GPU run, DIR/logic/ and DIR/precision/ each holding both; engine-isolated.h5 where
// the run had --isolate.
std::vector<ComparePair> run_dir_pairs(const std::string& dir) {
  const auto pair_in = [](const fs::path& d) -> std::optional<ComparePair> {
    if (!fs::is_regular_file(d / "engine.h5") || !fs::is_regular_file(d / "reference.h5")) return std::nullopt;
    ComparePair p;
    p.engine_path = (d / "engine.h5").string();
    p.reference_path = (d / "reference.h5").string();
    if (fs::is_regular_file(d / "engine-isolated.h5")) p.isolated_path = (d / "engine-isolated.h5").string();
    return p;
  };
  if (auto p = pair_in(dir)) return {*p};
  std::vector<ComparePair> pairs;
  for (const char* sub : {"logic", "precision"}) {
    auto p = pair_in(fs::path(dir) / sub);
    if (!p) continue;
    const DumpMeta e = DumpReader(p->engine_path).meta(), r = DumpReader(p->reference_path).meta();
    p->title = fmt::format("{}: {}/{} engine vs {}/{} reference", sub, e.backend, e.precision, r.backend, r.precision);
    pairs.push_back(*p);
  }
  if (pairs.empty()) {
    throw InputError(fmt::format("{}: a directory without engine.h5 and reference.h5 (nor logic/ or precision/ "
                                 "holding them); give two dumps or the --out directory of a diffrun run",
                                 dir));
  }
  return pairs;
}

const CommandRegistrar registrar{
    "compare",
    "Compare an engine dump (A) with a reference dump (B), or a run's --out directory: first divergence, verdict, "
    "per-layer errors",
    [](CLI::App& sub) -> std::function<int()> {
      auto o = std::make_shared<CompareCommand>();
      sub.add_option("dumps", o->dumps,
                     "Engine dump (side a), then the reference dump (side b); or the --out directory of a diffrun run. "
                     "Side a may be a tensor-parallel run's rank dumps (several files, or their directory), merged "
                     "(the last argument is the reference)")
          ->required();
      sub.add_option("--isolated", o->isolated,
                     "The engine's isolation-replay dump (diffrun dump --replay REFERENCE): local error per checkpoint");
      sub.add_option("--model,-m", o->model, "The dumps' GGUF model: its tokenizer decodes the token ids in the report");
      sub.add_option("--steps", o->steps, "Compare only these steps, e.g. 0 or 0,3-5 (0 is the prefill)");
      sub.add_option("--checkpoints", o->report.checkpoints,
                     "Compare only the checkpoints matching these globs, e.g. 'l_out-*,result_*' (diffrun vocab)");
      sub.add_option("--unrecorded", o->report.unrecorded,
                     "The recording check: a dump of the same engine's production path on the same tokens that "
                     "recorded only result_output; every step's last logits row must equal the engine dump's bit "
                     "for bit, else 'recording changed the result' (exit 1)");
      o->report.add_options(sub);
      return [o] {
        Progress progress("diffrun compare");
        if (!o->steps.empty()) o->report.steps = parse_steps(o->steps);
        std::function<std::string(int32_t)> token_text;
        if (!o->model.empty()) {
          const auto file = GgufFile::open(o->model);
          std::shared_ptr<const Tokenizer> tok = load_tokenizer(*file);
          const int64_t n_vocab = tok->n_vocab();
          token_text = [tok, n_vocab](int32_t id) {
            if (id < 0 || id >= n_vocab) return std::string("(outside the vocabulary)");
            const int32_t one[1] = {id};
            return tok->decode(one);
          };
        }
        if (o->dumps.size() == 1) {
          if (!fs::is_directory(o->dumps[0])) {
            throw InputError(fmt::format("{}: give the reference dump too (diffrun compare ENGINE.h5 REFERENCE.h5), "
                                         "or a run's --out directory",
                                         o->dumps[0]));
          }
          std::vector<ComparePair> pairs = run_dir_pairs(o->dumps[0]);
          if (!o->isolated.empty()) {
            if (pairs.size() != 1) throw InputError("--isolated: the run directory holds two pairs; compare one of them");
            pairs[0].isolated_path = o->isolated;
          }
          return compare_and_report_pairs(pairs, o->report, progress, token_text);
        }
        const std::vector<std::string> engine(o->dumps.begin(), o->dumps.end() - 1);
        return compare_and_report(engine, o->dumps.back(), o->report, progress, token_text, o->isolated);
      };
    }};

}  // namespace
}  // namespace diffrun::cli
