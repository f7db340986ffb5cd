// Byte-level GGUF writer for tests: well-formed files and deliberately broken ones, with byte offsets recorded.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "model/gguf.hpp"
#include "test_util.hpp"

namespace diffrun::test {

class GgufBuilder {
 public:
  std::vector<uint8_t> bytes;

  size_t pos() const { return bytes.size(); }

  GgufBuilder& raw(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    bytes.insert(bytes.end(), b, b + n);
    return *this;
  }
  template <typename T>
  GgufBuilder& put(T v) {
    return raw(&v, sizeof(T));
  }
  GgufBuilder& u8(uint8_t v) { return put(v); }
  GgufBuilder& u32(uint32_t v) { return put(v); }
  GgufBuilder& u64(uint64_t v) { return put(v); }
  GgufBuilder& str(const std::string& s) {
    u64(s.size());
    return raw(s.data(), s.size());
  }

  // "GGUF", version, tensor count, metadata count.
  GgufBuilder& header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
    raw("GGUF", 4);
    u32(version);
    u64(n_tensors);
    return u64(n_kv);
  }

  GgufBuilder& kv_string(const std::string& key, const std::string& v) {
    str(key);
    u32(static_cast<uint32_t>(GgufValueType::STRING));
    return str(v);
  }
  GgufBuilder& kv_u32(const std::string& key, uint32_t v) {
    str(key);
    u32(static_cast<uint32_t>(GgufValueType::UINT32));
    return u32(v);
  }
  GgufBuilder& kv_f32(const std::string& key, float v) {
    str(key);
    u32(static_cast<uint32_t>(GgufValueType::FLOAT32));
    return put(v);
  }
  GgufBuilder& kv_string_array(const std::string& key, const std::vector<std::string>& v) {
    str(key);
    u32(static_cast<uint32_t>(GgufValueType::ARRAY));
    u32(static_cast<uint32_t>(GgufValueType::STRING));
    u64(v.size());
    for (const auto& s : v) str(s);
    return *this;
  }

  GgufBuilder& tensor_info(const std::string& name, const std::vector<uint64_t>& ne, uint32_t type,
                           uint64_t offset) {
    str(name);
    u32(static_cast<uint32_t>(ne.size()));
    for (uint64_t d : ne) u64(d);
    u32(type);
    return u64(offset);
  }

  GgufBuilder& pad_to(size_t alignment) {
    while (bytes.size() % alignment) bytes.push_back(0);
    return *this;
  }
  GgufBuilder& zeros(size_t n) {
    bytes.insert(bytes.end(), n, 0);
    return *this;
  }

  void patch_u64(size_t at, uint64_t v) { std::memcpy(bytes.data() + at, &v, 8); }

  std::string write(const std::string& path) const { return write_prefix(path, bytes.size()); }
  std::string write_prefix(const std::string& path, size_t n) const {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(n));
    return path;
  }
};

}  // namespace diffrun::test
