// Subcommand registry: each cli/cmd_*.cpp registers itself with a static CommandRegistrar.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace diffrun::cli {

// Adds options to `sub` and returns the function that runs the command (its exit code).
using CommandSetup = std::function<std::function<int()>(CLI::App& sub)>;

struct CommandSpec {
  std::string name;  // "" is the top-level job (`diffrun --prompt ...`)
  std::string help;
  CommandSetup setup;
};

std::vector<CommandSpec>& command_registry();

struct CommandRegistrar {
  CommandRegistrar(std::string name, std::string help, CommandSetup setup) {
    command_registry().push_back({std::move(name), std::move(help), std::move(setup)});
  }
};

// $DIFFRUN_MODELS/SmolLM2-135M-Instruct.Q4_1.gguf, $DIFFRUN_MODELS defaulting to
// ${XDG_CACHE_HOME:-$HOME/.cache}/diffrun/models.
std::string models_dir();
std::string default_model_path();

}  // namespace diffrun::cli
