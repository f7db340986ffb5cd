// GGUF file reader: header, metadata, tensor infos, read-only mmap of the tensor data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace diffrun {

// ggml tensor types, numbered as in ggml.h / the GGUF spec.
enum class GgmlType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22,
  IQ4_XS = 23, I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
  TQ1_0 = 34, TQ2_0 = 35,
};

const char* ggml_type_name(GgmlType t);     // "Q4_K", or "type#N" for unknown numbers
bool ggml_type_known(uint32_t raw);           // a type number this reader can size
int64_t ggml_block_elements(GgmlType t);      // elements per block (1 for F32/F16/BF16)
int64_t ggml_block_bytes(GgmlType t);         // bytes per block

// GGUF metadata value types, numbered as in the spec.
enum class GgufValueType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};

struct GgufValue;
struct GgufArray {
  GgufValueType elem_type;
  std::vector<GgufValue> items;
};

struct GgufValue {
  GgufValueType type;
  std::variant<uint64_t, int64_t, double, bool, std::string, std::shared_ptr<GgufArray>> v;

  // Conversions throw ModelError naming `key` when the type does not fit.
  int64_t as_int(std::string_view key) const;
  double as_float(std::string_view key) const;
  bool as_bool(std::string_view key) const;
  const std::string& as_string(std::string_view key) const;
  const GgufArray& as_array(std::string_view key) const;
  std::string to_display(size_t max_items = 8) const;  // for `diffrun inspect`
};

struct GgufKv {
  std::string key;
  GgufValue value;
};

struct TensorInfo {
  std::string name;
  GgmlType type;
  std::vector<int64_t> ne;  // GGUF order: ne[0] is the fastest-varying (token_embd.weight is [n_embd, n_vocab])
  uint64_t offset;          // relative to the start of the data section
  int64_t n_elements;
  uint64_t n_bytes;
  int64_t rows() const;     // product of ne[1..]
};

class GgufFile {
 public:
  // Opens and validates the whole header and tensor table; throws GgufError.
  static std::unique_ptr<GgufFile> open(const std::string& path);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t file_size() const { return size_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }

  const std::vector<GgufKv>& metadata() const { return kv_; }
  const GgufValue* find(std::string_view key) const;  // nullptr when absent
  const GgufValue& get(std::string_view key) const;   // throws ModelError naming the key

  // Typed convenience getters (throw ModelError naming the key when missing or mistyped).
  int64_t get_int(std::string_view key) const;
  int64_t get_int(std::string_view key, int64_t fallback) const;
  double get_float(std::string_view key) const;
  double get_float(std::string_view key, double fallback) const;
  bool get_bool(std::string_view key, bool fallback) const;
  std::string get_string(std::string_view key) const;
  std::string get_string(std::string_view key, std::string_view fallback) const;
  std::vector<std::string> get_string_array(std::string_view key) const;
  std::vector<double> get_float_array(std::string_view key) const;
  std::vector<int64_t> get_int_array(std::string_view key) const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(std::string_view name) const;  // nullptr when absent
  const TensorInfo& tensor(std::string_view name) const;       // throws ModelError naming it
  std::span<const std::byte> tensor_data(const TensorInfo& t) const;

  // size plus a 64-bit FNV-1a hash of the header and tensor table, as 16 hex digits: "size:hash".
  std::string fingerprint() const;

 private:
  GgufFile() = default;
  std::string path_;
  uint32_t version_ = 0;
  uint64_t size_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  const std::byte* map_ = nullptr;
  std::vector<GgufKv> kv_;
  std::vector<TensorInfo> tensors_;
  friend class GgufParser;
};

}  // namespace diffrun
