// Pre-tokenizers of byte-level BPE as hand-written scanners over code points (no regex library).
//
// Pre-tokenizers that Hugging Face writes as a Sequence of Split/Digits/Punctuation steps (falcon,
// deepseek, llama.cpp's default) are applied as llama.cpp applies its list of patterns: each step
// splits every piece of the previous one into its matches and the text between them.
//
// Each scanner reproduces one fixed pattern with the semantics of a backtracking regex engine
// (alternatives tried in order at each position, greedy quantifiers), which is how Hugging Face
// tokenizers (Oniguruma) applies them. The code point classes come from model/unicode_tables.cpp.
// One deliberate difference from llama.cpp: the case-insensitive contractions of llama3/qwen2 follow
// Oniguruma's (?i:...) case folding, under which U+017F LATIN SMALL LETTER LONG S matches 's'.
#include <string>
#include <utility>
#include <vector>

#include "model/tokenizer_vocab.hpp"
#include "model/unicode.hpp"

namespace diffrun {

const char* pre_tokenizer_name(PreTokenizer p) {
  switch (p) {
    case PreTokenizer::gpt2: return "gpt2";
    case PreTokenizer::llama3: return "llama3";
    case PreTokenizer::qwen2: return "qwen2";
    case PreTokenizer::smollm: return "smollm";
    case PreTokenizer::qwen35: return "qwen35";
    case PreTokenizer::falcon: return "falcon";
    case PreTokenizer::deepseek_llm: return "deepseek-llm";
    case PreTokenizer::deepseek_coder: return "deepseek-coder";
    case PreTokenizer::fallback: return "default";
  }
  return "?";
}

PreTokenizer parse_pre_tokenizer(std::string_view pre, std::string& warning) {
  warning.clear();
  // The names llama.cpp (src/llama-vocab.cpp) maps to these patterns.
  if (pre == "default") return PreTokenizer::fallback;
  if (pre.empty()) {
    warning = "tokenizer.ggml.pre is missing: using llama.cpp's default pre-tokenizer; token ids may differ "
              "from the model's own tokenizer";
    return PreTokenizer::fallback;
  }
  if (pre == "gpt2" || pre == "gpt-2" || pre == "mpt" || pre == "olmo" || pre == "phi-2") return PreTokenizer::gpt2;
  if (pre == "llama3" || pre == "llama-bpe" || pre == "llama-v3" || pre == "dbrx" || pre == "smaug-bpe")
    return PreTokenizer::llama3;
  if (pre == "qwen2" || pre == "deepseek-r1-qwen" || pre == "stablelm2") return PreTokenizer::qwen2;
  if (pre == "qwen35") return PreTokenizer::qwen35;
  if (pre == "smollm" || pre == "starcoder" || pre == "refact" || pre == "command-r") return PreTokenizer::smollm;
  if (pre == "falcon") return PreTokenizer::falcon;
  if (pre == "deepseek-llm") return PreTokenizer::deepseek_llm;
  if (pre == "deepseek-coder") return PreTokenizer::deepseek_coder;
  warning = "unknown tokenizer.ggml.pre '" + std::string(pre) +
            "': using the gpt2 pre-tokenizer; token ids may differ from the model's own tokenizer";
  return PreTokenizer::gpt2;
}

namespace {

// The text decoded once into code points with their classes and byte offsets.
struct CodePoints {
  std::vector<uint32_t> cp;   // [n]
  std::vector<uint8_t> cls;   // [n] letter, number, whitespace or other
  std::vector<uint8_t> ext;   // [n] as cls, with punctuation and mark told apart from other
  std::vector<size_t> off;    // [n + 1] byte offset of each code point, then the text size

  explicit CodePoints(std::string_view text) {
    cp.reserve(text.size());
    cls.reserve(text.size());
    ext.reserve(text.size());
    off.reserve(text.size() + 1);
    size_t pos = 0;
    while (pos < text.size()) {
      const auto b = static_cast<uint8_t>(text[pos]);
      size_t len = 1;
      const uint32_t c = b < 0x80 ? b : utf8_decode(text, pos, len);
      cp.push_back(c);
      const uint8_t k = c == unicode_invalid ? uint8_t{unicode_other} : unicode_class(c);
      ext.push_back(k);
      cls.push_back(k & (unicode_letter | unicode_number | unicode_whitespace));
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
  // With `marks` (qwen35), \p{L}+ becomes [\p{L}\p{M}]+ and [^\s\p{L}\p{N}]+ becomes [^\s\p{L}\p{M}\p{N}]+.
  void llama3(size_t b, size_t e, size_t max_digits, bool marks = false) {
    const auto word = [&](size_t m) { return c_.cls[m] == unicode_letter || (marks && c_.ext[m] == unicode_mark); };
    const auto word_end = [&](size_t m) {
      while (m < e && word(m)) ++m;
      return m;
    };
    const auto other = [&](size_t m) { return c_.cls[m] == unicode_other && !(marks && c_.ext[m] == unicode_mark); };
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
      if (word(i)) {
        i = emit(i, word_end(i + 1));
        continue;
      }
      if (cp != '\r' && cp != '\n' && k != unicode_number && i + 1 < e && word(i + 1)) {
        i = emit(i, word_end(i + 2));
        continue;
      }
      if (k == unicode_number) {
        size_t m = i + 1;
        while (m < e && m - i < max_digits && c_.cls[m] == unicode_number) ++m;
        i = emit(i, m);
        continue;
      }
      const size_t j = (cp == ' ' && i + 1 < e) ? i + 1 : i;
      if (other(j)) {
        size_t m = j + 1;
        while (m < e && other(m)) ++m;
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

  // falcon: [\p{P}\$\+<=>\^~\|`]+, then the gpt2 pattern, then [0-9][0-9][0-9].
  // llama.cpp's default: [\p{P}\$\+<=>\^~\|]+, the gpt2 pattern, \p{N}+, [0-9][0-9][0-9].
  void falcon(bool fallback) {
    auto chunks = whole();
    split(chunks, [&](size_t i, size_t e) {
      const auto punct = [&](size_t m) {
        const uint32_t c = c_.cp[m];
        return c_.ext[m] == unicode_punctuation || c == '$' || c == '+' || c == '<' || c == '=' || c == '>' ||
               c == '^' || c == '~' || c == '|' || (!fallback && c == '`');
      };
      size_t m = i;
      while (m < e && punct(m)) ++m;
      return m;
    });
    each(chunks, [&](size_t b, size_t e) { gpt2(b, e); });
    if (fallback) split(chunks, [&](size_t i, size_t e) { return run(i, e, unicode_number); });
    split(chunks, [&](size_t i, size_t e) {
      const auto digit = [&](size_t m) { return c_.cp[m] >= '0' && c_.cp[m] <= '9'; };
      return i + 3 <= e && digit(i) && digit(i + 1) && digit(i + 2) ? i + 3 : i;
    });
    flush(chunks);
  }

  // deepseek-llm: [\r\n], \s?[cased letters]+, \s?[!-/:-~！-／：-～‘-‟　-。]+, \s+$, [一-龥ࠀ-一가-퟿]+, \p{N}+.
  // deepseek-coder: [\r\n], \s?\p{L}+, \s?\p{P}+, [一-龥ࠀ-一가-퟿]+, \p{N}.
  void deepseek(bool coder) {
    auto chunks = whole();
    split(chunks, [&](size_t i, size_t) { return c_.cp[i] == '\r' || c_.cp[i] == '\n' ? i + 1 : i; });
    const auto space_run = [&](auto in_set) {
      return [this, in_set](size_t i, size_t e) {
        const size_t j = c_.cls[i] == unicode_whitespace && i + 1 < e && in_set(i + 1) ? i + 1 : i;
        size_t m = j;
        while (m < e && in_set(m)) ++m;
        return m == j ? i : m;
      };
    };
    if (coder) {
      split(chunks, space_run([this](size_t m) { return c_.cls[m] == unicode_letter; }));
      split(chunks, space_run([this](size_t m) { return c_.ext[m] == unicode_punctuation; }));
    } else {
      split(chunks, space_run([this](size_t m) { return deepseek_letter(c_.cp[m]); }));
      split(chunks, space_run([this](size_t m) {
        const uint32_t c = c_.cp[m];
        return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x7E) || (c >= 0xFF01 && c <= 0xFF0F) ||
               (c >= 0xFF1A && c <= 0xFF5E) || (c >= 0x2018 && c <= 0x201F) || (c >= 0x3000 && c <= 0x3002);
      }));
      split(chunks, [&](size_t i, size_t e) {
        const size_t m = run(i, e, unicode_whitespace);
        return m == e ? e : i;
      });
    }
    split(chunks, [&](size_t i, size_t e) {
      const auto cjk = [&](size_t m) {
        const uint32_t c = c_.cp[m];
        return (c >= 0x4E00 && c <= 0x9FA5) || (c >= 0x0800 && c <= 0x4E00) || (c >= 0xAC00 && c <= 0xD7FF);
      };
      size_t m = i;
      while (m < e && cjk(m)) ++m;
      return m;
    });
    if (coder) {
      split(chunks, [&](size_t i, size_t) { return c_.cls[i] == unicode_number ? i + 1 : i; });
    } else {
      split(chunks, [&](size_t i, size_t e) { return run(i, e, unicode_number); });
    }
    flush(chunks);
  }

 private:
  using Ranges = std::vector<std::pair<size_t, size_t>>;  // [begin, end) in code points

  Ranges whole() const { return size() ? Ranges{{0, size()}} : Ranges{}; }

  // One step of a sequence: every piece is split into the matches of `match` and the text between
  // them. match(i, e) gives the end of the match that starts at i within a piece ending at e, or i
  // where none starts there; the leftmost match wins, as a regex search finds it.
  template <class Match>
  void split(Ranges& chunks, Match match) {
    Ranges next;
    for (const auto& [b, e] : chunks) {
      size_t gap = b;
      for (size_t i = b; i < e;) {
        const size_t m = match(i, e);
        if (m == i) {
          ++i;
          continue;
        }
        if (gap < i) next.emplace_back(gap, i);
        next.emplace_back(i, m);
        i = gap = m;
      }
      if (gap < e) next.emplace_back(gap, e);
    }
    chunks.swap(next);
  }

  // A step given by one of the scanners above, which emit their pieces.
  template <class Scan>
  void each(Ranges& chunks, Scan scan) {
    Ranges next;
    sink_ = &next;
    for (const auto& [b, e] : chunks) scan(b, e);
    sink_ = nullptr;
    chunks.swap(next);
  }

  void flush(const Ranges& chunks) {
    for (const auto& [b, e] : chunks) emit(b, e);
  }

  // The letters of deepseek-llm's pattern, as its tokenizer.json spells them (cased scripts only).
  static bool deepseek_letter(uint32_t c) {
    static constexpr std::pair<uint32_t, uint32_t> ranges[] = {
        {0x41, 0x5A}, {0x61, 0x7A}, {0xB5, 0xB5}, {0xC0, 0xD6}, {0xD8, 0xF6}, {0xF8, 0x1BA}, {0x1BC, 0x1BF},
        {0x1C4, 0x293}, {0x295, 0x2AF}, {0x370, 0x373}, {0x376, 0x377}, {0x37B, 0x37D}, {0x37F, 0x37F},
        {0x386, 0x386}, {0x388, 0x38A}, {0x38C, 0x38C}, {0x38E, 0x3A1}, {0x3A3, 0x3F5}, {0x3F7, 0x481},
        {0x48A, 0x52F}, {0x531, 0x556}, {0x10A0, 0x10C5}, {0x13A0, 0x13F5}, {0x13F8, 0x13FD}, {0x1C90, 0x1CBA},
        {0x1CBD, 0x1CBF}, {0x1D00, 0x1D2B}, {0x1D6B, 0x1D77}, {0x1D79, 0x1D9A}, {0x1E00, 0x1F15},
        {0x1F18, 0x1F1D}, {0x1F20, 0x1F45}, {0x1F48, 0x1F4D}, {0x1F50, 0x1F57}, {0x1F59, 0x1F59},
        {0x1F5B, 0x1F5B}, {0x1F5D, 0x1F5D}, {0x1F5F, 0x1F7D}, {0x1F80, 0x1FB4}, {0x1FB6, 0x1FBC},
        {0x1FBE, 0x1FBE}, {0x1FC2, 0x1FC4}, {0x1FC6, 0x1FCC}, {0x1FD0, 0x1FD3}, {0x1FD6, 0x1FDB},
        {0x1FE0, 0x1FEC}, {0x1FF2, 0x1FF4}, {0x1FF6, 0x1FFC}, {0x2102, 0x2102}, {0x2107, 0x2107},
        {0x210A, 0x2113}, {0x2115, 0x2115}, {0x2119, 0x211D}, {0x2124, 0x2124}, {0x2126, 0x2126},
        {0x2128, 0x2128}, {0x212A, 0x212D}, {0x212F, 0x2134}, {0x2139, 0x2139}, {0x213C, 0x213F},
        {0x2145, 0x2149}, {0x214E, 0x214E}, {0x2183, 0x2184}, {0x2C00, 0x2C7B}, {0x2C7E, 0x2CE4},
        {0x2CEB, 0x2CEE}, {0x2CF2, 0x2CF3}, {0xA640, 0xA66D}, {0xA680, 0xA69B}, {0xA722, 0xA76F},
        {0xA771, 0xA787}, {0xA78B, 0xA78E}, {0xAB70, 0xABBF}, {0xFB00, 0xFB06}, {0xFB13, 0xFB17},
        {0xFF21, 0xFF3A}, {0xFF41, 0xFF5A}, {0x10400, 0x1044F}, {0x104B0, 0x104D3}, {0x104D8, 0x104FB},
        {0x10C80, 0x10CB2}, {0x10CC0, 0x10CF2}, {0x118A0, 0x118DF}, {0x1E900, 0x1E943}};
    for (const auto& [lo, hi] : ranges)
      if (c >= lo && c <= hi) return true;
    return false;
  }

 private:
  size_t emit(size_t a, size_t b) {
    if (sink_) sink_->emplace_back(a, b);
    else out_.emplace_back(text_.data() + c_.off[a], c_.off[b] - c_.off[a]);
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
  Ranges* sink_ = nullptr;  // where emit() goes during a sequence step
};

}  // namespace

void pre_tokenize(PreTokenizer p, std::string_view text, std::vector<std::string_view>& out) {
  Scanner s(text, out);
  switch (p) {
    case PreTokenizer::gpt2: s.gpt2(0, s.size()); break;
    case PreTokenizer::llama3: s.llama3(0, s.size(), 3); break;
    case PreTokenizer::qwen2: s.llama3(0, s.size(), 1); break;
    case PreTokenizer::smollm: s.smollm(); break;
    case PreTokenizer::qwen35: s.llama3(0, s.size(), 1, true); break;
    case PreTokenizer::falcon: s.falcon(false); break;
    case PreTokenizer::deepseek_llm: s.deepseek(false); break;
    case PreTokenizer::deepseek_coder: s.deepseek(true); break;
    case PreTokenizer::fallback: s.falcon(true); break;
  }
}

}  // namespace diffrun
