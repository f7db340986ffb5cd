// libFuzzer target over the GGUF reader: parse, config, every tensor's data span dequantized or read, fingerprint.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "model/config.hpp"
#include "model/dequant.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"

namespace {

// The reader takes a path and mmaps it: give it an in-memory file (memfd) through /proc/self/fd.
int input_fd() {
  static const int fd = memfd_create("fuzz.gguf", 0);
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = input_fd();
  if (fd < 0 || ftruncate(fd, 0) != 0) __builtin_trap();
  for (size_t done = 0; done < size;) {
    const ssize_t n = pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    if (n <= 0) __builtin_trap();
    done += static_cast<size_t>(n);
  }
  try {
    auto f = diffrun::GgufFile::open("/proc/self/fd/" + std::to_string(fd));
    volatile size_t sink = f->fingerprint().size();
    for (const auto& kv : f->metadata()) sink = sink + kv.value.to_display().size();
    for (const auto& t : f->tensors()) {
      const auto span = f->tensor_data(t);
      if (diffrun::dequant_supported(t.type)) {
        const auto v = diffrun::dequantize_tensor<double>(*f, t);
        sink = sink + v.size();
      } else {
        unsigned acc = 0;
        for (std::byte b : span) acc += static_cast<unsigned>(b);
        sink = sink + acc;
      }
    }
    try {
      const diffrun::ModelConfig cfg = diffrun::config_from_gguf(*f);
      diffrun::validate_tensors(*f, cfg);
      sink = sink + diffrun::describe(cfg).size();
    } catch (const diffrun::ModelError&) {
    }
  } catch (const diffrun::GgufError&) {
  } catch (const diffrun::ModelError&) {
  }
  return 0;
}
