// SIGINT/SIGTERM/SIGPIPE/SIGHUP: remove the run's dump temporaries and exit 128 + the signal; list (or remove) stale ones of killed runs.
#include "cli/interrupt.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <random>
#include <stdexcept>

#include <fmt/core.h>

#include "dump/dump_format.hpp"

namespace diffrun::cli {
namespace {

constexpr size_t kSlots = 8;
constexpr size_t kPathMax = 4096;

// Written only outside the handler, with the slot's flag cleared; the handler reads flagged slots.
std::array<std::array<char, kPathMax>, kSlots> g_paths{};
std::array<std::atomic<bool>, kSlots> g_live{};

void write_stderr(const char* s) {
  for (size_t n = std::strlen(s); n > 0;) {
    const ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

// Async-signal-safe only: unlink, write, _exit.
extern "C" void on_signal(int sig) {
  for (size_t i = 0; i < kSlots; ++i) {
    if (g_live[i].load()) ::unlink(g_paths[i].data());
  }
  // With SIGPIPE, stderr may be the closed pipe itself: the line is then lost, the exit code says it.
  write_stderr(sig == SIGINT    ? "diffrun: interrupted (SIGINT): temporary dumps removed\n"
               : sig == SIGPIPE ? "diffrun: output pipe closed (SIGPIPE): temporary dumps removed\n"
               : sig == SIGHUP  ? "diffrun: hung up (SIGHUP): temporary dumps removed\n"
                                : "diffrun: terminated (SIGTERM): temporary dumps removed\n");
  ::_exit(128 + sig);
}

// Whether `path` is a regular file (not followed through a symlink) that starts with HDF5's
// signature, as every temporary diffrun creates does from its first moment (H5Fcreate writes the
// superblock): a file named like one but holding something else is not diffrun's to remove.
bool holds_hdf5_signature(const std::string& path) {
  static constexpr unsigned char kSignature[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st{};
  unsigned char head[8] = {};
  const bool ok = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && ::pread(fd, head, sizeof head, 0) == sizeof head &&
                  std::memcmp(head, kSignature, sizeof head) == 0;
  ::close(fd);
  return ok;
}

}  // namespace

void install_interrupt_handlers() {
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  // SIGPIPE (`diffrun ... | head -3` once head has exited) and SIGHUP (the terminal closed) end the
  // run as SIGTERM does, temporaries removed, rather than killing it with them left behind.
  for (int sig : {SIGINT, SIGTERM, SIGPIPE, SIGHUP}) sigaddset(&sa.sa_mask, sig);
  for (int sig : {SIGINT, SIGTERM, SIGPIPE, SIGHUP}) {
    struct sigaction old{};
    // A signal ignored by the parent (SIGINT in a background job of a non-interactive shell, SIGHUP
    // under nohup) stays ignored.
    if (::sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;
    ::sigaction(sig, &sa, nullptr);
  }
}

TempGuard::TempGuard(const std::string& final_path) {
  const std::string tmp = dump_temporary_path(final_path, static_cast<long>(::getpid()));
  if (tmp.size() >= kPathMax) return;  // no such path can be created either
  for (size_t i = 0; i < kSlots; ++i) {
    if (g_live[i].load()) continue;
    std::memcpy(g_paths[i].data(), tmp.c_str(), tmp.size() + 1);
    g_live[i].store(true);
    slot_ = static_cast<int>(i);
    return;
  }
  throw std::logic_error("more than 8 dump temporaries guarded at once");
}

TempGuard::~TempGuard() {
  if (slot_ >= 0) g_live[static_cast<size_t>(slot_)].store(false);
}

std::vector<StaleTemp> stale_temporaries(const std::string& dir) {
  std::vector<StaleTemp> out;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir.empty() ? "." : dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const long pid = dump_temporary_pid(name);
    if (pid <= 0 || !it->is_regular_file(ec) || it->is_symlink(ec)) continue;
    // Alive (or not ours to signal) means some run is still writing it.
    if (pid == ::getpid() || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    if (!holds_hdf5_signature(it->path().string())) continue;
    out.push_back({it->path().string(), static_cast<uint64_t>(it->file_size(ec))});
  }
  return out;
}

void report_stale_temporaries(const std::string& dir, bool remove) {
  const std::vector<StaleTemp> stale = stale_temporaries(dir);
  if (stale.empty()) return;
  uint64_t total = 0;
  std::string list;
  for (const auto& s : stale) {
    total += s.bytes;
    list += (list.empty() ? "" : ", ") + s.path;
  }
  if (remove) {
    for (const auto& s : stale) {
      std::error_code ec;
      std::filesystem::remove(s.path, ec);
    }
    fmt::print(stderr, "diffrun: removed {} stale temporar{} of killed runs ({:.1f} MB): {}\n", stale.size(),
               stale.size() == 1 ? "y" : "ies", total / 1e6, list);
  } else {
    fmt::print(stderr, "diffrun: warning: {} stale temporar{} of killed runs ({:.1f} MB; --remove-stale removes them): {}\n",
               stale.size(), stale.size() == 1 ? "y" : "ies", total / 1e6, list);
  }
}

std::string new_run_id() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", &utc);
  std::random_device rd;
  return fmt::format("{}-{}-{:08x}", stamp, ::getpid(), rd());
}

}  // namespace diffrun::cli
