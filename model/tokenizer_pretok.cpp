// Pre-tokenizers of byte-level BPE as hand-written scanners over code points (no regex library).
//
// Each scanner reproduces one fixed pattern with the semantics of a backtracking regex engine
// (alternatives tried in order at each position, greedy quantifiers), which is how Hugging Face
// tokenizers (Oniguruma) applies them. The code point classes come from model/unicode_tables.cpp.
// One deliberate difference from llama.cpp: the case-insensitive contractions of llama3/qwen2 follow
// Oniguruma's (?i:...) case folding, under which U+017F LATIN SMALL LETTER LONG S matches 's'.
#include <string>

#include "model/tokenizer_vocab.hpp"
#include "model/unicode.hpp"

namespace diffrun {

const char* pre_tokenizer_name(PreTokenizer p) {
  switch (p) {
    case PreTokenizer::gpt2: return "gpt2";
    case PreTokenizer::llama3: return "llama3";
    case PreTokenizer::qwen2: return "qwen2";
    case PreTokenizer::smollm: return "smollm";
  }
  return "?";
}

PreTokenizer parse_pre_tokenizer(std::string_view pre, std::string& warning) {
  warning.clear();
  if (pre == "default" || pre == "gpt2" || pre.empty()) return PreTokenizer::gpt2;
  if (pre == "llama3" || pre == "llama-bpe" || pre == "llama-v3") return PreTokenizer::llama3;
  if (pre == "qwen2") return PreTokenizer::qwen2;
  if (pre == "smollm" || pre == "starcoder") return PreTokenizer::smollm;
  warning = "unknown tokenizer.ggml.pre '" + std::string(pre) +
            "': using the default (gpt2) pre-tokenizer; token ids may differ from the model's own tokenizer";
  return PreTokenizer::gpt2;
}

namespace {

// The text decoded once into code points with their classes and byte offsets.
struct CodePoints {
  std::vector<uint32_t> cp;   // [n]
  std::vector<uint8_t> cls;   // [n]
  std::vector<size_t> off;    // [n + 1] byte offset of each code point, then the text size

  explicit CodePoints(std::string_view text) {
    cp.reserve(text.size());
    cls.reserve(text.size());
    off.reserve(text.size() + 1);
    size_t pos = 0;
    while (pos < text.size()) {
      const auto b = static_cast<uint8_t>(text[pos]);
      size_t len = 1;
      const uint32_t c = b < 0x80 ? b : utf8_decode(text, pos, len);
      cp.push_back(c);
      cls.push_back(c == unicode_invalid ? uint8_t{unicode_other} : unicode_class(c));
      off.push_back(pos);
      pos += len;
    }
    off.push_back(text.size());
  }
};

class Scanner {
 public:
  Scanner(std::string_view text, std::vector<std::string_view>& out) : text_(text), c_(text), out_(out) {}

  size_t size() const { return c_.cp.size(); }

  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ over [b, e).
  void gpt2(size_t b, size_t e) {
    size_t i = b;
    while (i < e) {
      const uint32_t cp = c_.cp[i];
      if (cp == '\'' && i + 1 < e) {
        const uint32_t c1 = c_.cp[i + 1];
        if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
          i = emit(i, i + 2);
          continue;
        }
        if (i + 2 < e) {
          const uint32_t c2 = c_.cp[i + 2];
          if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
            i = emit(i, i + 3);
            continue;
          }
        }
      }
      const size_t j = (cp == ' ' && i + 1 < e) ? i + 1 : i;  // the optional leading space
      const uint8_t k = c_.cls[j];
      if (k != unicode_whitespace) {  // \p{L}+, \p{N}+ or [^\s\p{L}\p{N}]+ after it
        i = emit(i, run(j + 1, e, k));
        continue;
      }
      i = emit(i, whitespace_end(i, e));
    }
  }

  // The llama3 (max_digits 3) and qwen2 (max_digits 1) pattern over [b, e):
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max}| ?[^\s\p{L}\p{N}]+[\r\n]*|
  // \s*[\r\n]+|\s+(?!\S)|\s+
  void llama3(size_t b, size_t e, size_t max_digits) {
    size_t i = b;
    while (i < e) {
      const uint32_t cp = c_.cp[i];
      const uint8_t k = c_.cls[i];
      if (cp == '\'' && i + 1 < e) {
        const uint32_t c1 = fold(c_.cp[i + 1]);
        if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
          i = emit(i, i + 2);
          continue;
        }
        if (i + 2 < e) {
          const uint32_t c2 = fold(c_.cp[i + 2]);
          if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
            i = emit(i, i + 3);
            continue;
          }
        }
      }
      if (k == unicode_letter) {
        i = emit(i, run(i + 1, e, unicode_letter));
        continue;
      }
      if (cp != '\r' && cp != '\n' && k != unicode_number && i + 1 < e && c_.cls[i + 1] == unicode_letter) {
        i = emit(i, run(i + 2, e, unicode_letter));
        continue;
      }
      if (k == unicode_number) {
        size_t m = i + 1;
        while (m < e && m - i < max_digits && c_.cls[m] == unicode_number) ++m;
        i = emit(i, m);
        continue;
      }
      const size_t j = (cp == ' ' && i + 1 < e) ? i + 1 : i;
      if (c_.cls[j] == unicode_other) {
        size_t m = run(j + 1, e, unicode_other);
        while (m < e && (c_.cp[m] == '\r' || c_.cp[m] == '\n')) ++m;
        i = emit(i, m);
        continue;
      }
      size_t m = i;
      size_t after_newline = 0;  // end of \s*[\r\n]+: just past the last \r or \n of the run
      while (m < e && c_.cls[m] == unicode_whitespace) {
        if (c_.cp[m] == '\r' || c_.cp[m] == '\n') after_newline = m + 1;
        ++m;
      }
      i = emit(i, after_newline ? after_newline : whitespace_end(i, e));
    }
  }

  // \p{N} split off one code point at a time (Hugging Face's Digits(individual_digits=True)), the
  // gpt2 pattern over the text between them.
  void smollm() {
    const size_t n = size();
    size_t start = 0;
    for (size_t i = 0; i < n; ++i) {
      if (c_.cls[i] != unicode_number) continue;
      gpt2(start, i);
      emit(i, i + 1);
      start = i + 1;
    }
    gpt2(start, n);
  }

 private:
  size_t emit(size_t a, size_t b) {
    out_.emplace_back(text_.data() + c_.off[a], c_.off[b] - c_.off[a]);
    return b;
  }

  // End of the run of class k that starts at or before m.
  size_t run(size_t m, size_t e, uint8_t k) const {
    while (m < e && c_.cls[m] == k) ++m;
    return m;
  }

  // \s+(?!\S)|\s+ at i: a whitespace run followed by a non-space gives up its last code point
  // (which then prefixes the next piece), unless it is a single one.
  size_t whitespace_end(size_t i, size_t e) const {
    const size_t m = run(i, e, unicode_whitespace);
    return (m < e && m - i > 1) ? m - 1 : m;
  }

  // ASCII lower case, plus U+017F (long s), which Oniguruma's case folding maps to 's'.
  static uint32_t fold(uint32_t c) {
    if (c >= 'A' && c <= 'Z') return c + 32;
    if (c == 0x17F) return 's';
    return c;
  }

  std::string_view text_;
  CodePoints c_;
  std::vector<std::string_view>& out_;
};

}  // namespace

void pre_tokenize(PreTokenizer p, std::string_view text, std::vector<std::string_view>& out) {
  Scanner s(text, out);
  switch (p) {
    case PreTokenizer::gpt2: s.gpt2(0, s.size()); break;
    case PreTokenizer::llama3: s.llama3(0, s.size(), 3); break;
    case PreTokenizer::qwen2: s.llama3(0, s.size(), 1); break;
    case PreTokenizer::smollm: s.smollm(); break;
  }
}

}  // namespace diffrun
