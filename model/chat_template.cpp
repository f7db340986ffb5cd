// Chat templates for one user turn: ChatML, Zephyr, Llama 2 [INST], Llama 3, Gemma; detection from the GGUF's
// Jinja source by the markers each family uses (as llama.cpp's llm_chat_detect_template does).
#include "model/chat_template.hpp"

#include "model/error.hpp"

namespace diffrun {

namespace {

constexpr ChatTemplate all_templates[] = {ChatTemplate::chatml, ChatTemplate::zephyr, ChatTemplate::llama2,
                                          ChatTemplate::llama3, ChatTemplate::gemma};
constexpr const char* choices = "chatml, zephyr, llama2, llama3, gemma";

}  // namespace

const char* chat_template_name(ChatTemplate t) {
  switch (t) {
    case ChatTemplate::chatml: return "chatml";
    case ChatTemplate::zephyr: return "zephyr";
    case ChatTemplate::llama2: return "llama2";
    case ChatTemplate::llama3: return "llama3";
    case ChatTemplate::gemma: return "gemma";
  }
  return "?";
}

ChatTemplate parse_chat_template(std::string_view name) {
  for (ChatTemplate t : all_templates)
    if (name == chat_template_name(t)) return t;
  throw InputError("unknown chat template '" + std::string(name) + "' (choices: " + choices + ")");
}

std::optional<ChatTemplate> detect_chat_template_source(std::string_view jinja) {
  const auto has = [&](std::string_view s) { return jinja.find(s) != std::string_view::npos; };
  if (has("<|im_start|>")) return ChatTemplate::chatml;
  if (has("<|start_header_id|>") && has("<|end_header_id|>")) return ChatTemplate::llama3;
  if (has("<|user|>") && has("<|assistant|>")) return ChatTemplate::zephyr;
  if (has("[INST]")) return ChatTemplate::llama2;
  if (has("<start_of_turn>")) return ChatTemplate::gemma;
  return std::nullopt;
}

ChatTemplate detect_chat_template(const GgufFile& file) {
  const GgufValue* v = file.find("tokenizer.chat_template");
  if (!v && file.find("tokenizer.ggml.tokens")) {
    // Gemma 3 GGUFs often ship without a template; their vocabulary names the turn markers.
    bool start = false, end = false;
    for (const GgufValue& t : file.get("tokenizer.ggml.tokens").as_array("tokenizer.ggml.tokens").items) {
      if (t.type != GgufValueType::STRING) continue;
      const std::string& piece = t.as_string("tokenizer.ggml.tokens");
      start |= piece == "<start_of_turn>";
      end |= piece == "<end_of_turn>";
    }
    if (start && end) return ChatTemplate::gemma;
  }
  if (!v)
    throw ModelError(file.path() + ": the model has no tokenizer.chat_template; choose one with --template (" +
                     choices + ")");
  if (auto t = detect_chat_template_source(v->as_string("tokenizer.chat_template"))) return *t;
  throw ModelError(file.path() + ": tokenizer.chat_template is not one diffrun recognises; choose one with "
                   "--template (" + choices + ")");
}

// Looks for '<|im_start|>system' + newline (a real one or the two characters \n inside a Jinja string)
// followed by literal text up to '<|im_end|>'. Text that holds Jinja or string syntax is an expression
// (the user's system message), not a default, and is skipped.
std::string chatml_default_system(std::string_view jinja) {
  constexpr std::string_view head = "<|im_start|>system";
  constexpr std::string_view tail = "<|im_end|>";
  for (size_t at = jinja.find(head); at != std::string_view::npos; at = jinja.find(head, at + 1)) {
    size_t p = at + head.size();
    if (jinja.substr(p).starts_with("\n")) {
      p += 1;
    } else if (jinja.substr(p).starts_with("\\n")) {
      p += 2;
    } else {
      continue;
    }
    const size_t end = jinja.find(tail, p);
    if (end == std::string_view::npos) continue;
    const std::string_view text = jinja.substr(p, end - p);
    if (text.empty() || text.find_first_of("'\"{}+\n") != std::string_view::npos) continue;
    std::string out;
    for (size_t i = 0; i < text.size(); ++i) {
      if (text[i] == '\\' && i + 1 < text.size() && text[i + 1] == 'n') {
        out += '\n';
        ++i;
      } else {
        out += text[i];
      }
    }
    return out;
  }
  return "";
}

std::string render_chat_template(ChatTemplate t, std::string_view system, std::string_view user,
                                 std::string_view eos_text) {
  std::string s;
  const std::string sys(system);
  const std::string usr(user);
  switch (t) {
    case ChatTemplate::chatml:
      if (!sys.empty()) s += "<|im_start|>system\n" + sys + "<|im_end|>\n";
      s += "<|im_start|>user\n" + usr + "<|im_end|>\n<|im_start|>assistant\n";
      break;
    case ChatTemplate::zephyr:
      if (!sys.empty()) s += "<|system|>\n" + sys + std::string(eos_text) + "\n";
      s += "<|user|>\n" + usr + std::string(eos_text) + "\n<|assistant|>\n";
      break;
    case ChatTemplate::llama2:
      s += "[INST] ";
      if (!sys.empty()) s += "<<SYS>>\n" + sys + "\n<</SYS>>\n\n";
      s += usr + " [/INST]";
      break;
    case ChatTemplate::llama3:
      if (!sys.empty()) s += "<|start_header_id|>system<|end_header_id|>\n\n" + sys + "<|eot_id|>";
      s += "<|start_header_id|>user<|end_header_id|>\n\n" + usr +
           "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    case ChatTemplate::gemma:  // no system role: Gemma's template puts it at the head of the first user turn
      s += "<start_of_turn>user\n" + (sys.empty() ? "" : sys + "\n\n") + usr +
           "<end_of_turn>\n<start_of_turn>model\n";
      break;
  }
  return s;
}

std::string apply_chat_template(ChatTemplate t, const GgufFile& file, std::string_view system,
                                std::string_view user) {
  std::string sys(system);
  if (sys.empty() && t == ChatTemplate::chatml)
    sys = chatml_default_system(file.get_string("tokenizer.chat_template", ""));
  std::string eos = "</s>";
  if (t == ChatTemplate::zephyr) {
    const int64_t id = file.get_int("tokenizer.ggml.eos_token_id", -1);
    const auto& tokens = file.get("tokenizer.ggml.tokens").as_array("tokenizer.ggml.tokens").items;
    if (id >= 0 && static_cast<size_t>(id) < tokens.size()) eos = tokens[static_cast<size_t>(id)].as_string("tokenizer.ggml.tokens");
  }
  return render_chat_template(t, sys, user, eos);
}

}  // namespace diffrun
