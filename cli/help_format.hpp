// The --help layout: CLI11's two columns, wrapped so that no line passes 100 columns.
#pragma once

#include <memory>

#include <CLI/CLI.hpp>

namespace diffrun::cli {

// Option and subcommand descriptions wrap at word boundaries inside the right column; an option
// whose name, type and default are wider than the page breaks after a comma of its choice list, and
// its description starts on the next line.
std::shared_ptr<CLI::Formatter> help_formatter();

}  // namespace diffrun::cli
