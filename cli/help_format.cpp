// The --help layout: CLI11's two columns, wrapped so that no line passes 100 columns.
#include "cli/help_format.hpp"

#include <string>
#include <string_view>
#include <vector>

namespace diffrun::cli {
namespace {

constexpr size_t kWidth = 100;
constexpr size_t kColumn = 30;  // where descriptions start (CLI11's default)

// Breaks `text` into lines of at most `width` columns, at spaces (a word longer than the line is
// broken where it must); existing line breaks are kept.
std::vector<std::string> wrap(std::string_view text, size_t width) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t nl = text.find('\n', start);
    std::string_view para = text.substr(start, nl == std::string_view::npos ? std::string_view::npos : nl - start);
    std::string line;
    size_t i = 0;
    while (i < para.size()) {
      const size_t sp = para.find(' ', i);
      std::string_view word = para.substr(i, sp == std::string_view::npos ? std::string_view::npos : sp - i);
      i = sp == std::string_view::npos ? para.size() : sp + 1;
      while (word.size() > width) {  // a word wider than the column
        if (!line.empty()) lines.push_back(std::move(line)), line.clear();
        lines.emplace_back(word.substr(0, width));
        word.remove_prefix(width);
      }
      if (!line.empty() && line.size() + 1 + word.size() > width) lines.push_back(std::move(line)), line.clear();
      if (!line.empty()) line += ' ';
      line += word;
    }
    lines.push_back(std::move(line));
    if (nl == std::string_view::npos) break;
    start = nl + 1;
  }
  return lines;
}

// The left column: "  NAME OPTS", broken after a comma where it passes the page (a choice list),
// continuation lines indented by six. A default value is never broken (a long path stays whole).
std::vector<std::string> wrap_name(const std::string& name) {
  std::vector<std::string> lines;
  std::string line = "  ";
  for (size_t i = 0; i < name.size();) {
    const size_t comma = name.find(',', i);
    const size_t j = comma == std::string::npos ? name.size() : comma + 1;
    const std::string piece = name.substr(i, j - i);
    i = j;
    if (line.size() + piece.size() > kWidth && line.find_first_not_of(' ') != std::string::npos) {
      lines.push_back(std::move(line));
      line = "      ";
    }
    line += piece;
  }
  lines.push_back(std::move(line));
  return lines;
}

std::string two_columns(const std::string& name, const std::string& desc) {
  std::vector<std::string> left = wrap_name(name);
  std::string out;
  for (size_t i = 0; i + 1 < left.size(); ++i) out += left[i] + "\n";
  std::string last = left.back();
  if (desc.empty()) return out + last + "\n";
  const std::vector<std::string> right = wrap(desc, kWidth - kColumn);
  if (last.size() >= kColumn) {
    out += last + "\n";
    last.clear();
  }
  for (const std::string& r : right) {
    out += last + std::string(kColumn - last.size(), ' ') + r + "\n";
    last.clear();
  }
  return out;
}

class WrappingFormatter : public CLI::Formatter {
 public:
  WrappingFormatter() { column_width(kColumn); }

  std::string make_option(const CLI::Option* opt, bool is_positional) const override {
    return two_columns(make_option_name(opt, is_positional) + make_option_opts(opt), make_option_desc(opt));
  }
  std::string make_subcommand(const CLI::App* sub) const override {
    return two_columns(sub->get_display_name(true), sub->get_description());
  }
  std::string make_description(const CLI::App* app) const override {
    std::string text = CLI::Formatter::make_description(app);  // "" or the text and a line break
    if (text.empty()) return text;
    text.pop_back();
    std::string out;
    for (const std::string& line : wrap(text, kWidth)) out += line + "\n";
    return out;
  }
};

}  // namespace

std::shared_ptr<CLI::Formatter> help_formatter() { return std::make_shared<WrappingFormatter>(); }

}  // namespace diffrun::cli
