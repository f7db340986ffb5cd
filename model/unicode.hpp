// Code point classes for the pre-tokenizers (letter, number, whitespace, punctuation, mark) and a lenient UTF-8 decoder.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace diffrun {

enum UnicodeClass : uint8_t {
  unicode_other = 0,
  unicode_letter = 1,      // \p{L}
  unicode_number = 2,      // \p{N}
  unicode_whitespace = 4,  // \s (White_Space)
  unicode_punctuation = 8, // \p{P}, a kind of other ([^\s\p{L}\p{N}])
  unicode_mark = 16,       // \p{M}, a kind of other
};

struct UnicodeRange {
  uint32_t first, last;
  uint8_t cls;
};

// Generated tables (model/unicode_tables.cpp, written by scripts/gen_unicode_tables.py).
extern const char* const unicode_tables_version;  // the Unicode version of Python's unicodedata
extern const uint8_t unicode_latin1_class[256];
extern const UnicodeRange unicode_ranges[];
extern const size_t unicode_ranges_count;

// Marks a byte that does not start a valid UTF-8 sequence; it decodes as one unit of class other.
inline constexpr uint32_t unicode_invalid = 0xFFFFFFFFu;

uint8_t unicode_class(uint32_t cp);

// Decodes the code point at s[pos]; `len` gets its byte length (1 for an invalid byte, which yields
// unicode_invalid). Rejects overlong forms, surrogates and values above U+10FFFF.
uint32_t utf8_decode(std::string_view s, size_t pos, size_t& len);

// Appends the UTF-8 encoding of a valid code point.
void utf8_append(std::string& out, uint32_t cp);

}  // namespace diffrun
