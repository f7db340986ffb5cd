// The sweep's corpus reader, its statistics and grouping, and its three reports (see sweep.hpp).
#include "cli/sweep.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "model/error.hpp"
#include "model/file_check.hpp"

namespace diffrun::cli {

namespace {

using json = nlohmann::ordered_json;

bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (int k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    i += n;
  }
  return true;
}

SweepPrompt prompt_of_object(const std::string& path, int line, const std::string& text) {
  const auto fail = [&](const std::string& what) {
    throw InputError(fmt::format("{}:{}: {}", path, line, what));
  };
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail(fmt::format("not a JSON object: {}", e.what()));
  }
  if (!j.is_object()) fail("a line starting with '{' must be one JSON object");
  SweepPrompt p;
  p.line = line;
  for (const auto& [key, v] : j.items()) {
    if (key == "prompt") {
      if (!v.is_string() || v.get<std::string>().empty()) fail("\"prompt\" must be a non-empty string");
      p.text = v.get<std::string>();
    } else if (key == "tokens") {
      if (!v.is_array() || v.empty()) fail("\"tokens\" must be a non-empty array of token ids");
      for (const auto& t : v) {
        if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX)
          fail("\"tokens\" must hold token ids (whole numbers >= 0)");
        p.tokens.push_back(static_cast<int32_t>(t.get<int64_t>()));
      }
    } else if (key == "chat") {
      if (!v.is_boolean()) fail("\"chat\" must be true or false");
      p.chat = v.get<bool>();
    } else if (key == "steps") {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 100000)
        fail("\"steps\" must be a whole number from 0 to 100000");
      p.steps = static_cast<int>(v.get<int64_t>());
    } else if (key == "id") {
      if (!v.is_string()) fail("\"id\" must be a string");
      p.id = v.get<std::string>();
    } else {
      fail(fmt::format("unknown key \"{}\" (known: prompt, tokens, chat, steps, id)", key));
    }
  }
  if (p.text.empty() == p.tokens.empty()) fail("give exactly one of \"prompt\" and \"tokens\"");
  return p;
}

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos)), hi = static_cast<size_t>(std::ceil(pos));
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

// A number for JSON: null when NaN.
json num(double x) { return std::isnan(x) ? json(nullptr) : json(x); }

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\t') out += ' ';
        else out += c;
    }
  }
  return out;
}

std::string short_text(const SweepPrompt& p, size_t width) {
  std::string s = p.text.empty() ? fmt::format("{} token ids", p.tokens.size()) : p.text;
  std::replace(s.begin(), s.end(), '\n', ' ');
  if (s.size() <= width) return s;
  size_t cut = width - 3;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  return s.substr(0, cut) + "...";
}

std::string problem_line(const SweepProblem& g, const std::vector<PromptResult>& results) {
  std::vector<std::string> where;
  for (size_t i : g.prompts) {
    const PromptResult& r = results[i];
    where.push_back(fmt::format("{} (step {})", r.prompt.id, r.drill->step));
  }
  if (where.size() > 6) {
    const size_t more = where.size() - 6;
    where.resize(6);
    where.push_back(fmt::format("and {} more", more));
  }
  const PromptResult& first = results[g.prompts.front()];
  if (g.checkpoint.empty())
    return fmt::format("no divergence with every checkpoint recorded: {} prompt{} ({})", g.prompts.size(),
                       g.prompts.size() == 1 ? "" : "s", fmt::join(where, ", "));
  return fmt::format("{}, verdict {} ({}): {} prompt{}: {}", g.checkpoint, first.drill->verdict, first.drill->rule,
                     g.prompts.size(), g.prompts.size() == 1 ? "" : "s", fmt::join(where, ", "));
}

}  // namespace

std::vector<SweepPrompt> load_sweep_prompts(const std::string& path) {
  if (const std::string why = regular_file_problem(path, uint64_t(64) << 20); !why.empty())
    throw InputError(fmt::format("--prompts {}: {}", path, why));
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) throw InputError(fmt::format("--prompts {}: cannot be read", path));
  return parse_sweep_prompts(text.str(), path);
}

std::vector<SweepPrompt> parse_sweep_prompts(const std::string& text, const std::string& source) {
  std::vector<SweepPrompt> out;
  std::istringstream in(text);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!valid_utf8(line)) throw InputError(fmt::format("{}:{}: not UTF-8 text", source, n));
    const size_t first = line.find_first_not_of(" \t");
    if (first == std::string::npos || line[first] == '#') continue;
    SweepPrompt p;
    if (line[first] == '{') {
      p = prompt_of_object(source, n, line);
    } else {
      p.line = n;
      p.text = line;
    }
    if (p.id.empty()) p.id = fmt::format("line {}", n);
    out.push_back(std::move(p));
  }
  if (out.empty()) throw InputError(fmt::format("{}: no prompt in it (blank lines and # comments only)", source));
  return out;
}

double PromptResult::max_kl() const {
  double m = 0;
  for (const TokenStat& t : tokens) m = std::isnan(t.kl) || std::isnan(m) ? NAN : std::max(m, t.kl);
  return m;
}

int PromptResult::first_bad() const {
  for (const TokenStat& t : tokens)
    if (t.bad) return t.step;
  return -1;
}

SweepSummary summarize(const std::vector<PromptResult>& results) {
  SweepSummary s;
  std::vector<double> kl;
  double top5 = 0;
  int agree = 0;
  for (const PromptResult& r : results) {
    ++s.prompts;
    bool bad = false, unexplained = false;
    for (const TokenStat& t : r.tokens) {
      ++s.tokens;
      kl.push_back(std::isnan(t.kl) ? INFINITY : t.kl);
      top5 += t.top5;
      agree += t.reference == t.engine ? 1 : 0;
      if (!t.bad) continue;
      ++s.bad_tokens, bad = true;
      if (r.explained(t)) ++s.explained_tokens;
      else unexplained = true;
    }
    s.bad_prompts += bad ? 1 : 0;
    s.explained_prompts += bad && !unexplained ? 1 : 0;
  }
  if (!kl.empty()) {
    double sum = 0;
    for (double x : kl) sum += x;
    s.kl_mean = sum / static_cast<double>(kl.size());
    s.kl_median = quantile(kl, 0.5);
    s.kl_p99 = quantile(kl, 0.99);
    s.kl_max = *std::max_element(kl.begin(), kl.end());
    s.top1 = static_cast<double>(agree) / static_cast<double>(kl.size());
    s.top5 = top5 / static_cast<double>(kl.size());
  }
  return s;
}

std::vector<size_t> worst_prompts(const std::vector<PromptResult>& results, int k) {
  std::vector<size_t> order(results.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  const auto key = [&](size_t i) {
    const int fb = results[i].first_bad();
    const double kl = results[i].max_kl();
    return std::make_tuple(fb < 0 ? 1 : 0, std::isnan(kl) ? -INFINITY : -kl, i);
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return key(a) < key(b); });
  order.resize(std::min(order.size(), static_cast<size_t>(std::max(k, 0))));
  return order;
}

std::vector<SweepProblem> group_problems(const std::vector<PromptResult>& results) {
  std::vector<SweepProblem> groups;
  std::map<std::string, size_t> at;
  for (size_t i = 0; i < results.size(); ++i) {
    const std::optional<DrillResult>& d = results[i].drill;
    if (!d || !d->ran) continue;
    auto [it, added] = at.try_emplace(d->checkpoint, groups.size());
    if (added) groups.push_back({d->checkpoint, {}});
    groups[it->second].prompts.push_back(i);
  }
  // Problems first (most prompts first), "nothing found" last.
  std::stable_sort(groups.begin(), groups.end(), [](const SweepProblem& a, const SweepProblem& b) {
    if (a.checkpoint.empty() != b.checkpoint.empty()) return b.checkpoint.empty();
    return a.prompts.size() > b.prompts.size();
  });
  return groups;
}

std::string render_sweep_terminal(const SweepReport& r) {
  const SweepSummary s = summarize(r.results);
  std::string out;
  out += fmt::format("diffrun sweep: {} ({})\n", r.model, r.pair);
  out += fmt::format("corpus    {}: {} of {} prompts{}\n", r.corpus, s.prompts, r.planned,
                     r.complete ? "" : " (INCOMPLETE: the sweep stopped early)");
  if (!r.skipped.empty())
    out += fmt::format("skipped   {} prompt{} longer than the model's context\n", r.skipped.size(),
                       r.skipped.size() == 1 ? "" : "s");
  out += fmt::format("tokens    {} generated positions, {} outside the result_output rule, in {} prompt{}\n", s.tokens,
                     s.bad_tokens, s.bad_prompts, s.bad_prompts == 1 ? "" : "s");
  if (s.explained_tokens > 0)
    out += fmt::format("          of them {} in {} prompt{} explained by routing flips by drift: the drill-down followed "
                       "them and found no divergence (no failure)\n",
                       s.explained_tokens, s.explained_prompts, s.explained_prompts == 1 ? "" : "s");
  out += fmt::format("KL        mean {:.3g}  median {:.3g}  p99 {:.3g}  max {:.3g} (nats, reference || engine)\n",
                     s.kl_mean, s.kl_median, s.kl_p99, s.kl_max);
  out += fmt::format("agreement top-1 {:.2f}%  top-5 overlap {:.2f}%\n", 100 * s.top1, 100 * s.top5);
  std::vector<size_t> order = worst_prompts(r.results, 5);
  if (!order.empty()) {
    out += "worst prompts (max KL, first bad step):\n";
    for (size_t i : order) {
      const PromptResult& p = r.results[i];
      const int fb = p.first_bad();
      out += fmt::format("  {:<24} KL {:<10.3g} {:<14} {}\n", p.prompt.id, p.max_kl(),
                         fb < 0 ? std::string("no bad token") : fmt::format("bad at step {}", fb), short_text(p.prompt, 50));
      for (const TokenStat& t : p.tokens)
        if (t.bad && t.step == fb) out += fmt::format("  {:<24} step {}: {}\n", "", fb, t.why);
    }
  }
  const std::vector<SweepProblem> groups = group_problems(r.results);
  if (!groups.empty()) {
    out += "drill-down (every checkpoint, the worst prompts), grouped by the first divergence:\n";
    for (size_t g = 0; g < groups.size(); ++g) out += fmt::format("  {}. {}\n", g + 1, problem_line(groups[g], r.results));
  }
  if (!r.minimized.empty()) out += fmt::format("minimal failing case: {}\n", r.minimized);
  int checked = 0, chunk_fail = 0, reprefill_fail = 0;
  double worst_chunk = 0, worst_reprefill = 0;
  for (const PromptResult& p : r.results) {
    if (p.chunked) ++checked, chunk_fail += p.chunked->pass ? 0 : 1, worst_chunk = std::max(worst_chunk, p.chunked->rel_l2);
    if (p.reprefill)
      reprefill_fail += p.reprefill->pass ? 0 : 1, worst_reprefill = std::max(worst_reprefill, p.reprefill->rel_l2);
  }
  if (r.chunk > 0) {
    out += fmt::format("invariance (the engine against itself, bound rel_l2 {:.3g}) over {} prompts:\n", r.invariance_bound,
                       checked);
    out += fmt::format("  prefill in chunks of {} vs whole: {} fail, worst rel_l2 {:.3g}\n", r.chunk, chunk_fail, worst_chunk);
    out += fmt::format("  last decode step vs a re-prefill of the same tokens: {} fail, worst rel_l2 {:.3g}\n",
                       reprefill_fail, worst_reprefill);
  }
  const bool failed = chunk_fail > 0 || reprefill_fail > 0 || s.failing_tokens() > 0 ||
                      std::any_of(groups.begin(), groups.end(), [](const SweepProblem& g) { return !g.checkpoint.empty(); });
  out += fmt::format("RESULT: {}\n", !r.complete ? "INCOMPLETE" : failed ? "DIVERGED" : "PASS");
  return out;
}

std::string render_sweep_json(const SweepReport& r) {
  const SweepSummary s = summarize(r.results);
  json j;
  j["sweep_version"] = 1;
  j["model"] = r.model;
  j["pair"] = r.pair;
  j["corpus"] = r.corpus;
  j["complete"] = r.complete;
  j["planned_prompts"] = r.planned;
  j["skipped"] = r.skipped;
  j["summary"] = {{"prompts", s.prompts},       {"tokens", s.tokens},       {"bad_tokens", s.bad_tokens},
                  {"bad_prompts", s.bad_prompts}, {"kl_mean", num(s.kl_mean)}, {"kl_median", num(s.kl_median)},
                  {"kl_p99", num(s.kl_p99)},     {"kl_max", num(s.kl_max)},   {"top1", num(s.top1)},
                  {"top5_overlap", num(s.top5)}, {"explained_tokens", s.explained_tokens},
                  {"explained_prompts", s.explained_prompts}};
  json prompts = json::array();
  for (const PromptResult& p : r.results) {
    json tokens = json::array();
    for (const TokenStat& t : p.tokens) {
      json jt = {{"step", t.step},           {"reference", t.reference}, {"engine", t.engine},
                 {"kl", num(t.kl)},          {"top5_overlap", num(t.top5)}, {"max_abs", num(t.max_abs)},
                 {"rel_l2", num(t.rel_l2)}, {"bad", t.bad}};
      if (t.bad) jt["why"] = t.why;
      tokens.push_back(std::move(jt));
    }
    json jp = {{"id", p.prompt.id}, {"line", p.prompt.line}, {"prompt", p.prompt.text}, {"ids", p.ids},
               {"steps", p.steps}, {"max_kl", num(p.max_kl())}, {"first_bad_step", p.first_bad()},
               {"tokens", tokens}};
    for (const auto& [key, check] : {std::pair{"chunked_prefill", &p.chunked}, {"decode_vs_reprefill", &p.reprefill}})
      if (*check) jp[key] = {{"rel_l2", num((*check)->rel_l2)}, {"kl", num((*check)->kl)}, {"pass", (*check)->pass}};
    if (p.drill && p.drill->ran)
      jp["drill_down"] = {{"steps", p.drill->steps}, {"checkpoint", p.drill->checkpoint}, {"step", p.drill->step},
                          {"verdict", p.drill->verdict}, {"rule", p.drill->rule},
                          {"explanation", p.drill->explanation}, {"routing_followed", p.drill->routing_followed}};
    prompts.push_back(std::move(jp));
  }
  j["prompts"] = std::move(prompts);
  json problems = json::array();
  for (const SweepProblem& g : group_problems(r.results)) {
    json ids = json::array();
    for (size_t i : g.prompts) ids.push_back(r.results[i].prompt.id);
    problems.push_back({{"checkpoint", g.checkpoint}, {"prompts", ids}});
  }
  j["problems"] = std::move(problems);
  j["minimized"] = r.minimized;
  if (r.chunk > 0) j["invariance"] = {{"chunk", r.chunk}, {"max_rel_l2", r.invariance_bound}};
  return j.dump(1, ' ', false, json::error_handler_t::replace) + "\n";
}

std::string render_sweep_junit(const SweepReport& r) {
  const SweepSummary s = summarize(r.results);
  const std::vector<SweepProblem> groups = group_problems(r.results);
  int failures = s.failing_prompts();
  for (const SweepProblem& g : groups) failures += g.checkpoint.empty() ? 0 : 1;
  std::string out = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  out += fmt::format("<testsuites name=\"diffrun sweep\" tests=\"{}\" failures=\"{}\">\n",
                     s.prompts + static_cast<int>(groups.size()), failures);
  out += fmt::format("  <testsuite name=\"prompts\" tests=\"{}\" failures=\"{}\">\n", s.prompts, s.failing_prompts());
  for (const PromptResult& p : r.results) {
    out += fmt::format("    <testcase classname=\"sweep\" name=\"{}\">", xml_escape(p.prompt.id));
    const int fb = p.first_bad();
    const bool explained =
        std::all_of(p.tokens.begin(), p.tokens.end(), [&](const TokenStat& t) { return !t.bad || p.explained(t); });
    if (fb >= 0 && explained)
      out += "<system-out>bad tokens explained by routing flips by drift (the drill-down followed them)</system-out>";
    else if (fb >= 0)
      out += fmt::format("<failure message=\"result_output outside its rule from step {} (max KL {:.3g})\"/>", fb,
                         p.max_kl());
    out += "</testcase>\n";
  }
  out += "  </testsuite>\n";
  out += fmt::format("  <testsuite name=\"problems\" tests=\"{}\" failures=\"{}\">\n", groups.size(),
                     failures - s.failing_prompts());
  for (const SweepProblem& g : groups) {
    out += fmt::format("    <testcase classname=\"sweep.problem\" name=\"{}\">",
                       xml_escape(g.checkpoint.empty() ? "no divergence found" : g.checkpoint));
    if (!g.checkpoint.empty()) out += fmt::format("<failure message=\"{}\"/>", xml_escape(problem_line(g, r.results)));
    out += "</testcase>\n";
  }
  out += "  </testsuite>\n</testsuites>\n";
  return out;
}

}  // namespace diffrun::cli
