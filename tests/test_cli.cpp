// Integration tests of `diffrun compare` and `diffrun --prompt` through the built binary ($DIFFRUN_BIN): exit codes 0/1/2, bad inputs, report files.
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/diff_dumps.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using diffrun::test::SyntheticDump;

namespace {

using Result = diffrun::test::CommandResult;
using diffrun::test::shell_quote;
using diffrun::test::slurp;

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    bin_ = diffrun::test::env_or("DIFFRUN_BIN", "build/cli/diffrun");
    python_ = diffrun::test::env_or("PYTHON", "python3");
    dir_ = diffrun::test::make_scratch_dir("test-cli-" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    reference_.write(path("reference.h5"));
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  Result run(const std::string& args) const { return diffrun::test::run_command(bin_, args, dir_); }

  Result compare(const std::string& engine, const std::string& extra = "") const {
    return run("compare " + shell_quote(engine) + " " + shell_quote(path("reference.h5")) + " --no-color " + extra);
  }

  int python(const std::string& code) const {
    return std::system((shell_quote(python_) + " -c " + shell_quote(code)).c_str());
  }

  static SyntheticDump engine_dump() {
    SyntheticDump d;
    d.meta = diffrun::test::synthetic_meta("cpu", "f32");
    return d;
  }

  // Exit 2 and exactly one error line, the last one, containing `what`.
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
  }

  std::string bin_, python_;
  fs::path dir_;
  SyntheticDump reference_;
};

}  // namespace

TEST_F(Cli, IdenticalDumpsExitZero) {
  engine_dump().write(path("engine.h5"));
  Result r = compare(path("engine.h5"));
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("RESULT: PASS"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("\033["), std::string::npos);  // --no-color, and stdout is a file anyway
}

TEST_F(Cli, PerturbedDumpExitsOneWithValidReports) {
  SyntheticDump e = engine_dump();
  e.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 1 && name == "attn_out-2") v[3] += 0.25f;
  };
  e.write(path("engine.h5"));
  Result r = compare(path("engine.h5"), "--report-json " + shell_quote(path("r.json")) + " --report-junit " + shell_quote(path("r.xml")));
  EXPECT_EQ(r.rc, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("FIRST DIVERGENCE  attn_out-2  (step 1, layer 2)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("verdict   LOCAL (rule jump)"), std::string::npos) << r.out;
  nlohmann::json j = nlohmann::json::parse(slurp(path("r.json")));
  EXPECT_EQ(j["exit_code"], 1);
  EXPECT_EQ(j["first_divergence"]["name"], "attn_out-2");
  EXPECT_EQ(j["tolerances"]["preset"], "f32_vs_f64");
  // The JUnit file is well-formed XML with one failing test case.
  EXPECT_EQ(python("import xml.etree.ElementTree as E; r = E.parse(" + shell_quote(path("r.xml")) + ").getroot(); "
                   "assert r.tag == 'testsuites' and r.get('failures') == '1', r.attrib; "
                   "assert len(r.findall('testsuite')) == 3; "
                   "f = [c for c in r.iter('testcase') if c.find('failure') is not None]; "
                   "assert [(c.get('classname'), c.get('name')) for c in f] == [('step_0001', 'attn_out-2')]"),
            0);
}

// A command that returned ends its process without the exit-time teardown (cli/main.cpp end_process): its exit
// code, its whole output to a file and its reports are those of the ordinary exit (DIFFRUN_FAST_EXIT=0). `faults`
// prints its table without flushing it: the last of it is still in stdio's buffer when the command returns.
TEST_F(Cli, FastExitKeepsTheOutputAndTheExitCode) {
  SyntheticDump e = engine_dump();
  e.perturb = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 1 && name == "attn_out-2") v[3] += 0.25f;
  };
  e.write(path("engine.h5"));
  std::vector<Result> compared, listed;
  for (const char* fast : {"1", "0"}) {
    ::setenv("DIFFRUN_FAST_EXIT", fast, 1);
    const std::string report = path(std::string("r") + fast + ".json");
    compared.push_back(compare(path("engine.h5"), "--report-json " + shell_quote(report)));
    listed.push_back(run("faults"));
  }
  ::unsetenv("DIFFRUN_FAST_EXIT");
  for (const Result& r : compared) EXPECT_EQ(r.rc, 1) << r.out << r.err;
  EXPECT_EQ(compared[0].out, compared[1].out);
  EXPECT_EQ(nlohmann::json::parse(slurp(path("r1.json"))), nlohmann::json::parse(slurp(path("r0.json"))));
  for (const Result& r : listed) EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_GT(listed[0].out.size(), 8192u);  // more than a buffer: the end is written at the exit
  EXPECT_EQ(listed[0].out, listed[1].out);
}

// The kernel's part of the exit is left to a child (cli/main.cpp teardown_child): it ends by itself once the job has
// exited, with status 0, and leaves no process behind, the job's output through a pipe whole; with
// DIFFRUN_DEFERRED_TEARDOWN=0 there is none. This test process is made the runs' subreaper (PR_SET_CHILD_SUBREAPER),
// so that the child, orphaned when the job exits, is reparented here and can be waited for.
TEST_F(Cli, DeferredTeardownChildEndsByItself) {
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  // The orphans reparented here, waited for until none is left (at most 10 s): their exit statuses.
  const auto reap_orphans = [] {
    std::vector<int> statuses;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < until) {
      int st = 0;
      const pid_t pid = ::waitpid(-1, &st, __WALL | WNOHANG);
      if (pid < 0) break;  // ECHILD: none left
      if (pid > 0) statuses.push_back(st);
      else std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return statuses;
  };
  reap_orphans();  // none of the earlier tests' left over
  std::vector<Result> listed;
  for (const char* deferred : {"1", "0"}) {
    ::setenv("DIFFRUN_DEFERRED_TEARDOWN", deferred, 1);
    // Through a pipe: the command's status comes back only once its reader has seen the end of the output.
    listed.push_back(run("faults | cat"));
    const std::vector<int> orphans = reap_orphans();
    if (std::string(deferred) == "1") {
      ASSERT_EQ(orphans.size(), 1u);
      EXPECT_TRUE(WIFEXITED(orphans[0]) && WEXITSTATUS(orphans[0]) == 0) << orphans[0];
    } else {
      EXPECT_TRUE(orphans.empty()) << orphans.size();
    }
  }
  ::unsetenv("DIFFRUN_DEFERRED_TEARDOWN");
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 0), 0);
  for (const Result& r : listed) EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_GT(listed[0].out.size(), 8192u);
  EXPECT_EQ(listed[0].out, listed[1].out);
}

// Two dumps holding the same NaN (a NaN in a weight row reaches both sides): exit 1, located in every
// report; the JSON has null, not 0 or 1, for the metrics over it (checked with Python's json).
TEST_F(Cli, SameNaNInBothDumpsExitsOne) {
  auto nan_at_vcur1 = [](int step, const std::string& name, std::vector<float>& v) {
    if (step == 2 && name == "Vcur-1") v[1] = std::numeric_limits<float>::quiet_NaN();
  };
  SyntheticDump ref;
  ref.perturb = nan_at_vcur1;
  ref.write(path("reference.h5"));
  SyntheticDump e = engine_dump();
  e.perturb = nan_at_vcur1;
  e.write(path("engine.h5"));
  Result r = compare(path("engine.h5"), "--tolerances " + shell_quote(path("tol.json")) + " --report-json " +
                                            shell_quote(path("r.json")) + " --report-junit " + shell_quote(path("r.xml")));
  ASSERT_EQ(r.rc, 2) << r.out << r.err;  // no tolerance file yet
  std::ofstream(path("tol.json")) << R"({"rules": [], "default": {"max_fail_frac": 1, "reason": "the loosest bound"}})";
  r = compare(path("engine.h5"), "--tolerances " + shell_quote(path("tol.json")) + " --report-json " + shell_quote(path("r.json")) +
                                     " --report-junit " + shell_quote(path("r.xml")));
  EXPECT_EQ(r.rc, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("FIRST DIVERGENCE  Vcur-1  (step 2, layer 1)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("reference NaN 1, Inf 0, first nan at T=0, Hkv=0, Dh=1"), std::string::npos) << r.out;
  EXPECT_EQ(python("import json; j = json.load(open(" + shell_quote(path("r.json")) + ")); "
                   "n = j['first_nonfinite']; assert (n['name'], n['step']) == ('Vcur-1', 2), n; "
                   "m = j['checkpoints'][n['index']]['metrics']; "
                   "assert m['rel_l2'] is None and m['cosine'] is None, m; "
                   "assert n['engine']['first']['coords'] == {'T': 0, 'Hkv': 0, 'Dh': 1}, n"),
            0);
  EXPECT_NE(slurp(path("r.xml")).find("first NaN/Inf Vcur-1 (step 2, layer 1): NaN/Inf: engine NaN 1 Inf 0"), std::string::npos);
}

TEST_F(Cli, TruncatedHdf5) {
  engine_dump().write(path("engine.h5"));
  const auto size = fs::file_size(path("engine.h5"));
  fs::resize_file(path("engine.h5"), size / 2);
  expect_error(compare(path("engine.h5")), path("engine.h5"));
}

TEST_F(Cli, ForeignHdf5AndNotHdf5) {
  ASSERT_EQ(python("import h5py, numpy; f = h5py.File(" + shell_quote(path("foreign.h5")) +
                   ", 'w'); f['x'] = numpy.zeros(3); f.close()"),
            0);
  expect_error(compare(path("foreign.h5")), "foreign.h5");
  std::ofstream(path("text.h5")) << "not an HDF5 file\n";
  expect_error(compare(path("text.h5")), "text.h5");
  expect_error(compare(path("missing.h5")), "missing.h5");
  // A FIFO is refused unopened (opening it would block) and a directory is named as one, in every command.
  ASSERT_EQ(::mkfifo(path("fifo.h5").c_str(), 0600), 0);
  expect_error(compare(path("fifo.h5")), "fifo.h5: is a FIFO (named pipe), not a regular file");
  expect_error(run("show " + shell_quote(path("fifo.h5")) + " embd"), "fifo.h5: is a FIFO");
  expect_error(run("ls " + shell_quote(path("fifo.h5"))), "fifo.h5: is a FIFO");
  fs::create_directories(path("dir.h5"));
  expect_error(compare(path("dir.h5")), "dir.h5: is a directory, not a regular file");
  expect_error(run("ls " + shell_quote(path("dir.h5"))), "dir.h5: is a directory");
}

TEST_F(Cli, WrongFormatVersion) {
  engine_dump().write(path("engine.h5"));
  ASSERT_EQ(python("import h5py; f = h5py.File(" + shell_quote(path("engine.h5")) +
                   ", 'r+'); f.attrs['format_version'] = 99; f.close()"),
            0);
  expect_error(compare(path("engine.h5")), "engine.h5");
}

TEST_F(Cli, MissingTokensDataset) {
  SyntheticDump e = engine_dump();
  e.skip = [](int step, const std::string& name) { return step == 1 && name == "tokens"; };
  e.write(path("engine.h5"));
  expect_error(compare(path("engine.h5")), "step 1 has no \"tokens\" dataset");
}

TEST_F(Cli, DumpsThatLieAboutTheirSize) {
  // A root attribute n_layer = 2e9 once drove compare to 21 GB before anything was checked.
  engine_dump().write(path("engine.h5"));
  ASSERT_EQ(python("import h5py; f = h5py.File(" + shell_quote(path("engine.h5")) + ", 'r+'); "
                   "f.attrs['n_layer'] = 2000000000; f.close()"),
            0);
  expect_error(compare(path("engine.h5")), "engine.h5: attribute 'n_layer' is 2000000000, outside 1..4096");
  expect_error(run("ls " + shell_quote(path("engine.h5"))), "attribute 'n_layer' is 2000000000");
  // A dataset whose shape declares 1.6 GB with nothing stored: refused before it is allocated.
  engine_dump().write(path("engine.h5"));
  ASSERT_EQ(python("import h5py; f = h5py.File(" + shell_quote(path("engine.h5")) + ", 'r+'); g = f['step_0000']; "
                   "a = dict(g['embd'].attrs); del g['embd']; d = g.create_dataset('embd', shape=(3, 2**27), dtype='f4'); "
                   "[d.attrs.__setitem__(k, v) for k, v in a.items()]; f.close()"),
            0);
  const std::string lie = "dataset 'step_0000/embd': its shape declares 1610612736 bytes but 0 bytes are stored";
  expect_error(compare(path("engine.h5")), lie);
  expect_error(run("show " + shell_quote(path("engine.h5")) + " embd"), lie);
  expect_error(run("ls " + shell_quote(path("engine.h5"))), lie);
  // Compressed data stores fewer bytes than it declares and is read as usual.
  engine_dump().write(path("engine.h5"));
  ASSERT_EQ(python("import h5py; f = h5py.File(" + shell_quote(path("engine.h5")) + ", 'r+'); g = f['step_0000']; "
                   "a = dict(g['embd'].attrs); v = g['embd'][()]; del g['embd']; "
                   "d = g.create_dataset('embd', data=v, compression='gzip', chunks=True); "
                   "[d.attrs.__setitem__(k, x) for k, x in a.items()]; f.close()"),
            0);
  Result r = compare(path("engine.h5"));
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
}

TEST_F(Cli, MismatchedShapes) {
  // A different prompt length: every shape differs, refused as not comparable.
  SyntheticDump longer = engine_dump();
  longer.meta.token_ids = {1, 5, 9, 3};
  longer.step_tokens = {4, 1, 1};
  longer.fed = {1, 5, 9, 3, 7, 2};
  longer.write(path("longer.h5"));
  expect_error(compare(path("longer.h5")), "not comparable");
  // Forced, the shapes are compared and reported as a divergence.
  Result forced = compare(path("longer.h5"), "--force");
  EXPECT_EQ(forced.rc, 1) << forced.out << forced.err;
  EXPECT_NE(forced.out.find("shape     engine [4, 8] vs reference [3, 8]"), std::string::npos) << forced.out;
  // Same tokens, one checkpoint with the wrong shape: a divergence at that checkpoint.
  SyntheticDump one = engine_dump();
  one.shrink = "kq_soft_max-1";
  one.write(path("one.h5"));
  Result r = compare(path("one.h5"));
  EXPECT_EQ(r.rc, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("FIRST DIVERGENCE  kq_soft_max-1"), std::string::npos) << r.out;
}

TEST_F(Cli, DifferentModelRefusedUnlessForced) {
  SyntheticDump e = engine_dump();
  e.meta.model_fingerprint = "size=9;fnv1a64=0000000000000009";
  e.write(path("engine.h5"));
  expect_error(compare(path("engine.h5")), "different models");
  Result r = compare(path("engine.h5"), "--force");
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("warning: forced: different models"), std::string::npos) << r.out;
}

TEST_F(Cli, BadToleranceFiles) {
  engine_dump().write(path("engine.h5"));
  expect_error(compare(path("engine.h5"), "--tolerances " + shell_quote(path("none.json"))), "none.json: cannot read");
  std::ofstream(path("bad.json")) << "{\n  \"rules\": [],\n  \"default\": {\"max_rel\": 1, \"reason\": \"r\"}\n}\n";
  expect_error(compare(path("engine.h5"), "--tolerances " + shell_quote(path("bad.json"))), "bad.json:3: unknown key \"max_rel\"");
  std::ofstream(path("broken.json")) << "{\n  \"rules\": [,\n";
  expect_error(compare(path("engine.h5"), "--tolerances " + shell_quote(path("broken.json"))), "broken.json:2: invalid JSON");
  // Typos that once grew memory without end, a FIFO that once blocked forever, a directory.
  std::ofstream(path("open.json")) << "{\"rules\": [\n  \"default\": {\"max_abs\": 1, \"reason\": \"r\"}\n}\n";
  expect_error(compare(path("engine.h5"), "--tolerances " + shell_quote(path("open.json"))), "open.json:2: invalid JSON");
  std::ofstream(path("deep.json")) << std::string(20000, '[') + std::string(20000, ']');
  expect_error(compare(path("engine.h5"), "--tolerances " + shell_quote(path("deep.json"))), "deep.json:1: JSON nested deeper");
  ASSERT_EQ(::mkfifo(path("fifo.json").c_str(), 0600), 0);
  expect_error(compare(path("engine.h5"), "--tolerances " + shell_quote(path("fifo.json"))),
               "fifo.json: cannot read the tolerance file: it is a FIFO");
  expect_error(compare(path("engine.h5"), "--tolerances " + shell_quote(dir_.string())), "it is a directory");
  // A tolerance file that makes identical dumps fail is still a clean run: exit 0 needs no bound to fail.
  std::ofstream(path("strict.json")) << R"({"rules": [], "default": {"max_abs": 0, "reason": "exact"}})";
  EXPECT_EQ(compare(path("engine.h5"), "--tolerances " + shell_quote(path("strict.json"))).rc, 0);
}

TEST_F(Cli, NoPresetForThePrecisionPair) {
  SyntheticDump e = engine_dump();
  e.meta.precision = "bf16";
  e.write(path("engine.h5"));
  expect_error(compare(path("engine.h5")), "bf16_vs_f64");
}

TEST_F(Cli, UnwritableReport) {
  engine_dump().write(path("engine.h5"));
  expect_error(compare(path("engine.h5"), "--report-json " + shell_quote(path("no/such/dir/r.json"))), "cannot write");
}

// With dumps in processes of their own (spare cores), a diffrun without diffrun-dump-child beside it still writes
// them, from its own process, and says why that is slower; beside it, or with DIFFRUN_DUMP_PROCESSES=0, no note.
TEST_F(Cli, MissingDumpChildIsNamed) {
  const std::string model = diffrun::test::fixture_path("tiny-llama-q4_0.gguf");
  if (!fs::exists(model)) GTEST_SKIP() << "fixture missing: " << model << " (run the fixtures_generate test)";
  fs::create_directories(dir_ / "alone");
  const fs::path alone = dir_ / "alone" / "diffrun";
  fs::copy_file(fs::canonical(bin_), alone);
  fs::permissions(alone, fs::perms::owner_all);
  const std::string args = "--model " + shell_quote(model) + " --tokens 1,2,3 --steps 2 --engine cpu --no-color --out ";
  const std::string note = "diffrun-dump-child is not beside this diffrun";
  ::setenv("DIFFRUN_SPARE_CORES", "1", 1);
  ::unsetenv("DIFFRUN_DUMP_CHILD");
  const Result without = diffrun::test::run_command(alone.string(), args + shell_quote(path("a")), dir_);
  const Result beside = run(args + shell_quote(path("b")));
  ::setenv("DIFFRUN_DUMP_PROCESSES", "0", 1);
  const Result in_process = diffrun::test::run_command(alone.string(), args + shell_quote(path("c")), dir_);
  ::unsetenv("DIFFRUN_DUMP_PROCESSES");
  ::unsetenv("DIFFRUN_SPARE_CORES");
  EXPECT_EQ(without.rc, 0) << without.err;
  EXPECT_NE(without.err.find(note), std::string::npos) << without.err;
  EXPECT_TRUE(fs::exists(path("a") + "/engine.h5") && fs::exists(path("a") + "/reference.h5"));
  EXPECT_EQ(beside.rc, 0) << beside.err;
  EXPECT_EQ(beside.err.find(note), std::string::npos) << beside.err;
  EXPECT_EQ(in_process.rc, 0) << in_process.err;
  EXPECT_EQ(in_process.err.find(note), std::string::npos) << in_process.err;
}

// A dump written over the last run's replaces it whole, and the old file, given a second name over the rename so
// that freeing it is not in the run's time, is removed: by a process of its own from a dump child, at once in the
// job's process. Each run's dumps carry their own run id.
TEST_F(Cli, DumpsWrittenOverTheLastRunsLeaveNothingBehind) {
  const std::string model = diffrun::test::fixture_path("tiny-llama-q4_0.gguf");
  if (!fs::exists(model)) GTEST_SKIP() << "fixture missing: " << model << " (run the fixtures_generate test)";
  const std::string out = path("again");
  const std::string args = "--model " + shell_quote(model) + " --tokens 1,2,3 --steps 2 --engine cpu --no-color --out " +
                           shell_quote(out);
  const auto run_id = [&](const std::string& file) {
    const Result r = run("ls " + shell_quote(out + "/" + file));
    const size_t at = r.out.find("run_id");
    return at == std::string::npos ? std::string() : r.out.substr(at, r.out.find('\n', at) - at);
  };
  const auto leftovers = [&] {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(out))
      if (e.path().filename().string().find(".diffrun-tmp-") != std::string::npos) names.push_back(e.path().string());
    return names;
  };
  ::setenv("DIFFRUN_SPARE_CORES", "1", 1);
  for (const char* processes : {"1", "0"}) {
    ::setenv("DIFFRUN_DUMP_PROCESSES", processes, 1);
    const Result first = run(args);
    ASSERT_EQ(first.rc, 0) << first.err;
    const std::string before = run_id("engine.h5");
    const Result second = run(args);
    ASSERT_EQ(second.rc, 0) << second.err;
    EXPECT_FALSE(before.empty());
    EXPECT_NE(run_id("engine.h5"), before) << "DIFFRUN_DUMP_PROCESSES=" << processes;
    EXPECT_EQ(run_id("reference.h5"), run_id("engine.h5"));
    // The background removal ends soon after the run (it is one unlink).
    for (int i = 0; i < 100 && !leftovers().empty(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_TRUE(leftovers().empty()) << "DIFFRUN_DUMP_PROCESSES=" << processes << ": " << leftovers().front();
  }
  ::unsetenv("DIFFRUN_DUMP_PROCESSES");
  ::unsetenv("DIFFRUN_SPARE_CORES");
}

TEST_F(Cli, PromptEndToEndOnATinyFixture) {
  const std::string model = diffrun::test::fixture_path("tiny-llama-q4_0.gguf");
  if (!fs::exists(model)) GTEST_SKIP() << "fixture missing: " << model << " (run the fixtures_generate test)";
  const std::string out = path("run");
  Result r = run("--model " + shell_quote(model) + " --tokens 1,2,3 --steps 3 --engine cpu --no-color --out " + shell_quote(out) +
                 " --report-json " + shell_quote(path("run.json")) + " --report-junit " + shell_quote(path("run.xml")));
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  EXPECT_TRUE(fs::exists(out + "/reference.h5"));
  EXPECT_TRUE(fs::exists(out + "/engine.h5"));
  nlohmann::json j = nlohmann::json::parse(slurp(path("run.json")));
  EXPECT_EQ(j["engine"]["precision"], "f32");
  EXPECT_EQ(j["reference"]["precision"], "f64");
  EXPECT_EQ(j["summary"]["steps"], 4);
  EXPECT_EQ(j["tokens"].size(), 4u);
  for (const auto& t : j["tokens"]) EXPECT_TRUE(t["match"].get<bool>()) << t;
  // Progress counts the 4 steps (the prefill and 3 decode steps) from 1 to 4.
  EXPECT_NE(r.err.find("compared step 1/4"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("compared step 4/4"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("step 0/"), std::string::npos) << r.err;
  Result dumped = run("dump --backend cpu --model " + shell_quote(model) + " --tokens 1,2,3 --steps 2 --out " +
                      shell_quote(path("progress.h5")));
  EXPECT_EQ(dumped.rc, 0) << dumped.err;
  EXPECT_NE(dumped.err.find("step 1/3 done"), std::string::npos) << dumped.err;
  EXPECT_NE(dumped.err.find("step 3/3 done"), std::string::npos) << dumped.err;
  EXPECT_EQ(dumped.err.find("step 0/"), std::string::npos) << dumped.err;
  EXPECT_EQ(python("import xml.etree.ElementTree as E; E.parse(" + shell_quote(path("run.xml")) + ")"), 0);
  // The same precision on both sides agrees bit for bit under the exact preset.
  Result same = run("--model " + shell_quote(model) + " --tokens 1,2,3 --steps 2 --engine cpu --engine-precision f32 "
                    "--reference-precision f32 --no-color --out " + shell_quote(out));
  EXPECT_EQ(same.rc, 0) << same.out << same.err;
  EXPECT_NE(same.out.find("f32_vs_f32"), std::string::npos) << same.out;
  // A filter records fewer checkpoints; tokens are always kept so the comparison still runs.
  // --engine auto (the default) says in one line when it falls back to the CPU backend.
  Result filtered = run("--model " + shell_quote(model) + " --tokens 1,2,3 --steps 1 --checkpoints 'l_out-*' "
                        "--no-color --out " + shell_quote(out));
  EXPECT_EQ(filtered.rc, 0) << filtered.out << filtered.err;
  EXPECT_TRUE(filtered.err.find("the engine side is the CPU backend at f32 against an f64 reference") != std::string::npos ||
              filtered.out.find("engine     cuda/") != std::string::npos)
      << filtered.err;
  EXPECT_NE(filtered.out.find("compared   4 checkpoints over 2 steps"), std::string::npos) << filtered.out;
}

// Catalog faults end to end: the first divergence's pattern names the bug class, in the terminal and JSON.
TEST_F(Cli, ErrorPatternOfCatalogFaults) {
  const std::string model = diffrun::test::fixture_path("tiny-qwen2-f32.gguf");  // H 8, Hkv 2
  if (!fs::exists(model)) GTEST_SKIP() << "fixture missing: " << model << " (run the fixtures_generate test)";
  auto inject = [&](const std::string& fault) {
    Result r = run("--model " + shell_quote(model) + " --tokens 1,17,42,7,99,3,120,5,63 --steps 1 --engine cpu --no-color --inject " +
                   fault + " --out " + shell_quote(path(fault)) + " --report-json " + shell_quote(path(fault + ".json")) +
                   " --report-junit " + shell_quote(path(fault.substr(0, 3) + ".xml")));
    EXPECT_EQ(r.rc, 1) << r.out << r.err;
    return std::make_pair(r.out, nlohmann::json::parse(slurp(path(fault + ".json")))["first_divergence"]);
  };
  // Query head h reads KV head h % 2 instead of h / 4: heads 0, 2, 5 and 7 happen to be right.
  auto [gqa_text, gqa] = inject("gqa_head_modulo");
  EXPECT_EQ(gqa["name"], "kq_soft_max-0");
  EXPECT_NE(gqa_text.find("pattern   heads 0,2,5,7 exact, 1,3-4,6 wrong"), std::string::npos) << gqa_text;
  EXPECT_NE(gqa_text.find("-> some query heads exact, others not: the query-to-KV head mapping (GQA)"), std::string::npos)
      << gqa_text;
  EXPECT_EQ(gqa["pattern"]["axes"][0]["dim"], "H");
  EXPECT_EQ(gqa["pattern"]["axes"][0]["exact"], nlohmann::json::parse("[0, 2, 5, 7]"));
  ASSERT_TRUE(fs::exists(path("gqa.xml")));
  EXPECT_NE(slurp(path("gqa.xml")).find("pattern: heads 0,2,5,7 exact, 1,3-4,6 wrong"), std::string::npos);
  // The decode step's K/V written at cache row 0 instead of row 9: row 9 stays zero.
  auto [kv_text, kv] = inject("kv_cache_pos0");
  EXPECT_EQ(kv["name"], "cache_k-0");
  EXPECT_EQ(kv["step"], 1);
  EXPECT_NE(kv_text.find("pattern   cache rows 1-8 exact, 0,9 wrong (9 all zero in engine)"), std::string::npos) << kv_text;
  EXPECT_NE(kv_text.find("cache row 9 never written in the engine: the K/V write position"), std::string::npos) << kv_text;
  EXPECT_EQ(kv["pattern"]["axes"][1]["zero_engine"], nlohmann::json::parse("[9]"));
}

TEST_F(Cli, PromptBadInputs) {
  const std::string model = diffrun::test::fixture_path("tiny-llama-q4_0.gguf");
  if (!fs::exists(model)) GTEST_SKIP() << "fixture missing: " << model;
  expect_error(run("--model " + shell_quote(model) + " --tokens 1,2 --engine cpu --engine-precision f16"), "f16");
  expect_error(run("--model " + shell_quote(path("none.gguf")) + " --prompt hi"), "none.gguf");
  expect_error(run("--model " + shell_quote(model) + " --prompt ''"), "empty prompt");
  Result help = run("");
  EXPECT_EQ(help.rc, 2);
  EXPECT_NE(help.out.find("--prompt"), std::string::npos);
  EXPECT_EQ(run("--model " + shell_quote(model) + " --tokens 1 --steps -1").rc, 2);
}

// --tp and the tensor-parallel faults: refused, exit 2, with what is wrong, wherever they cannot run (here: on the
// CPU backend, an unknown fault name).
TEST_F(Cli, TensorParallelBadInputs) {
  const std::string model = diffrun::test::fixture_path("tiny-llama-f32.gguf");
  if (!fs::exists(model)) GTEST_SKIP() << "fixture missing: " << model;
  const std::string m = " --model " + shell_quote(model) + " --tokens 1,2";
  expect_error(run("dump --backend cpu --tp 2" + m + " --out " + shell_quote(path("tp"))), "--tp 2 runs the cuda backend");
  expect_error(run("dump --backend cpu --inject tp_stale_kv_row" + m + " --out " + shell_quote(path("tp.h5"))),
               "tensor-parallel faults are the cuda engine's");
  expect_error(run("dump --backend cuda --tp 2 --inject tp_nope" + m + " --out " + shell_quote(path("tp"))),
               "unknown tensor-parallel fault 'tp_nope'");
  expect_error(run("dump --backend cpu --tp 0" + m + " --out " + shell_quote(path("tp"))), "--tp");
  const Result faults = run("faults");
  EXPECT_EQ(faults.rc, 0);
  EXPECT_NE(faults.out.find("tp_attn_allreduce_skipped"), std::string::npos);
}

// The reference that emulates the f16 engine's storage (f32-f16store) against the same storage in f64
// arithmetic: the CPU twin of the default GPU precision pair, under its preset (f16_vs_f32-f16store).
// The stored tensors hold f16 values and say so; a small RMSNorm error that the old f16 preset let
// through (rms_eps_1e5, ~1e-4 at attn_norm-0) is caught at attn_norm-0.
TEST_F(Cli, EmulatedF16StoragePair) {
  const std::string model = diffrun::test::fixture_path("tiny-qwen2-q8_0.gguf");
  if (!fs::exists(model)) GTEST_SKIP() << "fixture missing: " << model << " (run the fixtures_generate test)";
  const std::string out = path("run");
  const std::string pair = "--model " + shell_quote(model) + " --tokens 1,17,42,7,99,3,120 --steps 3 --engine cpu "
                           "--engine-precision f32-f16store --reference-precision f64-f16store --no-color --out " +
                           shell_quote(out) + " --report-json " + shell_quote(path("run.json"));
  Result clean = run(pair);
  EXPECT_EQ(clean.rc, 0) << clean.out << clean.err;
  nlohmann::json j = nlohmann::json::parse(slurp(path("run.json")));
  EXPECT_EQ(j["tolerances"]["preset"], "f16_vs_f32-f16store");
  EXPECT_EQ(python("import h5py, numpy as np\n"
                   "f = h5py.File(" + shell_quote(out + "/reference.h5") + ", 'r')\n"
                   "t = f['step_0000/_attributes'][()]\n"
                   "native = dict(zip(t['name'], t['native_dtype']))\n"
                   "for n in ['attn_norm-0', 'kqv_out-1', 'ffn_swiglu-0', 'ffn_norm-1', 'result_norm']:\n"
                   "    d = f['step_0000'][n]; a = d[()]\n"
                   "    assert native[n.encode()] == b'f16', (n, native[n.encode()])\n"
                   "    assert (a.astype(np.float16).astype(np.float32) == a).all(), n\n"
                   "q = f['step_0000']['Qcur-0']\n"
                   "assert native[b'Qcur-0'] == b'f64'\n"
                   "assert (q[()].astype(np.float16).astype(np.float32) != q[()]).any()\n"),
            0);
  Result fault = run(pair + " --inject rms_eps_1e5");
  EXPECT_EQ(fault.rc, 1) << fault.out << fault.err;
  j = nlohmann::json::parse(slurp(path("run.json")));
  EXPECT_EQ(j["first_divergence"]["name"], "attn_norm-0") << fault.out;
  Result bad = run("--model " + shell_quote(model) + " --tokens 1,2 --engine cpu --engine-precision f32-f16stor");
  EXPECT_EQ(bad.rc, 2);
  EXPECT_NE(bad.err.find("f32-f16stor"), std::string::npos) << bad.err;
}

// A residual stream kept in f16 (f32-f16residual) is a precision choice: against the f64 reference it
// fails the f32 bounds at ffn_inp-0, and the verdict says drift (precision) by the storage rule. The
// same storage with a real bug (the residual add skipped) is still local.
TEST_F(Cli, ResidualInF16IsPrecisionDrift) {
  const std::string model = diffrun::test::fixture_path("tiny-llama-q4_0.gguf");
  if (!fs::exists(model)) GTEST_SKIP() << "fixture missing: " << model;
  const std::string args = "--model " + shell_quote(model) + " --tokens 1,2,3,4,5 --steps 2 --engine cpu "
                           "--engine-precision f32-f16residual --no-color --out " + shell_quote(path("run")) +
                           " --report-json " + shell_quote(path("run.json"));
  Result r = run(args);
  EXPECT_EQ(r.rc, 1) << r.out << r.err;
  nlohmann::json j = nlohmann::json::parse(slurp(path("run.json")));
  EXPECT_EQ(j["reference"]["precision"], "f64");
  EXPECT_EQ(j["tolerances"]["preset"], "f32_vs_f64");
  EXPECT_EQ(j["first_divergence"]["name"], "ffn_inp-0");
  EXPECT_EQ(j["first_divergence"]["verdict"]["kind"], "drift");
  EXPECT_EQ(j["first_divergence"]["verdict"]["rule"], "storage");
  EXPECT_TRUE(j["first_divergence"]["verdict"]["precision"].get<bool>());
  EXPECT_NE(r.out.find("DRIFT (precision)"), std::string::npos) << r.out;

  // With the isolation replay the op on the reference's inputs fails the f32 bounds by the rounding
  // alone; the error's structure (f16 values within half a spacing) still says precision.
  Result iso = run(args + " --isolate");
  EXPECT_EQ(iso.rc, 1) << iso.out << iso.err;
  j = nlohmann::json::parse(slurp(path("run.json")));
  EXPECT_EQ(j["first_divergence"]["name"], "ffn_inp-0");
  EXPECT_EQ(j["first_divergence"]["verdict"]["kind"], "drift") << iso.out;
  EXPECT_EQ(j["first_divergence"]["verdict"]["rule"], "f16_storage") << iso.out;
  EXPECT_TRUE(j["first_divergence"]["verdict"]["precision"].get<bool>());

  Result bug = run(args + " --inject residual_skipped");
  EXPECT_EQ(bug.rc, 1) << bug.out << bug.err;
  j = nlohmann::json::parse(slurp(path("run.json")));
  EXPECT_EQ(j["first_divergence"]["name"], "ffn_inp-0");
  EXPECT_EQ(j["first_divergence"]["verdict"]["kind"], "local") << bug.out;

  // The precision pair: an f16 engine (the f16 engine's storage emulated) that also keeps its residual
  // stream in f16, against the f32-f16store reference, judged by the f16 preset with the isolation
  // replay the pair always runs: drift by the error's structure; the residual add skipped stays local.
  const std::string f16_args = "--model " + shell_quote(model) + " --tokens 1,2,3,4,5 --steps 2 --engine cpu "
                               "--engine-precision f32-f16store-f16residual --reference-precision f32-f16store "
                               "--no-color --out " + shell_quote(path("run16")) + " --report-json " +
                               shell_quote(path("run16.json"));
  Result f16 = run(f16_args);
  EXPECT_EQ(f16.rc, 1) << f16.out << f16.err;
  j = nlohmann::json::parse(slurp(path("run16.json")));
  EXPECT_EQ(j["tolerances"]["preset"], "f16_vs_f32-f16store");
  EXPECT_EQ(j["first_divergence"]["name"], "ffn_inp-0");
  EXPECT_EQ(j["first_divergence"]["verdict"]["kind"], "drift") << f16.out;
  EXPECT_EQ(j["first_divergence"]["verdict"]["rule"], "f16_storage") << f16.out;
  Result f16_bug = run(f16_args + " --inject residual_skipped");
  EXPECT_EQ(f16_bug.rc, 1) << f16_bug.out << f16_bug.err;
  j = nlohmann::json::parse(slurp(path("run16.json")));
  EXPECT_EQ(j["first_divergence"]["name"], "ffn_inp-0");
  EXPECT_EQ(j["first_divergence"]["verdict"]["kind"], "local") << f16_bug.out;
}

// A replay that replaced only the recorded checkpoints would judge a chain of ops by one op's bound:
// --isolate with --checkpoints is refused before anything runs, and the f16store pair, which runs the
// replay by default, goes without it under a filter and says so.
TEST_F(Cli, IsolationNeedsEveryCheckpoint) {
  const std::string model = diffrun::test::fixture_path("tiny-qwen2-q8_0.gguf");
  if (!fs::exists(model)) GTEST_SKIP() << "fixture missing: " << model << " (run the fixtures_generate test)";
  Result refused = run("--model " + shell_quote(model) + " --tokens 1,17,42,7 --steps 1 --engine cpu --isolate "
                       "--checkpoints 'l_out-*' --no-color --out " + shell_quote(path("refused")));
  EXPECT_EQ(refused.rc, 2) << refused.out << refused.err;
  EXPECT_NE(refused.err.find("--isolate needs every checkpoint"), std::string::npos) << refused.err;
  EXPECT_FALSE(fs::exists(path("refused") + "/reference.h5"));
  Result filtered = run("--model " + shell_quote(model) + " --tokens 1,17,42,7 --steps 1 --engine cpu "
                        "--engine-precision f32-f16store --reference-precision f32-f16store --checkpoints 'l_out-*' "
                        "--no-color --out " + shell_quote(path("filtered")));
  EXPECT_EQ(filtered.rc, 0) << filtered.out << filtered.err;
  EXPECT_NE(filtered.err.find("runs without the isolation replay: --checkpoints records only some"), std::string::npos)
      << filtered.err;
  EXPECT_FALSE(fs::exists(path("filtered") + "/engine-isolated.h5"));
}

// The isolation replay of the top-level job reuses the pipeline's engine (reset, not loaded again): its
// dump holds exactly what a fresh engine replaying the same reference dump records (`dump --replay`).
TEST_F(Cli, IsolationReplayReusingTheEngineEqualsAFreshReplay) {
  const std::string model = diffrun::test::fixture_path("tiny-qwen2-q8_0.gguf");
  if (!fs::exists(model)) GTEST_SKIP() << "fixture missing: " << model << " (run the fixtures_generate test)";
  const std::string out = path("run");
  Result job = run("--model " + shell_quote(model) + " --tokens 1,17,42,7 --steps 3 --engine cpu --isolate --no-color --out " +
                   shell_quote(out));
  EXPECT_EQ(job.rc, 0) << job.out << job.err;
  Result fresh = run("dump --backend cpu --precision f32 --model " + shell_quote(model) + " --tokens 1,17,42,7 --steps 3 "
                     "--replay " + shell_quote(out + "/reference.h5") + " --out " + shell_quote(path("fresh.h5")));
  ASSERT_EQ(fresh.rc, 0) << fresh.out << fresh.err;
  EXPECT_EQ(fresh.err.find("warning"), std::string::npos) << fresh.err;  // the job's reference holds every checkpoint
  Result same = run("compare " + shell_quote(path("fresh.h5")) + " " + shell_quote(out + "/engine-isolated.h5") +
                   " --no-color");
  EXPECT_EQ(same.rc, 0) << same.out << same.err;
  EXPECT_NE(same.out.find("PASS"), std::string::npos) << same.out;
}

// A replay from a reference recorded with a filter replaces only what it holds: `dump --replay` says
// so, and `compare --isolated` gives the checkpoints whose op inputs were not replaced no local error.
TEST_F(Cli, ReplayFromAFilteredReferenceGivesNoLocalErrors) {
  const std::string model = diffrun::test::fixture_path("tiny-qwen2-q8_0.gguf");
  if (!fs::exists(model)) GTEST_SKIP() << "fixture missing: " << model << " (run the fixtures_generate test)";
  const std::string common = "--model " + shell_quote(model) + " --tokens 1,17,42,7 --steps 1 --out ";
  Result ref = run("dump --backend cpu --precision f64 --checkpoints 'l_out-*' " + common + shell_quote(path("ref.h5")));
  ASSERT_EQ(ref.rc, 0) << ref.out << ref.err;
  Result eng = run("dump --backend cpu --precision f32 " + common + shell_quote(path("eng.h5")));
  ASSERT_EQ(eng.rc, 0) << eng.out << eng.err;
  Result iso = run("dump --backend cpu --precision f32 --replay " + shell_quote(path("ref.h5")) + " " + common +
                   shell_quote(path("iso.h5")));
  ASSERT_EQ(iso.rc, 0) << iso.out << iso.err;
  EXPECT_NE(iso.err.find("warning: --replay"), std::string::npos) << iso.err;
  Result cmp = run("compare " + shell_quote(path("eng.h5")) + " " + shell_quote(path("ref.h5")) + " --isolated " +
                   shell_quote(path("iso.h5")) + " --no-color --report-json " + shell_quote(path("r.json")));
  EXPECT_NE(cmp.out.find("have no local error (l_out-0 at step 0 the first)"), std::string::npos) << cmp.out;
}
