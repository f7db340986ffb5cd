// Chat template tests: detection from the GGUF's Jinja source, rendering per family, and the tokens of a chat prompt.
#include <algorithm>
#include <string>

#include <gtest/gtest.h>

#include "model/chat_template.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"
#include "tests/test_util.hpp"

namespace diffrun {
namespace {

TEST(ChatTemplate, NamesRoundTripAndUnknownThrows) {
  for (auto t : {ChatTemplate::chatml, ChatTemplate::zephyr, ChatTemplate::llama2, ChatTemplate::llama3,
                 ChatTemplate::gemma})
    EXPECT_EQ(parse_chat_template(chat_template_name(t)), t);
  EXPECT_THROW(parse_chat_template("vicuna"), InputError);
}

TEST(ChatTemplate, DetectsFamiliesFromJinja) {
  EXPECT_EQ(detect_chat_template_source("{{'<|im_start|>' + message['role']}}"), ChatTemplate::chatml);
  EXPECT_EQ(detect_chat_template_source("{{ '<|start_header_id|>' + role + '<|end_header_id|>\n\n' }}"),
            ChatTemplate::llama3);
  EXPECT_EQ(detect_chat_template_source("{{ '<|user|>\n' + c + eos_token }}{{ '<|assistant|>' }}"),
            ChatTemplate::zephyr);
  EXPECT_EQ(detect_chat_template_source("{{ bos_token + '[INST] ' + content + ' [/INST]' }}"), ChatTemplate::llama2);
  EXPECT_EQ(detect_chat_template_source("{{ '<start_of_turn>' + role + '\n' + content + '<end_of_turn>\n' }}"),
            ChatTemplate::gemma);
  EXPECT_EQ(detect_chat_template_source("{{ message.content }}"), std::nullopt);
}

TEST(ChatTemplate, ChatmlDefaultSystemFromTheTemplate) {
  // SmolLM2's form (a real newline inside the Jinja string) and Qwen2.5's (the characters \n).
  EXPECT_EQ(chatml_default_system("{% if loop.first %}{{ '<|im_start|>system\nYou are SmolLM<|im_end|>\n' }}"),
            "You are SmolLM");
  EXPECT_EQ(chatml_default_system("{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
                                  "{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}"),
            "You are Qwen.");
  EXPECT_EQ(chatml_default_system("{{'<|im_start|>' + message['role'] + '\n'}}"), "");
}

TEST(ChatTemplate, RendersEachFamily) {
  EXPECT_EQ(render_chat_template(ChatTemplate::chatml, "S", "U", "</s>"),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(render_chat_template(ChatTemplate::chatml, "", "U", "</s>"),
            "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(render_chat_template(ChatTemplate::zephyr, "S", "U", "</s>"),
            "<|system|>\nS</s>\n<|user|>\nU</s>\n<|assistant|>\n");
  EXPECT_EQ(render_chat_template(ChatTemplate::llama2, "S", "U", "</s>"), "[INST] <<SYS>>\nS\n<</SYS>>\n\nU [/INST]");
  EXPECT_EQ(render_chat_template(ChatTemplate::llama2, "", "U", "</s>"), "[INST] U [/INST]");
  EXPECT_EQ(render_chat_template(ChatTemplate::llama3, "S", "U", "</s>"),
            "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
            "U<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  // Gemma has no system role: its template puts the system text at the head of the user turn.
  EXPECT_EQ(render_chat_template(ChatTemplate::gemma, "", "U", "</s>"),
            "<start_of_turn>user\nU<end_of_turn>\n<start_of_turn>model\n");
  EXPECT_EQ(render_chat_template(ChatTemplate::gemma, "S", "U", "</s>"),
            "<start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n");
}

// The Gemma 3 GGUF ships without tokenizer.chat_template; its vocabulary's turn markers select Gemma's,
// and the chat prompt's ids are those llama.cpp gives (llama_tokenize with add_special and parse_special).
TEST(ChatTemplate, Gemma3FromItsVocabulary) {
  if (!std::filesystem::exists(test::gemma3_path())) GTEST_SKIP() << test::gemma3_path() << " is missing";
  auto file = GgufFile::open(test::gemma3_path());
  ASSERT_EQ(detect_chat_template(*file), ChatTemplate::gemma);
  const std::string prompt = apply_chat_template(ChatTemplate::gemma, *file, "", "What is the capital of France?");
  auto tok = Tokenizer::from_gguf(*file);
  EXPECT_EQ(tok->encode(prompt, true, true),
            (std::vector<int32_t>{2, 105, 2364, 107, 3689, 563, 506, 5279, 529, 7001, 236881, 106, 107, 105, 4368, 107}));
}

TEST(ChatTemplate, SmolLM2KeepsItsDefaultSystemLine) {
  if (!std::filesystem::exists(test::smollm2_path())) GTEST_SKIP() << test::smollm2_path() << " is missing";
  auto file = GgufFile::open(test::smollm2_path());
  ASSERT_EQ(detect_chat_template(*file), ChatTemplate::chatml);
  const std::string prompt = apply_chat_template(ChatTemplate::chatml, *file, "", "Hi");
  EXPECT_EQ(prompt,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(apply_chat_template(ChatTemplate::chatml, *file, "Be brief.", "Hi"),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  auto tok = Tokenizer::from_gguf(*file);
  const auto ids = tok->encode(prompt, true, true);
  ASSERT_GE(ids.size(), 6u);
  EXPECT_EQ(ids.front(), 1);                         // <|im_start|>, matched whole
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 1), 3);  // system, user, assistant
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 2), 2);  // <|im_end|> after system and user
  EXPECT_EQ(tok->decode(ids), prompt);
}

TEST(ChatTemplate, TinyLlamaZephyrUsesItsEosPiece) {
  const std::string path = test::fixture_path("tiny-llama-f32.gguf");
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is missing";
  auto file = GgufFile::open(path);
  ASSERT_EQ(detect_chat_template(*file), ChatTemplate::zephyr);
  EXPECT_EQ(apply_chat_template(ChatTemplate::zephyr, *file, "", "Hi"), "<|user|>\nHi</s>\n<|assistant|>\n");
}

}  // namespace
}  // namespace diffrun
