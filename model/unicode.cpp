// Code point class lookup over the generated tables, and UTF-8 decoding/encoding.
#include "model/unicode.hpp"

#include <algorithm>

namespace diffrun {

uint8_t unicode_class(uint32_t cp) {
  if (cp < 256) return unicode_latin1_class[cp];
  const UnicodeRange* end = unicode_ranges + unicode_ranges_count;
  const UnicodeRange* it =
      std::upper_bound(unicode_ranges, end, cp, [](uint32_t c, const UnicodeRange& r) { return c < r.first; });
  if (it == unicode_ranges) return unicode_other;
  --it;
  return cp <= it->last ? it->cls : uint8_t{unicode_other};
}

uint32_t utf8_decode(std::string_view s, size_t pos, size_t& len) {
  const auto b = [&](size_t i) { return static_cast<uint8_t>(s[pos + i]); };
  const size_t avail = s.size() - pos;
  const uint8_t c0 = b(0);
  len = 1;
  if (c0 < 0x80) return c0;
  size_t n;
  uint32_t cp;
  uint32_t min;
  if ((c0 & 0xE0) == 0xC0) {
    n = 2, cp = c0 & 0x1F, min = 0x80;
  } else if ((c0 & 0xF0) == 0xE0) {
    n = 3, cp = c0 & 0x0F, min = 0x800;
  } else if ((c0 & 0xF8) == 0xF0) {
    n = 4, cp = c0 & 0x07, min = 0x10000;
  } else {
    return unicode_invalid;
  }
  if (avail < n) return unicode_invalid;
  for (size_t i = 1; i < n; ++i) {
    if ((b(i) & 0xC0) != 0x80) return unicode_invalid;
    cp = (cp << 6) | (b(i) & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return unicode_invalid;
  len = n;
  return cp;
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace diffrun
