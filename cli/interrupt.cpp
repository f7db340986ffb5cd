// SIGINT/SIGTERM: remove the run's dump temporaries and exit 130/143; list (or remove) stale ones of killed runs.
#include "cli/interrupt.hpp"

#include <signal.h>
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
  write_stderr(sig == SIGINT ? "diffrun: interrupted (SIGINT): temporary dumps removed\n"
                             : "diffrun: terminated (SIGTERM): temporary dumps removed\n");
  ::_exit(128 + sig);
}

// "<name>.tmp-<digits>": the pid, or -1 when `name` is not a dump temporary.
long temp_pid(const std::string& name) {
  const size_t at = name.rfind(".tmp-");
  if (at == std::string::npos || at + 5 == name.size()) return -1;
  long pid = 0;
  for (size_t i = at + 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || pid > 1'000'000'000) return -1;
    pid = pid * 10 + (name[i] - '0');
  }
  return pid;
}

}  // namespace

void install_interrupt_handlers() {
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaddset(&sa.sa_mask, SIGINT);
  sigaddset(&sa.sa_mask, SIGTERM);
  for (int sig : {SIGINT, SIGTERM}) {
    struct sigaction old{};
    // A SIGINT ignored by the parent (a background job of a non-interactive shell) stays ignored.
    if (::sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;
    ::sigaction(sig, &sa, nullptr);
  }
}

TempGuard::TempGuard(const std::string& final_path) {
  const std::string tmp = final_path + ".tmp-" + std::to_string(::getpid());
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
    const long pid = temp_pid(name);
    if (pid <= 0 || !it->is_regular_file(ec)) continue;
    // Alive (or not ours to signal) means some run is still writing it.
    if (pid == ::getpid() || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
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
