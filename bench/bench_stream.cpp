// Benchmark of the main job's comparator (diff::StreamComparison) on two dumps of a run: every step's
// checkpoints read into memory first, then fed as the pipeline feeds them (the engine's step in one batch,
// then the reference's, add_all, end_step) and timed per step, and its finish() after the last, so that the
// comparison's own cost is seen without the backends beside it. Prints per step the median seconds and microseconds a checkpoint, and a
// hash of the results (failures, worst errors) so that two builds can be checked to compare alike.
// Prints figures; not a test.
//
//   bench_stream ENGINE.h5 REFERENCE.h5 [--preset NAME] [--threads N] [--reps N] [--batch N]
//
// --batch N feeds each side in batches of N checkpoints (the pipeline takes what has arrived, up to a byte
// bound); 0 (default) feeds a side's step at once.
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench/bench_util.hpp"
#include "diff/stream.hpp"
#include "diff/tolerances.hpp"
#include "dump/dump.hpp"
#include "model/error.hpp"

namespace {

using diffrun::DatasetInfo;
using diffrun::diff::StreamComparison;
using diffrun::diff::StreamSide;

struct SideStep {
  std::vector<DatasetInfo> infos;
  std::vector<std::shared_ptr<const std::vector<float>>> values;
  std::vector<int32_t> tokens;
};

uint64_t mix(uint64_t h, double v) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof bits);
  return (h ^ bits) * 0x100000001b3ull;
}

}  // namespace

int main(int argc, char** argv) {
  std::string paths[2], preset = "f32_vs_f64";
  int threads = 4, reps = 5, batch = 0, n_paths = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--preset") && i + 1 < argc) {
      preset = argv[++i];
    } else if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--batch") && i + 1 < argc) {
      batch = std::atoi(argv[++i]);
    } else if (argv[i][0] != '-' && n_paths < 2) {
      paths[n_paths++] = argv[i];
    } else {
      n_paths = -1;
      break;
    }
  }
  if (n_paths != 2 || threads < 1 || reps < 1 || batch < 0) {
    std::fprintf(stderr, "usage: bench_stream ENGINE.h5 REFERENCE.h5 [--preset NAME] [--threads N] [--reps N] [--batch N]\n");
    return 2;
  }
  try {
    const diffrun::DumpReader dumps[2] = {diffrun::DumpReader(paths[0]), diffrun::DumpReader(paths[1])};
    const std::vector<int> steps = dumps[1].steps();
    std::vector<SideStep> held[2];
    for (int side : {0, 1}) {
      for (int s : steps) {
        SideStep st;
        for (const DatasetInfo& info : dumps[side].datasets(s)) {
          if (info.is_int) {
            st.tokens = dumps[side].read_ids(s, info.name);
            continue;
          }
          st.values.push_back(std::make_shared<const std::vector<float>>(dumps[side].read(s, info.name)));
          st.infos.push_back(info);
        }
        held[side].push_back(std::move(st));
      }
    }
    omp_set_num_threads(threads);
    const diffrun::diff::ToleranceSet tolerances = diffrun::diff::preset_tolerances(preset);
    std::vector<std::vector<double>> seconds(steps.size());
    std::vector<double> finish_s;  // StreamComparison::finish, after the last step
    uint64_t hash = 0;
    for (int r = 0; r < reps; ++r) {
      StreamComparison sc(dumps[0].meta(), dumps[1].meta(), tolerances);
      for (size_t i = 0; i < steps.size(); ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int side : {0, 1}) {
          const SideStep& st = held[side][i];
          const StreamSide id = side == 0 ? StreamSide::engine : StreamSide::reference;
          sc.add_tokens(id, steps[i], st.tokens);
          const size_t n = st.infos.size(), per = batch > 0 ? static_cast<size_t>(batch) : n;
          for (size_t k0 = 0; k0 < n; k0 += per) {
            std::vector<std::pair<DatasetInfo, StreamComparison::Values>> b;
            for (size_t k = k0; k < std::min(n, k0 + per); ++k) b.emplace_back(st.infos[k], st.values[k]);
            sc.add_all(id, std::move(b));
          }
        }
        sc.end_step(steps[i]);
        seconds[i].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      const auto f0 = std::chrono::steady_clock::now();
      const diffrun::diff::Comparison c = sc.finish(paths[0], paths[1], {}, {});
      finish_s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - f0).count());
      uint64_t h = mix(0xcbf29ce484222325ull, static_cast<double>(c.results.size()));
      for (const auto& cr : c.results) {
        h = mix(h, cr.failed() ? 1.0 : 0.0);
        if (cr.metrics) h = mix(mix(h, cr.metrics->rel_l2), cr.metrics->max_abs);
      }
      hash = h;
    }
    double total = 0;
    for (size_t i = 0; i < steps.size(); ++i) {
      const double s = diffrun::bench_util::median(seconds[i]);
      total += s;
      const size_t n = held[1][i].infos.size();
      std::printf("step %3d  %4zu checkpoints  %8.4f s  %7.2f us/checkpoint (median of %d)\n", steps[i], n, s,
                  1e6 * s / static_cast<double>(n), reps);
    }
    std::printf("finish   %.4f s (median of %d)\n", diffrun::bench_util::median(finish_s), reps);
    std::printf("all steps %.4f s on %d threads; results hash %016llx\n", total, threads,
                static_cast<unsigned long long>(hash));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_stream: %s\n", e.what());
    return 2;
  }
  return 0;
}
