// Tokenizer tests: golden ids from Hugging Face tokenizers, pre-tokenizer splits, and behaviour on hand-made vocabularies.
//
// Goldens (tests/data/tokenizer/*.json) are written by scripts/gen_tokenizer_goldens.py, never by diffrun:
//   smollm2.json  SmolLM2-135M-Instruct's GGUF vocabulary and merges, built with the `tokenizers` library as
//                 SmolLM2's tokenizer.json declares it (BPE, Digits(individual) + ByteLevel, ByteLevel decoder)
//   qwen2.json    fixtures/vocab/qwen2_bpe.tokenizer.json loaded by `tokenizers` (the tiny-qwen2 fixture)
//   spm.json      fixtures/vocab/llama_spm.tokenizer.json loaded by `tokenizers` (the tiny-llama fixture)
//   pretokenize.json  the pieces of `tokenizers`' pre-tokenizers for gpt2, llama3, qwen2 and smollm
// Each file records its oracle and a cross-check against transformers' GGUF converter.
// Regenerate: scripts/gen_tokenizer_goldens.py --fixtures build/fixtures (needs gguf, tokenizers, and
// transformers for the cross-check).
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/error.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"
#include "model/tokenizer_vocab.hpp"
#include "tests/test_util.hpp"

namespace diffrun {
namespace {

nlohmann::json load_json(const std::string& name) {
  const std::string path = test::source_dir() + "/tests/data/tokenizer/" + name;
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  return nlohmann::json::parse(in);
}

std::string model_path(const std::string& tokenizer) {
  if (tokenizer == "smollm2") return test::smollm2_path();
  if (tokenizer == "gemma3") return test::gemma3_path();  // llama.cpp's ids (tests/data/tokenizer/gemma3.json)
  if (tokenizer == "qwen2") return test::fixture_path("tiny-qwen2-f32.gguf");
  return test::fixture_path("tiny-llama-f32.gguf");
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

class Goldens : public testing::TestWithParam<std::string> {};

TEST_P(Goldens, MatchHuggingFace) {
  const std::string path = model_path(GetParam());
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is missing (scripts/fetch_models or the tiny_models fixture)";
  auto file = GgufFile::open(path);
  auto tok = Tokenizer::from_gguf(*file);
  EXPECT_TRUE(tok->warnings().empty());
  const auto doc = load_json(GetParam() + ".json");
  const auto& cases = doc.at("cases");
  ASSERT_GE(cases.size(), 40u);
  int matched = 0;
  for (const auto& c : cases) {
    const std::string text = c.at("text");
    const auto want = c.at("ids").get<std::vector<int32_t>>();
    const auto got = tok->encode(text, c.at("add_bos"), c.at("parse_special"));
    EXPECT_EQ(got, want) << "text \"" << show(text) << "\" parse_special=" << c.at("parse_special");
    EXPECT_EQ(tok->decode(want), c.at("decoded").get<std::string>()) << "decoding \"" << show(text) << "\"";
    matched += got == want;
  }
  RecordProperty("strings_matched", matched);
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, Goldens, testing::Values("smollm2", "qwen2", "spm", "gemma3"));

TEST(PreTokenize, MatchesHuggingFacePreTokenizers) {
  const auto doc = load_json("pretokenize.json");
  const std::pair<const char*, PreTokenizer> pres[] = {{"gpt2", PreTokenizer::gpt2},
                                                       {"llama3", PreTokenizer::llama3},
                                                       {"qwen2", PreTokenizer::qwen2},
                                                       {"smollm", PreTokenizer::smollm}};
  ASSERT_GE(doc.at("cases").size(), 40u);
  for (const auto& c : doc.at("cases")) {
    const std::string text = c.at("text");
    for (const auto& [name, pre] : pres) {
      std::vector<std::string_view> got;
      pre_tokenize(pre, text, got);
      const auto want = c.at("pieces").at(name).get<std::vector<std::string>>();
      EXPECT_EQ(std::vector<std::string>(got.begin(), got.end()), want) << name << " on \"" << show(text) << "\"";
    }
  }
}

TEST(PreTokenize, NamesAndUnknownWarning) {
  std::string warning;
  EXPECT_EQ(parse_pre_tokenizer("llama-bpe", warning), PreTokenizer::llama3);
  EXPECT_EQ(parse_pre_tokenizer("smollm", warning), PreTokenizer::smollm);
  EXPECT_EQ(parse_pre_tokenizer("default", warning), PreTokenizer::fallback);
  EXPECT_TRUE(warning.empty());
  EXPECT_EQ(parse_pre_tokenizer("gpt-2", warning), PreTokenizer::gpt2);
  EXPECT_TRUE(warning.empty());
  EXPECT_EQ(parse_pre_tokenizer("command-r", warning), PreTokenizer::smollm);
  EXPECT_TRUE(warning.empty());
  EXPECT_EQ(parse_pre_tokenizer("", warning), PreTokenizer::fallback);  // key missing: llama.cpp's default
  EXPECT_NE(warning.find("missing"), std::string::npos);
  EXPECT_EQ(parse_pre_tokenizer("brand-new-pre", warning), PreTokenizer::gpt2);
  EXPECT_NE(warning.find("brand-new-pre"), std::string::npos);
}

TEST(PreTokenize, InvalidUtf8BytesStayInThePieces) {
  const std::string text = "ab\xff\xfe cd\xe4\xb8";
  std::vector<std::string_view> got;
  pre_tokenize(PreTokenizer::gpt2, text, got);
  std::string joined;
  for (auto p : got) joined += p;
  EXPECT_EQ(joined, text);
  EXPECT_EQ(std::vector<std::string>(got.begin(), got.end()),
            (std::vector<std::string>{"ab", "\xff\xfe", " cd", "\xe4\xb8"}));
}

// A byte-level vocabulary: every GPT-2 byte character, plus what the merges need.
TokenizerVocab tiny_bpe(std::vector<std::string> extra, std::vector<std::string> merges) {
  TokenizerVocab v;
  v.kind = VocabKind::bpe;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    if (printable) v.tokens.push_back(b < 128 ? std::string(1, static_cast<char>(b))
                                              : std::string{static_cast<char>(0xC0 | (b >> 6)),
                                                            static_cast<char>(0x80 | (b & 0x3F))});
  }
  v.tokens.push_back("\xC4\xA0");  // Ġ, the space (U+0120)
  for (auto& t : extra) v.tokens.push_back(t);
  v.merges = std::move(merges);
  return v;
}

TEST(Bpe, MergesByRankThroughPiecesMissingFromTheVocabulary) {
  // "ab" is not a token, but the merge "ab c" needs it: it takes part in merging (as in llama.cpp).
  auto tok = make_tokenizer(tiny_bpe({"abc"}, {"a b", "ab c"}));
  const auto abc = tok->encode("abc", false, false);
  ASSERT_EQ(abc.size(), 1u);
  EXPECT_EQ(tok->piece(abc[0]), "abc");
  // "abd": "ab" is left as a symbol that is no token, so it falls back to its bytes.
  const auto abd = tok->encode("abd", false, false);
  ASSERT_EQ(abd.size(), 3u);
  EXPECT_EQ(tok->decode(abd), "abd");
}

TEST(Bpe, LowerRankWinsAndLeftmostAmongEquals) {
  auto tok = make_tokenizer(tiny_bpe({"bc", "ab", "aa"}, {"b c", "a b", "a a"}));
  auto ids = tok->encode("abc", false, false);  // "b c" (rank 0) before "a b" (rank 1)
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(tok->piece(ids[0]), "a");
  EXPECT_EQ(tok->piece(ids[1]), "bc");
  ids = tok->encode("aaa", false, false);
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(tok->piece(ids[0]), "aa");
  EXPECT_EQ(tok->piece(ids[1]), "a");
}

TEST(Bpe, IgnoreMergesEmitsAWordThatIsAToken) {
  // llama3 vocabularies: "abc" is a token though no merge chain reaches it.
  auto v = tiny_bpe({"abc", "ab"}, {"a b"});
  auto plain = make_tokenizer(v);
  EXPECT_EQ(plain->encode("abc", false, false).size(), 2u);
  v.ignore_merges = true;
  auto tok = make_tokenizer(v);
  const auto ids = tok->encode("abc", false, false);
  ASSERT_EQ(ids.size(), 1u);
  EXPECT_EQ(tok->piece(ids[0]), "abc");
}

TEST(Bpe, ByteWithoutTokenBecomesUnknownOrThrows) {
  auto v = tiny_bpe({}, {"a b"});
  v.tokens.push_back("<unk>");
  v.types.assign(v.tokens.size(), TokenType::normal);
  v.types.back() = TokenType::unknown;
  v.unk = static_cast<int32_t>(v.tokens.size() - 1);
  auto tok = make_tokenizer(v);
  EXPECT_EQ(tok->encode("a\x01", false, false), (std::vector<int32_t>{tok->encode("a", false, false)[0], v.unk}));
  auto no_unk = tiny_bpe({}, {"a b"});
  auto tok2 = make_tokenizer(no_unk);
  EXPECT_THROW(tok2->encode("\x01", false, false), InputError);
}

TEST(Bpe, RejectsMalformedMerges) {
  EXPECT_THROW(make_tokenizer(tiny_bpe({}, {"ab"})), ModelError);
  EXPECT_THROW(make_tokenizer(tiny_bpe({}, {})), ModelError);
}

TEST(Spm, HighestScoreMergesFirstAndBytesFallBack) {
  TokenizerVocab v;
  v.kind = VocabKind::spm;
  v.add_space_prefix = true;
  v.add_bos = true;
  const std::vector<std::pair<std::string, float>> pieces = {
      {"<unk>", 0}, {"<s>", 0}, {"</s>", 0}, {"\xE2\x96\x81", -1}, {"a", -2}, {"b", -3}, {"c", -4},
      {"ab", -10}, {"bc", -5}, {"\xE2\x96\x81" "a", -6}};
  for (const auto& [p, s] : pieces) {
    v.tokens.push_back(p);
    v.scores.push_back(s);
    v.types.push_back(TokenType::normal);
  }
  v.types[0] = TokenType::unknown;
  v.types[1] = v.types[2] = TokenType::control;
  v.unk = 0, v.bos = 1, v.eos = 2;
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    v.tokens.push_back(name);
    v.scores.push_back(0);
    v.types.push_back(TokenType::byte);
  }
  auto tok = make_tokenizer(v);
  // "▁abc": bc (-5) beats ▁a (-6) and ab (-10): ▁ a bc → then ▁a: [▁a, bc].
  auto ids = tok->encode("abc", true, true);
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(tok->piece(ids[1]), "\xE2\x96\x81" "a");
  EXPECT_EQ(tok->piece(ids[2]), "bc");
  EXPECT_EQ(tok->decode(ids), "<s> abc");
  EXPECT_EQ(tok->decode(std::vector<int32_t>(ids.begin() + 1, ids.end())), "abc");
  // "é" is no piece: its two UTF-8 bytes come back as <0xC3><0xA9> and decode whole.
  ids = tok->encode("é", false, false);
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(tok->piece(ids[1]), "<0xC3>");
  EXPECT_EQ(tok->piece(ids[2]), "<0xA9>");
  EXPECT_EQ(tok->decode(ids), "é");
  EXPECT_EQ(tok->token_text(ids[1]), "\xC3");
}

template <class F>
void expect_input_error(F f, const std::string& want) {
  try {
    f();
    ADD_FAILURE() << "no InputError (expected one containing \"" << want << "\")";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
}

TEST(SmolLM2, VocabularyFacts) {
  if (!std::filesystem::exists(test::smollm2_path())) GTEST_SKIP() << test::smollm2_path() << " is missing";
  auto file = GgufFile::open(test::smollm2_path());
  auto tok = Tokenizer::from_gguf(*file);
  EXPECT_EQ(tok->n_vocab(), 49152);
  EXPECT_EQ(tok->bos(), 1);
  EXPECT_EQ(tok->eos(), 2);
  EXPECT_TRUE(tok->is_eog(2));  // <|im_end|>
  EXPECT_TRUE(tok->is_eog(0));  // <|endoftext|>
  EXPECT_FALSE(tok->is_eog(1));
  EXPECT_EQ(tok->encode("Hi", true, true), tok->encode("Hi", false, true));  // add_bos_token is false
  EXPECT_EQ(tok->piece(1), "<|im_start|>");
  EXPECT_EQ(tok->token_text(tok->encode(" the", false, false).at(0)), " the");
  // Byte 0x04 has no byte-level token in SmolLM2, and its unknown token is <|endoftext|>, a control
  // token: an error naming the byte, never a silent special token.
  expect_input_error([&] { tok->encode("a\x04", false, false); }, "byte 0x04 has no token");
  // So is 0xff, which is never valid UTF-8: the error names its offset.
  expect_input_error([&] { tok->encode("ok \xff", false, false); }, "invalid UTF-8 at byte offset 3 (0xff)");
  // Invalid UTF-8 goes through byte-level BPE and comes back as the same bytes.
  const std::string bad = "ok \x80\xc3 fine \xe4\xb8";
  EXPECT_EQ(tok->decode(tok->encode(bad, false, false)), bad);
  EXPECT_THROW(tok->piece(49152), InputError);
  EXPECT_THROW(tok->decode(std::vector<int32_t>{-1}), InputError);
}

}  // namespace
}  // namespace diffrun
