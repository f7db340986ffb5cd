// Tokenizers built from GGUF metadata: byte-level BPE (gpt2 with its pre-tokenizers) and SentencePiece (llama).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/gguf.hpp"

namespace diffrun {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Reads tokenizer.ggml.* from the file; throws ModelError naming the key that is missing or bad.
  static std::unique_ptr<Tokenizer> from_gguf(const GgufFile& file);

  // add_bos: prepend BOS when the model asks for it (tokenizer.ggml.add_bos_token) — callers pass true
  // for a fresh prompt. parse_special: match special/control tokens (<|im_start|>) atomically.
  virtual std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special) const = 0;

  // Ids back to UTF-8 text (byte tokens joined before decoding; no U+FFFD inside valid sequences).
  virtual std::string decode(std::span<const int32_t> ids) const = 0;

  // The raw vocabulary string of one id (as stored in GGUF), for `diffrun tokenize`.
  virtual const std::string& piece(int32_t id) const = 0;

  // The bytes one token stands for: byte-level characters and <0xNN> undone, ▁ as a space, control
  // tokens as their text; no prefix space is stripped. May be a partial UTF-8 sequence.
  virtual std::string token_text(int32_t id) const = 0;

  virtual int n_vocab() const = 0;
  virtual int32_t bos() const = 0;   // -1 when the model has none
  virtual int32_t eos() const = 0;
  virtual bool is_eog(int32_t id) const = 0;  // end of generation (eos, <|im_end|>, <|eot_id|>...)

  // Problems found while loading that do not stop tokenization (an unknown tokenizer.ggml.pre); the
  // library never prints them, the CLI shows them on stderr.
  const std::vector<std::string>& warnings() const { return warnings_; }

 protected:
  std::vector<std::string> warnings_;
};

}  // namespace diffrun
