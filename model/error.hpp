// Typed errors thrown by diffrun's libraries; only cli/main.cpp turns them into exit codes.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace diffrun {

// Base of every error that means "the run could not be done" (exit code 2).
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A malformed or unsupported GGUF file. The message names the file, what is wrong and the byte offset.
struct GgufError : Error {
  GgufError(const std::string& file, uint64_t offset, const std::string& what)
      : Error(file + ": " + what + " (at byte offset " + std::to_string(offset) + ")"),
        file(file), offset(offset) {}
  std::string file;
  uint64_t offset;
};

// A model whose metadata or tensors do not fit what diffrun supports (names the tensor or key).
struct ModelError : Error {
  using Error::Error;
};

// Bad user input: an empty prompt, a prompt longer than the context, a bad flag value.
struct InputError : Error {
  using Error::Error;
};

// A dump file that cannot be read or written (names the file and dataset).
struct DumpError : Error {
  using Error::Error;
};

}  // namespace diffrun
