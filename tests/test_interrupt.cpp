// Integration tests of interruptions through the built diffrun: SIGINT/SIGTERM exit codes and temporaries, run ids, stale temporaries, a full disk.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using diffrun::test::ScratchDir;

namespace {

using diffrun::test::slurp;

std::vector<std::string> temporaries(const fs::path& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().filename().string().find("tmp-") != std::string::npos) out.push_back(e.path().filename().string());
  return out;
}

struct Child {
  pid_t pid = -1;
  int status = 0;
};

// Starts diffrun with `args`, stderr to `err`, with SIGINT and SIGTERM at their defaults whatever
// the test runner inherited.
Child spawn(const std::vector<std::string>& args, const fs::path& err) {
  const std::string bin = diffrun::test::env_or("DIFFRUN_BIN", "build/cli/diffrun");
  Child c;
  c.pid = ::fork();
  if (c.pid == 0) {
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    if (!std::freopen(err.c_str(), "w", stderr) || !std::freopen("/dev/null", "w", stdout)) ::_exit(127);
    std::vector<char*> argv{const_cast<char*>(bin.c_str())};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(bin.c_str(), argv.data());
    ::_exit(127);
  }
  return c;
}

int wait_exit(Child& c) {
  ::waitpid(c.pid, &c.status, 0);
  return WIFEXITED(c.status) ? WEXITSTATUS(c.status) : -WTERMSIG(c.status);
}

int run(const std::vector<std::string>& args, const fs::path& err) {
  Child c = spawn(args, err);
  return wait_exit(c);
}

class Interrupt : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = diffrun::test::fixture_path("tiny-llama-f32.gguf");
    if (!fs::exists(model_)) GTEST_SKIP() << "fixture missing: " << model_ << " (run the fixtures_generate test)";
  }
  std::vector<std::string> job(const fs::path& out, int steps) const {
    return {"--model", model_, "--tokens", "1,2,3", "--steps", std::to_string(steps), "--engine", "cpu",
            "--no-color", "--out", out.string()};
  }
  // Starts a long run, waits until `tmp_name` (a temporary of that run) exists, sends `sig`.
  int interrupt_while_writing(const std::vector<std::string>& args, const fs::path& dir, const std::string& final_name,
                              int sig, const fs::path& err) const {
    Child c = spawn(args, err);
    const fs::path tmp = dir / (final_name + ".diffrun-tmp-" + std::to_string(c.pid));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (!fs::exists(tmp) && std::chrono::steady_clock::now() < deadline) {
      int st = 0;
      if (::waitpid(c.pid, &st, WNOHANG) == c.pid) {
        ADD_FAILURE() << "diffrun ended before writing " << tmp << ": " << slurp(err);
        return -1000;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_TRUE(fs::exists(tmp)) << tmp;
    ::kill(c.pid, sig);
    return wait_exit(c);
  }
  std::string model_;
};

}  // namespace

TEST_F(Interrupt, SignalsRemoveTheTemporariesAndExitConventionally) {
  ScratchDir dir("interrupt-signals");
  const fs::path out = fs::path(dir.path) / "run";
  const fs::path err = fs::path(dir.path) / "err.txt";
  // SIGINT while the reference is written: exit 130, nothing left but the empty run directory.
  EXPECT_EQ(interrupt_while_writing(job(out, 250), out, "reference.h5", SIGINT, err), 130) << slurp(err);
  EXPECT_NE(slurp(err).find("diffrun: interrupted (SIGINT)"), std::string::npos) << slurp(err);
  EXPECT_TRUE(temporaries(out).empty()) << temporaries(out)[0];
  EXPECT_FALSE(fs::exists(out / "reference.h5"));
  // SIGTERM while `diffrun dump` writes: exit 143, no temporary.
  const fs::path dump = fs::path(dir.path) / "d.h5";
  EXPECT_EQ(interrupt_while_writing({"dump", "--model", model_, "--tokens", "1,2,3", "--steps", "250", "--backend",
                                     "cpu", "--out", dump.string()},
                                    dir.path, "d.h5", SIGTERM, err),
            143)
      << slurp(err);
  EXPECT_NE(slurp(err).find("diffrun: terminated (SIGTERM)"), std::string::npos) << slurp(err);
  EXPECT_TRUE(temporaries(dir.path).empty()) << temporaries(dir.path)[0];
  EXPECT_FALSE(fs::exists(dump));
  // SIGPIPE (`diffrun ... 2>&1 | head -3` once head has exited) and SIGHUP end the run the same way.
  for (const auto& [sig, code, line] : {std::tuple{SIGPIPE, 141, "diffrun: output pipe closed (SIGPIPE)"},
                                        std::tuple{SIGHUP, 129, "diffrun: hung up (SIGHUP)"}}) {
    EXPECT_EQ(interrupt_while_writing({"dump", "--model", model_, "--tokens", "1,2,3", "--steps", "250", "--backend",
                                       "cpu", "--out", dump.string()},
                                      dir.path, "d.h5", sig, err),
              code)
        << slurp(err);
    EXPECT_NE(slurp(err).find(line), std::string::npos) << slurp(err);
    EXPECT_TRUE(temporaries(dir.path).empty()) << temporaries(dir.path)[0];
    EXPECT_FALSE(fs::exists(dump));
  }
}

// The pids of the running processes whose parent is `parent`.
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(e.path() / "stat");
    std::string line;
    if (!std::getline(stat, line)) continue;
    const size_t close = line.rfind(')');  // "pid (comm) state ppid ..."
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    char state = 0;
    long ppid = 0;
    if (rest >> state >> ppid && ppid == parent) out.push_back(static_cast<pid_t>(std::stol(name)));
  }
  return out;
}

TEST_F(Interrupt, SignalsWithDumpProcessesLeaveNothing) {
  // With spare cores each dump is written by a diffrun-dump-child process: SIGINT removes the job's
  // temporaries (named with its pid) and the children, reading the end of their input, end too.
  ScratchDir dir("interrupt-children");
  const fs::path out = fs::path(dir.path) / "run";
  const fs::path err = fs::path(dir.path) / "err.txt";
  ::setenv("DIFFRUN_SPARE_CORES", "1", 1);
  ::setenv("DIFFRUN_DUMP_PROCESSES", "1", 1);
  Child c = spawn(job(out, 250), err);
  const fs::path tmp = out / ("reference.h5.diffrun-tmp-" + std::to_string(c.pid));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!fs::exists(tmp) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ::unsetenv("DIFFRUN_SPARE_CORES");
  ::unsetenv("DIFFRUN_DUMP_PROCESSES");
  ASSERT_TRUE(fs::exists(tmp)) << slurp(err);
  const std::vector<pid_t> children = children_of(c.pid);
  EXPECT_GE(children.size(), 2u) << "a writer process per dump";
  ::kill(c.pid, SIGINT);
  EXPECT_EQ(wait_exit(c), 130) << slurp(err);
  const auto gone = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (pid_t child : children) {
    while (::kill(child, 0) == 0 && std::chrono::steady_clock::now() < gone) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_NE(::kill(child, 0), 0) << "writer process " << child << " outlived the job";
  }
  EXPECT_TRUE(temporaries(out).empty()) << temporaries(out)[0];
  EXPECT_FALSE(fs::exists(out / "reference.h5"));
  EXPECT_FALSE(fs::exists(out / "engine.h5"));
}

TEST_F(Interrupt, CompareRefusesAPairFromTwoRuns) {
  ScratchDir dir("interrupt-pairs");
  const fs::path a = fs::path(dir.path) / "a", b = fs::path(dir.path) / "b";
  const fs::path err = fs::path(dir.path) / "err.txt";
  ASSERT_EQ(run(job(a, 1), err), 0) << slurp(err);
  ASSERT_EQ(run(job(b, 1), err), 0) << slurp(err);
  // What an interrupted run leaves: its new reference beside the previous run's engine.
  fs::copy_file(b / "reference.h5", a / "reference.h5", fs::copy_options::overwrite_existing);
  const std::string eng = (a / "engine.h5").string(), ref = (a / "reference.h5").string();
  EXPECT_EQ(run({"compare", eng, ref, "--no-color"}, err), 2);
  EXPECT_NE(slurp(err).find("not comparable: different runs (run_id "), std::string::npos) << slurp(err);
  EXPECT_EQ(run({"compare", eng, ref, "--no-color", "--force"}, err), 0) << slurp(err);
  // A pair of one run compares as usual.
  EXPECT_EQ(run({"compare", (b / "engine.h5").string(), (b / "reference.h5").string(), "--no-color"}, err), 0)
      << slurp(err);
}

TEST_F(Interrupt, StaleTemporariesAreListedThenRemoved) {
  ScratchDir dir("interrupt-stale");
  const fs::path out = fs::path(dir.path) / "run";
  const fs::path err = fs::path(dir.path) / "err.txt";
  fs::create_directories(out);
  // The pid of a process that has ended: what a killed run leaves.
  Child gone;
  gone.pid = ::fork();
  if (gone.pid == 0) ::_exit(0);
  wait_exit(gone);
  // A killed run's temporary: its name and HDF5's signature, which H5Fcreate writes first.
  const std::string hdf5_signature("\x89HDF\r\n\x1a\n", 8);
  const std::string stale = "engine.h5.diffrun-tmp-" + std::to_string(gone.pid);
  std::ofstream(out / stale) << hdf5_signature << "partial";
  // A temporary of a live process (this test) is someone's run in progress: left alone.
  const std::string live = "reference.h5.diffrun-tmp-" + std::to_string(::getpid());
  std::ofstream(out / live) << hdf5_signature << "in progress";
  // Not diffrun's: another program's temporary, a file only named like one, a symlink named like one
  // (to an HDF5 file elsewhere). Neither listed nor removed.
  const std::vector<std::string> foreign = {"notes.txt.tmp-" + std::to_string(gone.pid),
                                            "notes.txt.diffrun-tmp-" + std::to_string(gone.pid),
                                            "link.h5.diffrun-tmp-" + std::to_string(gone.pid)};
  std::ofstream(out / foreign[0]) << hdf5_signature << "someone's notes";
  std::ofstream(out / foreign[1]) << "someone's notes";
  std::ofstream(fs::path(dir.path) / "victim.h5") << hdf5_signature << "victim";
  fs::create_symlink(fs::path(dir.path) / "victim.h5", out / foreign[2]);
  ASSERT_EQ(run(job(out, 1), err), 0) << slurp(err);
  EXPECT_NE(slurp(err).find("warning: 1 stale temporary of killed runs"), std::string::npos) << slurp(err);
  EXPECT_NE(slurp(err).find(stale), std::string::npos) << slurp(err);
  EXPECT_TRUE(fs::exists(out / stale));
  ASSERT_EQ(run([&] {
              auto a = job(out, 1);
              a.push_back("--remove-stale");
              return a;
            }(),
            err),
            0)
      << slurp(err);
  EXPECT_NE(slurp(err).find("removed 1 stale temporary of killed runs"), std::string::npos) << slurp(err);
  EXPECT_FALSE(fs::exists(out / stale));
  EXPECT_TRUE(fs::exists(out / live));
  for (const auto& f : foreign) {
    EXPECT_TRUE(fs::exists(fs::symlink_status(out / f))) << f;
    EXPECT_EQ(slurp(err).find(f), std::string::npos) << slurp(err);
  }
  EXPECT_TRUE(fs::exists(fs::path(dir.path) / "victim.h5"));
}

// A full disk: the "No space left on device" error, exit 2, no temporary left. HDF5's exit-time
// cleanup once crashed (exit 139) on the file whose close had failed. Needs a 2 MB tmpfs, mounted
// in a private mount namespace (unshare -rm; root or user namespaces).
TEST_F(Interrupt, FullDiskExitsTwoAndLeavesNothing) {
  ScratchDir dir("interrupt-full");
  const fs::path mnt = fs::path(dir.path) / "full";
  const fs::path log = fs::path(dir.path) / "log.txt";
  fs::create_directories(mnt);
  const std::string probe = "unshare -rm sh -c 'mount -t tmpfs -o size=2m tmpfs " + mnt.string() + "' >/dev/null 2>&1";
  if (std::system(probe.c_str()) != 0) GTEST_SKIP() << "cannot mount a tmpfs in a private mount namespace (unshare -rm)";
  const std::string bin = diffrun::test::env_or("DIFFRUN_BIN", "build/cli/diffrun");
  // Each command: its exit code, its stderr, then what is left on the tmpfs.
  const std::string script =
      "mount -t tmpfs -o size=2m tmpfs " + mnt.string() + " || exit 9\n" +
      "for steps in 34 200; do\n"
      "  '" + bin + "' dump --model '" + model_ + "' --tokens 1,2,3 --steps $steps --backend cpu --out " + mnt.string() +
      "/d.h5 >/dev/null 2>" + mnt.string() + "/../err.txt; echo \"dump rc=$?\"; grep -v 'step ' " + mnt.string() +
      "/../err.txt; echo left: $(ls -A " + mnt.string() + ")\n"
      "done\n"
      "'" + bin + "' --model '" + model_ + "' --tokens 1,2,3 --steps 40 --engine cpu --no-color --out " + mnt.string() +
      "/run >/dev/null 2>" + mnt.string() + "/../err.txt; echo \"job rc=$?\"; tail -1 " + mnt.string() +
      "/../err.txt; echo left: $(ls -A " + mnt.string() + "/run)\n"
      // The same job with each dump written by a diffrun-dump-child process.
      "rm -rf " + mnt.string() + "/run\n"
      "DIFFRUN_SPARE_CORES=1 DIFFRUN_DUMP_PROCESSES=1 '" + bin + "' --model '" + model_ +
      "' --tokens 1,2,3 --steps 40 --engine cpu --no-color --out " + mnt.string() + "/run >/dev/null 2>" + mnt.string() +
      "/../err.txt; echo \"children job rc=$?\"; tail -1 " + mnt.string() + "/../err.txt; echo left: $(ls -A " +
      mnt.string() + "/run)\n";
  std::ofstream(fs::path(dir.path) / "full.sh") << script;
  ASSERT_EQ(std::system(("unshare -rm sh " + (fs::path(dir.path) / "full.sh").string() + " >" + log.string() + " 2>&1").c_str()), 0)
      << slurp(log);
  const std::string out = slurp(log);
  // Full near the end (34 steps: the data writer's pwrite, or HDF5's final flush when the data fits),
  // while creating datasets (200 steps), and in the top-level job.
  EXPECT_EQ(out.find("rc=139"), std::string::npos) << out;
  EXPECT_NE(out.find("dump rc=2\n"), std::string::npos) << out;
  EXPECT_EQ(out.find("dump rc=0"), std::string::npos) << out;
  EXPECT_NE(out.find("job rc=2\n"), std::string::npos) << out;
  EXPECT_NE(out.find("children job rc=2\n"), std::string::npos) << out;
  size_t errors = 0;
  for (size_t at = 0; (at = out.find("file write failed: No space left on device)\n", at)) != std::string::npos; ++at)
    ++errors;
  EXPECT_EQ(errors, 4u) << out;
  EXPECT_EQ(out.find("Segmentation"), std::string::npos) << out;
  // Nothing left: no temporary, no final file.
  size_t empty = 0;
  for (size_t at = 0; (at = out.find("left:\n", at)) != std::string::npos; ++at) ++empty;
  EXPECT_EQ(empty, 4u) << out;
}

// Options that cannot work are refused before the reference runs: exit 2, nothing written.
TEST_F(Interrupt, BadOptionsAreRefusedBeforeAnyCompute) {
  ScratchDir dir("interrupt-options");
  const fs::path err = fs::path(dir.path) / "err.txt";
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--inject", "rope_theta_1000"}, "--inject: unknown fault 'rope_theta_1000'"},
      {{"--inject", "rope_theta_10000"}, "the model's rope_theta is already 10000"},
      {{"--checkpoints", "Qcurr-*"}, "--checkpoints: pattern 'Qcurr-*' matches no checkpoint of this model"},
      {{"--checkpoints", "l_out-*,Qnorm-*"}, "pattern 'Qnorm-*' matches no checkpoint"},  // llama: no q/k norm
      {{"--checkpoints", "tokens"}, "keeps only the token ids: nothing to compare"},
  };
  int i = 0;
  for (const auto& [extra, message] : cases) {
    const fs::path out = fs::path(dir.path) / ("run" + std::to_string(i++));
    std::vector<std::string> args = job(out, 250);
    args.insert(args.end(), extra.begin(), extra.end());
    EXPECT_EQ(run(args, err), 2) << message;
    EXPECT_NE(slurp(err).find(message), std::string::npos) << slurp(err);
    EXPECT_FALSE(fs::exists(out / "reference.h5")) << message;
  }
  // --engine cuda without the CUDA engine or a device: refused before the reference runs.
  const fs::path out = fs::path(dir.path) / "cuda";
  std::vector<std::string> args = job(out, 2);
  args[args.size() - 4] = "cuda";  // "--engine", "cpu" -> "cuda"
  const int rc = run(args, err);
  if (rc == 2) {
    EXPECT_NE(slurp(err).find("CUDA"), std::string::npos) << slurp(err);
    EXPECT_FALSE(fs::exists(out / "reference.h5"));
  }
  // The same checks in `diffrun dump`.
  const fs::path dump = fs::path(dir.path) / "d.h5";
  EXPECT_EQ(run({"dump", "--model", model_, "--tokens", "1,2", "--backend", "cpu", "--checkpoints", "Qcurr-*", "--out",
                 dump.string()},
                err),
            2);
  EXPECT_NE(slurp(err).find("pattern 'Qcurr-*' matches no checkpoint"), std::string::npos) << slurp(err);
  EXPECT_FALSE(fs::exists(dump));
}
