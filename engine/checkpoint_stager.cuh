// Checkpoint hooks, the recording side: asynchronous device-to-host copies into pinned memory
// (allocated in chunks on first use and reused every step), handed to the sink after the step's
// synchronization as f32 with their native dtype; and isolation-replay uploads of replacements.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "checkpoints/sink.hpp"
#include "engine/device_buffer.cuh"

namespace diffrun::engine {

class CheckpointStager {
 public:
  // Enqueues the copy of the row-major tensor `dev` of `shape` (f32 or f16 device memory) on `stream`.
  void stage(int step, std::string name, int layer, const char* layout, std::vector<int64_t> shape,
             const float* dev, cudaStream_t stream);
  void stage(int step, std::string name, int layer, const char* layout, std::vector<int64_t> shape,
             const __half* dev, cudaStream_t stream);

  // Enqueues the upload of n replacement values (host f32) over `dev`, converted to dev's type.
  void replace(const float* host, float* dev, int64_t n, cudaStream_t stream);
  void replace(const float* host, __half* dev, int64_t n, cudaStream_t stream);

  // After the stream has been synchronized: records every staged checkpoint, in staging order,
  // then starts the next step on the same pinned memory.
  void deliver(Sink& sink);
  // Drops what was staged (a step that failed).
  void discard();

 private:
  struct Pending {
    int step;
    std::string name;
    int layer;
    const char* layout;
    std::vector<int64_t> shape;
    bool is_f16;
    const void* host;  // pinned
    int64_t n;
  };
  struct Chunk {
    PinnedBuffer<unsigned char> mem;
    size_t used = 0;
  };

  void* reserve(size_t bytes);

  std::vector<Chunk> chunks_;
  size_t current_ = 0;
  std::vector<Pending> pending_;
  std::vector<float> widened_;  // f16 → f32 conversion scratch
};

}  // namespace diffrun::engine
