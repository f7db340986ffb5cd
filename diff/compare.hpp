// The comparator: every checkpoint of two dumps in execution order, and the first divergence.
//
// Decisions:
// - Side a is the engine, side b the reference; the reference's recorded order leads, and a
//   checkpoint only the engine recorded is placed by its own `order`.
// - Integer datasets (`tokens`) are not compared numerically: the engine is teacher-forced with
//   the reference's tokens, so they must be equal, like the model fingerprint, the prompt ids and
//   the config. Any difference there refuses the comparison (InputError, exit 2) unless `force`,
//   in which case it becomes a warning.
// - A float checkpoint present in one dump only is reported with status only_engine /
//   only_reference. It is a warning, not a failure: a writer may record a subset (a filter, a
//   foreign engine). It never becomes the first divergence.
// - A checkpoint whose shapes differ (with identical configs and tokens) is a failure with status
//   shape_mismatch: an engine that, say, keeps one cache row instead of S shows up here.
// - A NaN or Inf on either side fails the checkpoint, also when both sides hold the same one (a NaN
//   in a weight row reaches the reference too); the first such checkpoint is kept apart
//   (first_nonfinite) so a report names it even when an earlier finite failure leads.
// - Coverage: the reference's float checkpoints that the engine also recorded (compared, or failed
//   on shape) over all of the reference's float checkpoints. With require_coverage > 0 a coverage
//   below it fails the comparison (exit 1), so a dump that records only a few checkpoints is no
//   false green; the reports name the kinds that are missing.
// - No float checkpoint in common is a DumpError.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "checkpoints/vocabulary.hpp"
#include "diff/metrics.hpp"
#include "diff/pattern.hpp"
#include "diff/result.hpp"
#include "diff/routing.hpp"
#include "diff/tolerances.hpp"
#include "diff/verdict.hpp"
#include "dump/dump.hpp"

namespace diffrun::diff {

// Token agreement of one step: the token the reference chose next vs the engine's argmax.
struct StepTokens {
  int step = 0;
  int32_t reference = -1;  // -1 when unknown
  int32_t engine = -1;
  bool match() const { return reference >= 0 && reference == engine; }
};

struct CompareOptions {
  bool force = false;        // compare dumps of different models, tokens or configs anyway
  double jump_factor = 10.0; // verdict: "local" when the error jumps by more than this over its inputs
  int preceding = 4;         // passing checkpoints shown before the first divergence
  double require_coverage = 0;  // percent of the reference's float checkpoints that must be compared
  // `compare --steps/--checkpoints`: only these steps (empty: all) and the checkpoints matching the
  // filter; coverage counts the selected ones.
  std::vector<int> steps;
  CheckpointFilter checkpoints;
  // add_isolation: the isolated comparison used bounds calibrated for local errors (a `<pair>_local`
  // preset), so a checkpoint whose local error fails them fails the comparison, however small its
  // propagated error.
  bool judge_local = false;
};

struct Coverage {
  int reference = 0;  // float checkpoints in the reference dump (all steps)
  int compared = 0;   // of those, present in the engine dump too
  std::vector<std::string> missing_kinds;  // vocabulary bases of the reference's checkpoints not compared
  // Steps the reference holds (of those compared) that the engine dump lacks altogether: always a
  // failure, whatever `required` (a dump without step_0000 is no pass).
  std::vector<int> missing_steps;
  double required = 0;  // percent; 0: no requirement
  double percent() const { return reference ? 100.0 * compared / reference : 100.0; }
  bool met() const { return missing_steps.empty() && percent() + 1e-9 >= required; }
};

// Whether recording changed the engine's result: its per-step logits in the recorded run against
// an unrecorded run of the same tokens, bit for bit (the top-level job runs it on the CUDA engine;
// `compare --unrecorded` on any engine's two dumps).
struct RecordingCheck {
  int steps = 0;           // steps compared
  bool same = true;
  int step = -1;           // the first step that differs
  int64_t index = -1;      // its first logit that differs
  float recorded = 0.0f, unrecorded = 0.0f;
  std::string unrecorded_source;  // "an unrecorded run of the same tokens", or the dump compared
};

struct Comparison {
  std::string engine_path, reference_path;
  DumpMeta engine_meta, reference_meta;
  std::string tolerance_source, tolerance_preset;
  std::vector<std::string> warnings;  // refusals overridden by --force; local errors add_isolation left out
  std::vector<CheckpointResult> results;  // step 0 first, then execution order
  std::optional<size_t> first_failure;    // index into results
  std::vector<size_t> preceding;          // indices of the passing checkpoints just before it
  Verdict verdict;
  // The first checkpoint (step order, then execution order) holding a NaN or Inf on either side,
  // the same on both included; it always fails, so it is the first failure or comes after it.
  std::optional<size_t> first_nonfinite;  // index into results
  Verdict nonfinite_verdict;              // decided at first_nonfinite (rule nonfinite)
  // Where the error sits (diff/pattern.hpp) at the first failure and at the first NaN/Inf; absent
  // for a shape mismatch.
  std::optional<ErrorPattern> pattern, nonfinite_pattern;
  std::vector<StepTokens> tokens;
  // Mixtures of experts: every compared ffn_moe_topk's flips, their margins and router errors
  // (diff/routing.hpp); empty for a dense model.
  RoutingSummary routing;
  int n_pass = 0, n_fail = 0, n_one_sided = 0;
  Coverage coverage;
  std::string isolated_path;  // the isolation-replay dump, when add_isolation ran
  std::optional<RecordingCheck> recording;  // when the recording check ran
  // The engine's StepPath per step (root attributes step_fused and step_graph; empty: not known).
  // add_isolation gives no local error to a checkpoint that the engine's step computed in a fused kernel
  // the isolation replay's step did not run, or in a graph replay where the isolation replay launched
  // the kernels one by one, when the engine's fact fused_kernel_checkpoints names it for that kernel or
  // for "graph": the replay measured another program there.
  std::vector<int32_t> step_fused, step_graph;

  bool diverged() const { return first_failure.has_value(); }
  bool recording_changed() const { return recording && !recording->same; }
  bool failed() const { return diverged() || !coverage.met() || recording_changed(); }
};

// One step of a recording check: counts the step and, at the first logit whose bits differ (or a
// length mismatch), marks `check` changed there and returns true.
bool add_recording_step(RecordingCheck& check, int step, std::span<const float> recorded,
                        std::span<const float> unrecorded);

// The recording check of two dumps of one engine (`compare --unrecorded`): `recorded`'s last row of
// result_output at each step against `unrecorded`'s (a run of the engine's production path that
// recorded the logits alone), bit for bit. Throws InputError naming the file and step where either
// lacks result_output, or `unrecorded` lacks a step.
RecordingCheck check_recording_dumps(const DumpReader& recorded, const DumpReader& unrecorded);

// Sizes of the layout letters for a config (D, H, Hkv, Dh, F, V).
DimSizes dim_sizes(const ModelConfig& cfg);

// Throws InputError when the dumps cannot be compared (and !opt.force), DumpError when they
// share no checkpoint or a dataset cannot be read.
Comparison compare_dumps(const DumpReader& engine, const DumpReader& reference, const ToleranceSet& tolerances,
                         const CompareOptions& opt = {});

// The building blocks of compare_dumps, shared with the streaming comparison (diff/stream.hpp) so
// that both judge a checkpoint by the same code.

// Reasons two dumps (by their root attributes) are not runs of the same model on the same tokens.
std::vector<std::string> incompatibilities(const DumpMeta& engine, const DumpMeta& reference);

// Fills a (engine) and b (reference) with a checkpoint's values as stored.
using ReadValues = std::function<void(std::vector<float>& a, std::vector<float>& b)>;

// One checkpoint of one step (either side may be null: only_engine / only_reference). `read` is
// called only when both sides hold it with the same shape. a_out/b_out (optional) receive the values
// compared (the rows both sides hold). `positions`: the KV length after the step (the sum of the
// token counts of the steps up to it), for rules whose bounds grow with it (rel_l2_per_position).
CheckpointResult compare_checkpoint(int step, const DatasetInfo* engine, const DatasetInfo* reference,
                                    const ToleranceSet& tolerances, const DimSizes& dims, int64_t positions,
                                    const ReadValues& read,
                                    std::vector<float>* a_out = nullptr, std::vector<float>* b_out = nullptr);

// The values a comparison of values in memory compared: the rows both sides hold, each a view into the
// values given, or where the rows left out are not the leading ones (a row dimension after the first), into
// a copy held here.
struct ComparedValues {
  std::span<const float> a, b;
  std::vector<float> a_cut, b_cut;
};

// The same on values already in memory (a and b as stored), read where they are: nothing is copied unless
// rows must be left out behind the first dimension. `compared` (optional) receives the values compared.
CheckpointResult compare_checkpoint(int step, const DatasetInfo* engine, const DatasetInfo* reference,
                                    const ToleranceSet& tolerances, const DimSizes& dims, int64_t positions,
                                    std::span<const float> a, std::span<const float> b,
                                    ComparedValues* compared = nullptr);

// Appends one step's results to c in the comparator's order (the reference's datasets by order,
// engine-only ones placed by their own order), counting coverage, passes, failures and one-sided
// checkpoints; `result` gives each checkpoint's result. A checkpoint failing only in the slots of a
// routing flip by drift passes (excuse_routing_flip, diff/routing.hpp; the step's results are its evidence).
void add_step_results(Comparison& c, const std::vector<DatasetInfo>& engine, const std::vector<DatasetInfo>& reference,
                      const std::function<CheckpointResult(const DatasetInfo* engine, const DatasetInfo* reference)>& result,
                      const ToleranceSet& tolerances);

// After the last step: the first failure and the first NaN/Inf with their verdicts and error
// patterns (`values` gives the compared values of results[index]), the passing checkpoints before
// the first failure, and token agreement per reference step (each side's argmax per step, else the
// last row of result_output).
void finish_comparison(Comparison& c, const ToleranceSet& tolerances, const CompareOptions& opt,
                       const std::function<void(size_t index, std::vector<float>& a, std::vector<float>& b)>& values,
                       std::span<const int> reference_steps, std::span<const int32_t> engine_argmax,
                       std::span<const int32_t> reference_argmax);

// Isolation replay: `isolated` compares the engine's isolation-replay dump (each op run on the
// reference's inputs) with the same reference. Attaches each checkpoint's local error to the
// matching result of `c` (same step and name), where the replay could replace every input of its op
// (each dataflow input held whole by the reference at that step, judged among the checkpoints
// opt.checkpoints selects; else the isolated error spans several ops, and a warning counts the
// checkpoints left without one), and, when `c` diverged, decides its verdict again
// with that evidence (rule isolation). With opt.judge_local, a checkpoint that fails in `isolated`
// fails in `c` too (its failed local bounds are added to its checks as "local <metric>"), and the
// first divergence, its pattern (from the isolated dump when only the local error fails) and the
// verdict are decided again: this is how a one-row or one-head error deep in the model is caught
// where the accumulated rounding of an f16 engine hides it (DESIGN.md, Precision).
void add_isolation(Comparison& c, const Comparison& isolated, const CompareOptions& opt = {});

}  // namespace diffrun::diff
