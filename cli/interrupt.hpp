// SIGINT/SIGTERM: remove the run's dump temporaries and exit 130/143; list (or remove) stale ones of killed runs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace diffrun::cli {

// Installs the SIGINT and SIGTERM handlers (once, from main): on a signal the temporaries of every
// live TempGuard are unlinked, one line is written to stderr and the process exits with 128 + the
// signal number (130 for SIGINT, 143 for SIGTERM).
void install_interrupt_handlers();

// While alive, a signal removes "<final_path>.tmp-<pid>", the file a DumpWriter for `final_path`
// writes before its rename (checkpoints/dump.hpp). At most 8 guards are live at once.
class TempGuard {
 public:
  explicit TempGuard(const std::string& final_path);
  ~TempGuard();
  TempGuard(const TempGuard&) = delete;
  TempGuard& operator=(const TempGuard&) = delete;

 private:
  int slot_ = -1;
};

// A dump temporary ("*.tmp-<pid>") in a directory whose writing process no longer runs.
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
