// Owning device and pinned-host buffers; allocation failures say how much was needed and how much is free.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include <cuda_runtime.h>

namespace diffrun::engine {

// "12.3 MiB", for memory figures in errors and facts.
std::string mib(uint64_t bytes);

// cudaMalloc that throws Error("not enough device memory for <what>: need X MiB, Y MiB free of Z MiB").
void* device_alloc(size_t bytes, const char* what);
// cudaHostAlloc (pinned, mapped) that throws Error naming `what` and the size.
void* pinned_alloc(size_t bytes, const char* what);
// The device address of mapped pinned memory from pinned_alloc (the same pointer under unified
// addressing).
void* pinned_device_address(void* host);

// A stream capture in flight in this process (a decode graph being captured, on any thread), as a scope around
// cudaStreamBeginCapture .. cudaStreamEndCapture. A call on another thread that synchronizes the whole device while
// a stream captures invalidates that capture (cudaErrorStreamCaptureInvalidated at its next launch), whatever its
// capture mode. cublasDestroy is one: with another thread destroying cuBLAS handles, 300 of 300 captures failed
// (CUDA 13, H200), so one engine let go at the end of its run (its cuBLAS handle) failed another's first decode step
// or recording check beside it. cudaFree and cudaFreeHost, documented as synchronizing, failed none there; they wait
// too. So while a capture is in flight on the device, releases wait in a list and the last capture to end runs them.
// Per device: the current device's captures and releases.
class CaptureInFlight {
 public:
  CaptureInFlight();
  ~CaptureInFlight();
  CaptureInFlight(const CaptureInFlight&) = delete;
  CaptureInFlight& operator=(const CaptureInFlight&) = delete;

 private:
  int device_;
};

// Runs `release` now, or when the last capture in flight on the current device ends (CaptureInFlight). For the
// calls that may synchronize the device: cudaFree, cudaFreeHost, cublasDestroy.
void after_captures(std::function<void()> release);

// cudaFree and cudaFreeHost through after_captures; errors are not reported (a free fails only after a fatal error,
// which the next checked call reports).
void device_free(void* p);
void pinned_free(void* p);

// n elements of T in device memory (uninitialized).
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(size_t n, const char* what) : n_(n) {
    if (n > 0) p_ = static_cast<T*>(device_alloc(n * sizeof(T), what));
  }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return p_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }

 private:
  void release() {
    device_free(p_);
    p_ = nullptr;
    n_ = 0;
  }
  T* p_ = nullptr;
  size_t n_ = 0;
};

// n elements of T in pinned host memory (for asynchronous copies).
template <typename T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(size_t n, const char* what) : n_(n) {
    if (n > 0) {
      p_ = static_cast<T*>(pinned_alloc(n * sizeof(T), what));
      try {
        dev_ = static_cast<T*>(pinned_device_address(p_));
      } catch (...) {
        release();
        throw;
      }
    }
  }
  ~PinnedBuffer() { release(); }
  PinnedBuffer(PinnedBuffer&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), dev_(std::exchange(o.dev_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) {
      release();
      p_ = std::exchange(o.p_, nullptr);
      dev_ = std::exchange(o.dev_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  T* get() const { return p_; }
  // The same memory as kernels address it: a kernel may read what the host wrote before the launch,
  // and its writes are the host's to read after the stream synchronizes.
  T* device() const { return dev_; }
  size_t size() const { return n_; }

 private:
  void release() {
    pinned_free(p_);
    p_ = nullptr;
    dev_ = nullptr;
    n_ = 0;
  }
  T* p_ = nullptr;
  T* dev_ = nullptr;
  size_t n_ = 0;
};

}  // namespace diffrun::engine
