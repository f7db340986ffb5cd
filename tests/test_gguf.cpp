// GGUF reader: compared with the gguf package's GGUFReader on real and fixture files; broken files must fail cleanly.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <sys/stat.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/dequant.hpp"
#include "model/error.hpp"
#include "model/gguf.hpp"
#include "tests/gguf_builder.hpp"
#include "tests/test_util.hpp"

namespace diffrun {
namespace {

namespace fs = std::filesystem;
using test::GgufBuilder;
using json = nlohmann::json;

constexpr uint32_t kF32 = 0, kQ8_0 = 8;

const char* value_type_name(GgufValueType t) {
  static const char* names[] = {"UINT8", "INT8",   "UINT16", "INT16",  "UINT32", "INT32",  "FLOAT32",
                                "BOOL",  "STRING", "ARRAY",  "UINT64", "INT64",  "FLOAT64"};
  return names[static_cast<uint32_t>(t)];
}

std::string hex(const std::string& s) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

// Leaf values of a (possibly nested) array, in file order: how GGUFReader exposes arrays.
void flatten(const GgufValue& v, std::vector<const GgufValue*>& out) {
  if (v.type == GgufValueType::ARRAY) {
    for (const auto& item : v.as_array("").items) flatten(item, out);
  } else {
    out.push_back(&v);
  }
}

// Compares one scalar with GGUFReader's JSON rendering of it; returns "" when equal.
std::string compare_scalar(const GgufValue& v, const json& j) {
  switch (v.type) {
    case GgufValueType::STRING:
      return hex(v.as_string("")) == j.get<std::string>() ? "" : "string differs";
    case GgufValueType::BOOL:
      return v.as_bool("") == j.get<bool>() ? "" : "bool differs";
    case GgufValueType::FLOAT32:
    case GgufValueType::FLOAT64: {
      const double mine = v.as_float(""), theirs = j.get<double>();
      return std::bit_cast<uint64_t>(mine) == std::bit_cast<uint64_t>(theirs) ? ""
                                                                             : "float differs: " + v.to_display();
    }
    default:
      if (std::holds_alternative<uint64_t>(v.v))
        return std::get<uint64_t>(v.v) == j.get<uint64_t>() ? "" : "uint differs: " + v.to_display();
      return std::get<int64_t>(v.v) == j.get<int64_t>() ? "" : "int differs: " + v.to_display();
  }
}

// Runs scripts/gguf_to_json.py over `models` (one Python start) into `dir`.
void dump_with_gguf_package(const std::vector<std::string>& models, int rows, const std::string& dir) {
  std::string cmd = test::env_or("PYTHON", "python3") + " " + test::source_dir() + "/scripts/gguf_to_json.py --rows " +
                    std::to_string(rows) + " '" + dir + "'";
  for (const auto& m : models) cmd += " '" + m + "'";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

// Checks every metadata value, tensor info and the dumped dequantized rows of every tensor of `model`
// against what GGUFReader and gguf.quants reported (dump_with_gguf_package into `dir`).
void compare_with_gguf_package(const std::string& model, const std::string& dir) {
  const std::string stem = dir + "/" + fs::path(model).stem().string();
  std::ifstream jin(stem + ".json");
  ASSERT_TRUE(jin.good()) << "no " << stem << ".json";
  const json doc = json::parse(jin);
  std::ifstream fin(stem + ".f32", std::ios::binary);
  std::vector<char> raw((std::istreambuf_iterator<char>(fin)), std::istreambuf_iterator<char>());
  std::vector<float> theirs(raw.size() / 4);
  std::memcpy(theirs.data(), raw.data(), theirs.size() * 4);

  auto f = GgufFile::open(model);
  EXPECT_EQ(f->version(), doc["version"].get<uint32_t>());
  EXPECT_EQ(f->alignment(), doc["alignment"].get<uint64_t>());
  EXPECT_EQ(f->data_offset(), doc["data_offset"].get<uint64_t>());

  const json& md = doc["metadata"];
  ASSERT_EQ(f->metadata().size(), md.size());
  for (size_t i = 0; i < md.size(); ++i) {
    const GgufKv& kv = f->metadata()[i];
    const json& j = md[i];
    ASSERT_EQ(kv.key, j["key"].get<std::string>());
    ASSERT_EQ(value_type_name(kv.value.type), j["type"].get<std::string>()) << kv.key;
    if (kv.value.type == GgufValueType::ARRAY) {
      EXPECT_EQ(value_type_name(kv.value.as_array("").elem_type), j["elem_type"].get<std::string>()) << kv.key;
      std::vector<const GgufValue*> leaves;
      flatten(kv.value, leaves);
      ASSERT_EQ(leaves.size(), j["values"].size()) << kv.key;
      for (size_t k = 0; k < leaves.size(); ++k) {
        const std::string diff = compare_scalar(*leaves[k], j["values"][k]);
        ASSERT_EQ(diff, "") << kv.key << "[" << k << "]";
      }
    } else {
      EXPECT_EQ(compare_scalar(kv.value, j["value"]), "") << kv.key;
    }
  }

  const json& ts = doc["tensors"];
  ASSERT_EQ(f->tensors().size(), ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    const TensorInfo& t = f->tensors()[i];
    const json& j = ts[i];
    ASSERT_EQ(t.name, j["name"].get<std::string>());
    EXPECT_EQ(static_cast<uint32_t>(t.type), j["type"].get<uint32_t>()) << t.name;
    EXPECT_EQ(t.ne, j["ne"].get<std::vector<int64_t>>()) << t.name;
    EXPECT_EQ(f->data_offset() + t.offset, j["data_offset"].get<uint64_t>()) << t.name;
    EXPECT_EQ(t.n_elements, j["n_elements"].get<int64_t>()) << t.name;
    EXPECT_EQ(t.n_bytes, j["n_bytes"].get<uint64_t>()) << t.name;
    EXPECT_EQ(f->find_tensor(t.name), &t);
    if (!dequant_supported(t.type)) continue;
    const std::vector<float> mine = dequantize_tensor<float>(*f, t);
    const auto off = j["f32_offset"].get<size_t>(), count = j["f32_count"].get<size_t>();
    ASSERT_LE(off + count, theirs.size());
    ASSERT_LE(count, mine.size());
    size_t bad = 0;
    for (size_t k = 0; k < count; ++k) {
      const float a = mine[k], b = theirs[off + k];
      const bool same = std::isnan(b) ? std::isnan(a) : std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
      if (!same && ++bad <= 3) ADD_FAILURE() << t.name << "[" << k << "]: " << a << " vs gguf " << b;
    }
    EXPECT_EQ(bad, 0u) << t.name << " (" << ggml_type_name(t.type) << ")";
  }

  // Block sizes agree with the package for every type both know (Q8_1: ggml's block is 36 bytes,
  // two halves and 32 int8; the package still lists the old 40-byte layout; it never occurs in files).
  int checked = 0;
  for (uint32_t raw_type = 0; raw_type < 64; ++raw_type) {
    if (!ggml_type_known(raw_type) || raw_type == static_cast<uint32_t>(GgmlType::Q8_1)) continue;
    const auto type = static_cast<GgmlType>(raw_type);
    const json& q = doc["quant_sizes"][ggml_type_name(type)];
    ASSERT_FALSE(q.is_null()) << ggml_type_name(type);
    EXPECT_EQ(ggml_block_elements(type), q[0].get<int64_t>()) << ggml_type_name(type);
    EXPECT_EQ(ggml_block_bytes(type), q[1].get<int64_t>()) << ggml_type_name(type);
    ++checked;
  }
  EXPECT_EQ(checked, 30);
}

TEST(GgufVsPackage, SmolLM2) {
  const std::string model = test::smollm2_path();
  if (!fs::exists(model)) GTEST_SKIP() << "SmolLM2 not fetched (" << model << "); run scripts/fetch_models";
  const test::ScratchDir dir("gguf-smollm2");
  dump_with_gguf_package({model}, 8, dir.path);
  compare_with_gguf_package(model, dir.path);
  auto f = GgufFile::open(model);
  EXPECT_EQ(f->tensor("token_embd.weight").ne, (std::vector<int64_t>{576, 49152}));
  EXPECT_EQ(f->get_string_array("tokenizer.ggml.tokens").size(), 49152u);
  EXPECT_EQ(f->get_string("general.architecture"), "llama");
  EXPECT_EQ(f->get_int("llama.block_count"), 30);
  EXPECT_FLOAT_EQ(static_cast<float>(f->get_float("llama.rope.freq_base")), 100000.0f);
}

TEST(GgufVsPackage, EveryFixture) {
  const std::string dir = test::fixture_path("");
  std::vector<std::string> files;
  if (fs::is_directory(dir))
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".gguf" && e.path().filename().string().rfind("tiny-", 0) == 0)
        files.push_back(e.path().string());
  if (files.empty()) GTEST_SKIP() << "no tiny-*.gguf fixtures in " << dir << " (ctest fixture tiny_models)";
  std::sort(files.begin(), files.end());
  const test::ScratchDir out("gguf-fixtures");
  dump_with_gguf_package(files, 64, out.path);
  for (const auto& file : files) {
    SCOPED_TRACE(file);
    compare_with_gguf_package(file, out.path);
  }
}

// ---- a small well-formed file built byte by byte ----

struct Sample {
  GgufBuilder b;
  size_t tensor_info_a = 0, tensor_info_b = 0;
};

// Two tensors: "a" F32 [32, 2] at data offset 0 and "b" Q8_0 [64] at data offset 256.
Sample sample_file(uint32_t version = 3, uint32_t alignment = 32) {
  Sample s;
  GgufBuilder& b = s.b;
  b.header(2, 9, version);
  b.kv_string("general.architecture", "llama");
  b.kv_u32("general.alignment", alignment);
  b.kv_f32("test.f32", -0.0f);
  b.str("test.i8").u32(1).put<int8_t>(-7);
  b.str("test.u64").u32(10).u64(~uint64_t{0});
  b.str("test.f64").u32(12).put<double>(1e-300);
  b.str("test.bool").u32(7).u8(1);
  b.kv_string_array("test.strings", {"x", "", std::string("\xff\x00z", 3)});
  // nested: [[1, 2], [3]] of INT16
  b.str("test.nested").u32(9).u32(9).u64(2);
  b.u32(3).u64(2).put<int16_t>(1).put<int16_t>(2);
  b.u32(3).u64(1).put<int16_t>(-3);
  s.tensor_info_a = b.pos();
  b.tensor_info("a", {32, 2}, kF32, 0);
  s.tensor_info_b = b.pos();
  b.tensor_info("b", {64}, kQ8_0, 256);
  b.pad_to(alignment);
  for (int i = 0; i < 64; ++i) b.put<float>(static_cast<float>(i) * 0.5f);
  b.pad_to(alignment);
  for (int blk = 0; blk < 2; ++blk) {
    b.put<uint16_t>(0x3800);  // d = 0.5
    for (int i = 0; i < 32; ++i) b.put<int8_t>(static_cast<int8_t>(i - 16));
  }
  return s;
}

class GgufFiles : public ::testing::Test {
 protected:
  test::ScratchDir scratch{"gguf"};
  std::string dir = scratch.path;
  std::string path(const std::string& name) const { return dir + "/" + name; }
};

TEST_F(GgufFiles, ReadsEveryValueTypeAndTensorData) {
  for (uint32_t version : {2u, 3u}) {
    const std::string p = sample_file(version).b.write(path("sample-v" + std::to_string(version) + ".gguf"));
    auto f = GgufFile::open(p);
    EXPECT_EQ(f->version(), version);
    EXPECT_EQ(f->alignment(), 32u);
    EXPECT_EQ(f->data_offset() % 32, 0u);
    EXPECT_EQ(std::bit_cast<uint32_t>(static_cast<float>(f->get_float("test.f32"))), 0x80000000u);
    EXPECT_EQ(f->get_int("test.i8"), -7);
    EXPECT_THROW(f->get_int("test.u64"), ModelError);  // 2^64-1 does not fit in int64
    EXPECT_EQ(f->get_float("test.f64"), 1e-300);
    EXPECT_TRUE(f->get_bool("test.bool", false));
    EXPECT_EQ(f->get_string_array("test.strings"), (std::vector<std::string>{"x", "", std::string("\xff\x00z", 3)}));
    const GgufArray& nested = f->get("test.nested").as_array("test.nested");
    ASSERT_EQ(nested.items.size(), 2u);
    EXPECT_EQ(nested.elem_type, GgufValueType::ARRAY);
    EXPECT_EQ(f->get("test.nested").to_display(), "[[1, 2], [-3]]");
    const TensorInfo& a = f->tensor("a");
    EXPECT_EQ(a.ne, (std::vector<int64_t>{32, 2}));
    EXPECT_EQ(a.rows(), 2);
    EXPECT_EQ(a.n_bytes, 256u);
    const std::vector<double> av = dequantize_tensor<double>(*f, a);
    EXPECT_EQ(av[63], 31.5);
    const std::vector<float> bv = dequantize_tensor<float>(*f, f->tensor("b"));
    EXPECT_EQ(bv[0], -8.0f);
    EXPECT_EQ(bv[63], 7.5f);
    EXPECT_EQ(f->find_tensor("c"), nullptr);
    EXPECT_EQ(f->find("absent"), nullptr);
    EXPECT_EQ(f->get_int("absent", 42), 42);
    EXPECT_EQ(f->get_string("absent", "dflt"), "dflt");
  }
  // And what the gguf package makes of the same bytes.
  dump_with_gguf_package({path("sample-v3.gguf"), path("sample-v2.gguf")}, 1 << 20, dir);
  compare_with_gguf_package(path("sample-v3.gguf"), dir);
  compare_with_gguf_package(path("sample-v2.gguf"), dir);
}

TEST_F(GgufFiles, CustomAlignment) {
  const std::string p = sample_file(3, 256).b.write(path("align256.gguf"));
  auto f = GgufFile::open(p);
  EXPECT_EQ(f->alignment(), 256u);
  EXPECT_EQ(f->data_offset() % 256, 0u);
  EXPECT_EQ(dequantize_tensor<float>(*f, f->tensor("a"))[1], 0.5f);
  dump_with_gguf_package({p}, 1 << 20, dir);
  compare_with_gguf_package(p, dir);
}

TEST_F(GgufFiles, MistypedAndMissingKeysNameTheKey) {
  auto f = GgufFile::open(sample_file().b.write(path("keys.gguf")));
  auto message_of = [](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const ModelError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message_of([&] { f->get_int("general.architecture"); }).find("general.architecture"), std::string::npos);
  EXPECT_NE(message_of([&] { f->get_string("test.bool"); }).find("test.bool"), std::string::npos);
  EXPECT_NE(message_of([&] { f->get_float("nope"); }).find("nope"), std::string::npos);
  EXPECT_NE(message_of([&] { f->tensor("nope.weight"); }).find("nope.weight"), std::string::npos);
  EXPECT_NE(message_of([&] { f->get_int_array("test.strings"); }).find("test.strings"), std::string::npos);
  EXPECT_NE(message_of([&] { f->get_bool("test.i8", false); }).find("test.i8"), std::string::npos);
}

TEST_F(GgufFiles, DisplayAbbreviatesLongArrays) {
  GgufBuilder b;
  std::vector<std::string> many;
  for (int i = 0; i < 100; ++i) many.push_back(std::string(1, 't').append(std::to_string(i)));
  b.header(0, 1).kv_string_array("tokens", many);
  auto f = GgufFile::open(b.write(path("display.gguf")));
  const std::string d = f->get("tokens").to_display(3);
  EXPECT_EQ(d, "[\"t0\", \"t1\", \"t2\", ... (100 STRING items)]");
}

TEST_F(GgufFiles, FingerprintHashesHeaderOnly) {
  Sample s = sample_file();
  auto f = GgufFile::open(s.b.write(path("fp.gguf")));
  const std::string fp = f->fingerprint();
  // FNV-1a 64 over [0, data_offset), written out here independently of the reader.
  uint64_t h = 14695981039346656037ull;
  for (size_t i = 0; i < f->data_offset(); ++i) h = (h ^ s.b.bytes[i]) * 1099511628211ull;
  char want[64];
  std::snprintf(want, sizeof want, "%zu:%016llx", s.b.bytes.size(), static_cast<unsigned long long>(h));
  EXPECT_EQ(fp, want);
  // Tensor data does not enter the hash; metadata does.
  GgufBuilder data_changed = s.b;
  data_changed.bytes.back() ^= 1;
  EXPECT_EQ(GgufFile::open(data_changed.write(path("fp2.gguf")))->fingerprint(), fp);
  GgufBuilder meta_changed = s.b;
  meta_changed.bytes[40] ^= 1;  // inside the first key
  EXPECT_NE(GgufFile::open(meta_changed.write(path("fp3.gguf")))->fingerprint(), fp);
}

// ---- broken files: a GgufError naming the file and the offset, never a crash ----

struct Broken {
  std::string label;
  GgufBuilder b;
  uint64_t offset;   // where the error must point
  std::string what;  // a phrase the message must contain
};

std::vector<Broken> broken_files() {
  std::vector<Broken> out;
  auto add = [&](std::string label, GgufBuilder b, uint64_t offset, std::string what) {
    out.push_back({std::move(label), std::move(b), offset, std::move(what)});
  };
  {
    GgufBuilder b;
    b.raw("GGML", 4).u32(3).u64(0).u64(0);
    add("bad magic", b, 0, "bad magic");
  }
  {
    GgufBuilder b;
    b.header(0, 0, 1);
    add("version 1", b, 4, "unsupported GGUF version 1");
  }
  {
    GgufBuilder b;
    b.header(0, 0, 0x03000000);
    add("big-endian version", b, 4, "big-endian");
  }
  {
    GgufBuilder b;
    b.raw("GGUF", 4).u32(3).u32(0);
    add("truncated counts", b, 8, "truncated header");
  }
  {
    GgufBuilder b;
    b.header(0, 1);
    const size_t at = b.pos();
    b.u64(1000).raw("abcdefghijklmnop", 16);
    add("key length past the end", b, at, "runs past the end");
  }
  {
    GgufBuilder b;
    b.header(0, 1).str("k").u32(8);
    const size_t at = b.pos();
    b.u64(~uint64_t{0} - 3);
    add("string value length past the end", b, at, "runs past the end");
  }
  {
    GgufBuilder b;
    b.header(0, 1).str("k").u32(9).u32(4);
    const size_t at = b.pos();
    b.u64(uint64_t{1} << 60).u32(1);
    add("array length past the end", b, at, "runs past the end");
  }
  {
    GgufBuilder b;
    b.header(0, 1).str("k").u32(9).u32(9);
    const size_t at = b.pos();
    b.u64(uint64_t{1} << 40);
    add("nested array count past the end", b, at, "runs past the end");
  }
  {
    GgufBuilder b;
    b.header(0, 1).str("k").u32(9);
    const size_t at = b.pos() + 12 * 8;  // the ninth array header
    for (int i = 0; i < 12; ++i) b.u32(9).u64(1);
    b.u32(4).u64(1).u32(0);
    add("arrays nested too deep", b, at, "nested deeper");
  }
  {
    GgufBuilder b;
    b.raw("GGUF", 4).u32(3).u64(uint64_t{1} << 50).u64(0);
    add("absurd tensor count", b, 8, "absurd tensor count");
  }
  {
    GgufBuilder b;
    b.raw("GGUF", 4).u32(3).u64(0).u64(uint64_t{1} << 62);
    add("absurd metadata count", b, 16, "absurd metadata count");
  }
  {
    GgufBuilder b;
    b.header(0, 1).str("k");
    const size_t at = b.pos();
    b.u32(13).u32(0);
    add("unknown value type", b, at, "unknown metadata value type 13");
  }
  {
    GgufBuilder b;
    b.header(0, 2).kv_u32("k", 1);
    const size_t at = b.pos();
    b.kv_u32("k", 2);
    add("duplicate key", b, at, "duplicate metadata key 'k'");
  }
  for (uint32_t a : {0u, 3u, 48u}) {
    GgufBuilder b;
    b.header(0, 1).str("general.alignment").u32(4);
    const size_t at = b.pos();
    b.u32(a);
    add("alignment " + std::to_string(a), b, at, "bad general.alignment");
  }
  {
    GgufBuilder b;
    b.header(0, 1).str("general.alignment").u32(8);
    const size_t at = b.pos();
    b.str("32");
    add("alignment as a string", b, at, "expected an integer");
  }
  {
    GgufBuilder b;
    b.header(0, 1).str("b").u32(7);
    const size_t at = b.pos();
    b.u8(2);
    add("bool 2", b, at, "neither 0 nor 1");
  }
  {
    GgufBuilder b;
    b.header(1, 0).str("t");
    const size_t at = b.pos();
    b.u32(5).u64(1).u64(1).u64(1).u64(1).u64(1).u32(0).u64(0).zeros(64);
    add("n_dims 5", b, at, "n_dims 5");
  }
  {
    GgufBuilder b;
    b.header(1, 0).str("t").u32(2).u64(uint64_t{1} << 32);
    const size_t at = b.pos();
    b.u64(uint64_t{1} << 32).u32(0).u64(0).zeros(64);
    add("dims product overflow", b, at, "overflows");
  }
  {
    GgufBuilder b;
    b.header(1, 0).str("t").u32(2).u64(uint64_t{1} << 31);
    const size_t at = b.pos();
    b.u64(uint64_t{1} << 31).u32(0).u64(0).zeros(64);  // 2^62 elements * 4 bytes
    add("byte size overflow", b, at - 12, "overflows");
  }
  {
    GgufBuilder b;
    b.header(1, 0).str("t").u32(1);
    const size_t at = b.pos();
    b.u64(uint64_t{1} << 63).u32(0).u64(0).zeros(64);
    add("negative dim", b, at, "negative");
  }
  {
    GgufBuilder b;
    b.header(1, 0).tensor_info("t", {8}, 0, 0);
    const size_t at = b.pos() - 8;
    b.pad_to(32).zeros(16);
    add("tensor data past the end", b, at, "runs past the end");
  }
  {
    GgufBuilder b;
    b.header(1, 0).tensor_info("t", {8}, 0, 4);
    const size_t at = b.pos() - 8;
    b.pad_to(32).zeros(64);
    add("misaligned tensor", b, at, "not a multiple of the alignment");
  }
  {
    GgufBuilder b;
    b.header(1, 0).tensor_info("t", {8}, 0, ~uint64_t{0} - 31);
    const size_t at = b.pos() - 8;
    b.pad_to(32).zeros(64);
    add("tensor offset wraps around", b, at, "runs past the end");
  }
  for (uint32_t dtype : {4u, 31u, 99u}) {
    GgufBuilder b;
    b.header(1, 0).str("t").u32(1).u64(32);
    const size_t at = b.pos();
    b.u32(dtype).u64(0).pad_to(32).zeros(256);
    add("unknown dtype " + std::to_string(dtype), b, at, "unknown dtype " + std::to_string(dtype));
  }
  {
    GgufBuilder b;
    b.header(1, 0).str("t");
    const size_t at = b.pos();
    b.u32(1).u64(33).u32(kQ8_0).u64(0).pad_to(32).zeros(64);
    add("partial block", b, at, "not a multiple of the Q8_0 block size");
  }
  {
    GgufBuilder b;
    b.header(2, 0).tensor_info("t", {8}, 0, 0);
    const size_t at = b.pos();
    b.tensor_info("t", {8}, 0, 32).pad_to(32).zeros(64);
    add("duplicate tensor name", b, at, "duplicate tensor name 't'");
  }
  {
    GgufBuilder b;
    b.header(1, 0).tensor_info(std::string(64, 'n'), {8}, 0, 0).pad_to(32).zeros(64);
    add("tensor name too long", b, 24, "longer than ggml's limit");
  }
  return out;
}

TEST_F(GgufFiles, BrokenFilesGiveTypedErrorsWithFileAndOffset) {
  int n = 0;
  for (const Broken& c : broken_files()) {
    SCOPED_TRACE(c.label);
    const std::string p = c.b.write(path("broken-" + std::to_string(n++) + ".gguf"));
    try {
      GgufFile::open(p);
      ADD_FAILURE() << "no error";
    } catch (const GgufError& e) {
      const std::string msg = e.what();
      EXPECT_EQ(e.file, p);
      EXPECT_NE(msg.find(p), std::string::npos) << msg;
      EXPECT_NE(msg.find("offset " + std::to_string(e.offset)), std::string::npos) << msg;
      EXPECT_NE(msg.find(c.what), std::string::npos) << msg;
      EXPECT_EQ(e.offset, c.offset) << msg;
    }
  }
  EXPECT_GE(n, 30);
}

TEST_F(GgufFiles, EveryTruncationOfAValidFileFails) {
  const Sample s = sample_file();
  ASSERT_NO_THROW(GgufFile::open(s.b.write(path("whole.gguf"))));
  // Cut anywhere before the last byte of tensor data: a GgufError, never a crash or a partial read.
  for (size_t n = 0; n < s.b.bytes.size(); ++n) {
    const std::string p = s.b.write_prefix(path("cut.gguf"), n);
    EXPECT_THROW(GgufFile::open(p), GgufError) << "cut at " << n;
  }
}

TEST_F(GgufFiles, MissingFileAndDirectory) {
  try {
    GgufFile::open(path("does-not-exist.gguf"));
    FAIL() << "no error";
  } catch (const GgufError& e) {
    EXPECT_NE(std::string(e.what()).find("does-not-exist.gguf"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("No such file"), std::string::npos) << e.what();
  }
  EXPECT_THROW(GgufFile::open(dir), GgufError);
  ASSERT_EQ(::mkfifo(path("fifo.gguf").c_str(), 0600), 0);
  EXPECT_THROW(GgufFile::open(path("fifo.gguf")), GgufError);  // refused at once, not blocked on
  std::ofstream(path("empty.gguf")).close();
  EXPECT_THROW(GgufFile::open(path("empty.gguf")), GgufError);
}

TEST(GgmlTypes, NamesAndSizes) {
  EXPECT_STREQ(ggml_type_name(GgmlType::Q4_K), "Q4_K");
  EXPECT_STREQ(ggml_type_name(static_cast<GgmlType>(77)), "type#77");
  EXPECT_FALSE(ggml_type_known(4));
  EXPECT_FALSE(ggml_type_known(36));
  EXPECT_TRUE(ggml_type_known(30));
  EXPECT_EQ(ggml_block_bytes(GgmlType::Q6_K), 210);
}

}  // namespace
}  // namespace diffrun
