// Two references of one model (the job's f64 and f32-f16store, say) reading each weight row once for both in their
// decode mat-vecs: the mat-vecs are memory bound, and both stream the same matrices every step.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

namespace diffrun::ref {

// One reference's decode mat-vec (matmul with one token over streamed weights), type-erased: `run` decodes rows
// [n0, n1) of the weights into `tile` (room for tile_rows() rows of `value_bytes`-byte values) and writes their
// outputs. Made by matmul (ops/matmul.cpp); run alone or beside another reference's part over the same bytes.
struct MatvecPart {
  const void* key = nullptr;  // the weight matrix's bytes: parts with one key read the same rows
  int64_t rows = 0;           // N outputs
  int64_t cols = 0;           // K inputs
  int value_bytes = 0;        // sizeof the decoded value (4 or 8)
  void (*run)(const MatvecPart& part, int64_t n0, int64_t n1, void* tile) = nullptr;
  void* out = nullptr;
  const void* x = nullptr;
  const void* weights = nullptr;
  const void* bias = nullptr;
};

// Rows a tile holds: about 32 KB of the widest decoded values, so a tile stays in L1/L2 between its decode and
// its dot products.
int64_t tile_rows(int64_t cols, int value_bytes);

// Runs `part` alone on the calling thread's OpenMP team: each thread its contiguous block of tiles.
void run_matvec(const MatvecPart& part);

// The meeting point of two references, seats 0 and 1, that run the same sequence of decode mat-vecs (one model,
// one prompt, the same steps, no injected faults). A seat's k-th mat-vec waits for the other seat's k-th; then
// both seats' OpenMP teams take tiles from one counter, and each tile is decoded and dotted for both parts while
// its bytes are in cache. Every output is computed as run_matvec computes it alone, so the values are the same
// bit for bit whether the seats meet or not; only the time changes.
//
// A seat that will issue no more mat-vecs leaves (its backend's destructor), and the other stops waiting for it.
// Two parts of one rank over different bytes (the sequences differ) part the seats for good: each then runs
// alone. So does a wait longer than kPatience, a guard against a partner stalled on something other than
// this meeting; the pipeline's seats never wait on each other elsewhere.
class SharedWeightReads {
 public:
  void matvec(int seat, const MatvecPart& part);
  void leave(int seat);

  // Mat-vecs run together, and in all (both seats).
  int64_t joined() const;
  int64_t total() const;

 private:
  struct Joint;
  static void run_joint(Joint& joint);

  mutable std::mutex m_;
  std::condition_variable cv_;
  int64_t next_[2] = {0, 0};                  // the rank of each seat's next mat-vec
  const MatvecPart* waiting_[2] = {nullptr, nullptr};  // a seat's part, posted for the other seat's
  std::shared_ptr<Joint> joint_[2];          // handed to a waiting seat by the seat that met it
  bool left_[2] = {false, false};
  bool apart_ = false;
  int64_t joined_ = 0;
};

// A reference's place at a SharedWeightReads (none by default: its mat-vecs run alone).
struct WeightReadSeat {
  std::shared_ptr<SharedWeightReads> reads;
  int index = 0;
};

}  // namespace diffrun::ref
