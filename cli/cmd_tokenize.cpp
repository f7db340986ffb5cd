// `diffrun tokenize --model M --prompt P [--chat] [--system S] [--template T] [--no-parse-special] [--no-bos]`: ids and pieces.
//
// One line per token: the id, then the text the token stands for in single quotes, with \n \t \r \\ \'
// escaped, other control bytes and bytes that are not (yet) whole UTF-8 as \xNN, and invisible or
// non-ASCII whitespace code points as \u{NNNN}; then the count. --tokens 1,2,3 shows the pieces of ids.
#include <string>

#include <fmt/core.h>

#include "cli/command.hpp"
#include "cli/run.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"
#include "model/unicode.hpp"

namespace diffrun::cli {
namespace {

bool invisible(uint32_t cp) {
  return (cp >= 0x200B && cp <= 0x200F) || (cp >= 0x2060 && cp <= 0x2064) || (cp >= 0xFE00 && cp <= 0xFE0F) ||
         cp == 0xFEFF || cp == 0x00AD || (cp >= 0x80 && cp < 0xA0) || unicode_class(cp) == unicode_whitespace;
}

std::string quoted(const std::string& s) {
  std::string out = "'";
  for (size_t pos = 0; pos < s.size();) {
    size_t len;
    const uint32_t cp = utf8_decode(s, pos, len);
    const auto byte = static_cast<unsigned char>(s[pos]);
    if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\\' || cp == '\'') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == unicode_invalid || cp < 0x20 || cp == 0x7F) {
      out += fmt::format("\\x{:02x}", byte);
    } else if (cp != ' ' && invisible(cp)) {
      out += fmt::format("\\u{{{:04x}}}", cp);
    } else {
      out.append(s, pos, len);
    }
    pos += len;
  }
  return out + "'";
}

int run_tokenize(const std::string& model, const PromptOptions& opt) {
  auto file = GgufFile::open(model);
  auto tok = load_tokenizer(*file);
  const std::vector<int32_t> ids = prompt_tokens(*file, *tok, opt);
  for (int32_t id : ids) fmt::print("{:>7}  {}\n", id, quoted(tok->token_text(id)));
  fmt::print("{} tokens\n", ids.size());
  return 0;
}

const CommandRegistrar registrar("tokenize", "Show the token ids and pieces of a prompt", [](CLI::App& sub) {
  auto model = std::make_shared<std::string>(default_model_path());
  auto opt = std::make_shared<PromptOptions>();
  sub.add_option("--model,-m", *model, "GGUF model")->capture_default_str();
  opt->add_options(sub);
  return std::function<int()>([model, opt] { return run_tokenize(*model, *opt); });
});

}  // namespace
}  // namespace diffrun::cli
