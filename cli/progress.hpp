// Progress on stderr while loading, running and comparing: a bar on a TTY, plain lines otherwise.
// DIFFRUN_PROGRESS_TIMES=1 starts every plain line with the seconds since the program started
// ("[+1.234 s]") and adds timing() lines: the phases of a run, for benchmarks.
#pragma once

#include <string>
#include <string_view>

namespace diffrun::cli {

class Progress {
 public:
  // `prefix` starts every line ("diffrun"). enabled = false prints nothing.
  explicit Progress(std::string prefix = "diffrun", bool enabled = true);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // One line of news ("loading model.gguf"); ends an open bar first.
  void message(std::string_view text);
  // `what` is done/total: on a TTY one bar redrawn in place, otherwise one line per call.
  void update(std::string_view what, int done, int total);
  // Ends an open bar line.
  void finish();
  // A line only under DIFFRUN_PROGRESS_TIMES (the inner phases of a run: each backend's load and steps).
  void timing(std::string_view text);

  bool tty() const { return tty_; }
  bool times() const { return times_; }  // DIFFRUN_PROGRESS_TIMES: timing() prints

 private:
  std::string prefix_;
  bool enabled_;
  bool tty_;
  bool open_ = false;
  bool times_ = false;
  std::string stamp() const;
};

}  // namespace diffrun::cli
