// Private to model/tokenizer*.cpp: the vocabulary-backed base shared by the BPE and SentencePiece tokenizers.
#pragma once

#include <array>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "model/tokenizer_vocab.hpp"

namespace diffrun {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenIndex = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// Holds the vocabulary, matches special tokens and leaves the plain text between them to the subclass.
class VocabTokenizer : public Tokenizer {
 public:
  explicit VocabTokenizer(TokenizerVocab vocab);

  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  const std::string& piece(int32_t id) const override;
  std::string token_text(int32_t id) const override;
  int n_vocab() const override { return static_cast<int>(v_.tokens.size()); }
  int32_t bos() const override { return v_.bos; }
  int32_t eos() const override { return v_.eos; }
  bool is_eog(int32_t id) const override { return eog_.count(id) != 0; }

 protected:
  // Appends the ids of plain text that holds no special token: the whole input, or a stretch of it
  // that starts the input or follows a special token (where SentencePiece adds its dummy prefix).
  virtual void encode_text(std::string_view text, std::vector<int32_t>& out) const = 0;

  // Whether byte b has a token of its own (a byte-level character, a <0xNN> piece), not the unknown one.
  virtual bool has_byte_token(uint8_t b) const = 0;

  TokenType type(int32_t id) const { return v_.types[static_cast<size_t>(id)]; }
  int32_t find(std::string_view s) const {  // -1 when absent
    auto it = index_.find(s);
    return it == index_.end() ? -1 : it->second;
  }
  void check_id(int32_t id) const;  // throws InputError for an id outside the vocabulary

  TokenizerVocab v_;
  TokenIndex index_;                // piece → id (the last id wins for duplicated pieces)
  std::vector<std::string> text_;   // [V] token_text of every id, filled by the subclass
  bool strip_leading_space_ = false;  // decode drops one leading space (SentencePiece dummy prefix)

 private:
  struct Special {
    std::string_view text;
    int32_t id;
    bool always;  // user-defined tokens are matched even without parse_special
  };
  std::vector<Special> specials_;     // longest first
  std::array<bool, 256> special_start_{};
  std::unordered_set<int32_t> eog_;
};

std::unique_ptr<Tokenizer> make_bpe_tokenizer(TokenizerVocab vocab);
std::unique_ptr<Tokenizer> make_spm_tokenizer(TokenizerVocab vocab);

}  // namespace diffrun
