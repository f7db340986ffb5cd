// Validation of command-line values before any compute: whole-number counts, finite factors, output paths.
#include "cli/options.hpp"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <system_error>

#include <fmt/core.h>

#include "model/error.hpp"
#include "model/file_check.hpp"

namespace diffrun::cli {

namespace fs = std::filesystem;

CLI::Validator count_in(int64_t min, int64_t max) {
  return CLI::Validator(
      [min, max](std::string& s) -> std::string {
        int64_t v = 0;
        const char* end = s.data() + s.size();
        const auto [p, ec] = std::from_chars(s.data() + (s.starts_with("+") ? 1 : 0), end, v);
        if (s.empty() || p != end || (ec != std::errc() && ec != std::errc::result_out_of_range))
          return fmt::format("'{}' is not a whole number (expected {} to {})", printable(s, 40), min, max);
        if (ec == std::errc::result_out_of_range || v > max)
          return fmt::format("{} is more than {}", printable(s, 40), max);
        if (v < min) return fmt::format("is {}, must be at least {}", v, min);
        return {};
      },
      fmt::format("INT in [{} - {}]", min, max), "count_in");
}

CLI::Validator finite_positive() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        errno = 0;
        char* end = nullptr;
        const double v = s.empty() ? 0 : std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size())
          return fmt::format("'{}' is not a number", printable(s, 40));
        if (!std::isfinite(v) || errno == ERANGE || !(v > 0))
          return fmt::format("{} is not a finite number above 0", printable(s, 40));
        return {};
      },
      "FLOAT > 0", "finite_positive");
}

namespace {

// The first existing ancestor of `p` (p itself included) that is not a directory, if any.
std::string non_directory_on_path(const fs::path& p) {
  std::error_code ec;
  for (fs::path q = p; !q.empty(); q = q.parent_path()) {
    const fs::file_status st = fs::status(q, ec);
    if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory) return {};
    if (fs::exists(st)) return fs::is_directory(st) ? std::string() : q.string();
    if (q == q.parent_path()) break;
  }
  return {};
}

}  // namespace

void check_output_dir(const std::string& option, const std::string& dir) {
  if (dir.empty()) throw InputError(option + ": empty path; give a directory for the dumps");
  const fs::path p = fs::path(dir).lexically_normal();
  if (const std::string bad = non_directory_on_path(p); !bad.empty()) {
    if (fs::path(bad) == p)
      throw InputError(fmt::format("{} {}: exists and is not a directory", option, printable(dir)));
    throw InputError(fmt::format("{} {}: {} is not a directory", option, printable(dir), printable(bad)));
  }
}

void check_output_file(const std::string& option, const std::string& file) {
  if (file.empty()) throw InputError(option + ": empty path");
  std::error_code ec;
  const fs::path p(file);
  if (fs::is_directory(p, ec)) throw InputError(fmt::format("{} {}: is a directory", option, printable(file)));
  const fs::path parent = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  if (const std::string bad = non_directory_on_path(parent); !bad.empty())
    throw InputError(fmt::format("{} {}: {} is not a directory", option, printable(file), printable(bad)));
  if (!fs::is_directory(parent, ec))
    throw InputError(fmt::format("{} {}: directory {} does not exist", option, printable(file), printable(parent.string())));
}

void check_dump_output_file(const std::string& option, const std::string& file) {
  check_output_file(option, file);
  if (const std::string problem = regular_file_problem(file); !problem.empty() && problem != "does not exist" &&
                                                               problem.rfind("cannot be read", 0) != 0)
    throw InputError(fmt::format("{} {}: exists and {}: a dump replaces only a regular file", option, printable(file),
                                 problem));
}

}  // namespace diffrun::cli
