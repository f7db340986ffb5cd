// Tokenizer construction from GGUF metadata, special-token matching and decoding shared by BPE and SPM.
//
// Behaviour decided here (Hugging Face tokenizers is the oracle where llama.cpp and it differ):
// - Special tokens are found leftmost-longest, as HF's added-token matcher does. With parse_special,
//   control, unknown and user-defined tokens are matched; without it only user-defined ones (as HF
//   keeps non-special added tokens and llama.cpp its user-defined tokens).
// - encode(add_bos = true) is "a fresh sequence": BOS when tokenizer.ggml.add_bos_token (default true
//   for SentencePiece, false for BPE), EOS when tokenizer.ggml.add_eos_token.
// - decode returns the exact bytes of the tokens joined, so a UTF-8 sequence split across tokens comes
//   back whole; bytes that never form a valid sequence are returned as they are, not replaced.
#include <algorithm>

#include <fmt/format.h>

#include "model/error.hpp"
#include "model/tokenizer_impl.hpp"
#include "model/unicode.hpp"

namespace diffrun {

VocabTokenizer::VocabTokenizer(TokenizerVocab vocab) : v_(std::move(vocab)) {
  const size_t n = v_.tokens.size();
  if (n == 0) throw ModelError("tokenizer.ggml.tokens is empty");
  if (n > static_cast<size_t>(INT32_MAX)) throw ModelError("tokenizer.ggml.tokens has too many tokens");
  if (v_.types.empty()) v_.types.assign(n, TokenType::normal);
  if (v_.types.size() != n)
    throw ModelError("tokenizer.ggml.token_type has " + std::to_string(v_.types.size()) + " entries for " +
                     std::to_string(n) + " tokens");
  const auto check = [&](int32_t id, const char* key) {
    if (id < -1 || id >= static_cast<int32_t>(n))
      throw ModelError(std::string("tokenizer.ggml.") + key + " = " + std::to_string(id) +
                       " is outside the vocabulary of " + std::to_string(n) + " tokens");
  };
  check(v_.bos, "bos_token_id");
  check(v_.eos, "eos_token_id");
  check(v_.unk, "unknown_token_id");
  check(v_.eot, "eot_token_id");
  check(v_.eom, "eom_token_id");
  warnings_ = v_.warnings;

  index_.reserve(n);
  for (size_t i = 0; i < n; ++i) index_[v_.tokens[i]] = static_cast<int32_t>(i);

  static const char* const eog_texts[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                                          "<|endoftext|>", "<|eom_id|>", "<EOT>"};
  for (int32_t id : {v_.eos, v_.eot, v_.eom})
    if (id >= 0) eog_.insert(id);
  for (size_t i = 0; i < n; ++i) {
    const TokenType t = v_.types[i];
    if (t != TokenType::control && t != TokenType::unknown && t != TokenType::user_defined) continue;
    if (v_.tokens[i].empty()) continue;
    specials_.push_back({v_.tokens[i], static_cast<int32_t>(i), t == TokenType::user_defined});
    special_start_[static_cast<uint8_t>(v_.tokens[i][0])] = true;
    if (t == TokenType::control &&
        std::find(std::begin(eog_texts), std::end(eog_texts), v_.tokens[i]) != std::end(eog_texts))
      eog_.insert(static_cast<int32_t>(i));
  }
  std::stable_sort(specials_.begin(), specials_.end(),
                   [](const Special& a, const Special& b) { return a.text.size() > b.text.size(); });
}

std::vector<int32_t> VocabTokenizer::encode(std::string_view text, bool add_bos, bool parse_special) const {
  // Bytes that are not valid UTF-8 become their byte tokens where the vocabulary has them, never the
  // unknown token (SmolLM2's is <|endoftext|>).
  for (size_t pos = 0; pos < text.size();) {
    size_t len = 1;
    const auto b = static_cast<uint8_t>(text[pos]);
    if (b >= 0x80 && utf8_decode(text, pos, len) == unicode_invalid && !has_byte_token(b))
      throw InputError(fmt::format("invalid UTF-8 at byte offset {} (0x{:02x}), and the vocabulary has no token "
                                   "for that byte",
                                   pos, b));
    pos += len;
  }
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  if (add_bos && v_.add_bos && v_.bos >= 0) out.push_back(v_.bos);
  size_t start = 0;
  size_t i = 0;
  while (i < text.size()) {
    if (!special_start_[static_cast<uint8_t>(text[i])]) {
      ++i;
      continue;
    }
    const Special* match = nullptr;
    for (const Special& s : specials_) {
      if ((parse_special || s.always) && text.substr(i).starts_with(s.text)) {
        match = &s;
        break;
      }
    }
    if (!match) {
      ++i;
      continue;
    }
    if (i > start) encode_text(text.substr(start, i - start), out);
    out.push_back(match->id);
    i += match->text.size();
    start = i;
  }
  if (start < text.size()) encode_text(text.substr(start), out);
  if (add_bos && v_.add_eos && v_.eos >= 0) out.push_back(v_.eos);
  return out;
}

void VocabTokenizer::check_id(int32_t id) const {
  if (id < 0 || id >= n_vocab())
    throw InputError("token id " + std::to_string(id) + " is outside the vocabulary of " +
                     std::to_string(n_vocab()) + " tokens");
}

std::string VocabTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) {
    check_id(id);
    out += text_[static_cast<size_t>(id)];
  }
  if (strip_leading_space_ && !out.empty() && out[0] == ' ') out.erase(0, 1);
  return out;
}

const std::string& VocabTokenizer::piece(int32_t id) const {
  check_id(id);
  return v_.tokens[static_cast<size_t>(id)];
}

std::string VocabTokenizer::token_text(int32_t id) const {
  check_id(id);
  return text_[static_cast<size_t>(id)];
}

std::unique_ptr<Tokenizer> make_tokenizer(TokenizerVocab vocab) {
  return vocab.kind == VocabKind::bpe ? make_bpe_tokenizer(std::move(vocab)) : make_spm_tokenizer(std::move(vocab));
}

TokenizerVocab read_tokenizer_vocab(const GgufFile& file) {
  TokenizerVocab v;
  const std::string model = file.get_string("tokenizer.ggml.model");
  if (model == "gpt2") {
    v.kind = VocabKind::bpe;
  } else if (model == "llama") {
    v.kind = VocabKind::spm;
  } else {
    throw ModelError(file.path() + ": tokenizer.ggml.model '" + printable(model) +
                     "' is not supported (gpt2 for byte-level BPE, llama for SentencePiece)");
  }
  v.tokens = file.get_string_array("tokenizer.ggml.tokens");
  const size_t n = v.tokens.size();
  if (file.find("tokenizer.ggml.token_type")) {
    const auto types = file.get_int_array("tokenizer.ggml.token_type");
    if (types.size() != n)
      throw ModelError(file.path() + ": tokenizer.ggml.token_type has " + std::to_string(types.size()) +
                       " entries for " + std::to_string(n) + " tokens");
    v.types.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      if (types[i] < 0 || types[i] > 6)
        throw ModelError(file.path() + ": tokenizer.ggml.token_type[" + std::to_string(i) + "] = " +
                         std::to_string(types[i]) + " is not a token type (0..6)");
      v.types.push_back(static_cast<TokenType>(types[i]));
    }
  }
  if (v.kind == VocabKind::spm) {
    const auto scores = file.get_float_array("tokenizer.ggml.scores");
    if (scores.size() != n)
      throw ModelError(file.path() + ": tokenizer.ggml.scores has " + std::to_string(scores.size()) +
                       " entries for " + std::to_string(n) + " tokens");
    v.scores.assign(scores.begin(), scores.end());
  } else {
    v.merges = file.get_string_array("tokenizer.ggml.merges");
    std::string warning;
    v.pre = parse_pre_tokenizer(file.get_string("tokenizer.ggml.pre", ""), warning);
    if (!warning.empty()) v.warnings.push_back(warning);
    v.ignore_merges = v.pre == PreTokenizer::llama3;
  }
  const auto id = [&](const char* key) { return static_cast<int32_t>(file.get_int(key, -1)); };
  v.bos = id("tokenizer.ggml.bos_token_id");
  v.eos = id("tokenizer.ggml.eos_token_id");
  v.unk = id("tokenizer.ggml.unknown_token_id");
  v.eot = id("tokenizer.ggml.eot_token_id");
  v.eom = id("tokenizer.ggml.eom_token_id");
  const bool spm = v.kind == VocabKind::spm;
  v.add_bos = file.get_bool("tokenizer.ggml.add_bos_token", spm);
  v.add_eos = file.get_bool("tokenizer.ggml.add_eos_token", false);
  v.add_space_prefix = spm && file.get_bool("tokenizer.ggml.add_space_prefix", true);
  return v;
}

std::unique_ptr<Tokenizer> Tokenizer::from_gguf(const GgufFile& file) {
  TokenizerVocab vocab = read_tokenizer_vocab(file);
  try {
    return make_tokenizer(std::move(vocab));
  } catch (const ModelError& e) {
    throw ModelError(file.path() + ": " + e.what());
  }
}

}  // namespace diffrun
