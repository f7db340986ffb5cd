// Typed errors thrown by diffrun's libraries; only cli/main.cpp turns them into exit codes.
#pragma once

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>

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

// The length of the well-formed UTF-8 sequence that starts at s[i] (1 to 4 bytes; no overlong form,
// no surrogate, at most U+10FFFF), or 0 where the bytes there are not valid UTF-8.
inline size_t utf8_sequence_length(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return 1;
  const size_t n = c >= 0xf5 ? 0 : c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 ? 2 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return 0;
  const auto c1 = static_cast<unsigned char>(s[i + 1]);
  if ((c == 0xe0 && c1 < 0xa0) || (c == 0xf0 && c1 < 0x90)) return 0;  // overlong
  if (c == 0xed && c1 >= 0xa0) return 0;                                 // surrogate
  if (c == 0xf4 && c1 >= 0x90) return 0;                                 // past U+10FFFF
  return n;
}

// A value from a file or the command line made safe to echo in one error line: backslash, the quote
// character `quote` (0: none), newline, tab, other control bytes (C0, DEL, UTF-8-encoded C1, so no
// ANSI escape reaches the terminal) and bytes that are not valid UTF-8 are escaped (\\, \n, \t,
// \xNN); past `max_bytes` bytes of the value the rest is cut and "... (N bytes)" says how long it was.
// The one helper for this: `inspect` shows GGUF strings through it too.
inline std::string printable(std::string_view s, size_t max_bytes = 200, char quote = '\'') {
  auto hex = [](unsigned char c) {
    char buf[5];
    std::snprintf(buf, sizeof buf, "\\x%02x", c);
    return std::string(buf);
  };
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    if (i >= max_bytes) {
      out += "... (" + std::to_string(s.size()) + " bytes)";
      break;
    }
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = utf8_sequence_length(s, i);
    if (n == 1 && (c == '\\' || (quote && c == static_cast<unsigned char>(quote)))) {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (n == 0 || c < 0x20 || c == 0x7f) {
      out += hex(c);
    } else if (n == 2 && c == 0xc2 && static_cast<unsigned char>(s[i + 1]) < 0xa0) {  // C1 control
      out += hex(c) + hex(static_cast<unsigned char>(s[i + 1]));
    } else {
      out.append(s.substr(i, n));
    }
    i += n == 0 ? 1 : n;
  }
  return out;
}

}  // namespace diffrun
