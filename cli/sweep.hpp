// `diffrun sweep`: many prompts, the logits of every generated token compared, the worst prompts drilled down.
//
// A sweep runs each prompt of a corpus through the pair's reference (greedy, N steps) and its engine
// (teacher-forced on the reference's tokens), recording nothing but the last logits row of each step,
// and measures per token: KL(reference || engine), top-1 agreement, top-5 overlap, the largest
// |Δlogit|, and whether the pair's result_output rule passes (a "bad" token). Over the corpus: mean,
// median, p99 and max KL, and the agreement rate (llama-perplexity's KL statistics). The worst K
// prompts are then run again with every checkpoint, up to their first bad token plus a margin, and
// each gets the first divergence and verdict of the main job; drill-downs that land on the same
// checkpoint are one problem. --minimize shrinks the first problem's prompt to the shortest token
// prefix and the fewest steps that still fail at that checkpoint.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "diff/compare.hpp"

namespace diffrun::cli {

// One prompt of a corpus file. A text line is a prompt; a line starting with '{' is a JSON object
// {"prompt": str | "tokens": [int], "chat": bool, "steps": int, "id": str}; blank lines and lines
// starting with '#' are skipped.
struct SweepPrompt {
  int line = 0;             // in the file, 1-based
  std::string id;           // "line N" unless the object names one
  std::string text;         // the prompt text (empty with tokens)
  std::vector<int32_t> tokens;  // explicit ids (empty with text)
  std::optional<bool> chat;     // the object's "chat"; absent: --chat
  int steps = -1;               // the object's "steps"; -1: --steps
};

// Reads a corpus. Throws InputError naming the file and line: unreadable, not UTF-8 text, a bad JSON
// object, an unknown key, no prompt in it, or no prompt at all.
std::vector<SweepPrompt> load_sweep_prompts(const std::string& path);
// The same from text; `source` names it in errors.
std::vector<SweepPrompt> parse_sweep_prompts(const std::string& text, const std::string& source);

// The default corpus (fixtures/sweep/prompts.jsonl, compiled in) and the name reports give it.
const char* sweep_default_corpus();
inline constexpr const char* kSweepDefaultCorpusName = "fixtures/sweep/prompts.jsonl (built in)";

// One generated position: the step's last logits row, engine against reference.
struct TokenStat {
  int step = 0;
  int32_t reference = -1, engine = -1;  // each side's argmax
  double kl = 0;                        // KL(reference || engine), nats
  double top5 = 1;                      // |top5 ∩ top5| / 5
  double max_abs = 0;                   // largest |Δlogit|
  double rel_l2 = 0;                    // ||engine − reference|| / ||reference|| of the row
  bool bad = false;                     // the result_output rule failed
  std::string why;                      // bad: the first failed bound ("rel_l2 5.1e-03 > max_rel_l2 4.4e-03")
};

// Where a drill-down found the first divergence.
struct DrillResult {
  bool ran = false;
  int steps = 0;                        // decode steps it ran
  std::string checkpoint;               // "" when nothing diverged with every checkpoint recorded
  int step = -1;
  std::string verdict, rule, explanation;
  // Mixtures of experts: routing flips by drift the drill-down followed (follow_routing_drift). A drill-down that
  // followed some and then found nothing explains the prompt's bad tokens up to its steps: routing drift, no failure.
  int routing_followed = 0;
  bool explains_bad_tokens() const { return ran && checkpoint.empty() && routing_followed > 0; }
};

// One invariance check of the engine against itself (--check chunked-prefill): the last logits row of
// two ways to the same position.
struct InvarianceCheck {
  double rel_l2 = 0, kl = 0;
  bool pass = true;
};

struct PromptResult {
  SweepPrompt prompt;
  std::vector<int32_t> ids;  // the prompt's token ids
  int steps = 0;
  std::vector<TokenStat> tokens;
  std::optional<DrillResult> drill;
  // --check chunked-prefill: the prefill in chunks against the whole prefill, and the last decode step
  // against a prefill of the prompt and the tokens fed (absent: not checked).
  std::optional<InvarianceCheck> chunked, reprefill;
  double max_kl() const;
  int first_bad() const;  // the first bad token's step, -1 when none
  // Whether the drill-down explains token t's badness (DrillResult::explains_bad_tokens, t within its steps).
  bool explained(const TokenStat& t) const { return drill && drill->explains_bad_tokens() && t.step <= drill->steps; }
};

struct SweepSummary {
  int prompts = 0, tokens = 0, bad_tokens = 0, bad_prompts = 0;
  // Of the bad ones: those a drill-down explained as routing flips by drift (DrillResult::explains_bad_tokens), which
  // fail nothing. A prompt is explained when all its bad tokens are.
  int explained_tokens = 0, explained_prompts = 0;
  int failing_tokens() const { return bad_tokens - explained_tokens; }
  int failing_prompts() const { return bad_prompts - explained_prompts; }
  double kl_mean = 0, kl_median = 0, kl_p99 = 0, kl_max = 0;
  double top1 = 1, top5 = 1;  // agreement rate, mean top-5 overlap
};
SweepSummary summarize(const std::vector<PromptResult>& results);

// Drill-downs that found the same first-divergence checkpoint, as one problem.
struct SweepProblem {
  std::string checkpoint;      // "" for the drill-downs that found nothing
  std::vector<size_t> prompts;  // indices into the results
};
std::vector<SweepProblem> group_problems(const std::vector<PromptResult>& results);

// The worst `k` prompts to drill into: by first bad token (any before none), then max KL.
std::vector<size_t> worst_prompts(const std::vector<PromptResult>& results, int k);

struct SweepReport {
  std::string model, pair, corpus;
  bool complete = true;  // false: the sweep stopped before its last prompt (a signal or an error)
  int planned = 0;       // prompts in the corpus
  std::string minimized;  // `diffrun --tokens ...` re-running the minimal failing case, or ""
  std::vector<std::string> skipped;  // prompts longer than the model's context: "id (N prompt tokens plus S steps)"
  int chunk = 0;             // --check chunked-prefill's chunk length (0: not checked)
  double invariance_bound = 0;  // the largest rel L2 either invariance check passes with
  std::vector<PromptResult> results;
};

std::string render_sweep_terminal(const SweepReport& r);
std::string render_sweep_json(const SweepReport& r);
std::string render_sweep_junit(const SweepReport& r);

}  // namespace diffrun::cli
