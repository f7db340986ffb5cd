// Bad input through the built diffrun ($DIFFRUN_BIN): one clear error line and exit 2 for bad paths and values, the reports of a failed run, odd bytes in prompts and GGUF strings, integer checkpoints.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/diff_dumps.hpp"
#include "tests/gguf_builder.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using diffrun::test::SyntheticDump;

namespace {

using Result = diffrun::test::CommandResult;
using diffrun::test::shell_quote;
using diffrun::test::slurp;

// A Python string literal of s (ASCII text).
std::string pystr(const std::string& s) {
  std::string q = "\"";
  for (char c : s) q += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
  return q + "\"";
}

class Reliability : public ::testing::Test {
 protected:
  void SetUp() override {
    bin_ = diffrun::test::env_or("DIFFRUN_BIN", "build/cli/diffrun");
    python_ = diffrun::test::env_or("PYTHON", "python3");
    model_ = diffrun::test::fixture_path("tiny-llama-f32.gguf");
    dir_ = diffrun::test::make_scratch_dir("test-reliability-" +
                                           std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  Result run(const std::string& args) const { return diffrun::test::run_command(bin_, args, dir_); }

  // The top-level job on the tiny fixture with `extra` options.
  Result job(const std::string& extra) const {
    return run("--model " + shell_quote(model_) + " --tokens 1,2,3 --steps 1 --engine cpu --no-color " + extra);
  }

  int python(const std::string& code) const {
    return std::system((shell_quote(python_) + " -c " + shell_quote(code)).c_str());
  }

  bool have_model() const { return fs::exists(model_); }

  // Exit 2 and exactly one error line, the last one, containing `what`, with no control byte in it.
  static void expect_error(const Result& r, const std::string& what) {
    EXPECT_EQ(r.rc, 2) << r.out << r.err;
    std::istringstream lines(r.err);
    std::string line, last;
    int errors = 0;
    while (std::getline(lines, line)) {
      if (line.rfind("diffrun: error: ", 0) == 0) ++errors;
      last = line;
    }
    EXPECT_EQ(errors, 1) << r.err;
    EXPECT_EQ(last.rfind("diffrun: error: ", 0), 0u) << r.err;
    EXPECT_NE(last.find(what), std::string::npos) << "expected '" << what << "' in: " << r.err;
    for (char c : last) EXPECT_GE(static_cast<unsigned char>(c), 0x20) << "control byte in: " << last;
  }

  std::string bin_, python_, model_;
  fs::path dir_;
};

}  // namespace

// --out under a regular file, --out "" and a dump path that is a directory once ended in "internal
// error: filesystem error"; now each is named before anything runs, and nothing is written.
TEST_F(Reliability, OutputPathsAreCheckedBeforeAnyCompute) {
  if (!have_model()) GTEST_SKIP() << "fixture missing: " << model_ << " (run the fixtures_generate test)";
  std::ofstream(path("file")) << "x";
  expect_error(job("--out " + shell_quote(path("file") + "/run")), "--out " + path("file") + "/run: " + path("file") + " is not a directory");
  expect_error(job("--out " + shell_quote(path("file"))), "--out " + path("file") + ": exists and is not a directory");
  expect_error(job("--out ''"), "--out: empty path");
  expect_error(job("--out " + shell_quote(path("run")) + " --report-json " + shell_quote(path("none/r.json"))),
               "--report-json " + path("none/r.json") + ": directory " + path("none") + " does not exist");
  EXPECT_FALSE(fs::exists(path("run")));
  fs::create_directories(path("dir.h5"));
  expect_error(run("dump --model " + shell_quote(model_) + " --tokens 1,2 --out " + shell_quote(path("dir.h5"))),
               "--out " + path("dir.h5") + ": is a directory");
  expect_error(run("dump --model " + shell_quote(model_) + " --tokens 1,2 --out " + shell_quote(path("file/d.h5"))),
               path("file") + " is not a directory");
  expect_error(run("dump --model " + shell_quote(model_) + " --tokens 1,2 --out ''"), "--out: empty path");
}

// Counts and factors: "abc" once gave a range with a 300-digit bound, -n 0 "0 not in range 0 to ...",
// and --jump-factor nan was accepted.
TEST_F(Reliability, NumbersAreRefusedWithWhatIsWrong) {
  expect_error(run("--tokens 1 --steps abc"), "--steps: 'abc' is not a whole number (expected 0 to 2147483647)");
  expect_error(run("--tokens 1 --steps -1"), "--steps: is -1, must be at least 0");
  expect_error(run("--tokens 1 --steps 99999999999999999999"), "--steps: 99999999999999999999 is more than 2147483647");
  expect_error(run("--tokens 1 --steps 2.5"), "'2.5' is not a whole number");
  expect_error(run("generate --tokens 1 -n 0"), "--n-predict: is 0, must be at least 1");
  expect_error(run("dump --tokens 1 --out x.h5 --steps x"), "--steps: 'x' is not a whole number");
  expect_error(run("show a.h5 embd --rows 1e3"), "--rows: '1e3' is not a whole number");
  for (const char* bad : {"nan", "inf", "-inf", "0", "-2", "1e999"})
    expect_error(run(std::string("--tokens 1 --jump-factor ") + bad), std::string("--jump-factor: ") + bad + " is not a finite number above 0");
  expect_error(run("compare a.h5 b.h5 --jump-factor nan"), "--jump-factor: nan is not a finite number above 0");
  expect_error(run("compare a.h5 b.h5 --jump-factor x"), "--jump-factor: 'x' is not a number");
  for (char c : run("--tokens 1 --steps \"$(printf '\\033[31m')\"").err) EXPECT_NE(c, '\x1b');
}

// A run that ends with exit 2 still writes the reports it was asked for, with the error in them:
// after the command line was read, and when the command line itself was refused.
TEST_F(Reliability, ExitTwoStillWritesTheReports) {
  const std::string reports = " --report-json " + shell_quote(path("r.json")) + " --report-junit " + shell_quote(path("r.xml"));
  auto check = [&](const std::string& title, const std::string& error) {
    EXPECT_EQ(python("import json, xml.etree.ElementTree as E\n"
                     "j = json.load(open(" + shell_quote(path("r.json")) + "))\n"
                     "assert j['exit_code'] == 2 and j['title'] == " + pystr(title) + ", j\n"
                     "assert " + pystr(error) + " in j['error'], j\n"
                     "r = E.parse(" + shell_quote(path("r.xml")) + ").getroot()\n"
                     "assert r.tag == 'testsuites' and r.get('errors') == '1', r.attrib\n"
                     "e = r.find('testsuite/testcase/error')\n"
                     "assert " + pystr(error) + " in e.get('message') and " + pystr(error) + " in e.text, e.attrib\n"
                     "assert r.find('testsuite').get('name') == " + pystr(title) + "\n"),
              0)
        << title << ": " << error;
    fs::remove(path("r.json"));
    fs::remove(path("r.xml"));
  };
  expect_error(run("compare " + shell_quote(path("missing.h5")) + " " + shell_quote(path("other.h5")) + reports), "missing.h5: no such file");
  check("diffrun compare", "missing.h5: no such file");
  expect_error(run("--model " + shell_quote(path("none.gguf")) + " --tokens 1" + reports), "none.gguf");
  check("diffrun", "none.gguf");
  expect_error(run("--tokens 1 --steps abc" + reports), "--steps: 'abc'");
  check("diffrun", "--steps: 'abc' is not a whole number");
  // The error holds bytes that are not UTF-8 and control bytes: both reports still parse.
  expect_error(run("compare " + shell_quote(path("bad\xff.h5")) + " b.h5" + reports), "no such file");
  check("diffrun compare", "no such file");
}

// A prompt that is not valid UTF-8 once crashed --report-json after a PASS and made --report-junit
// write XML that does not parse; the bytes that are not UTF-8 now stand as U+FFFD.
TEST_F(Reliability, PromptWithInvalidUtf8GivesParsableReports) {
  if (!have_model()) GTEST_SKIP() << "fixture missing: " << model_ << " (run the fixtures_generate test)";
  const std::string prompt = "caf\xc3\xa9 \xff\xfe half \xe6\x97 ctl \x01\x1b[0m \xef\xbf\xbf end";
  Result r = run("--model " + shell_quote(model_) + " --prompt " + shell_quote(prompt) + " --steps 1 --engine cpu --no-color --out " +
                 shell_quote(path("run")) + " --report-json " + shell_quote(path("r.json")) + " --report-junit " + shell_quote(path("r.xml")));
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  EXPECT_EQ(python("import json, xml.etree.ElementTree as E\n"
                   "j = json.load(open(" + shell_quote(path("r.json")) + ", encoding='utf-8'))\n"
                   "p = j['engine']['prompt']\n"
                   "assert p.startswith('caf\\u00e9 \\ufffd\\ufffd half \\ufffd'), repr(p)\n"
                   "assert p.endswith(' end'), repr(p)\n"
                   "E.parse(" + shell_quote(path("r.xml")) + ")\n"),
            0);
}

// Control bytes and long values from a GGUF string are escaped and cut in the error line, as `inspect` shows them.
TEST_F(Reliability, GgufStringsAreEscapedAndTruncatedInErrors) {
  diffrun::test::GgufBuilder b;
  const std::string evil = std::string("ll\x1b[2J\x00\nama\x9b", 12) + std::string(5u << 20, 'x');
  b.header(0, 1).kv_string("general.architecture", evil);
  b.write(path("evil.gguf"));
  Result r = run("--model " + shell_quote(path("evil.gguf")) + " --tokens 1");
  expect_error(r, "unsupported architecture 'll\\x1b[2J\\x00\\nama\\x9bxxx");
  EXPECT_NE(r.err.find("... (5242892 bytes)"), std::string::npos) << r.err.substr(0, 500);
  EXPECT_LT(r.err.size(), 2000u);
  // The duplicate key of a malformed header, a parse error of the reader itself.
  diffrun::test::GgufBuilder d;
  d.header(0, 2).kv_string("k\x1b[31m", "a").kv_string("k\x1b[31m", "b");
  d.write(path("dup.gguf"));
  expect_error(run("--model " + shell_quote(path("dup.gguf")) + " --tokens 1"), "duplicate metadata key 'k\\x1b[31m'");
  expect_error(run("inspect " + shell_quote(path("dup.gguf"))), "duplicate metadata key 'k\\x1b[31m'");
}

// An integer dataset outside the vocabulary was skipped, and reported as "in one dump only" when the
// other dump held it as floats; now it is compared as values like any checkpoint.
TEST_F(Reliability, IntegerCheckpointsAreCompared) {
  SyntheticDump ref;
  ref.write(path("reference.h5"));
  SyntheticDump eng;
  eng.meta = diffrun::test::synthetic_meta("cpu", "f32");
  eng.write(path("engine.h5"));
  auto add = [&](const std::string& file, const std::string& dtype, const std::string& values) {
    return python("import h5py, numpy as np\nf = h5py.File(" + shell_quote(path(file)) +
                  ", 'r+')\nf['step_0000'].create_dataset('inp_pos', data=np.array(" + values + ", dtype='" + dtype +
                  "'))\nf.close()\n");
  };
  ASSERT_EQ(add("reference.h5", "int32", "[0, 1, 2]"), 0);
  ASSERT_EQ(add("engine.h5", "float32", "[0, 1, 2]"), 0);
  const std::string report = " --no-color --report-json " + shell_quote(path("r.json"));
  Result r = run("compare " + shell_quote(path("engine.h5")) + " " + shell_quote(path("reference.h5")) + report);
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  EXPECT_EQ(r.out.find("one dump only"), std::string::npos) << r.out;
  const std::string compared = "import json\nj = json.load(open(" + shell_quote(path("r.json")) + "))\n"
                               "c = [x for x in j['checkpoints'] if x['name'] == 'inp_pos']\n"
                               "assert len(c) == 1 and c[0]['status'] == '";
  EXPECT_EQ(python(compared + "pass', c\n"), 0);
  // Both integer, one position wrong: the first divergence.
  eng.write(path("engine.h5"));
  ASSERT_EQ(add("engine.h5", "int32", "[0, 1, 3]"), 0);
  r = run("compare " + shell_quote(path("engine.h5")) + " " + shell_quote(path("reference.h5")) + report);
  EXPECT_EQ(r.rc, 1) << r.out << r.err;
  EXPECT_EQ(python(compared + "fail', c\n"), 0);
}

// Found by fuzz_dump: a dump whose root attributes fail HDF5's checksum once made `validate` crash
// (exit 139) inside HDF5 1.10 reading a damaged global heap; such a file is now refused unread.
TEST_F(Reliability, DamagedDumpIsRefusedByEveryReader) {
  const std::string damaged = diffrun::test::source_dir() + "/tests/data/fuzz-damaged-global-heap.h5";
  expect_error(run("validate " + shell_quote(damaged)), "damaged: its root attributes cannot be read (HDF5: incorrect metadata checksum");
  expect_error(run("compare " + shell_quote(damaged) + " " + shell_quote(damaged)), "(HDF5: incorrect metadata checksum");
  expect_error(run("ls " + shell_quote(damaged)), "(HDF5: incorrect metadata checksum");
}
