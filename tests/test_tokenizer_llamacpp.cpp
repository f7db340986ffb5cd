// llama.cpp's own tokenizer test suite: every models/ggml-vocab-*.gguf either matches its .inp/.out goldens or is refused.
//
// The vocabularies and goldens are read from the llama.cpp source that scripts/build_llamacpp.sh --source
// unpacks (build/llama.cpp-src, or $DIFFRUN_LLAMACPP_SRC); nothing of it is copied into this repository.
// The goldens were written by llama.cpp's convert_hf_to_gguf_update.py from each model's Hugging Face
// tokenizer; llama.cpp's tests/test-tokenizer-0.cpp reads them as done here (cases separated by
// "\n__ggml_vocab_test__\n", one line of ids per case, no BOS, special tokens not parsed).
// A vocabulary diffrun cannot tokenize must be refused by Tokenizer::from_gguf with a ModelError; one
// that loads must match every golden exactly. The test prints one line per vocabulary.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "model/error.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"
#include "tests/test_util.hpp"

namespace diffrun {
namespace {

namespace fs = std::filesystem;

fs::path suite_dir() {
  const std::string src = test::env_or("DIFFRUN_LLAMACPP_SRC", test::source_dir() + "/build/llama.cpp-src");
  return fs::path(src) / "models";
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + p.string());
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

struct Case {
  std::string text;
  std::vector<int32_t> ids;
};

// The cases of one vocabulary, parsed as test-tokenizer-0.cpp parses them.
std::vector<Case> read_cases(const fs::path& inp, const fs::path& out) {
  const std::string raw = read_all(inp);
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> texts;
  for (size_t pos = 0; pos < raw.size();) {
    const size_t next = raw.find(sep, pos);
    if (next == std::string::npos) {
      texts.push_back(raw.substr(pos));
      break;
    }
    texts.push_back(raw.substr(pos, next - pos));
    pos = next + sep.size();
  }
  std::istringstream lines(read_all(out));
  std::vector<Case> cases;
  size_t i = 0;
  for (std::string line; std::getline(lines, line); ++i) {
    if (i >= texts.size()) throw std::runtime_error(out.string() + ": more lines than " + inp.string() + " has cases");
    Case c{texts[i], {}};
    std::istringstream ids(line);
    for (long id; ids >> id;) c.ids.push_back(static_cast<int32_t>(id));
    cases.push_back(std::move(c));
  }
  if (cases.size() != texts.size())
    throw std::runtime_error(out.string() + ": " + std::to_string(cases.size()) + " lines for " +
                             std::to_string(texts.size()) + " cases");
  return cases;
}

std::string show(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else out += static_cast<char>(c);
  }
  return out;
}

TEST(LlamaCppSuite, EveryVocabularyPassesOrIsRefused) {
  const fs::path dir = suite_dir();
  if (!fs::is_directory(dir))
    GTEST_SKIP() << dir.string() << " is missing (scripts/build_llamacpp.sh --source, run by scripts/setup, unpacks it)";
  std::vector<fs::path> vocabs;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("ggml-vocab-", 0) == 0 && entry.path().extension() == ".gguf") vocabs.push_back(entry.path());
  }
  std::sort(vocabs.begin(), vocabs.end());
  ASSERT_GE(vocabs.size(), 10u) << "too few ggml-vocab-*.gguf in " << dir.string();

  int passed = 0, refused = 0, failed = 0, no_goldens = 0;
  for (const auto& path : vocabs) {
    const std::string name = path.stem().string().substr(std::string("ggml-vocab-").size());
    const fs::path inp = path.string() + ".inp", out = path.string() + ".out";
    const bool goldens = fs::exists(inp) && fs::exists(out);
    std::unique_ptr<Tokenizer> tok;
    try {
      auto file = GgufFile::open(path.string());
      tok = Tokenizer::from_gguf(*file);
    } catch (const ModelError& e) {
      ++refused;
      std::cout << "  " << name << ": refused: " << e.what() << "\n";
      continue;
    }
    std::string warned;
    for (const auto& w : tok->warnings()) warned += " (warning: " + w + ")";
    if (!goldens) {
      ++no_goldens;
      std::cout << "  " << name << ": loaded, no goldens in the suite" << warned << "\n";
      continue;
    }
    const auto cases = read_cases(inp, out);
    int total = 0, matched = 0;
    for (const auto& c : cases) {
      if (c.text.empty()) continue;  // the empty case: no ids on either side
      ++total;
      const auto got = tok->encode(c.text, false, false);
      EXPECT_EQ(got, c.ids) << name << ": \"" << show(c.text) << "\"";
      matched += got == c.ids;
    }
    const bool ok = matched == total;
    ok ? ++passed : ++failed;
    std::cout << "  " << name << ": " << (ok ? "passed " : "FAILED ") << matched << "/" << total << warned << "\n";
  }
  std::cout << vocabs.size() << " vocabularies: " << passed << " passed, " << refused << " refused, " << no_goldens
            << " without goldens, " << failed << " failed\n";
  RecordProperty("passed", passed);
  RecordProperty("refused", refused);
  EXPECT_EQ(failed, 0);
}

}  // namespace
}  // namespace diffrun
