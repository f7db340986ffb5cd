// The JSON and JUnit reports of a run that ends with exit 2, written from main where the error is caught.
#include "cli/error_report.hpp"

#include <fstream>
#include <string_view>

#include <fmt/core.h>

#include "cli/command.hpp"
#include "diff/report.hpp"
#include "model/error.hpp"

namespace diffrun::cli {

void write_error_reports(int argc, const char* const* argv, const std::string& error) {
  // The title names the subcommand as the reports of a completed run do ("diffrun", "diffrun compare").
  std::string title = "diffrun";
  std::string json_path, junit_path;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value_of = [&](std::string_view opt, std::string& into) {
      if (a == opt && i + 1 < argc) {
        into = argv[++i];
      } else if (a.size() > opt.size() + 1 && a.starts_with(opt) && a[opt.size()] == '=') {
        into = std::string(a.substr(opt.size() + 1));
      }
    };
    value_of("--report-json", json_path);
    value_of("--report-junit", junit_path);
    if (title == "diffrun" && !a.starts_with("-"))
      for (const CommandSpec& spec : command_registry())
        if (!spec.name.empty() && spec.name == a) title += " " + spec.name;
  }
  auto write = [&](const std::string& path, const std::string& text, const char* what) {
    if (path.empty()) return;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    out.close();
    if (!out) fmt::print(stderr, "diffrun: note: cannot write the {} report of the error to {}\n", what, printable(path));
  };
  write(json_path, diff::render_json_error(title, error), "JSON");
  write(junit_path, diff::render_junit_error(title, error), "JUnit");
}

}  // namespace diffrun::cli
