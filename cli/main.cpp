// diffrun's entry point: builds the CLI from the registered subcommands and maps errors to exit codes.
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "cli/terminal.hpp"
#include "cli/command.hpp"
#include "cli/error_report.hpp"
#include "cli/help_format.hpp"
#include "cli/progress.hpp"
#include "cli/interrupt.hpp"
#include "model/error.hpp"

namespace diffrun::cli {

std::vector<CommandSpec>& command_registry() {
  static std::vector<CommandSpec> registry;
  return registry;
}

std::string models_dir() {
  if (const char* d = std::getenv("DIFFRUN_MODELS"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/diffrun/models";
  const char* home = std::getenv("HOME");
  return std::string(home ? home : ".") + "/.cache/diffrun/models";
}

std::string default_model_path() { return models_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf"; }

}  // namespace diffrun::cli

namespace {

// The kernel's share of the exit, left to a child process: freeing the process's memory and, when its last file
// descriptors on the GPU driver close, the driver's release of the CUDA context and its device memory (0.2 s and
// more after a GPU job, bench/NOTES.md). The child shares this process's memory (CLONE_VM) and holds copies of its
// descriptors, so this process's exit drops references and returns to its caller at once; the child closes every
// copy but the character devices past stderr (a caller reading the output through a pipe sees its end when this
// process exits), waits on a pipe whose write end only this process holds (it reads EOF once this process has
// exited: its memory and files are the child's alone then), and exits, doing the release. It runs on its own stack
// and makes system calls only (no library state: the memory it shares is a dying process's), with every signal
// blocked (the job's interrupt handlers must not run there).
alignas(64) char teardown_stack[64 * 1024];
int teardown_pipe[2] = {-1, -1};
constexpr int kTeardownMaxFds = 4096;
int teardown_fds[kTeardownMaxFds];

struct LinuxDirent64 {
  uint64_t d_ino;
  int64_t d_off;
  unsigned short d_reclen;
  unsigned char d_type;
  char d_name[1];
};

int teardown_child(void*) {
  ::syscall(SYS_close, teardown_pipe[1]);
  // The descriptors first (/proc/self/fd lists this child's copies), then the closes.
  int n_fds = 0;
  const long dir = ::syscall(SYS_openat, AT_FDCWD, "/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    alignas(8) char buf[4096];
    for (long n; (n = ::syscall(SYS_getdents64, dir, buf, sizeof buf)) > 0;) {
      for (long off = 0; off < n;) {
        const auto* d = reinterpret_cast<const LinuxDirent64*>(buf + off);
        off += d->d_reclen;
        int fd = 0;
        const char* c = d->d_name;
        if (*c < '0' || *c > '9') continue;
        for (; *c >= '0' && *c <= '9'; ++c) fd = fd * 10 + (*c - '0');
        if (fd != dir && fd != teardown_pipe[0] && n_fds < kTeardownMaxFds) teardown_fds[n_fds++] = fd;
      }
    }
    ::syscall(SYS_close, dir);
  } else {
    for (int fd = 0; fd <= 2; ++fd) teardown_fds[n_fds++] = fd;
  }
  for (int i = 0; i < n_fds; ++i) {
    struct stat st;
    const int fd = teardown_fds[i];
    if (fd > 2 && ::syscall(SYS_fstat, fd, &st) == 0 && S_ISCHR(st.st_mode)) continue;  // the driver's: kept
    ::syscall(SYS_close, fd);
  }
  char c;
  while (::syscall(SYS_read, teardown_pipe[0], &c, 1) > 0) {  // 0 at EOF (-1 only on an error: no signal reaches it)
  }
  ::syscall(SYS_exit, 0);
  return 0;
}

// A command that returned has closed every file it wrote (the dumps' HDF5 library keeps no exit-time cleanup:
// dump/dump_format.cpp's h5::silence) and printed its report. What an ordinary exit adds is teardown: the static
// destructors and the CUDA runtime's release of its context, device memory and pinned host buffers, which the
// kernel reclaims at the process's end anyway. The process ends here without it, its output flushed, and the
// kernel's part of the teardown is left to a child (teardown_child); DIFFRUN_FAST_EXIT=0 keeps the ordinary exit,
// as does a sanitizer build (LeakSanitizer checks at the exit), and DIFFRUN_DEFERRED_TEARDOWN=0 the child's part.
int end_process(int rc) {
#if defined(__SANITIZE_ADDRESS__)
  return rc;
#endif
  const char* v = std::getenv("DIFFRUN_FAST_EXIT");
  if (v && std::strcmp(v, "0") == 0) return rc;
  std::fflush(nullptr);
  const char* d = std::getenv("DIFFRUN_DEFERRED_TEARDOWN");
  if (!(d && std::strcmp(d, "0") == 0) && ::pipe2(teardown_pipe, O_CLOEXEC) == 0) {
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, nullptr);  // the child inherits the mask; this process only exits now
    ::clone(teardown_child, teardown_stack + sizeof teardown_stack, CLONE_VM, nullptr);  // failed: the plain exit
  }
  std::_Exit(rc);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace diffrun::cli;
  install_interrupt_handlers();
  CLI::App app{"diffrun: layer-by-layer differential debugging of LLM inference engines"};
  app.set_version_flag("--version", std::string("diffrun ") + DIFFRUN_VERSION);
  app.formatter(help_formatter());  // before the subcommands, which inherit it
  app.require_subcommand(0, 1);

  std::function<int()> run;
  std::function<int()> top_level;
  for (auto& spec : command_registry()) {
    if (spec.name.empty()) {
      top_level = spec.setup(app);
      continue;
    }
    CLI::App* sub = app.add_subcommand(spec.name, spec.help);
    auto fn = spec.setup(*sub);
    sub->callback([&run, fn] { run = fn; });
  }
  // Set after the subcommands, which would otherwise inherit it.
  app.footer(R"(Examples:
  diffrun --prompt "What is the capital of France?" --chat     reference vs engine, report
  diffrun --prompt "The capital of France is" --engine cpu --inject rope_theta_10000
  diffrun compare diffrun-out/engine.h5 diffrun-out/reference.h5 --report-junit junit.xml
  diffrun compare diffrun-out --steps 0 --full                 the last run's report again
  diffrun show diffrun-out/engine.h5 diffrun-out/reference.h5 Qrope-0 --slice T=3
  diffrun ls diffrun-out/engine.h5;  diffrun faults;  diffrun SUBCOMMAND --help
  python3 -m diffrun.plot diffrun-out --out plots     error by op and by layer, |a-b| heatmap

Exit codes:
  0  every compared checkpoint within tolerance (or the subcommand succeeded)
  1  a divergence, a NaN/Inf, coverage below --require-coverage or a step of the reference
     missing (validate: problems found)
  2  the run could not be done: bad input, missing or unreadable file, no GPU for --engine cuda
  130, 143, 141, 129  interrupted by SIGINT, SIGTERM, SIGPIPE, SIGHUP (the run's dump temporaries
     are removed))");
  // Exit 2 with one error line; the reports asked for (--report-json, --report-junit) say it too.
  auto fail = [&](const char* kind, const std::string& what) {
    write_error_reports(argc, argv, what);
    // Names and strings from a dump or a file reach the message: no control byte reaches the terminal.
    fmt::print(stderr, "diffrun: {}: {}\n", kind, diffrun::cli::terminal_safe(what));
    return 2;
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    return fail("error", diffrun::printable(e.what(), 400, 0) + " (--help lists the options)");
  }
  try {
    if (run) return end_process(run());
    if (top_level) {
      const int rc = top_level();
      Progress().timing("the job returned");
      return end_process(rc);
    }
    std::fputs(app.help().c_str(), stdout);
    return 2;
  } catch (const diffrun::Error& e) {
    return fail("error", e.what());
  } catch (const std::filesystem::filesystem_error& e) {
    // A directory that cannot be made or a file that cannot be moved: what and where, not "internal".
    std::string what = e.code().message();
    if (!e.path1().empty()) what = fmt::format("{}: {}", diffrun::printable(e.path1().string()), what);
    return fail("error", what);
  } catch (const std::exception& e) {
    return fail("internal error", e.what());
  }
}
