// The plain vocabulary a tokenizer is built from (what tokenizer.ggml.* holds), and the pre-tokenizers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "model/tokenizer.hpp"

namespace diffrun {

// Token types, numbered as llama.cpp's llama_token_type / gguf.TokenType.
enum class TokenType : int32_t {
  undefined = 0, normal = 1, unknown = 2, control = 3, user_defined = 4, unused = 5, byte = 6,
};

enum class VocabKind { bpe, spm };  // tokenizer.ggml.model: gpt2 | llama

// Pre-tokenizers of byte-level BPE, chosen by tokenizer.ggml.pre.
enum class PreTokenizer {
  gpt2,    // default, gpt2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  llama3,  // llama3, llama-bpe, llama-v3: case-insensitive contractions, letters with one leading
           // non-letter, \p{N}{1,3}, punctuation with trailing newlines, newline runs
  qwen2,   // qwen2: as llama3 with single digits (\p{N})
  smollm,  // smollm, starcoder, refact, command-r: every \p{N} split off alone, then the gpt2 pattern
  qwen35,  // qwen35: as qwen2 with marks (\p{M}) joined to letters
  falcon,  // falcon: runs of punctuation split off, the gpt2 pattern, then 3-digit groups
  deepseek_llm,    // deepseek-llm: newlines, cased-letter and ASCII/CJK-punctuation runs, CJK runs, \p{N}+
  deepseek_coder,  // deepseek-coder: newlines, \s?\p{L}+, \s?\p{P}+, CJK runs, single \p{N}
  fallback,        // llama.cpp's default (the key missing or "default"): punctuation runs, gpt2,
                   // \p{N}+, 3-digit groups
};

const char* pre_tokenizer_name(PreTokenizer p);

// Maps a tokenizer.ggml.pre value to its pre-tokenizer. An unknown value gives gpt2 and sets
// `warning` (the caller decides how to show it); a known one leaves `warning` empty.
PreTokenizer parse_pre_tokenizer(std::string_view pre, std::string& warning);

// Splits `text` into pre-tokens, appended to `out` as views into `text`, in order and covering it.
void pre_tokenize(PreTokenizer p, std::string_view text, std::vector<std::string_view>& out);

struct TokenizerVocab {
  VocabKind kind = VocabKind::bpe;
  PreTokenizer pre = PreTokenizer::gpt2;
  std::vector<std::string> tokens;  // [V] pieces as stored (byte-level chars for bpe, ▁ for spm)
  std::vector<float> scores;        // [V] spm merge priority (higher merges first); empty for bpe
  std::vector<TokenType> types;     // [V]; empty means every token is normal
  std::vector<std::string> merges;  // bpe only: "left right", rank = position
  int32_t bos = -1, eos = -1, unk = -1, eot = -1, eom = -1;
  bool add_bos = false, add_eos = false;
  bool add_space_prefix = false;  // spm: prepend ▁ to text at the start and after a special token
  bool ignore_merges = false;     // bpe: a pre-token that is itself a token is emitted whole (llama3)
  std::vector<std::string> warnings;  // carried to Tokenizer::warnings()
};

// Builds the tokenizer; throws ModelError when the vocabulary is inconsistent (sizes, ids, merges).
std::unique_ptr<Tokenizer> make_tokenizer(TokenizerVocab vocab);

// Reads tokenizer.ggml.* into a vocabulary; throws ModelError naming the missing or bad key.
TokenizerVocab read_tokenizer_vocab(const GgufFile& file);

}  // namespace diffrun
