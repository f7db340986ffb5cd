// The top-level job's pipeline: reference and engine run at once, a comparator per pair consumes their checkpoints as they arrive.
//
// Threads (per engine/reference pair): one for the reference, one for the engine, one comparator.
// The first pair's reference chooses the tokens greedily; every other backend is fed them (teacher
// forcing), so an engine's step s waits only for that reference's step s-1. Each backend's sink
// hands copies of its checkpoints to its pair's comparator, which compares them on arrival
// (diff/stream.hpp: the comparator's own code) and writes the dumps:
//   --dump full        every checkpoint of every step (the default), as `diffrun dump` would;
//   --dump divergence  every step's tokens, and the checkpoints of the steps around the first
//                      divergence only: the step before it, its step, the step after it, and the
//                      step of the first NaN/Inf;
//   --dump none        no file.
// The comparison, and so every report, is the same in the three modes.
//
// Bounded memory: the two sides of a pair record in lockstep (one waits when it is 32 checkpoints
// or a step ahead of the other), only the rows the dump keeps are copied (a long prompt's
// kq_soft_max), and a backend starts step s only once its comparator has finished step s-2. With
// --dump divergence the comparator also holds the step before the current one (and the current
// one) until it knows whether they are written: up to two steps of the kept rows in memory.
//
// --stop-at-first N: the run ends N steps after the step of the first divergence (of any pair).
// The comparators end each step together (a barrier), so every pair knows the last step before it
// goes on: the reports and the dumps hold the steps 0..first+N exactly, whatever the backends had
// started beyond them.
//
// Isolation replay from memory (PipelinePair::hold_reference): the comparator keeps the reference's
// checkpoints as its dump would present them, and the engine runs again on them, each checkpoint
// compared as it is recorded: no dump is read back. With a CUDA engine the replay runs beside the
// pipeline on a second engine (one more thread per pair, as the reference's steps arrive:
// replay_beside), else after it (add_isolation_held). The job holds them when the reference's
// planned dump is small enough (cmd_main.cpp), else it replays from the reference's dump file as
// `compare --isolated` would.
//
// Errors in any thread stop every thread; the first is rethrown by run_pipeline.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cli/diff_report.hpp"
#include "cli/progress.hpp"
#include "cli/run.hpp"
#include "diff/compare.hpp"
#include "diff/stream.hpp"
#include "dump/dump.hpp"
#include "model/config.hpp"
#include "model/gguf.hpp"

namespace diffrun::cli {

enum class DumpMode { full, divergence, none };
// "full", "divergence", "none"; InputError otherwise.
DumpMode parse_dump_mode(const std::string& s);
// What a report names a dump the mode did not write: "not written (--dump none)".
std::string not_written(DumpMode mode);

// One engine/reference pair of the job.
struct PipelinePair {
  std::string title;
  BackendOptions engine, reference;
  std::string engine_path, reference_path;        // the dumps (not written with --dump none)
  std::string replay_path;  // non-empty: the reference's full dump is also written here, whatever --dump
                            // says (the isolation replay reads it)
  int engine_threads = 1, reference_threads = 1;  // OpenMP threads of a cpu backend
  bool keep_engine = false;  // hand the engine back when the pair is done (the isolation replay reuses it)
  bool hold_reference = false;  // keep the reference's checkpoints in memory (HeldReference) for the replay
  // With hold_reference: run the isolation replay beside the pipeline, on a second engine (loaded at
  // the start when every engine of the run fits the device's free memory twice over, else once every
  // pair's engine has done its prefill) fed each held step once its comparator has taken the
  // reference's side of it; the comparison comes back with the local errors attached
  // (Comparison::isolated_path set). Where the second engine cannot be loaded (device memory),
  // nothing is attached and the caller replays after the pipeline (add_isolation_held).
  bool replay_beside = false;
  std::string isolated_path;  // where the isolated dump is written (empty: not written)
};

// A reference's run as its dump would present it (DumpReader's DatasetInfo, the values as stored),
// every step, kept by the pipeline's comparator for the isolation replay.
struct HeldReference {
  struct Tensor {
    DatasetInfo info;
    diff::StreamComparison::Values values;  // shared with the comparison and the dump writes
  };
  struct Step {
    std::vector<int32_t> tokens;
    std::vector<Tensor> tensors;  // in recording order
    bool complete = false;        // every tensor of the step is in (set under the pipeline's lock)
  };
  DumpMeta meta;
  std::deque<Step> steps;  // a deque: a step stays where it is while later ones are added
  std::vector<int32_t> argmax;  // the reference's greedy choice after each step
};

struct PipelineOptions {
  int steps = 8;
  DumpMode dump = DumpMode::full;
  int stop_at_first = -1;  // >= 0: end the run this many steps after the first divergence
  CheckpointFilter filter;
  DumpWriterOptions writer;
  std::string prompt;  // the prompt text dumps record
  std::string run_id;
  ReportOptions report;  // tolerances, --force, --jump-factor, --require-coverage
  // Each CUDA engine runs the steps once more unrecorded after its last step, and its logits must equal
  // the recorded run's bit for bit (Comparison::recording); off: --no-recording-check.
  bool recording_check = true;
  // The tokens of the decode steps, fed from the start (feed[s] is step s + 1's): every backend is fed them,
  // and the first pair's reference chooses greedily only the steps beyond them. A run again of a pair (the
  // routing follow-up, cli/cmd_main.cpp) is fed the first run's tokens. Empty: chosen as the run goes.
  std::vector<int32_t> feed;
};

// The recording check: `engine` reset and run again on the prompt and the fed tokens with nothing
// recorded; its logits of each step against `recorded` (the recorded run's, step 0 first), bit for
// bit. Resets the engine at the end.
diff::RecordingCheck check_recording_on_engine(Backend& engine, std::span<const int32_t> prompt,
                                               std::span<const int32_t> fed,
                                               const std::vector<std::vector<float>>& recorded);

// Cores this process may run on (its CPU affinity), at least 1.
int available_cores();

// Runs every pair on the prompt `ids` and returns one comparison per pair (dump paths as given, or
// "not written (--dump none)"). Throws what a backend, a writer or the comparison throws. With `kept`,
// (*kept)[p] receives the engine of each pair p whose keep_engine is set (loaded once for the run).
// With `held`, (*held)[p] receives the reference's checkpoints of each pair p whose hold_reference is set.
std::vector<diff::Comparison> run_pipeline(const GgufFile& file, const ModelConfig& cfg,
                                           const std::vector<PipelinePair>& pairs, const std::vector<int32_t>& ids,
                                           const PipelineOptions& opt, Progress& progress,
                                           std::vector<std::unique_ptr<Backend>>* kept = nullptr,
                                           std::vector<HeldReference>* held = nullptr);

// The tokens a run fed: the first pair's reference's greedy choice after each step (its comparison's StepTokens).
std::vector<int32_t> fed_tokens(const diff::Comparison& first);

// A routing flip by drift is no bug: a near tie of the router that the two programs' rounding tipped either way. But
// from it on, the two sides run other experts on that token, and what comes after differs by far more than any
// tolerance: every layer after it, and later steps through the cache. So where a pair diverged and drift flips came
// at or before its first divergence, the pair runs again (engine and reference, on the same tokens) with its CPU
// reference taking the engine's experts at those (step, layer, token)s (ForcedRouting), and that run's comparison
// replaces the first: the flips themselves were judged in the first run (RoutingSummary::followed keeps them), and
// everything after them now compares the same experts' outputs, so a bug after a flip is still found. The run again
// may show new drift flips (the reference's inputs changed after the followed ones): up to kMaxRoutingFollowUps runs.
// Only pairs with a CPU reference; the comparison of each pair run again replaces comparisons[p], its engine and held
// reference (*kept)[p] and (*held)[p] where given. `fed`: the tokens the first run fed (PipelineOptions::feed).
void follow_routing_drift(const GgufFile& file, const ModelConfig& cfg, const std::vector<PipelinePair>& pairs,
                          const std::vector<int32_t>& ids, const std::vector<int32_t>& fed, const PipelineOptions& opt,
                          std::vector<diff::Comparison>& comparisons, Progress& progress,
                          std::vector<std::unique_ptr<Backend>>* kept = nullptr,
                          std::vector<HeldReference>* held = nullptr);

// The isolation replay of `engine` (reset first) on a held reference, attached to `c` as
// add_isolation_for attaches a replay's dump: the engine fed the reference's tokens, each checkpoint
// recorded and then replaced by the reference's (ReplaySink's rules: a checkpoint the reference
// lacks, or holds only the last rows of, is not replaced), compared on arrival as compare_dumps would
// compare the isolated dump with the reference's. Writes the isolated dump at pair.isolated_path
// unless it is empty; the report names pair.isolated_path and pair.reference_path, or "not written".
// Consumes the held values.
void add_isolation_held(diff::Comparison& c, const GgufFile& file, const ModelConfig& cfg, Backend& engine,
                        HeldReference& reference, const PipelinePair& pair, const std::vector<int32_t>& ids,
                        const PipelineOptions& opt, Progress& progress);

}  // namespace diffrun::cli
