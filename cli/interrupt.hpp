// SIGINT/SIGTERM/SIGPIPE/SIGHUP: remove the run's dump temporaries and exit 128 + the signal; list (or remove) stale ones of killed runs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace diffrun::cli {

// Installs the SIGINT, SIGTERM, SIGPIPE and SIGHUP handlers (once, from main): on a signal the
// temporaries of every live TempGuard are unlinked, one line is written to stderr and the process
// exits with 128 + the signal number (130 for SIGINT, 143 for SIGTERM, 141 for SIGPIPE, 129 for SIGHUP).
void install_interrupt_handlers();

// While alive, a signal removes dump_temporary_path(final_path, pid) ("<final_path>.diffrun-tmp-<pid>"),
// the file a DumpWriter for `final_path` writes before its rename (dump/dump.hpp). At most 8
// guards are live at once.
class TempGuard {
 public:
  explicit TempGuard(const std::string& final_path);
  ~TempGuard();
  TempGuard(const TempGuard&) = delete;
  TempGuard& operator=(const TempGuard&) = delete;

 private:
  int slot_ = -1;
};

// A dump temporary ("*.diffrun-tmp-<pid>": a regular file, not a symlink, starting with HDF5's
// signature) in a directory whose writing process no longer runs. Other files are never listed, so
// --remove-stale removes diffrun's own temporaries only.
struct StaleTemp {
  std::string path;
  uint64_t bytes = 0;
};
std::vector<StaleTemp> stale_temporaries(const std::string& dir);

// Prints one warning listing the stale temporaries in `dir` (with `remove`: removes them and says so).
void report_stale_temporaries(const std::string& dir, bool remove);

// A new run id: UTC time, pid and random bits ("20261123T052900Z-1234-9f3a1c0e").
std::string new_run_id();

}  // namespace diffrun::cli
