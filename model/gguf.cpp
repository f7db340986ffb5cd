// GGUF reader: bounds-checked parse of header, metadata and tensor table over a read-only mmap.
#include "model/gguf.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <limits>
#include <unordered_set>

#include <fmt/core.h>

#include "model/error.hpp"

namespace diffrun {

namespace {

struct TypeTraits {
  const char* name;
  int64_t block_elements;  // 0: not a type number of ggml
  int64_t block_bytes;
};

// Sizes as in ggml's type_traits (ggml.c). Numbers 4, 5 and 31..33 were removed from ggml.
// Q8_1 is 36 bytes (two halves + 32 int8) as in ggml; it never appears in model files.
TypeTraits type_traits(uint32_t raw) {
  switch (raw) {
    case 0: return {"F32", 1, 4};
    case 1: return {"F16", 1, 2};
    case 2: return {"Q4_0", 32, 18};
    case 3: return {"Q4_1", 32, 20};
    case 6: return {"Q5_0", 32, 22};
    case 7: return {"Q5_1", 32, 24};
    case 8: return {"Q8_0", 32, 34};
    case 9: return {"Q8_1", 32, 36};
    case 10: return {"Q2_K", 256, 84};
    case 11: return {"Q3_K", 256, 110};
    case 12: return {"Q4_K", 256, 144};
    case 13: return {"Q5_K", 256, 176};
    case 14: return {"Q6_K", 256, 210};
    case 15: return {"Q8_K", 256, 292};
    case 16: return {"IQ2_XXS", 256, 66};
    case 17: return {"IQ2_XS", 256, 74};
    case 18: return {"IQ3_XXS", 256, 98};
    case 19: return {"IQ1_S", 256, 50};
    case 20: return {"IQ4_NL", 32, 18};
    case 21: return {"IQ3_S", 256, 110};
    case 22: return {"IQ2_S", 256, 82};
    case 23: return {"IQ4_XS", 256, 136};
    case 24: return {"I8", 1, 1};
    case 25: return {"I16", 1, 2};
    case 26: return {"I32", 1, 4};
    case 27: return {"I64", 1, 8};
    case 28: return {"F64", 1, 8};
    case 29: return {"IQ1_M", 256, 56};
    case 30: return {"BF16", 1, 2};
    case 34: return {"TQ1_0", 256, 54};
    case 35: return {"TQ2_0", 256, 66};
    default: return {nullptr, 0, 0};
  }
}

const char* value_type_name(uint32_t t) {
  static const char* names[] = {"UINT8", "INT8",   "UINT16", "INT16",  "UINT32", "INT32",  "FLOAT32",
                                "BOOL",  "STRING", "ARRAY",  "UINT64", "INT64",  "FLOAT64"};
  return t < 13 ? names[t] : "unknown";
}

// Bytes a value of a fixed-size type occupies; 0 for STRING and ARRAY.
uint64_t fixed_value_size(GgufValueType t) {
  switch (t) {
    case GgufValueType::UINT8: case GgufValueType::INT8: case GgufValueType::BOOL: return 1;
    case GgufValueType::UINT16: case GgufValueType::INT16: return 2;
    case GgufValueType::UINT32: case GgufValueType::INT32: case GgufValueType::FLOAT32: return 4;
    case GgufValueType::UINT64: case GgufValueType::INT64: case GgufValueType::FLOAT64: return 8;
    default: return 0;
  }
}

// The fewest bytes one value of type t can occupy in a file (used to reject absurd counts).
uint64_t min_value_size(GgufValueType t) {
  if (t == GgufValueType::STRING) return 8;             // length
  if (t == GgufValueType::ARRAY) return 4 + 8;          // element type + count
  return fixed_value_size(t);
}

constexpr int kMaxArrayDepth = 8;           // nested arrays deeper than this are rejected (stack safety)
constexpr uint64_t kMaxTensorName = 64;     // GGML_MAX_NAME, including ggml's terminating zero
constexpr uint64_t kMaxAlignment = 1u << 30;
// Containers grow as items are actually parsed: a count never reserves more than this up front.
constexpr uint64_t kMaxReserve = 1u << 16;
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;  // name length, n_dims, one dim, type, offset
constexpr uint64_t kMinKvBytes = 8 + 4 + 1;                   // key length, value type, one byte of value

std::string errno_text() { return std::strerror(errno); }

}  // namespace

const char* ggml_type_name(GgmlType t) {
  thread_local std::string unknown;
  TypeTraits tt = type_traits(static_cast<uint32_t>(t));
  if (tt.name) return tt.name;
  unknown = "type#" + std::to_string(static_cast<uint32_t>(t));
  return unknown.c_str();
}

bool ggml_type_known(uint32_t raw) { return type_traits(raw).name != nullptr; }

int64_t ggml_block_elements(GgmlType t) { return type_traits(static_cast<uint32_t>(t)).block_elements; }

int64_t ggml_block_bytes(GgmlType t) { return type_traits(static_cast<uint32_t>(t)).block_bytes; }

int64_t TensorInfo::rows() const {
  int64_t r = 1;
  for (size_t i = 1; i < ne.size(); ++i) r *= ne[i];
  return r;
}

// ---- GgufValue conversions ----

namespace {
[[noreturn]] void throw_type(std::string_view key, GgufValueType t, const char* wanted) {
  throw ModelError(fmt::format("metadata key '{}' is {}, expected {}", key,
                               value_type_name(static_cast<uint32_t>(t)), wanted));
}
}  // namespace

int64_t GgufValue::as_int(std::string_view key) const {
  if (auto* u = std::get_if<uint64_t>(&v)) {
    if (*u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      throw ModelError(fmt::format("metadata key '{}' = {} does not fit in int64", key, *u));
    return static_cast<int64_t>(*u);
  }
  if (auto* i = std::get_if<int64_t>(&v)) return *i;
  throw_type(key, type, "an integer");
}

double GgufValue::as_float(std::string_view key) const {
  if (auto* d = std::get_if<double>(&v)) return *d;
  if (auto* u = std::get_if<uint64_t>(&v)) return static_cast<double>(*u);
  if (auto* i = std::get_if<int64_t>(&v)) return static_cast<double>(*i);
  throw_type(key, type, "a number");
}

bool GgufValue::as_bool(std::string_view key) const {
  if (auto* b = std::get_if<bool>(&v)) return *b;
  throw_type(key, type, "a bool");
}

const std::string& GgufValue::as_string(std::string_view key) const {
  if (auto* s = std::get_if<std::string>(&v)) return *s;
  throw_type(key, type, "a string");
}

const GgufArray& GgufValue::as_array(std::string_view key) const {
  if (auto* a = std::get_if<std::shared_ptr<GgufArray>>(&v)) return **a;
  throw_type(key, type, "an array");
}

namespace {
std::string quote(const std::string& s, size_t max_bytes) {
  std::string out(1, '"');
  out += printable(s, max_bytes, '"');
  out += '"';
  return out;
}
}  // namespace

std::string GgufValue::to_display(size_t max_items) const {
  switch (type) {
    case GgufValueType::FLOAT32: return fmt::format("{}", static_cast<float>(std::get<double>(v)));
    case GgufValueType::FLOAT64: return fmt::format("{}", std::get<double>(v));
    case GgufValueType::BOOL: return std::get<bool>(v) ? "true" : "false";
    case GgufValueType::STRING: return quote(std::get<std::string>(v), 200);
    case GgufValueType::ARRAY: {
      const GgufArray& a = *std::get<std::shared_ptr<GgufArray>>(v);
      std::string out = "[";
      size_t shown = std::min(a.items.size(), max_items);
      for (size_t i = 0; i < shown; ++i) {
        if (i) out += ", ";
        out += a.items[i].to_display(max_items);
      }
      if (shown < a.items.size()) out += fmt::format(", ... ({} {} items)", a.items.size(),
                                                     value_type_name(static_cast<uint32_t>(a.elem_type)));
      return out + "]";
    }
    default:
      if (auto* u = std::get_if<uint64_t>(&v)) return std::to_string(*u);
      return std::to_string(std::get<int64_t>(v));
  }
}

// ---- parser ----

class GgufParser {
 public:
  GgufParser(GgufFile& f) : f_(f), p_(reinterpret_cast<const uint8_t*>(f.map_)), size_(f.size_) {}

  void parse() {
    need(4, "truncated header: no magic");
    if (std::memcmp(p_, "GGUF", 4) != 0)
      fail(0, fmt::format("bad magic {:02x} {:02x} {:02x} {:02x}, expected \"GGUF\"", p_[0], p_[1], p_[2], p_[3]));
    pos_ = 4;
    uint64_t at = pos_;
    f_.version_ = u32("truncated header: no version");
    if (f_.version_ != 2 && f_.version_ != 3) {
      std::string hint = (f_.version_ & 0xffff) == 0 ? " (a big-endian file?)" : "";
      fail(at, fmt::format("unsupported GGUF version {}{}; diffrun reads versions 2 and 3", f_.version_, hint));
    }
    at = pos_;
    uint64_t n_tensors = u64("truncated header: no tensor count");
    uint64_t at_kv = pos_;
    uint64_t n_kv = u64("truncated header: no metadata count");
    if (n_kv > remaining() / kMinKvBytes)
      fail(at_kv, fmt::format("absurd metadata count {} for {} remaining bytes", n_kv, remaining()));
    if (n_tensors > remaining() / kMinTensorInfoBytes)
      fail(at, fmt::format("absurd tensor count {} for {} remaining bytes", n_tensors, remaining()));

    read_metadata(n_kv);
    read_tensor_infos(n_tensors);

    uint64_t a = f_.alignment_;
    uint64_t end_of_infos = pos_;
    f_.data_offset_ = (end_of_infos + a - 1) / a * a;  // a <= 2^30 and end_of_infos <= file size: no overflow
    check_tensor_data();
  }

 private:
  [[noreturn]] void fail(uint64_t offset, const std::string& what) { throw GgufError(f_.path_, offset, what); }

  uint64_t remaining() const { return size_ - pos_; }

  void need(uint64_t n, const char* what) {
    if (n > remaining()) fail(pos_, fmt::format("{} ({} bytes needed, {} left)", what, n, remaining()));
  }

  template <typename T>
  T read_raw(const char* what) {
    need(sizeof(T), what);
    T x;
    std::memcpy(&x, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return x;
  }
  uint32_t u32(const char* what) { return read_raw<uint32_t>(what); }
  uint64_t u64(const char* what) { return read_raw<uint64_t>(what); }

  std::string str(const char* what) {
    uint64_t at = pos_;
    uint64_t len = u64(what);
    if (len > remaining())
      fail(at, fmt::format("{}: string length {} runs past the end of the file ({} bytes left)", what, len,
                           remaining()));
    std::string s(reinterpret_cast<const char*>(p_ + pos_), len);
    pos_ += len;
    return s;
  }

  GgufValue value(GgufValueType t, int depth) {
    GgufValue out{t, uint64_t{0}};
    switch (t) {
      case GgufValueType::UINT8: out.v = uint64_t{read_raw<uint8_t>("truncated value")}; break;
      case GgufValueType::INT8: out.v = int64_t{read_raw<int8_t>("truncated value")}; break;
      case GgufValueType::UINT16: out.v = uint64_t{read_raw<uint16_t>("truncated value")}; break;
      case GgufValueType::INT16: out.v = int64_t{read_raw<int16_t>("truncated value")}; break;
      case GgufValueType::UINT32: out.v = uint64_t{read_raw<uint32_t>("truncated value")}; break;
      case GgufValueType::INT32: out.v = int64_t{read_raw<int32_t>("truncated value")}; break;
      case GgufValueType::UINT64: out.v = read_raw<uint64_t>("truncated value"); break;
      case GgufValueType::INT64: out.v = read_raw<int64_t>("truncated value"); break;
      case GgufValueType::FLOAT32: out.v = double{read_raw<float>("truncated value")}; break;
      case GgufValueType::FLOAT64: out.v = read_raw<double>("truncated value"); break;
      case GgufValueType::BOOL: {
        uint64_t at = pos_;
        uint8_t b = read_raw<uint8_t>("truncated value");
        if (b > 1) fail(at, fmt::format("bool value {} is neither 0 nor 1", b));
        out.v = b == 1;
        break;
      }
      case GgufValueType::STRING: out.v = str("string value"); break;
      case GgufValueType::ARRAY: {
        if (depth >= kMaxArrayDepth) fail(pos_, fmt::format("arrays nested deeper than {}", kMaxArrayDepth));
        auto arr = std::make_shared<GgufArray>();
        uint64_t at = pos_;
        arr->elem_type = value_type(read_raw<uint32_t>("truncated array type"), at);
        at = pos_;
        uint64_t n = u64("truncated array length");
        uint64_t min_size = min_value_size(arr->elem_type);
        if (n > remaining() / min_size)
          fail(at, fmt::format("array of {} {} runs past the end of the file ({} bytes left)", n,
                               value_type_name(static_cast<uint32_t>(arr->elem_type)), remaining()));
        arr->items.reserve(std::min<uint64_t>(n, kMaxReserve));
        for (uint64_t i = 0; i < n; ++i) arr->items.push_back(value(arr->elem_type, depth + 1));
        out.v = std::move(arr);
        break;
      }
    }
    return out;
  }

  GgufValueType value_type(uint32_t raw, uint64_t at) {
    if (raw > static_cast<uint32_t>(GgufValueType::FLOAT64)) fail(at, fmt::format("unknown metadata value type {}", raw));
    return static_cast<GgufValueType>(raw);
  }

  void read_metadata(uint64_t n_kv) {
    std::unordered_set<std::string> seen;
    f_.kv_.reserve(std::min<uint64_t>(n_kv, kMaxReserve));
    for (uint64_t i = 0; i < n_kv; ++i) {
      uint64_t at = pos_;
      std::string key = str("metadata key");
      if (key.empty()) fail(at, "empty metadata key");
      if (!seen.insert(key).second) fail(at, fmt::format("duplicate metadata key '{}'", printable(key)));
      uint64_t at_type = pos_;
      GgufValueType t = value_type(u32("truncated metadata value type"), at_type);
      uint64_t at_value = pos_;
      GgufValue v = value(t, 0);
      if (key == "general.alignment") {
        if (t != GgufValueType::UINT32 && t != GgufValueType::UINT64 && t != GgufValueType::INT32 &&
            t != GgufValueType::INT64 && t != GgufValueType::UINT16 && t != GgufValueType::UINT8)
          fail(at_value, fmt::format("general.alignment has type {}, expected an integer",
                                     value_type_name(static_cast<uint32_t>(t))));
        uint64_t a = std::holds_alternative<uint64_t>(v.v) ? std::get<uint64_t>(v.v)
                                                            : static_cast<uint64_t>(std::get<int64_t>(v.v));
        bool is_int_negative = std::holds_alternative<int64_t>(v.v) && std::get<int64_t>(v.v) < 0;
        if (is_int_negative || a == 0 || (a & (a - 1)) != 0 || a > kMaxAlignment)
          fail(at_value, fmt::format("bad general.alignment {}: must be a power of two up to 2^30", v.to_display()));
        f_.alignment_ = a;
      }
      f_.kv_.push_back({std::move(key), std::move(v)});
    }
  }

  void read_tensor_infos(uint64_t n_tensors) {
    std::unordered_set<std::string> seen;
    f_.tensors_.reserve(std::min<uint64_t>(n_tensors, kMaxReserve));
    for (uint64_t i = 0; i < n_tensors; ++i) {
      uint64_t at = pos_;
      TensorInfo t;
      t.name = str("tensor name");
      if (t.name.empty()) fail(at, "empty tensor name");
      if (t.name.size() >= kMaxTensorName)
        fail(at, fmt::format("tensor name of {} bytes is longer than ggml's limit of {}", t.name.size(),
                             kMaxTensorName - 1));
      if (!seen.insert(t.name).second) fail(at, fmt::format("duplicate tensor name '{}'", printable(t.name)));
      uint64_t at_dims = pos_;
      uint32_t n_dims = u32("truncated tensor info");
      if (n_dims == 0 || n_dims > 4)
        fail(at_dims, fmt::format("tensor '{}' has n_dims {}, expected 1 to 4", printable(t.name), n_dims));
      int64_t n_elements = 1;
      for (uint32_t d = 0; d < n_dims; ++d) {
        uint64_t at_dim = pos_;
        uint64_t ne = u64("truncated tensor info");
        if (ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
          fail(at_dim, fmt::format("tensor '{}' has dimension {} = {} (negative as int64)", printable(t.name), d, ne));
        t.ne.push_back(static_cast<int64_t>(ne));
        if (__builtin_mul_overflow(n_elements, static_cast<int64_t>(ne), &n_elements))
          fail(at_dim, fmt::format("tensor '{}': the product of its dimensions overflows int64", printable(t.name)));
      }
      uint64_t at_type = pos_;
      uint32_t raw_type = u32("truncated tensor info");
      if (!ggml_type_known(raw_type))
        fail(at_type, fmt::format("tensor '{}' has unknown dtype {}", printable(t.name), raw_type));
      t.type = static_cast<GgmlType>(raw_type);
      int64_t be = ggml_block_elements(t.type);
      if (t.ne[0] % be != 0)
        fail(at_dims, fmt::format("tensor '{}': ne[0] = {} is not a multiple of the {} block size {}", printable(t.name),
                                  t.ne[0], ggml_type_name(t.type), be));
      int64_t n_bytes = 0;
      if (__builtin_mul_overflow(n_elements / be, ggml_block_bytes(t.type), &n_bytes))
        fail(at_dims, fmt::format("tensor '{}': its byte size overflows int64", printable(t.name)));
      t.n_elements = n_elements;
      t.n_bytes = static_cast<uint64_t>(n_bytes);
      t.offset = u64("truncated tensor info");
      tensor_info_offsets_.push_back(pos_ - 8);
      f_.tensors_.push_back(std::move(t));
    }
  }

  void check_tensor_data() {
    uint64_t data = f_.data_offset_;
    for (size_t i = 0; i < f_.tensors_.size(); ++i) {
      const TensorInfo& t = f_.tensors_[i];
      uint64_t at = tensor_info_offsets_[i];
      if (t.offset % f_.alignment_ != 0)
        fail(at, fmt::format("tensor '{}' data offset {} is not a multiple of the alignment {}", printable(t.name), t.offset,
                             f_.alignment_));
      uint64_t start = 0, end = 0;
      if (__builtin_add_overflow(data, t.offset, &start) || __builtin_add_overflow(start, t.n_bytes, &end) ||
          end > size_)
        fail(at, fmt::format("tensor '{}' data [{}, +{}) runs past the end of the file ({} bytes)", printable(t.name),
                             t.offset, t.n_bytes, size_));
    }
  }

  GgufFile& f_;
  const uint8_t* p_;
  uint64_t size_;
  uint64_t pos_ = 0;
  std::vector<uint64_t> tensor_info_offsets_;
};

// ---- GgufFile ----

std::unique_ptr<GgufFile> GgufFile::open(const std::string& path) {
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // O_NONBLOCK: a FIFO must not hang us
  if (fd < 0) throw GgufError(path, 0, "cannot open: " + errno_text());
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    std::string e = errno_text();
    ::close(fd);
    throw GgufError(path, 0, "cannot stat: " + e);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw GgufError(path, 0, "not a regular file");
  }
  f->size_ = static_cast<uint64_t>(st.st_size);
  if (f->size_ == 0) {
    ::close(fd);
    throw GgufError(path, 0, "truncated header: the file is empty");
  }
  void* m = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
  std::string e = errno_text();
  ::close(fd);
  if (m == MAP_FAILED) throw GgufError(path, 0, "cannot mmap: " + e);
  f->map_ = static_cast<const std::byte*>(m);
  GgufParser(*f).parse();
  return f;
}

GgufFile::~GgufFile() {
  if (map_) ::munmap(const_cast<std::byte*>(map_), size_);
}

const GgufValue* GgufFile::find(std::string_view key) const {
  for (const auto& kv : kv_)
    if (kv.key == key) return &kv.value;
  return nullptr;
}

const GgufValue& GgufFile::get(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) throw ModelError(fmt::format("{}: missing metadata key '{}'", path_, key));
  return *v;
}

int64_t GgufFile::get_int(std::string_view key) const { return get(key).as_int(key); }
int64_t GgufFile::get_int(std::string_view key, int64_t fallback) const {
  const GgufValue* v = find(key);
  return v ? v->as_int(key) : fallback;
}
double GgufFile::get_float(std::string_view key) const { return get(key).as_float(key); }
double GgufFile::get_float(std::string_view key, double fallback) const {
  const GgufValue* v = find(key);
  return v ? v->as_float(key) : fallback;
}
bool GgufFile::get_bool(std::string_view key, bool fallback) const {
  const GgufValue* v = find(key);
  return v ? v->as_bool(key) : fallback;
}
std::string GgufFile::get_string(std::string_view key) const { return get(key).as_string(key); }
std::string GgufFile::get_string(std::string_view key, std::string_view fallback) const {
  const GgufValue* v = find(key);
  return v ? v->as_string(key) : std::string(fallback);
}

std::vector<std::string> GgufFile::get_string_array(std::string_view key) const {
  std::vector<std::string> out;
  const GgufArray& a = get(key).as_array(key);
  out.reserve(a.items.size());
  for (const auto& item : a.items) out.push_back(item.as_string(key));
  return out;
}

std::vector<double> GgufFile::get_float_array(std::string_view key) const {
  std::vector<double> out;
  const GgufArray& a = get(key).as_array(key);
  out.reserve(a.items.size());
  for (const auto& item : a.items) out.push_back(item.as_float(key));
  return out;
}

std::vector<int64_t> GgufFile::get_int_array(std::string_view key) const {
  std::vector<int64_t> out;
  const GgufArray& a = get(key).as_array(key);
  out.reserve(a.items.size());
  for (const auto& item : a.items) out.push_back(item.as_int(key));
  return out;
}

const TensorInfo* GgufFile::find_tensor(std::string_view name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

const TensorInfo& GgufFile::tensor(std::string_view name) const {
  const TensorInfo* t = find_tensor(name);
  if (!t) throw ModelError(fmt::format("{}: missing tensor '{}'", path_, name));
  return *t;
}

std::span<const std::byte> GgufFile::tensor_data(const TensorInfo& t) const {
  return {map_ + data_offset_ + t.offset, static_cast<size_t>(t.n_bytes)};
}

std::string GgufFile::fingerprint() const {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64 offset basis
  uint64_t end = std::min(data_offset_, size_);
  const auto* p = reinterpret_cast<const uint8_t*>(map_);
  for (uint64_t i = 0; i < end; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;  // FNV-1a 64 prime
  }
  return fmt::format("{}:{:016x}", size_, h);
}

}  // namespace diffrun
