// What the CPU reference's benchmark programs share: the process's CPU time and the median of a sample.
#pragma once

#include <algorithm>
#include <ctime>
#include <vector>

namespace diffrun::bench_util {

// The process's CPU time in seconds (all threads): on a shared machine, less disturbed than the wall clock.
inline double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The median (the mean of the middle two for an even count); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace diffrun::bench_util
