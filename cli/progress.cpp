// Progress on stderr: a bar redrawn in place on a TTY, plain lines when stderr is a file or pipe.
#include "cli/progress.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <fmt/core.h>

namespace diffrun::cli {

namespace {
// The stamps count from the program's start (static initialization), so that they include what
// runs before a command makes its Progress.
const std::chrono::steady_clock::time_point kProgramStart = std::chrono::steady_clock::now();
}  // namespace

Progress::Progress(std::string prefix, bool enabled)
    : prefix_(std::move(prefix)), enabled_(enabled), tty_(isatty(fileno(stderr)) != 0) {
  const char* t = std::getenv("DIFFRUN_PROGRESS_TIMES");
  times_ = t && *t && std::strcmp(t, "0") != 0;
}

std::string Progress::stamp() const {
  if (!times_) return {};
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - kProgramStart).count();
  return fmt::format("[+{:.3f} s] ", s);
}

Progress::~Progress() { finish(); }

void Progress::message(std::string_view text) {
  if (!enabled_) return;
  finish();
  fmt::print(stderr, "{}: {}{}\n", prefix_, stamp(), text);
}

void Progress::timing(std::string_view text) {
  if (times_) message(text);
}

void Progress::update(std::string_view what, int done, int total) {
  if (!enabled_) return;
  if (!tty_) {
    fmt::print(stderr, "{}: {}{} {}/{}\n", prefix_, stamp(), what, done, total);
    return;
  }
  constexpr int kWidth = 30;
  const int filled = total > 0 ? std::clamp(done * kWidth / total, 0, kWidth) : kWidth;
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(kWidth, '.');
  fmt::print(stderr, "\r\033[K{}: {} [{}] {}/{}", prefix_, what, bar, done, total);
  std::fflush(stderr);
  open_ = true;
}

void Progress::finish() {
  if (!open_) return;
  fmt::print(stderr, "\n");
  open_ = false;
}

}  // namespace diffrun::cli
