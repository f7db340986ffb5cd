// Validation of command-line values before any compute: whole-number counts, finite factors, output paths.
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include <CLI/CLI.hpp>

namespace diffrun::cli {

// A whole number from `min` to `max`, refused with what is wrong: "'abc' is not a whole number",
// "is 0, must be at least 1" (CLI11's own checks print a range ending in a 300-digit double).
CLI::Validator count_in(int64_t min, int64_t max = std::numeric_limits<int32_t>::max());

// A finite number above 0 (nan, inf, 0 and negative numbers refused).
CLI::Validator finite_positive();

// Throws InputError naming `option` when `dir` cannot be the run's output directory: empty, or an
// existing path that is not a directory, or under something that is not one. Creates nothing.
void check_output_dir(const std::string& option, const std::string& dir);

// Throws InputError naming `option` when `file` cannot be written as an output file: empty, a
// directory, or in a directory that does not exist (or is not one). Creates nothing.
void check_output_file(const std::string& option, const std::string& file);

// check_output_file for a dump, which is written to a temporary and renamed over `file`: also an
// existing `file` that is not a regular file (a device such as /dev/null, a FIFO, a socket), which
// the rename would replace, is refused.
void check_dump_output_file(const std::string& option, const std::string& file);

}  // namespace diffrun::cli
