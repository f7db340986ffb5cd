// Chat templates for the families diffrun runs: ChatML, Zephyr, Llama 2 [INST], Llama 3, Gemma.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "model/gguf.hpp"

namespace diffrun {

enum class ChatTemplate { chatml, zephyr, llama2, llama3, gemma };

const char* chat_template_name(ChatTemplate t);
ChatTemplate parse_chat_template(std::string_view name);  // throws InputError listing the choices

// Detects the template from tokenizer.chat_template (or, where the file has none, from a vocabulary
// holding Gemma's <start_of_turn> and <end_of_turn>); throws ModelError when there is none or it is not
// recognised (the message suggests --template).
ChatTemplate detect_chat_template(const GgufFile& file);

// One user turn (with an optional system turn) followed by the assistant prefix. An empty `system`
// uses the template's default where it has one (SmolLM2's ChatML template adds one).
std::string apply_chat_template(ChatTemplate t, const GgufFile& file, std::string_view system,
                                std::string_view user);

// The pieces apply_chat_template is made of, for callers without a GgufFile and for tests.
// The rendered text never holds the BOS token: encode(text, add_bos = true, ...) adds it when the model
// asks for one (as llama.cpp does), so it is never doubled.
std::optional<ChatTemplate> detect_chat_template_source(std::string_view jinja);
// The literal default system message of a ChatML Jinja template (SmolLM2's, Qwen's), "" when none.
std::string chatml_default_system(std::string_view jinja);
// `eos_text` closes each Zephyr turn (the model's EOS piece, "</s>" for TinyLlama).
std::string render_chat_template(ChatTemplate t, std::string_view system, std::string_view user,
                                 std::string_view eos_text);

}  // namespace diffrun
