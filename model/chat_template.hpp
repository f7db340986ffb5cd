// Chat templates for the families diffrun runs: ChatML, Zephyr, Llama 2 [INST], Llama 3.
#pragma once

#include <string>
#include <string_view>

#include "model/gguf.hpp"

namespace diffrun {

enum class ChatTemplate { chatml, zephyr, llama2, llama3 };

const char* chat_template_name(ChatTemplate t);
ChatTemplate parse_chat_template(std::string_view name);  // throws InputError listing the choices

// Detects the template from tokenizer.chat_template; throws ModelError when there is none or it is
// not recognised (the message suggests --template).
ChatTemplate detect_chat_template(const GgufFile& file);

// One user turn (with an optional system turn) followed by the assistant prefix. An empty `system`
// uses the template's default where it has one (SmolLM2's ChatML template adds one).
std::string apply_chat_template(ChatTemplate t, const GgufFile& file, std::string_view system,
                                std::string_view user);

}  // namespace diffrun
