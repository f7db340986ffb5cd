// A step's inputs from mapped pinned host memory (T): the token ids and n_past, read by one small
// kernel instead of two host-to-device copies, so a captured decode graph starts with a kernel.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace diffrun::engine {

// tokens [T] and n_past [1] device; host_tokens [T] and host_n_past [1] the device addresses of
// mapped pinned host memory (PinnedBuffer::device()), written by the host before the launch.
void step_inputs(int32_t* tokens, int32_t* n_past, const int32_t* host_tokens, const int32_t* host_n_past, int T,
                 cudaStream_t stream);

}  // namespace diffrun::engine
