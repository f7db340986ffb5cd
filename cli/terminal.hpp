// Text from a dump or a file made safe for the terminal.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

namespace diffrun::cli {

// A message already made of printable() parts (model/error.hpp), made safe as a whole: control bytes
// (C0, DEL) that reached it some other way are written \xNN (\n, \t); everything else, backslashes
// included, stays as it is.
inline std::string terminal_safe(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char buf[5];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out;
}

}  // namespace diffrun::cli
