// Unit tests of diff/tolerances: parsing, first-match rules, errors that name the line, presets, bound checks.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "diff/tolerances.hpp"
#include "model/error.hpp"
#include "tests/test_util.hpp"

using namespace diffrun::diff;
using diffrun::InputError;

namespace {

const char* kValid = R"({
  "preset": "test",
  "description": "rules for the tests",
  "rules": [
    {"match": "Qcur-*", "max_rel_l2": 1e-5, "atol": 1e-6, "rtol": 1e-4, "reason": "q projection"},
    {"match": "*", "max_abs": 0.5, "reason": "everything else"},
    {"match": "Qcur-1", "max_rel_l2": 1, "reason": "never reached: an earlier rule matches"}
  ],
  "default": {"max_rel_l2": 1e-3, "min_cosine": 0.999, "reason": "default"}
})";

// The message of the InputError parsing `text` throws.
std::string error_of(const std::string& text) {
  try {
    parse_tolerances(text, "tol.json");
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(Tolerances, ParsesRulesAndTheFirstMatchWins) {
  ToleranceSet t = parse_tolerances(kValid, "tol.json");
  EXPECT_EQ(t.preset, "test");
  ASSERT_EQ(t.rules.size(), 3u);
  EXPECT_EQ(t.rules[0].line, 5);
  const ToleranceRule& q = t.rule_for("Qcur-1");
  EXPECT_EQ(q.match, "Qcur-*");
  EXPECT_DOUBLE_EQ(*q.max_rel_l2, 1e-5);
  EXPECT_DOUBLE_EQ(q.element.atol, 1e-6);
  EXPECT_DOUBLE_EQ(q.element.rtol, 1e-4);
  EXPECT_FALSE(q.max_abs.has_value());
  EXPECT_EQ(t.rule_for("l_out-0").match, "*");
  ToleranceSet only_default = parse_tolerances(R"({"rules": [], "default": {"max_abs": 0, "reason": "exact"}})", "x");
  EXPECT_EQ(only_default.rule_for("embd").reason, "exact");
  EXPECT_DOUBLE_EQ(*only_default.rule_for("embd").max_abs, 0.0);
}

TEST(Tolerances, UnknownKeyNamesFileAndLine) {
  std::string text = kValid;
  text.replace(text.find("\"max_abs\": 0.5"), 14, "\"max_abz\": 0.5");
  std::string msg = error_of(text);
  EXPECT_NE(msg.find("tol.json:6:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("max_abz"), std::string::npos) << msg;
  EXPECT_NE(error_of(R"({"rules": [], "default": {"max_abs": 1, "reason": "r"},
  "extra": 1})").find("tol.json:2: unknown key \"extra\""), std::string::npos);
}

TEST(Tolerances, BadPatternsNameTheLine) {
  std::string bad_chars = error_of(R"({"rules": [
 {"match": "Qcur[0]", "reason": "r"}], "default": {"max_abs": 1, "reason": "r"}})");
  EXPECT_NE(bad_chars.find("tol.json:2: bad pattern"), std::string::npos) << bad_chars;
  std::string typo = error_of(R"({"rules": [{"match": "Qcurr-*", "reason": "r"}],
 "default": {"max_abs": 1, "reason": "r"}})");
  EXPECT_NE(typo.find("tol.json:1: pattern \"Qcurr-*\" matches no checkpoint"), std::string::npos) << typo;
  EXPECT_NE(error_of(R"({"rules": [{"match": "", "reason": "r"}], "default": {"max_abs": 1, "reason": "r"}})").find("bad pattern"),
            std::string::npos);
}

TEST(Tolerances, BadNumbersNameTheLine) {
  auto with = [](const std::string& kv) {
    return error_of("{\n\"rules\": [\n{\"match\": \"embd\",\n " + kv + ",\n\"reason\": \"r\"}],\n\"default\": {\"max_abs\": 1, \"reason\": \"r\"}}");
  };
  for (const char* kv : {"\"max_rel_l2\": \"1e-5\"", "\"max_rel_l2\": -1", "\"min_cosine\": 1.5",
                         "\"max_fail_frac\": 2", "\"atol\": true", "\"max_kl\": 1e999"}) {
    std::string msg = with(kv);
    EXPECT_NE(msg.find("tol.json:4:"), std::string::npos) << kv << " -> " << msg;
  }
  EXPECT_EQ(with("\"min_sqnr_db\": -20"), "(no error)");
}

TEST(Tolerances, StructuralErrors) {
  EXPECT_NE(error_of("{\n\"rules\": [],\n\"default\": {\"max_abs\": 1, \"reason\": \"r\"\n").find("tol.json:4: invalid JSON"),
            std::string::npos)
      << error_of("{\n\"rules\": [],\n\"default\": {\"max_abs\": 1, \"reason\": \"r\"\n");
  EXPECT_NE(error_of(R"({"rules": []})").find("missing \"default\""), std::string::npos);
  EXPECT_NE(error_of(R"({"rules": [{"match": "embd"}], "default": {"max_abs": 1, "reason": "r"}})").find("\"reason\""),
            std::string::npos);
  EXPECT_NE(error_of(R"({"rules": [{"reason": "r"}], "default": {"max_abs": 1, "reason": "r"}})").find("needs \"match\""),
            std::string::npos);
  EXPECT_NE(error_of(R"({"rules": [], "default": {"match": "embd", "reason": "r"}})").find("unknown key \"match\""),
            std::string::npos);
  EXPECT_NE(error_of("[1, 2]").find("JSON object"), std::string::npos);
}

TEST(Tolerances, UnreadableFileIsAnInputErrorNamingIt) {
  try {
    load_tolerances("no/such/tolerances.json");
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("no/such/tolerances.json"), std::string::npos);
  }
  const diffrun::test::ScratchDir dir("test-tolerances");
  const std::string path = dir.path + "/tolerances.json";
  std::ofstream(path) << kValid;
  EXPECT_EQ(load_tolerances(path).source, path);
}

TEST(Tolerances, UnbalancedBracketsAreInvalidJsonNotAMemoryBlowUp) {
  // Each of these once sent a pre-pass over the text into an endless loop that grew memory.
  for (const char* text : {"[}", "{\"rules\": [", "{\"rules\": [\n  {\"match\": \"embd\", \"max_abs\": 1, \"reason\": \"r\"}\n"
                           "  \"default\": {\"max_abs\": 1, \"reason\": \"r\"}\n}", "{]", "{\"a\": [}]}"}) {
    std::string msg = error_of(text);
    EXPECT_NE(msg.find("invalid JSON"), std::string::npos) << text << " -> " << msg;
  }
}

TEST(Tolerances, DeepNestingIsRefusedWithTheLine) {
  // 20,000 levels in 40 KB once cost a gigabyte of path strings and overflowed the stack.
  std::string deep = "{\n\"rules\": [], \"default\": {\"max_abs\": 1, \"reason\": \"r\"},\n\"x\": " + std::string(20000, '[') +
                     std::string(20000, ']') + "}";
  std::string msg = error_of(deep);
  EXPECT_NE(msg.find("tol.json:3: JSON nested deeper than 32 levels"), std::string::npos) << msg.substr(0, 200);
  // Unbalanced and deep, and brackets inside strings do not count.
  EXPECT_NE(error_of(std::string(100000, '{')).find("nested deeper"), std::string::npos);
  std::string in_string = R"({"rules": [], "default": {"max_abs": 1, "reason": ")" + std::string(100, '[') + "\"}}";
  EXPECT_EQ(error_of(in_string), "(no error)");
  // 32 levels are fine as far as nesting goes: the error is the unknown key.
  std::string ok_depth = R"({"rules": [], "default": {"max_abs": 1, "reason": "r"}, "x": )" + std::string(31, '[') +
                         std::string(31, ']') + "}";
  EXPECT_NE(error_of(ok_depth).find("unknown key \"x\""), std::string::npos) << error_of(ok_depth);
}

TEST(Tolerances, DuplicateKeysNameBothLines) {
  std::string top = error_of("{\"rules\": [],\n\"default\": {\"max_abs\": 1, \"reason\": \"r\"},\n\"rules\": []}");
  EXPECT_NE(top.find("tol.json:3: duplicate key \"rules\" (first on line 1)"), std::string::npos) << top;
  std::string in_rule = error_of(
      "{\"rules\": [\n{\"match\": \"embd\", \"max_abs\": 1,\n \"max_abs\": 2, \"reason\": \"r\"}],\n"
      "\"default\": {\"max_abs\": 1, \"reason\": \"r\"}}");
  EXPECT_NE(in_rule.find("tol.json:3: duplicate key \"max_abs\" (first on line 2)"), std::string::npos) << in_rule;
  // The same key after JSON unescaping is the same key.
  std::string escaped = error_of(R"({"rules": [], "default": {"max_abs": 1, "reason": "r", "re\u0061son": "s"}})");
  EXPECT_NE(escaped.find("duplicate key \"reason\""), std::string::npos) << escaped;
}

TEST(Tolerances, RulesWithoutABoundAreRefused) {
  std::string rule = error_of("{\"rules\": [\n{\"match\": \"embd\", \"atol\": 1e-6, \"reason\": \"r\"}],\n"
                              "\"default\": {\"max_abs\": 1, \"reason\": \"r\"}}");
  EXPECT_NE(rule.find("tol.json:2: the rule for \"embd\" has no bound"), std::string::npos) << rule;
  std::string dflt = error_of("{\"rules\": [],\n\"default\": {\"reason\": \"r\"}}");
  EXPECT_NE(dflt.find("tol.json:2: the default rule has no bound"), std::string::npos) << dflt;
  EXPECT_NE(dflt.find("max_rel_l2"), std::string::npos) << dflt;
}

TEST(Tolerances, OnlyRegularFilesAreRead) {
  namespace fs = std::filesystem;
  const diffrun::test::ScratchDir scratch("test-tolerances-files");
  const fs::path dir = scratch.path;
  auto load_error = [](const fs::path& p) -> std::string {
    try {
      load_tolerances(p.string());
    } catch (const InputError& e) {
      return e.what();
    }
    return "(no error)";
  };
  // A FIFO once blocked forever; stat never opens it.
  fs::path fifo = dir / "fifo.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_NE(load_error(fifo).find(fifo.string() + ": cannot read the tolerance file: it is a FIFO"), std::string::npos)
      << load_error(fifo);
  EXPECT_NE(load_error(dir).find("is a directory"), std::string::npos) << load_error(dir);
  EXPECT_NE(load_error("/dev/zero").find("/dev/zero: cannot read the tolerance file: it is a character device"),
            std::string::npos);
  fs::path huge = dir / "huge.json";
  std::ofstream(huge).close();
  fs::resize_file(huge, uint64_t{17} << 20);  // sparse: takes no disk
  EXPECT_NE(load_error(huge).find("more than the 16777216 bytes"), std::string::npos) << load_error(huge);
}

TEST(Tolerances, EveryPresetParsesAndThePairsExist) {
  std::vector<std::string> names = preset_names();
  for (const char* pair : {"f32_vs_f64", "f16_vs_f32", "f16_vs_f64", "f32_vs_f32", "f64_vs_f64"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), pair), names.end()) << pair;
  }
  for (const auto& name : names) {
    ToleranceSet t = preset_tolerances(name);
    EXPECT_EQ(t.preset, name);
    EXPECT_FALSE(t.default_rule.reason.empty());
  }
  EXPECT_EQ(preset_name("f32", "f64"), "f32_vs_f64");
  EXPECT_THROW(preset_tolerances("f8_vs_f64"), InputError);
  // Same precision on both sides must be exact.
  EXPECT_DOUBLE_EQ(*preset_tolerances("f32_vs_f32").default_rule.max_abs, 0.0);
}

// A pattern must match a checkpoint name of some layer up to 255; found by fuzzing: a file of long
// "*a*a*..." patterns once took minutes to check, and patterns are now at most 64 characters.
TEST(Tolerances, PatternsAreCheckedAgainstTheVocabularyInLinearTime) {
  auto rule = [](const std::string& match) {
    return R"({"rules": [{"match": ")" + match + R"(", "max_abs": 1, "reason": "r"}], "default": {"max_abs": 1, "reason": "r"}})";
  };
  for (const char* ok : {"*", "Qcur-2?", "Qcur-2??", "*-255", "result_output", "result_*", "l_out-1?0", "?mbd", "*_*"})
    EXPECT_EQ(error_of(rule(ok)), "(no error)") << ok;
  for (const char* bad : {"Qcur-3??", "*-256", "x*", "result_output?", "Qcur-", "Qcur-?-*"})
    EXPECT_NE(error_of(rule(bad)).find("matches no checkpoint name"), std::string::npos) << bad << ": " << error_of(rule(bad));
  EXPECT_NE(error_of(rule(std::string(65, '*'))).find("pattern of 65 characters is longer than 64"), std::string::npos);
  // 300 rules of the costliest patterns allowed (the test's time limit bounds the check).
  std::string rules;
  for (int i = 0; i < 300; ++i) rules += std::string(i ? "," : "") + R"({"match": ")" + std::string(31, '*') + "a" + std::string(31, '*') + "b" + R"(", "max_abs": 1, "reason": "r"})";
  EXPECT_NE(error_of(R"({"rules": [)" + rules + R"(], "default": {"max_abs": 1, "reason": "r"}})").find("matches no checkpoint name"),
            std::string::npos);
}

TEST(Tolerances, CheckBounds) {
  ToleranceSet t = parse_tolerances(kValid, "tol.json");
  TensorMetrics m;
  m.rel_l2 = 2e-5;
  m.cosine = 1.0;
  auto checks = check_bounds(m, t.rule_for("Qcur-0"));
  ASSERT_EQ(checks.size(), 1u);
  EXPECT_EQ(checks[0].bound, "max_rel_l2");
  EXPECT_FALSE(checks[0].pass);
  m.rel_l2 = 1e-5;
  EXPECT_TRUE(check_bounds(m, t.rule_for("Qcur-0"))[0].pass);  // bounds are inclusive
  // min_cosine is a lower bound.
  m.cosine = 0.998;
  auto d = check_bounds(m, t.default_rule);
  ASSERT_EQ(d.size(), 2u);
  EXPECT_TRUE(d[0].pass);
  EXPECT_FALSE(d[1].pass);
  // A NaN or Inf on either side fails even under a rule without bounds, also the same on both
  // sides (no mismatch); the metric bounds are not checked over it.
  ToleranceRule empty;
  m.nan_a = 1;
  m.nan_b = 1;
  auto nf = check_bounds(m, empty);
  ASSERT_EQ(nf.size(), 1u);
  EXPECT_EQ(nf[0].metric, "nonfinite");
  EXPECT_EQ(nf[0].value, 2.0);
  EXPECT_FALSE(nf[0].pass);
  m.nan_a = m.nan_b = 0;
  m.inf_b = 3;
  auto only_nf = check_bounds(m, t.default_rule);
  ASSERT_EQ(only_nf.size(), 1u);
  EXPECT_EQ(only_nf[0].metric, "nonfinite");
  m.inf_b = 0;
  // Row and head bounds apply where the tensor has that axis.
  ToleranceRule slices = parse_tolerances(
      R"({"rules": [], "default": {"max_row_rel_l2": 1e-3, "max_head_rel_l2": 1e-3, "reason": "r"}})", "x").default_rule;
  EXPECT_TRUE(check_bounds(m, slices).empty());
  m.row = {"T", 4, 2, 2e-3};
  auto rc = check_bounds(m, slices);
  ASSERT_EQ(rc.size(), 1u);
  EXPECT_EQ(rc[0].bound, "max_row_rel_l2");
  EXPECT_FALSE(rc[0].pass);
  m.head = {"H", 3, 1, 1e-3};
  rc = check_bounds(m, slices);
  ASSERT_EQ(rc.size(), 2u);
  EXPECT_EQ(rc[1].bound, "max_head_rel_l2");
  EXPECT_TRUE(rc[1].pass);
  m.row = m.head = AxisWorst{};
  // Logit bounds apply only where logit metrics exist.
  ToleranceRule logits = parse_tolerances(
      R"({"rules": [], "default": {"min_top1": 1, "max_kl": 0.01, "reason": "r"}})", "x").default_rule;
  EXPECT_TRUE(check_bounds(m, logits).empty());
  m.logits = LogitMetrics{};
  m.logits->top1 = 0.5;
  m.logits->kl_max = 0.001;
  auto lc = check_bounds(m, logits);
  ASSERT_EQ(lc.size(), 2u);
  EXPECT_FALSE(lc[0].pass);
  EXPECT_TRUE(lc[1].pass);
}

// The check of bound `name` among `checks` (a failure when absent).
static BoundCheck bound(const std::vector<BoundCheck>& checks, const std::string& name) {
  for (const auto& c : checks)
    if (c.bound == name) return c;
  ADD_FAILURE() << "no " << name;
  return BoundCheck{};
}

// rel_l2_per_position grows the rel L2 bounds (tensor, row, head) with the step's KV length; it is
// not a bound by itself, and the other bounds stay as they are.
TEST(Tolerances, RelL2BoundsGrowWithThePositions) {
  const ToleranceSet t = parse_tolerances(R"({
    "rules": [{"match": "Qrope-*", "max_rel_l2": 2e-5, "max_row_rel_l2": 5e-5, "max_abs": 1e-3,
               "rel_l2_per_position": 2e-8, "reason": "f32 RoPE angles"}],
    "default": {"max_rel_l2": 1e-5, "reason": "rest"}})",
                                          "tol.json");
  const ToleranceRule& rule = t.rule_for("Qrope-0");
  ASSERT_TRUE(rule.rel_l2_per_position);
  TensorMetrics m;
  m.rel_l2 = 3e-5;
  m.max_abs = 1e-4;
  m.row.extent = 4;
  m.row.rel_l2 = 9e-5;
  // 32 positions: 2e-5 + 6.4e-7 and 5e-5 + 6.4e-7; both fail.
  auto at32 = check_bounds(m, rule, 32);
  EXPECT_FALSE(bound(at32, "max_rel_l2").pass);
  EXPECT_FALSE(bound(at32, "max_row_rel_l2").pass);
  EXPECT_NEAR(bound(at32, "max_rel_l2").limit, 2e-5 + 32 * 2e-8, 1e-15);
  // 4,096 positions: 2e-5 + 8.2e-5 and 5e-5 + 8.2e-5; both pass, max_abs unchanged.
  auto at4k = check_bounds(m, rule, 4096);
  EXPECT_TRUE(bound(at4k, "max_rel_l2").pass);
  EXPECT_TRUE(bound(at4k, "max_row_rel_l2").pass);
  EXPECT_DOUBLE_EQ(bound(at4k, "max_abs").limit, 1e-3);
  // Without the key the positions change nothing.
  EXPECT_DOUBLE_EQ(bound(check_bounds(m, t.default_rule, 4096), "max_rel_l2").limit, 1e-5);
  // Alone it bounds nothing.
  EXPECT_THROW(parse_tolerances(R"({"default": {"rel_l2_per_position": 1e-8, "reason": "r"}})", "t.json"), InputError);
  EXPECT_THROW(parse_tolerances(R"({"default": {"max_rel_l2": 1e-5, "rel_l2_per_position": -1, "reason": "r"}})", "t.json"),
               InputError);
}

// calibrated_positions: beyond it the rel L2 bounds (tensor, row, head, after rel_l2_per_position)
// scale by sqrt(positions / calibrated_positions) and max_kl by its square; within it nothing changes.
TEST(Tolerances, BoundsScaleBeyondTheCalibratedContext) {
  const ToleranceSet t = parse_tolerances(R"({
    "calibrated_positions": 600,
    "rules": [{"match": "kq_soft_max-*", "max_rel_l2": 5e-5, "max_row_rel_l2": 1.2e-4, "max_head_rel_l2": 1.5e-4,
               "max_abs": 1e-3, "reason": "r"},
              {"match": "result_output", "max_rel_l2": 1e-4, "max_kl": 1e-8, "reason": "r"}],
    "default": {"max_rel_l2": 1e-5, "reason": "rest"}})",
                                          "tol.json");
  ASSERT_EQ(t.calibrated_positions, 600);
  EXPECT_DOUBLE_EQ(t.length_scale(1), 1.0);
  EXPECT_DOUBLE_EQ(t.length_scale(600), 1.0);
  EXPECT_DOUBLE_EQ(t.length_scale(2400), 2.0);
  TensorMetrics m;
  m.rel_l2 = 4e-5;
  m.max_abs = 1e-4;
  m.row.extent = 586;
  m.row.rel_l2 = 1.9e-4;  // the worst of a 4,782-token prompt's rows (SmolLM2, cpu f32 vs f64)
  m.head.extent = 9;
  m.head.rel_l2 = 5e-5;
  const ToleranceRule& rule = t.rule_for("kq_soft_max-0");
  EXPECT_FALSE(bound(check_bounds(m, rule, 550, t.length_scale(550)), "max_row_rel_l2").pass);
  const auto at4782 = check_bounds(m, rule, 4782, t.length_scale(4782));
  EXPECT_TRUE(bound(at4782, "max_row_rel_l2").pass);
  EXPECT_NEAR(bound(at4782, "max_row_rel_l2").limit, 1.2e-4 * std::sqrt(4782.0 / 600.0), 1e-12);
  EXPECT_NEAR(bound(at4782, "max_head_rel_l2").limit, 1.5e-4 * std::sqrt(4782.0 / 600.0), 1e-12);
  EXPECT_DOUBLE_EQ(bound(at4782, "max_abs").limit, 1e-3);  // not a relative bound: unscaled
  // A real bug's error (one row 10x off) still fails at any length.
  m.row.rel_l2 = 0.1;
  EXPECT_FALSE(bound(check_bounds(m, rule, 4782, t.length_scale(4782)), "max_row_rel_l2").pass);
  TensorMetrics logits;
  logits.rel_l2 = 1e-6;
  logits.logits = LogitMetrics{};
  logits.logits->kl_max = 2.4e-8;
  logits.logits->top1 = 1;
  logits.logits->top5_overlap = 1;
  EXPECT_FALSE(bound(check_bounds(logits, t.rule_for("result_output"), 600, t.length_scale(600)), "max_kl").pass);
  const auto kl = bound(check_bounds(logits, t.rule_for("result_output"), 4800, t.length_scale(4800)), "max_kl");
  EXPECT_TRUE(kl.pass);
  EXPECT_NEAR(kl.limit, 8e-8, 1e-20);
  // Without the key: no scaling. Bad values name the key.
  EXPECT_DOUBLE_EQ(parse_tolerances(R"({"default": {"max_rel_l2": 1e-5, "reason": "r"}})", "t.json").length_scale(1 << 20),
                   1.0);
  for (const char* bad : {"0", "-5", "2.5", "\"600\"", "1e13"}) {
    try {
      parse_tolerances(std::string(R"({"calibrated_positions": )") + bad + R"(, "default": {"max_rel_l2": 1, "reason": "r"}})",
                       "t.json");
      ADD_FAILURE() << bad << " accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("calibrated_positions"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("t.json:1"), std::string::npos) << e.what();
    }
  }
}

// calibrated_reduction: on a wider model a checkpoint's rel L2 bounds scale by (K / K_cal)^exponent, K its
// reduction length: D for the projections out of the residual stream, the RMSNorms and what carries a q/k/v
// projection's error (RoPE, the cache, the attention), H·Dh for attn_out, F for ffn_out, the larger of those
// two for the residual sums; the embedding and models no wider than the calibration keep scale 1.
TEST(Tolerances, CalibratedReductionScalesReductionsOnWiderModels) {
  const ToleranceSet t = parse_tolerances(R"({
    "calibrated_reduction": {"n_embd": 576, "n_ff": 1536, "attn_width": 576, "exponent": 1},
    "default": {"max_rel_l2": 1e-5, "reason": "r"}})",
                                          "t.json");
  ASSERT_TRUE(t.calibrated_reduction.has_value());
  const DimSizes wide = {{"D", 4096}, {"F", 11008}, {"H", 32}, {"Dh", 128}};
  EXPECT_DOUBLE_EQ(t.reduction_scale("Qcur", wide), 4096.0 / 576);
  EXPECT_DOUBLE_EQ(t.reduction_scale("result_output", wide), 4096.0 / 576);
  EXPECT_DOUBLE_EQ(t.reduction_scale("attn_out", wide), 4096.0 / 576);
  EXPECT_DOUBLE_EQ(t.reduction_scale("ffn_out", wide), 11008.0 / 1536);
  EXPECT_DOUBLE_EQ(t.reduction_scale("attn_norm", wide), 4096.0 / 576);  // its sum of squares runs over D
  EXPECT_DOUBLE_EQ(t.reduction_scale("result_norm", wide), 4096.0 / 576);
  EXPECT_DOUBLE_EQ(t.reduction_scale("kq_soft_max", wide), 4096.0 / 576);  // q and k's error, carried on
  EXPECT_DOUBLE_EQ(t.reduction_scale("embd", wide), 1.0);                   // exact in both precisions
  EXPECT_DOUBLE_EQ(t.reduction_scale("l_out", wide), 11008.0 / 1536);  // a residual sum: the larger of attn_out's, ffn_out's
  EXPECT_DOUBLE_EQ(t.reduction_scale("ffn_inp", {{"D", 4096}, {"F", 22016}, {"H", 32}, {"Dh", 128}}), 22016.0 / 1536);
  // Mixtures of experts: the router and each expert's gate/up reduce over D, an expert's down over its Fe
  // (Mixtral's 14336 against the calibrated F), and what carries them on the same.
  const DimSizes moe = {{"D", 4096}, {"F", 14336}, {"Fe", 14336}, {"H", 32}, {"Dh", 128}, {"E", 8}, {"K", 2}};
  for (const char* kind : {"ffn_moe_logits", "ffn_moe_probs", "ffn_moe_weights_norm", "ffn_moe_gate", "ffn_moe_swiglu"})
    EXPECT_DOUBLE_EQ(t.reduction_scale(kind, moe), 4096.0 / 576) << kind;
  EXPECT_DOUBLE_EQ(t.reduction_scale("ffn_moe_down", moe), 14336.0 / 1536);
  EXPECT_DOUBLE_EQ(t.reduction_scale("ffn_moe_out", {{"D", 2048}, {"F", 6144}, {"Fe", 768}}), 1.0);  // Qwen3-30B-A3B
  EXPECT_DOUBLE_EQ(t.reduction_scale("ffn_moe_topk", moe), 1.0);  // ids: exact or not
  const DimSizes narrow = {{"D", 256}, {"F", 512}, {"H", 4}, {"Dh", 64}};
  EXPECT_DOUBLE_EQ(t.reduction_scale("Qcur", narrow), 1.0);
  const ToleranceSet sq = parse_tolerances(R"({
    "calibrated_reduction": {"n_embd": 1024, "n_ff": 1536, "attn_width": 576, "exponent": 0.5},
    "default": {"max_rel_l2": 1e-5, "reason": "r"}})",
                                           "t.json");
  EXPECT_DOUBLE_EQ(sq.reduction_scale("Vcur", wide), 2.0);
  // Without the key: no scaling. Missing or bad members name the key and the line.
  EXPECT_DOUBLE_EQ(parse_tolerances(R"({"default": {"max_rel_l2": 1e-5, "reason": "r"}})", "t.json")
                       .reduction_scale("Qcur", wide),
                   1.0);
  for (const char* bad : {R"({"n_embd": 576, "n_ff": 1536, "attn_width": 576})", R"({"n_embd": 0, "n_ff": 1, "attn_width": 1, "exponent": 1})",
                          R"({"n_embd": 5, "n_ff": 1, "attn_width": 1, "exponent": 9})", R"({"d": 5})", "576"}) {
    try {
      parse_tolerances(std::string(R"({"calibrated_reduction": )") + bad + R"(, "default": {"max_rel_l2": 1, "reason": "r"}})",
                       "t.json");
      ADD_FAILURE() << bad << " accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("t.json:1"), std::string::npos) << e.what();
    }
  }
}
