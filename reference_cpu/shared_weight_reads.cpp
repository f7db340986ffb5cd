// Decode mat-vecs alone or two at a time over the same weight bytes (see shared_weight_reads.hpp).
#include "reference_cpu/shared_weight_reads.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include <omp.h>

namespace diffrun::ref {

namespace {

// A wait for the other seat longer than this parts the seats (SharedWeightReads).
constexpr auto kPatience = std::chrono::seconds(5);

// Tiles a thread of a meeting takes from the counter at once: a few neighbouring tiles, so that each thread
// still streams runs of consecutive rows.
constexpr int64_t kTilesPerTake = 4;

// A tile's values, aligned for the widest of them.
std::unique_ptr<double[]> tile_buffer(int64_t rows, int64_t cols, int value_bytes) {
  return std::unique_ptr<double[]>(new double[(rows * cols * value_bytes + 7) / 8]);
}

}  // namespace

int64_t tile_rows(int64_t cols, int value_bytes) { return std::max<int64_t>(1, 32768 / (cols * value_bytes)); }

void run_matvec(const MatvecPart& part) {
  const int64_t per_tile = tile_rows(part.cols, part.value_bytes);
  const int64_t n_tiles = (part.rows + per_tile - 1) / per_tile;
#pragma omp parallel
  {
    const std::unique_ptr<double[]> tile = tile_buffer(per_tile, part.cols, part.value_bytes);
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n_tiles; ++i) {
      const int64_t n0 = i * per_tile;
      part.run(part, n0, std::min(part.rows, n0 + per_tile), tile.get());
    }
  }
}

struct SharedWeightReads::Joint {
  Joint(const MatvecPart& a, const MatvecPart& b)
      : parts{&a, &b}, rows(a.rows), cols(a.cols), value_bytes(std::max(a.value_bytes, b.value_bytes)),
        per_tile(tile_rows(cols, value_bytes)), n_tiles((rows + per_tile - 1) / per_tile) {}
  // The parts are read only while a tile is taken and not done: a seat returns, and its part ends, once all are.
  const MatvecPart* parts[2];
  const int64_t rows, cols;
  const int value_bytes;
  const int64_t per_tile, n_tiles;
  std::atomic<int64_t> next{0};  // the next tile to take
  std::atomic<int64_t> done{0};  // tiles whose outputs are written (both parts)
};

// Each seat's team takes tiles until none are left; the seat returns once every tile is done, its own outputs
// among them, whichever team wrote them.
void SharedWeightReads::run_joint(Joint& j) {
#pragma omp parallel
  {
    const std::unique_ptr<double[]> tile = tile_buffer(j.per_tile, j.cols, j.value_bytes);
    for (;;) {
      const int64_t i0 = j.next.fetch_add(kTilesPerTake, std::memory_order_relaxed);
      if (i0 >= j.n_tiles) break;
      const int64_t i1 = std::min(j.n_tiles, i0 + kTilesPerTake);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t n0 = i * j.per_tile, n1 = std::min(j.rows, n0 + j.per_tile);
        for (const MatvecPart* p : j.parts) p->run(*p, n0, n1, tile.get());
      }
      j.done.fetch_add(i1 - i0, std::memory_order_release);
    }
  }
  while (j.done.load(std::memory_order_acquire) < j.n_tiles) std::this_thread::yield();
}

void SharedWeightReads::matvec(int seat, const MatvecPart& part) {
  const int other = 1 - seat;
  std::shared_ptr<Joint> joint;
  {
    std::unique_lock lock(m_);
    const int64_t rank = next_[seat]++;
    if (!apart_ && !left_[other]) {
      if (const MatvecPart* theirs = waiting_[other]) {
        // The other seat waits at this rank (it waits only for a rank this seat has not reached, and every seat
        // takes every rank in turn).
        if (theirs->key == part.key && theirs->rows == part.rows && theirs->cols == part.cols) {
          joint = std::make_shared<Joint>(*theirs, part);
          joint_[other] = joint;
          joined_ += 2;
        } else {
          apart_ = true;
        }
        waiting_[other] = nullptr;
        cv_.notify_all();
      } else if (next_[other] <= rank) {
        waiting_[seat] = &part;
        const bool met = cv_.wait_for(lock, kPatience, [&] { return joint_[seat] || apart_ || left_[other]; });
        if (!met) apart_ = true;
        waiting_[seat] = nullptr;
        joint = std::move(joint_[seat]);
      }
    }
  }
  if (joint) {
    run_joint(*joint);
  } else {
    run_matvec(part);
  }
}

void SharedWeightReads::leave(int seat) {
  std::lock_guard lock(m_);
  left_[seat] = true;
  cv_.notify_all();
}

int64_t SharedWeightReads::joined() const {
  std::lock_guard lock(m_);
  return joined_;
}

int64_t SharedWeightReads::total() const {
  std::lock_guard lock(m_);
  return next_[0] + next_[1];
}

}  // namespace diffrun::ref
