// Paths to test inputs (generated fixtures, the fetched SmolLM2 model), per-process scratch directories,
// and running a command line with its output captured.
#pragma once

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>

#include <sys/wait.h>
#include <unistd.h>

namespace diffrun::test {

inline std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::string(v) : fallback;
}

inline std::string source_dir() { return env_or("DIFFRUN_SOURCE_DIR", "."); }

// A generated fixture, e.g. fixture_path("tiny-llama-q4_k.gguf").
inline std::string fixture_path(const std::string& name) {
  return env_or("DIFFRUN_FIXTURE_DIR", "build/fixtures") + "/" + name;
}

inline std::string models_dir() {
  if (const char* d = std::getenv("DIFFRUN_MODELS"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/diffrun/models";
  return env_or("HOME", ".") + "/.cache/diffrun/models";
}

// A new, empty directory <tmp>/diffrun-<name>-XXXXXX made by mkdtemp (<tmp> is TMPDIR, else /tmp):
// unique to the call, so concurrent runs (ctest -j, two checkouts on one machine) never share or
// delete each other's files. Characters other than [A-Za-z0-9_-] in `name` (e.g. the '/' of a
// parameterized test's name) become '_'. The caller removes it.
inline std::filesystem::path make_scratch_dir(const std::string& name) {
  std::string safe = name;
  for (char& c : safe)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) c = '_';
  std::string tmpl = (std::filesystem::temp_directory_path() / ("diffrun-" + safe + "-XXXXXX")).string();
  if (::mkdtemp(tmpl.data()) == nullptr) throw std::system_error(errno, std::generic_category(), "mkdtemp " + tmpl);
  return tmpl;
}

// A make_scratch_dir directory, removed with everything in it when destroyed.
struct ScratchDir {
  std::string path;
  explicit ScratchDir(const std::string& name) : path(make_scratch_dir(name).string()) {}
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
};

inline std::string smollm2_path() { return models_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf"; }
// Gemma 3 270M Q4_K_M, fetched on request (scripts/fetch_models gemma3); tests skip without it.
inline std::string gemma3_path() { return models_dir() + "/gemma-3-270m-q4_k_m.gguf"; }

// The whole file as bytes ("" when it cannot be read).
inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// s as one POSIX shell word.
inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += (c == '\'') ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

struct CommandResult {
  int rc;  // the exit status, -1 when killed by a signal
  std::string out;
  std::string err;
};

// Runs `program args` (args already shell-quoted where needed) through the shell, stdout and stderr
// captured through stdout.txt and stderr.txt in `dir`.
inline CommandResult run_command(const std::string& program, const std::string& args, const std::filesystem::path& dir) {
  const std::filesystem::path out = dir / "stdout.txt", err = dir / "stderr.txt";
  const std::string cmd = shell_quote(program) + " " + args + " >" + shell_quote(out.string()) + " 2>" +
                          shell_quote(err.string());
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
}

}  // namespace diffrun::test
