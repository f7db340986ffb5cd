// SentencePiece (tokenizer.ggml.model = llama): llama.cpp's llm_tokenizer_spm algorithm. Spaces become
// ▁ (U+2581), a ▁ is prepended at the start and after each special token when add_space_prefix, then
// adjacent symbols (UTF-8 characters at first) merge into the piece of highest score, leftmost first
// among equals. Only normal and user-defined pieces are merge results or emitted as text, as in
// SentencePiece; what is left unmatched falls back to <0xNN> byte tokens (or the unknown token).
#include <queue>

#include <fmt/format.h>

#include "model/error.hpp"
#include "model/tokenizer_impl.hpp"
#include "model/unicode.hpp"

namespace diffrun {
namespace {

constexpr std::string_view space_mark = "\xE2\x96\x81";  // ▁

class SpmTokenizer final : public VocabTokenizer {
 public:
  explicit SpmTokenizer(TokenizerVocab vocab) : VocabTokenizer(std::move(vocab)) {
    if (v_.scores.size() != v_.tokens.size())
      throw ModelError("tokenizer.ggml.scores has " + std::to_string(v_.scores.size()) + " entries for " +
                       std::to_string(v_.tokens.size()) + " tokens");
    strip_leading_space_ = v_.add_space_prefix;
    for (int b = 0; b < 256; ++b) {
      int32_t id = find(fmt::format("<0x{:02X}>", b));
      if (id < 0) id = find(std::string(1, static_cast<char>(b)));
      byte_id_[b] = id >= 0 ? id : v_.unk;
    }
    text_.resize(v_.tokens.size());
    for (size_t i = 0; i < v_.tokens.size(); ++i) {
      const std::string& p = v_.tokens[i];
      switch (v_.types[i]) {
        case TokenType::control:
        case TokenType::unknown:
          text_[i] = p;
          break;
        case TokenType::byte:
          text_[i] = byte_of(p, i);
          break;
        default:
          for (size_t pos = 0; pos < p.size();) {
            if (std::string_view(p).substr(pos).starts_with(space_mark)) {
              text_[i] += ' ';
              pos += space_mark.size();
            } else {
              text_[i] += p[pos++];
            }
          }
      }
    }
  }

 protected:
  bool has_byte_token(uint8_t b) const override { return byte_id_[b] >= 0 && byte_id_[b] != v_.unk; }

  void encode_text(std::string_view text, std::vector<int32_t>& out) const override {
    std::string s;
    s.reserve(text.size() + text.size() / 2 + 3);
    if (v_.add_space_prefix) s += space_mark;
    for (char c : text) {
      if (c == ' ')
        s += space_mark;
      else
        s += c;
    }

    std::vector<Sym> syms;
    for (size_t pos = 0; pos < s.size();) {
      size_t len;
      utf8_decode(s, pos, len);
      const auto i = static_cast<int32_t>(syms.size());
      syms.push_back({static_cast<uint32_t>(pos), static_cast<uint32_t>(len), i - 1, -1});
      if (i > 0) syms[i - 1].next = i;
      pos += len;
    }

    std::priority_queue<Bigram> queue;
    const auto try_add = [&](int32_t l, int32_t r) {
      if (l < 0 || r < 0) return;
      const std::string_view t(s.data() + syms[l].start, syms[l].n + syms[r].n);
      const int32_t id = find(t);
      if (id < 0 || !is_text(id)) return;
      queue.push({v_.scores[static_cast<size_t>(id)], l, r, static_cast<uint32_t>(t.size())});
    };
    for (int32_t i = 1; i < static_cast<int32_t>(syms.size()); ++i) try_add(i - 1, i);
    while (!queue.empty()) {
      const Bigram b = queue.top();
      queue.pop();
      Sym& l = syms[b.left];
      Sym& r = syms[b.right];
      if (l.n == 0 || r.n == 0 || l.n + r.n != b.size) continue;
      l.n += r.n;
      r.n = 0;
      l.next = r.next;
      if (r.next >= 0) syms[r.next].prev = b.left;
      try_add(l.prev, b.left);
      try_add(b.left, l.next);
    }

    for (int32_t i = syms.empty() ? -1 : 0; i >= 0; i = syms[i].next) {
      const std::string_view t(s.data() + syms[i].start, syms[i].n);
      if (const int32_t id = find(t); id >= 0 && is_text(id)) {
        out.push_back(id);
        continue;
      }
      for (char c : t) {
        const int32_t id = byte_id_[static_cast<uint8_t>(c)];
        if (id < 0)
          throw InputError(fmt::format("byte 0x{:02x} has no <0x{:02X}> token and the model has no unknown token",
                                       static_cast<uint8_t>(c), static_cast<uint8_t>(c)));
        out.push_back(id);
      }
    }
  }

 private:
  struct Sym {
    uint32_t start, n;  // bytes of the symbol in the escaped text; n = 0 once merged away
    int32_t prev, next;
  };
  struct Bigram {
    float score;
    int32_t left, right;
    uint32_t size;
    bool operator<(const Bigram& o) const { return score != o.score ? score < o.score : left > o.left; }
  };

  bool is_text(int32_t id) const {
    const TokenType t = type(id);
    return t == TokenType::normal || t == TokenType::user_defined;
  }

  static std::string byte_of(const std::string& p, size_t id) {
    if (p.size() == 6 && p.starts_with("<0x") && p[5] == '>') {
      unsigned v = 0;
      bool ok = true;
      for (size_t k = 3; k < 5; ++k) {
        const char c = p[k];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= static_cast<unsigned>(c - '0');
        else if (c >= 'A' && c <= 'F') v |= static_cast<unsigned>(c - 'A' + 10);
        else if (c >= 'a' && c <= 'f') v |= static_cast<unsigned>(c - 'a' + 10);
        else ok = false;
      }
      if (ok) return std::string(1, static_cast<char>(v));
    }
    throw ModelError("token " + std::to_string(id) + " '" + printable(p) + "' has type byte but is not <0xNN>");
  }

  std::array<int32_t, 256> byte_id_{};  // <0xNN> token of each byte (or the byte's own piece, or unk)
};

}  // namespace

std::unique_ptr<Tokenizer> make_spm_tokenizer(TokenizerVocab vocab) {
  return std::make_unique<SpmTokenizer>(std::move(vocab));
}

}  // namespace diffrun
