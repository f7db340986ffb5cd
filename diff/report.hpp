// Reports of a Comparison: terminal text, JSON (schema in report_json.cpp), JUnit XML. Each returns text.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "diff/compare.hpp"

namespace diffrun::diff {

struct TerminalOptions {
  bool color = false;  // ANSI colours (the CLI sets this on a TTY unless --no-color / NO_COLOR)
  // Token id -> text for the token table; empty: ids only.
  std::function<std::string(int32_t)> token_text;
  std::string title = "diffrun compare";  // the first line: the command that made the report
  bool full = false;     // every kind in the layer table, also after a divergence
  bool explain = false;  // the tolerance's calibration note and "to pass" also for a local verdict
};

// Width the terminal report keeps to: render_terminal wraps longer lines at spaces.
inline constexpr int kTerminalWidth = 100;

// Leads with the first divergence, then the per-layer error table, then token agreement; lines
// within kTerminalWidth columns.
std::string render_terminal(const Comparison& c, const TerminalOptions& opt = {});

// One line for scripts: "PASS ..." or "DIVERGED at NAME (step S, layer L) ...", newline-terminated.
std::string render_summary(const Comparison& c);

// Everything machine-readable (report_json.cpp documents the schema).
nlohmann::ordered_json report_json(const Comparison& c);
std::string render_json(const Comparison& c);

// One <testsuite> per step, one <testcase> per checkpoint: the first divergence (and an independent
// first NaN/Inf) fail; the checkpoints failing downstream of it are skipped as its consequences.
std::string render_junit(const Comparison& c);
// Several comparisons in one document (the top-level job's pairs): each one's suites named
// "TITLE: step_NNNN", the document's counts their sums.
std::string render_junit(const std::vector<std::pair<std::string, const Comparison*>>& titled);

// The reports of a run that could not be done (exit 2: bad input, a missing file, no GPU), so CI
// shows why: JSON {"report_version", "exit_code": 2, "title", "error"}; JUnit one test case of
// suite `title` with an <error> carrying the message.
std::string render_json_error(const std::string& title, const std::string& error);
std::string render_junit_error(const std::string& title, const std::string& error);

// ▁▂▃▄▅▆▇█ over log10 of the values between lo (▁) and hi (█), both > 0; by default the
// smallest and largest positive finite value. '·' for an exact zero, '!' for inf, ' ' for NaN (absent).
std::string sparkline(std::span<const double> values, double lo = 0, double hi = 0);

// Exit code of a finished comparison: 0 all within tolerance, 1 divergence found or coverage
// below the required.
inline int exit_code(const Comparison& c) { return c.failed() ? 1 : 0; }

}  // namespace diffrun::diff
