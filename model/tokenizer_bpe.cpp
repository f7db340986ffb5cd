// Byte-level BPE (tokenizer.ggml.model = gpt2): pre-tokenize, map bytes to GPT-2's byte characters,
// merge adjacent symbols by merge rank (lowest rank first, leftmost first among equals).
//
// Symbols are ids. A merge whose parts or result are not vocabulary pieces gets a synthetic id past
// the vocabulary so that it still takes part in merging (llama.cpp matches merges by string); a
// symbol left with a synthetic id at the end is emitted byte by byte. A byte whose character is not
// in the vocabulary (SmolLM2 lacks a few control bytes) becomes the unknown token, or an InputError
// when the model has none or its unknown token is a control token (SmolLM2's is <|endoftext|>;
// Hugging Face would silently drop the byte).
#include <algorithm>

#include <fmt/format.h>

#include "model/error.hpp"
#include "model/tokenizer_impl.hpp"
#include "model/unicode.hpp"

namespace diffrun {
namespace {

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the others for U+0100 on.
std::array<uint32_t, 256> byte_to_codepoint() {
  std::array<uint32_t, 256> map{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    map[b] = printable ? b : next++;
  }
  return map;
}

class BpeTokenizer final : public VocabTokenizer {
 public:
  explicit BpeTokenizer(TokenizerVocab vocab) : VocabTokenizer(std::move(vocab)) {
    const auto cps = byte_to_codepoint();
    std::unordered_map<uint32_t, uint8_t> cp_to_byte;
    for (uint32_t b = 0; b < 256; ++b) {
      utf8_append(byte_char_[b], cps[b]);
      cp_to_byte[cps[b]] = static_cast<uint8_t>(b);
    }

    TokenIndex synthetic;  // pieces named by merges that the vocabulary lacks
    int32_t next_id = n_vocab();
    const auto intern = [&](std::string_view s) {
      if (int32_t id = find(s); id >= 0) return id;
      auto [it, added] = synthetic.try_emplace(std::string(s), next_id);
      if (added) ++next_id;
      return it->second;
    };
    for (int b = 0; b < 256; ++b) {
      byte_id_[b] = find(byte_char_[b]);
      byte_sym_[b] = intern(byte_char_[b]);
    }
    merges_.reserve(v_.merges.size() * 2);
    for (size_t r = 0; r < v_.merges.size(); ++r) {
      const std::string& m = v_.merges[r];
      const size_t sp = m.find(' ', 1);
      if (sp == std::string::npos || sp + 1 == m.size())
        throw ModelError("tokenizer.ggml.merges[" + std::to_string(r) + "] = '" + printable(m) + "' is not 'left right'");
      const std::string_view left(m.data(), sp);
      const std::string_view right(m.data() + sp + 1, m.size() - sp - 1);
      const int32_t l = intern(left);
      const int32_t rr = intern(right);
      const int32_t res = intern(std::string(left) + std::string(right));
      merges_.try_emplace(key(l, rr), Merge{static_cast<int32_t>(r), res});
    }

    text_.resize(v_.tokens.size());
    for (size_t i = 0; i < v_.tokens.size(); ++i) {
      const std::string& p = v_.tokens[i];
      const TokenType t = v_.types[i];
      if (t == TokenType::control || t == TokenType::unknown || t == TokenType::user_defined) {
        text_[i] = p;
        continue;
      }
      std::string& out = text_[i];
      for (size_t pos = 0; pos < p.size();) {
        size_t len;
        const uint32_t cp = utf8_decode(p, pos, len);
        auto it = cp_to_byte.find(cp);
        if (it != cp_to_byte.end())
          out += static_cast<char>(it->second);
        else
          out.append(p, pos, len);
        pos += len;
      }
    }
  }

 protected:
  bool has_byte_token(uint8_t b) const override { return byte_id_[b] >= 0; }

  void encode_text(std::string_view text, std::vector<int32_t>& out) const override {
    std::vector<std::string_view> words;
    pre_tokenize(v_.pre, text, words);
    Work w;
    for (std::string_view word : words) encode_word(word, w, out);
  }

 private:
  struct Merge {
    int32_t rank;
    int32_t result;
  };
  struct Sym {
    int32_t id;    // -1 once merged into its left neighbour
    int32_t prev;  // symbol indices, -1 at the ends
    int32_t next;
  };
  struct Candidate {
    int32_t rank;
    int32_t left, right;      // symbol indices
    int32_t left_id, right_id;  // their ids when the candidate was made (stale if changed)
    int32_t result;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  struct Work {  // buffers reused across the words of one call
    std::vector<Sym> syms;
    std::vector<Candidate> heap;
    std::string mapped;
  };

  static uint64_t key(int32_t l, int32_t r) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(l)) << 32) | static_cast<uint32_t>(r);
  }

  void push_candidate(Work& w, int32_t l, int32_t r) const {
    auto it = merges_.find(key(w.syms[l].id, w.syms[r].id));
    if (it == merges_.end()) return;
    w.heap.push_back({it->second.rank, l, r, w.syms[l].id, w.syms[r].id, it->second.result});
    std::push_heap(w.heap.begin(), w.heap.end(), std::greater<>{});
  }

  void emit_byte(uint8_t b, std::vector<int32_t>& out) const {
    if (byte_id_[b] >= 0) {
      out.push_back(byte_id_[b]);
    } else if (v_.unk >= 0 && type(v_.unk) != TokenType::control) {
      out.push_back(v_.unk);
    } else if (v_.unk >= 0) {
      throw InputError(fmt::format("byte 0x{:02x} has no token in this vocabulary, and its unknown token '{}' is a "
                                   "control token",
                                   b, printable(v_.tokens[static_cast<size_t>(v_.unk)])));
    } else {
      throw InputError(fmt::format("byte 0x{:02x} has no token in this vocabulary and the model has no unknown token", b));
    }
  }

  void encode_word(std::string_view word, Work& w, std::vector<int32_t>& out) const {
    if (v_.ignore_merges) {
      w.mapped.clear();
      for (char c : word) w.mapped += byte_char_[static_cast<uint8_t>(c)];
      if (int32_t id = find(w.mapped); id >= 0) {
        out.push_back(id);
        return;
      }
    }
    const auto n = static_cast<int32_t>(word.size());
    w.syms.resize(static_cast<size_t>(n));
    for (int32_t i = 0; i < n; ++i) w.syms[i] = {byte_sym_[static_cast<uint8_t>(word[i])], i - 1, i + 1 < n ? i + 1 : -1};
    w.heap.clear();
    for (int32_t i = 0; i + 1 < n; ++i) push_candidate(w, i, i + 1);
    while (!w.heap.empty()) {
      std::pop_heap(w.heap.begin(), w.heap.end(), std::greater<>{});
      const Candidate c = w.heap.back();
      w.heap.pop_back();
      Sym& l = w.syms[c.left];
      Sym& r = w.syms[c.right];
      if (l.id != c.left_id || r.id != c.right_id || l.next != c.right) continue;
      l.id = c.result;
      l.next = r.next;
      if (r.next >= 0) w.syms[r.next].prev = c.left;
      r.id = -1;
      if (l.prev >= 0) push_candidate(w, l.prev, c.left);
      if (l.next >= 0) push_candidate(w, c.left, l.next);
    }
    for (int32_t i = 0; i >= 0 && i < n; i = w.syms[i].next) {
      const int32_t id = w.syms[i].id;
      if (id < n_vocab()) {
        out.push_back(id);
        continue;
      }
      const int32_t end = w.syms[i].next >= 0 ? w.syms[i].next : n;
      for (int32_t b = i; b < end; ++b) emit_byte(static_cast<uint8_t>(word[b]), out);
    }
  }

  std::unordered_map<uint64_t, Merge> merges_;  // (left id, right id) → rank and result
  std::array<std::string, 256> byte_char_;      // GPT-2 byte character of each byte, UTF-8
  std::array<int32_t, 256> byte_id_{};          // its vocabulary id, -1 when absent
  std::array<int32_t, 256> byte_sym_{};         // its symbol id (synthetic when absent)
};

}  // namespace

std::unique_ptr<Tokenizer> make_bpe_tokenizer(TokenizerVocab vocab) {
  if (vocab.merges.empty()) throw ModelError("tokenizer.ggml.merges is missing or empty for a BPE vocabulary");
  return std::make_unique<BpeTokenizer>(std::move(vocab));
}

}  // namespace diffrun
