// The JUnit XML report: one <testsuite> per step, one <testcase> per checkpoint; the first divergence fails, its consequences are one skipped case per step.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "diff/pattern.hpp"
#include "diff/report.hpp"
#include "model/error.hpp"

namespace diffrun::diff {
namespace {

// Escapes text for XML attributes (line breaks as character references) or character data;
// drops the control characters XML 1.0 cannot carry and replaces bytes that are not valid UTF-8
// (a prompt may hold any bytes) and U+FFFE/U+FFFF by U+FFFD, so the file always parses.
std::string xml_escape(std::string_view in, bool attribute = true) {
  std::string out;
  out.reserve(in.size());
  for (size_t i = 0; i < in.size();) {
    const size_t n = utf8_sequence_length(in, i);
    if (n != 1) {
      const bool nonchar = n == 3 && in.substr(i, 2) == "\xef\xbf" && static_cast<unsigned char>(in[i + 2]) >= 0xbe;
      out += n == 0 || nonchar ? std::string_view("\xef\xbf\xbd") : in.substr(i, n);
      i += n == 0 ? 1 : n;
      continue;
    }
    const char ch = in[i++];
    switch (ch) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      case '\n': out += attribute ? "&#10;" : "\n"; break;
      case '\t': out += "&#9;"; break;
      case '\r': out += "&#13;"; break;
      default:
        if (static_cast<unsigned char>(ch) >= 0x20) out += ch;
    }
  }
  return out;
}

std::string num(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  return fmt::format("{:.6g}", x);
}

std::string step_name(int step) { return fmt::format("step_{:04d}", step); }

std::string where(const CheckpointResult& r) {
  return r.layer >= 0 ? fmt::format("step {}, layer {}", r.step, r.layer) : fmt::format("step {}", r.step);
}

std::string failure_message(const CheckpointResult& r) {
  if (r.status == CheckpointStatus::shape_mismatch) {
    return fmt::format("shape mismatch: engine [{}] vs reference [{}]", fmt::join(r.shape_engine, ", "),
                       fmt::join(r.shape_reference, ", "));
  }
  std::vector<std::string> parts;
  for (const auto& k : r.checks) {
    if (k.pass) continue;
    if (k.metric == "nonfinite") {
      const TensorMetrics& m = *r.metrics;
      auto first = [](const NonFiniteSite& site) {
        return site.flat < 0 ? std::string() : fmt::format(", first {} at {}", num(site.value), format_coordinates(site.coords));
      };
      parts.push_back(fmt::format("NaN/Inf: engine NaN {} Inf {}{}; reference NaN {} Inf {}{}", m.nan_a, m.inf_a,
                                  first(m.first_nonfinite_a), m.nan_b, m.inf_b, first(m.first_nonfinite_b)));
    } else {
      parts.push_back(fmt::format("{} {} {} {}", k.metric, num(k.value), k.bound, num(k.limit)));
    }
  }
  return fmt::format("{}", fmt::join(parts, "; "));
}

std::string failure_body(const CheckpointResult& r) {
  if (!r.metrics) return failure_message(r);
  const TensorMetrics& m = *r.metrics;
  std::string body = fmt::format(
      "rule: {} ({})\nrel_l2 {}\nmax_abs {}\nmean_abs {}\nnmse {}\ncosine {}\nsqnr_db {}\nfail_frac {} (atol {}, rtol {})\n"
      "nan/inf engine {}/{} reference {}/{}\nmin_atol {}\nmin_rtol {}\n",
      r.rule_match.empty() ? "default" : r.rule_match, r.rule_reason, num(m.rel_l2), num(m.max_abs), num(m.mean_abs),
      num(m.nmse), num(m.cosine), num(m.sqnr_db), num(m.fail_frac), num(m.tolerance.atol), num(m.tolerance.rtol),
      m.nan_a, m.inf_a, m.nan_b, m.inf_b, num(m.min_atol), num(m.min_rtol));
  if (m.worst.flat >= 0) {
    body += fmt::format("worst {} [{}]: engine {:.9g} reference {:.9g}\n", format_coordinates(m.worst.coords), r.layout,
                        m.worst.a, m.worst.b);
  }
  if (m.logits) {
    body += fmt::format("top1 {} top5_overlap {} kl_max {}\n", num(m.logits->top1), num(m.logits->top5_overlap),
                        num(m.logits->kl_max));
  }
  return body;
}

// The failing checkpoints of one step as kinds with their layers, the kinds in the order they first
// appear among all of the step's checkpoints (`step`): "Qrope 0-29, Krope 0-29, result_norm".
std::string kinds_and_layers(const std::vector<const CheckpointResult*>& failing,
                             const std::vector<const CheckpointResult*>& step) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> kinds;
  for (const auto* r : step) {
    if (std::none_of(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == r->base; }))
      kinds.push_back({r->base, {}});
  }
  for (const auto* r : failing) {
    auto it = std::find_if(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == r->base; });
    if (it == kinds.end()) it = kinds.insert(kinds.end(), {r->base, {}});
    if (r->layer >= 0) it->second.push_back(r->layer);
  }
  std::vector<std::string> parts;
  for (auto& [base, layers] : kinds) {
    const std::string& kind = base;  // a lambda may not capture a structured binding before C++20's rule (clang 14)
    if (layers.empty() && std::none_of(failing.begin(), failing.end(), [&](const auto* r) { return r->base == kind; }))
      continue;
    std::sort(layers.begin(), layers.end());
    parts.push_back(layers.empty() ? base : fmt::format("{} {}", base, format_ranges(layers)));
  }
  return fmt::format("{}", fmt::join(parts, ", "));
}

std::string pattern_text(const std::optional<ErrorPattern>& p) {
  if (!p || (p->summary.empty() && p->hint.empty())) return "";
  return fmt::format("pattern: {}{}{}\n", p->summary, p->summary.empty() || p->hint.empty() ? "" : " -> ", p->hint);
}

}  // namespace

// A failing checkpoint is its own failure when it is the first divergence, or the first NaN/Inf
// whose verdict is local (non-finite values appear there from finite inputs). Every other failure
// comes after the first divergence in execution order and is its consequence: each step's
// consequences are one skipped test case ("consequences of NAME (step S)", listing their kinds and
// layers), so a CI page shows one red line per independent problem and the XML stays small
// (every checkpoint is in the JSON report).
namespace {

// One comparison's <testsuite> elements, each suite's name led by `prefix`, and their counts.
struct JunitSuites {
  std::string xml;
  int total = 0, failures = 0, skipped = 0;
};

JunitSuites junit_suites(const Comparison& c, const std::string& prefix) {
  const CheckpointResult* first = c.first_failure ? &c.results[*c.first_failure] : nullptr;
  const CheckpointResult* first_nf = c.first_nonfinite ? &c.results[*c.first_nonfinite] : nullptr;
  const bool nf_independent = first_nf && first_nf != first && c.nonfinite_verdict.kind == VerdictKind::local;
  const auto own_failure = [&](const CheckpointResult* r) { return r == first || (nf_independent && r == first_nf); };
  const std::string cause = first ? fmt::format("{} (step {})", first->name, first->step) : std::string();

  std::map<int, std::vector<const CheckpointResult*>> by_step;
  for (const auto& r : c.results) by_step[r.step].push_back(&r);
  int total = 0, failures = 0, skipped = 0, downstream = 0;
  std::set<int> steps_with_consequences;
  for (const auto& r : c.results) {
    ++total;
    if (own_failure(&r)) ++failures;
    else if (r.failed()) ++downstream, steps_with_consequences.insert(r.step);
    if (!r.failed() && !r.compared()) ++skipped;
  }
  // Each step's consequences are one case instead of one each.
  total += static_cast<int>(steps_with_consequences.size()) - downstream;
  skipped += static_cast<int>(steps_with_consequences.size());
  // Coverage is a property; with a requirement (--require-coverage) also one more test case, in a
  // suite of its own, failed when below it.
  const Coverage& cov = c.coverage;
  const std::string cov_text = fmt::format("{} of the reference's {} float checkpoints compared ({:.1f}%{}){}",
                                           cov.compared, cov.reference, cov.percent(),
                                           cov.required > 0 ? fmt::format(", {:g}% required", cov.required) : "",
                                           cov.missing_kinds.empty() ? "" : fmt::format("; missing: {}", fmt::join(cov.missing_kinds, ", "))) +
                               (cov.missing_steps.empty() ? "" : fmt::format("; the engine dump lacks steps {}", fmt::join(cov.missing_steps, ", ")));
  const bool cov_case = cov.required > 0 || !cov.missing_steps.empty();
  if (cov_case) ++total;
  if (!cov.met()) ++failures;
  std::string out;
  if (cov_case) {
    out += fmt::format("  <testsuite name=\"{}coverage\" tests=\"1\" failures=\"{}\" errors=\"0\" skipped=\"0\">\n",
                       xml_escape(prefix), cov.met() ? 0 : 1);
    out += "    <testcase classname=\"coverage\" name=\"coverage\" time=\"0\"";
    out += cov.met() ? fmt::format(">\n      <system-out>{}</system-out>\n    </testcase>\n", xml_escape(cov_text, false))
                     : fmt::format(">\n      <failure type=\"coverage\" message=\"{}\"/>\n    </testcase>\n",
                                   xml_escape(cov_text));
    out += "  </testsuite>\n";
  }
  for (const auto& [step, results] : by_step) {
    int f = 0, s = 0, n = 0;
    std::vector<const CheckpointResult*> consequences;
    for (const auto* r : results) {
      if (own_failure(r)) ++f, ++n;
      else if (r->failed()) consequences.push_back(r);
      else if (!r->compared()) ++s, ++n;
      else ++n;
    }
    if (!consequences.empty()) ++s, ++n;
    out += fmt::format("  <testsuite name=\"{}{}\" tests=\"{}\" failures=\"{}\" errors=\"0\" skipped=\"{}\">\n",
                       xml_escape(prefix), step_name(step), n, f, s);
    if (step == by_step.begin()->first) {
      out += "    <properties>\n";
      auto prop = [&](const char* name, const std::string& value) {
        out += fmt::format("      <property name=\"{}\" value=\"{}\"/>\n", name, xml_escape(value));
      };
      prop("engine", fmt::format("{}/{} {}", c.engine_meta.backend, c.engine_meta.precision, c.engine_path));
      prop("reference", fmt::format("{}/{} {}", c.reference_meta.backend, c.reference_meta.precision, c.reference_path));
      prop("model", c.reference_meta.model_path);
      prop("prompt", c.reference_meta.prompt);
      prop("tolerances", c.tolerance_preset.empty() ? c.tolerance_source : c.tolerance_preset);
      prop("coverage", cov_text);
      if (first_nf) prop("first_nonfinite", fmt::format("{} at step {}", first_nf->name, first_nf->step));
      if (first) {
        prop("first_divergence", fmt::format("{} at step {}", first->name, first->step));
        prop("verdict", fmt::format("{} (rule {}): {}", verdict_kind_name(c.verdict.kind), c.verdict.rule,
                                    c.verdict.explanation));
        prop("downstream_failures", std::to_string(downstream));
      }
      out += "    </properties>\n";
    }
    for (const auto* r : results) {
      if (!own_failure(r) && r->failed()) continue;  // a consequence: in the step's one case below
      out += fmt::format("    <testcase classname=\"{}\" name=\"{}\" time=\"0\"", step_name(step), xml_escape(r->name));
      if (own_failure(r)) {
        const bool is_first = r == first;
        const Verdict& v = is_first ? c.verdict : c.nonfinite_verdict;
        std::string lead = fmt::format("{} {} ({}): ", is_first ? "first divergence" : "first NaN/Inf", r->name, where(*r));
        if (is_first && r == first_nf) lead = fmt::format("first divergence and first NaN/Inf {} ({}): ", r->name, where(*r));
        std::string message = lead + failure_message(*r);
        if (r->metrics && r->metrics->worst.flat >= 0) {
          message += fmt::format("; worst {} engine {:.6g} reference {:.6g}", format_coordinates(r->metrics->worst.coords),
                                 r->metrics->worst.a, r->metrics->worst.b);
        }
        const std::optional<ErrorPattern>& p = is_first ? c.pattern : c.nonfinite_pattern;
        if (p && !p->summary.empty()) message += "; pattern " + p->summary;
        if (p && !p->hint.empty()) message += " -> " + p->hint;
        std::string body = failure_body(*r) + pattern_text(p);
        body += fmt::format("verdict {} (rule {}): {}\n", verdict_kind_name(v.kind), v.rule, v.explanation);
        if (is_first && downstream > 0) {
          body += fmt::format("{} checkpoints fail downstream of it (one skipped case per step here; each in the JSON "
                              "report)\n", downstream);
        }
        out += fmt::format(">\n      <failure type=\"{}\" message=\"{}\">{}</failure>\n    </testcase>\n",
                           checkpoint_status_name(r->status), xml_escape(message), xml_escape(body, false));
      } else if (!r->compared()) {
        out += fmt::format("><skipped message=\"recorded by the {} only\"/></testcase>\n",
                           r->status == CheckpointStatus::only_engine ? "engine" : "reference");
      } else {
        out += "/>\n";
      }
    }
    if (!consequences.empty()) {
      out += fmt::format(
          "    <testcase classname=\"{}\" name=\"{}\" time=\"0\">\n      <skipped message=\"{}\">{}</skipped>\n"
          "    </testcase>\n",
          step_name(step), xml_escape("consequences of " + cause),
          xml_escape(fmt::format("{} checkpoint{} of this step fail downstream of {}", consequences.size(),
                                 consequences.size() == 1 ? "" : "s", cause)),
          xml_escape(kinds_and_layers(consequences, results) + "\n", false));
    }
    out += "  </testsuite>\n";
  }
  return {std::move(out), total, failures, skipped};
}

std::string junit_document(const std::vector<JunitSuites>& parts) {
  int total = 0, failures = 0, skipped = 0;
  for (const auto& p : parts) total += p.total, failures += p.failures, skipped += p.skipped;
  std::string out = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  out += fmt::format("<testsuites name=\"diffrun\" tests=\"{}\" failures=\"{}\" errors=\"0\" skipped=\"{}\">\n", total,
                     failures, skipped);
  for (const auto& p : parts) out += p.xml;
  out += "</testsuites>\n";
  return out;
}

}  // namespace

std::string render_junit(const Comparison& c) { return junit_document({junit_suites(c, "")}); }

std::string render_junit(const std::vector<std::pair<std::string, const Comparison*>>& titled) {
  std::vector<JunitSuites> parts;
  for (const auto& [title, c] : titled) parts.push_back(junit_suites(*c, title + ": "));
  return junit_document(parts);
}

std::string render_junit_error(const std::string& title, const std::string& error) {
  std::string out = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  out += fmt::format("<testsuites name=\"diffrun\" tests=\"1\" failures=\"0\" errors=\"1\" skipped=\"0\">\n");
  out += fmt::format("  <testsuite name=\"{}\" tests=\"1\" failures=\"0\" errors=\"1\" skipped=\"0\">\n", xml_escape(title));
  out += fmt::format("    <testcase classname=\"{}\" name=\"run\" time=\"0\">\n", xml_escape(title));
  out += fmt::format("      <error type=\"exit 2\" message=\"{}\">{}</error>\n", xml_escape(error), xml_escape(error, false));
  out += "    </testcase>\n  </testsuite>\n</testsuites>\n";
  return out;
}

}  // namespace diffrun::diff
