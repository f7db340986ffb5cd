// Dump validation against docs/dump-format.md on the HDF5 C API: every root attribute, step group and dataset, all problems listed.
// Reads every dataset's data once, in blocks of rows (as compare would read it), within the readers' size limits.
#include "checkpoints/rows.hpp"
#include "checkpoints/dump_validate.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <set>

#include "checkpoints/dump_format.hpp"
#include "checkpoints/vocabulary.hpp"
#include "model/error.hpp"

namespace diffrun {

namespace {

using h5::Hid;

std::string shape_text(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t element_count(std::span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// What one attribute is, without reading it.
struct AttrShape {
  bool exists = false;
  H5T_class_t cls = H5T_NO_CLASS;
  size_t size = 0;
  bool is_signed = true;
  int rank = 0;
  hssize_t n = 0;
  bool vlen = false;  // a variable-length string
};

AttrShape inspect_attr(hid_t obj, const char* name) {
  AttrShape s;
  if (H5Aexists(obj, name) <= 0) return s;
  Hid a(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  if (!a.valid()) return s;
  s.exists = true;
  Hid t(H5Aget_type(a.get()), H5Tclose);
  Hid sp(H5Aget_space(a.get()), H5Sclose);
  s.cls = H5Tget_class(t.get());
  s.size = H5Tget_size(t.get());
  s.vlen = s.cls == H5T_STRING && H5Tis_variable_str(t.get()) != 0;
  if (s.cls == H5T_INTEGER) s.is_signed = H5Tget_sign(t.get()) == H5T_SGN_2;
  s.rank = H5Sget_simple_extent_ndims(sp.get());
  s.n = H5Sget_simple_extent_npoints(sp.get());
  return s;
}

// A string attribute's value; a variable-length one only when `vlen_ok` (format version 1): from
// version 2 on the type is checked before anything is read (HDF5 1.10 crashes on some damaged
// global heaps, found by fuzz_dump).
std::optional<std::string> read_string(hid_t obj, const char* name, bool vlen_ok) {
  Hid a(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  if (!a.valid()) return std::nullopt;
  Hid ftype(H5Aget_type(a.get()), H5Tclose);
  if (H5Tget_class(ftype.get()) != H5T_STRING) return std::nullopt;
  const htri_t vlen = H5Tis_variable_str(ftype.get());
  if (vlen < 0 || (vlen > 0 && !vlen_ok)) return std::nullopt;
  if (vlen > 0) {
    Hid mtype(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(mtype.get(), H5T_VARIABLE);
    H5Tset_cset(mtype.get(), H5Tget_cset(ftype.get()));
    char* p = nullptr;
    if (H5Aread(a.get(), mtype.get(), &p) < 0) return std::nullopt;
    std::string s = p ? p : "";
    H5free_memory(p);
    return s;
  }
  std::string s(H5Tget_size(ftype.get()), '\0');
  if (H5Aread(a.get(), ftype.get(), s.data()) < 0) return std::nullopt;
  s.resize(std::min(s.size(), s.find('\0')));
  return s;
}

// Integer (or enum over integers, h5py's bool) attribute values as int64.
std::optional<std::vector<int64_t>> read_ints(hid_t obj, const char* name) {
  Hid a(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  if (!a.valid()) return std::nullopt;
  Hid ftype(H5Aget_type(a.get()), H5Tclose);
  Hid space(H5Aget_space(a.get()), H5Sclose);
  const hssize_t n = H5Sget_simple_extent_npoints(space.get());
  if (n < 0) return std::nullopt;
  std::vector<int64_t> v(static_cast<size_t>(n));
  if (n == 0) return v;
  const H5T_class_t cls = H5Tget_class(ftype.get());
  if (cls == H5T_ENUM) {
    Hid base(H5Tget_super(ftype.get()), H5Tclose);
    if (H5Aread(a.get(), ftype.get(), v.data()) < 0 ||
        H5Tconvert(base.get(), H5T_NATIVE_INT64, v.size(), v.data(), nullptr, H5P_DEFAULT) < 0)
      return std::nullopt;
    return v;
  }
  if (cls != H5T_INTEGER || H5Aread(a.get(), H5T_NATIVE_INT64, v.data()) < 0) return std::nullopt;
  return v;
}

std::optional<double> read_real(hid_t obj, const char* name) {
  Hid a(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  double v = 0;
  if (!a.valid() || H5Aread(a.get(), H5T_NATIVE_DOUBLE, &v) < 0) return std::nullopt;
  return v;
}

std::string quoted_values(const RootAttribute& a) {
  std::string s;
  const auto values = enum_values(a);
  for (size_t i = 0; i < values.size(); ++i)
    s += (i == 0 ? "" : i + 1 == values.size() ? " or " : ", ") + ("\"" + values[i] + "\"");
  return s;
}

// "string", "string: \"norm\" or \"neox\"", "integer (int32)".
std::string expected_text(const RootAttribute& a) {
  switch (a.type) {
    case AttrType::string: return a.values ? "a string: " + quoted_values(a) : "a string";
    case AttrType::integer: return "an int32 scalar";
    case AttrType::real: return "a float64 scalar";
    case AttrType::boolean: return "a boolean (h5py bool, or an integer 0/1)";
    case AttrType::int_array: return "a 1-D int32 array";
  }
  return "?";
}

const char* class_text(H5T_class_t c) {
  switch (c) {
    case H5T_INTEGER: return "an integer";
    case H5T_FLOAT: return "a float";
    case H5T_STRING: return "a string";
    case H5T_ENUM: return "an enum";
    case H5T_COMPOUND: return "a compound";
    case H5T_ARRAY: return "an array type";
    case H5T_OPAQUE: return "an opaque type";
    case H5T_VLEN: return "a variable-length sequence";
    case H5T_BITFIELD: return "a bitfield";
    case H5T_REFERENCE: return "a reference";
    default: return "an unknown type";
  }
}

// Checks the stored type of one root attribute; "" when it fits.
std::string type_problem(const RootAttribute& a, const AttrShape& s) {
  const std::string got = std::string("is ") + class_text(s.cls);
  const bool scalar = s.n == 1 && s.rank <= 1;
  switch (a.type) {
    case AttrType::string:
      if (s.cls != H5T_STRING) return got + ", expected " + expected_text(a);
      if (!scalar) return "holds " + std::to_string(s.n) + " strings, expected one";
      return "";
    case AttrType::integer:
      if (s.cls != H5T_INTEGER) return got + ", expected " + expected_text(a);
      if (!scalar) return "holds " + std::to_string(s.n) + " values, expected one";
      return "";
    case AttrType::real:
      if (s.cls != H5T_FLOAT && s.cls != H5T_INTEGER) return got + ", expected " + expected_text(a);
      if (!scalar) return "holds " + std::to_string(s.n) + " values, expected one";
      return "";
    case AttrType::boolean:
      if (s.cls != H5T_ENUM && s.cls != H5T_INTEGER) return got + ", expected " + expected_text(a);
      if (!scalar) return "holds " + std::to_string(s.n) + " values, expected one";
      return "";
    case AttrType::int_array:
      if (s.cls != H5T_INTEGER) return got + ", expected " + expected_text(a);
      if (s.rank != 1) return "has rank " + std::to_string(s.rank) + ", expected " + expected_text(a);
      return "";
  }
  return "";
}

std::vector<std::string> list_links(hid_t group) {
  std::vector<std::string> names;
  H5Literate(
      group, H5_INDEX_NAME, H5_ITER_INC, nullptr,
      [](hid_t, const char* name, const H5L_info_t*, void* out) -> herr_t {
        static_cast<std::vector<std::string>*>(out)->push_back(name);
        return 0;
      },
      &names);
  return names;
}

H5O_type_t object_type(hid_t parent, const std::string& name) {
  H5O_info_t info{};
  if (H5Oget_info_by_name(parent, name.c_str(), &info, H5P_DEFAULT) < 0) return H5O_TYPE_UNKNOWN;
  return info.type;
}

// Reads a dataset's data once, as the readers do (floats as float32, integers as int32, opaque words
// as stored), in blocks of rows of at most 16 MiB: "" when it reads, else why not (an unknown
// filter, a damaged chunk, a failed checksum). The size checks (size_refusal) came first.
std::string read_problem(hid_t ds) {
  Hid t(H5Dget_type(ds), H5Tclose);
  Hid space(H5Dget_space(ds), H5Sclose);
  if (!t.valid() || !space.valid()) return "cannot be read" + h5::detail();
  const H5T_class_t cls = H5Tget_class(t.get());
  hid_t mem = H5T_NATIVE_FLOAT;
  if (cls == H5T_INTEGER) mem = H5T_NATIVE_INT32;
  else if (cls == H5T_OPAQUE) mem = t.get();
  else if (cls != H5T_FLOAT) return "";  // not numeric: reported by the type check
  const size_t elem = cls == H5T_OPAQUE ? H5Tget_size(t.get()) : 4;
  const int rank = H5Sget_simple_extent_ndims(space.get());
  if (rank < 0) return "cannot be read (its shape)" + h5::detail();
  std::vector<hsize_t> dims(static_cast<size_t>(rank));
  if (rank > 0) H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  const hssize_t total = H5Sget_simple_extent_npoints(space.get());
  if (total <= 0) return "";
  if (rank == 0) {
    std::vector<unsigned char> buf(elem);
    if (H5Dread(ds, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data()) < 0) return "cannot be read" + h5::detail();
    return "";
  }
  const uint64_t row = static_cast<uint64_t>(total) / dims[0];
  const hsize_t block = std::max<hsize_t>(1, (uint64_t(16) << 20) / std::max<uint64_t>(row * elem, 1));
  std::vector<unsigned char> buf(std::min<hsize_t>(block, dims[0]) * row * elem);
  for (hsize_t first = 0; first < dims[0]; first += block) {
    std::vector<hsize_t> start(dims.size(), 0), count = dims;
    start[0] = first;
    count[0] = std::min(block, dims[0] - first);
    Hid file_space(H5Scopy(space.get()), H5Sclose);
    Hid mem_space(H5Screate_simple(rank, count.data(), nullptr), H5Sclose);
    if (!file_space.valid() || !mem_space.valid() ||
        H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr) < 0 ||
        H5Dread(ds, mem, mem_space.get(), file_space.get(), H5P_DEFAULT, buf.data()) < 0)
      return "cannot be read (rows " + std::to_string(first) + ".." + std::to_string(first + count[0] - 1) +
             " of its first dimension)" + h5::detail();
  }
  return "";
}

// kq_soft_max read with its stored dims named `names`: every (H, T) row sums to 1 along S, and token
// t of the rows held sees positions <= n_past + t only (0 elsewhere).
bool softmax_reads_as(const std::vector<float>& x, std::span<const int64_t> shape, const std::vector<std::string>& names,
                      int64_t n_past) {
  const auto at = [&](const char* d) { return std::find(names.begin(), names.end(), d) - names.begin(); };
  const size_t ih = at("H"), it = at("T"), is = at("S");
  if (shape.size() != 3 || ih >= 3 || it >= 3 || is >= 3) return false;
  int64_t stride[3] = {shape[1] * shape[2], shape[2], 1};
  for (int64_t h = 0; h < shape[ih]; ++h) {
    for (int64_t t = 0; t < shape[it]; ++t) {
      double sum = 0;
      for (int64_t pos = 0; pos < shape[is]; ++pos) {
        const double v = x[h * stride[ih] + t * stride[it] + pos * stride[is]];
        if (!std::isfinite(v) || v < -1e-6 || (pos > n_past + t && v > 1e-6)) return false;
        sum += v;
      }
      if (std::abs(sum - 1) > 1e-2) return false;
    }
  }
  return true;
}

std::string bracketed(const std::vector<std::string>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? "," : "") + dims[i];
  return s + "]";
}

// A dataset stored in its vocabulary shape without a layout attribute, two of whose dims have the same
// size (> 1): the data may hold them swapped. kq_soft_max tells the readings apart (probabilities, causal,
// summing to 1 along S): one that fits only swapped is a problem. Otherwise the dims are ambiguous: a
// warning. `n_past`: the position before the first token row held.
void layout_ambiguity(hid_t ds, std::string_view base, const std::vector<std::string>& vocab_dims,
                      std::span<const int64_t> shape, int64_t n_past, std::string* problem, std::string* warning) {
  std::vector<std::pair<size_t, size_t>> swaps;
  for (size_t i = 0; i < shape.size(); ++i)
    for (size_t j = i + 1; j < shape.size(); ++j)
      if (shape[i] == shape[j] && shape[i] > 1) swaps.push_back({i, j});
  if (swaps.empty() || vocab_dims.size() != shape.size()) return;
  if (base == "kq_soft_max" && shape.size() == 3 && element_count(shape) <= (int64_t(16) << 20)) {
    Hid t(H5Dget_type(ds), H5Tclose);
    std::vector<float> x(static_cast<size_t>(element_count(shape)));
    if (H5Tget_class(t.get()) == H5T_FLOAT &&
        H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, x.data()) >= 0) {
      if (softmax_reads_as(x, shape, vocab_dims, n_past)) return;
      for (const auto& [i, j] : swaps) {
        std::vector<std::string> looks = vocab_dims;
        std::swap(looks[i], looks[j]);
        if (softmax_reads_as(x, shape, looks, n_past)) {
          *problem = "the layout looks like " + bracketed(looks) + ", not " + bracketed(vocab_dims) +
                     ": label it with the layout attribute";
          return;
        }
      }
    }
  }
  std::string what;
  for (const auto& [i, j] : swaps) {
    std::vector<std::string> other = vocab_dims;
    std::swap(other[i], other[j]);
    what += (what.empty() ? "dims " : "; dims ") + vocab_dims[i] + " and " + vocab_dims[j] + " are both " +
            std::to_string(shape[i]) + " (" + bracketed(vocab_dims) + " and " + bracketed(other) + " store the same shape)";
  }
  *warning = what + ": ambiguous without a layout attribute";
}

}  // namespace

RootCheck check_root_attributes(hid_t file) {
  RootCheck r;
  auto problem = [&](const std::string& name, const std::string& what) {
    r.problems.push_back({"root attribute '" + name + "'", what});
  };
  std::map<std::string, std::string> strings;
  std::map<std::string, int64_t> ints;
  std::map<std::string, double> reals;
  std::map<std::string, std::vector<int64_t>> arrays;
  // The version first: from version 2 on, strings are fixed-length and a variable-length one is
  // reported without being read.
  if (const AttrShape s = inspect_attr(file, "format_version"); s.exists && s.cls == H5T_INTEGER && s.n == 1)
    if (auto v = read_ints(file, "format_version"); v && v->size() == 1 && (*v)[0] >= 1 && (*v)[0] <= INT32_MAX)
      r.format_version = static_cast<int>((*v)[0]);
  r.vlen_strings_ok = r.format_version == 1 && version1_reads_allowed();
  if (r.format_version == 1 && !r.vlen_strings_ok) problem("format_version", "is 1: " + version1_refused());
  for (const RootAttribute& a : root_attributes()) {
    const AttrShape s = inspect_attr(file, a.name);
    if (!s.exists) {
      if (a.required) problem(a.name, "missing (" + expected_text(a) + ")");
      continue;
    }
    if (std::string p = type_problem(a, s); !p.empty()) {
      problem(a.name, p);
      continue;
    }
    if (s.vlen && !r.vlen_strings_ok) {
      problem(a.name, r.format_version == 1 ? std::string("is a variable-length string, not read (format version 1)")
                                            : "is a variable-length string; format version " +
                                                  std::to_string(r.format_version) + " stores fixed-length strings");
      continue;
    }
    switch (a.type) {
      case AttrType::string: {
        auto v = read_string(file, a.name, r.vlen_strings_ok);
        if (!v) {
          problem(a.name, "cannot be read as a string");
          break;
        }
        const auto values = enum_values(a);
        if (!values.empty() && std::find(values.begin(), values.end(), *v) == values.end())
          problem(a.name, "is \"" + *v + "\", expected " + quoted_values(a));
        else if (std::string_view(a.name) == "backend" && v->empty())
          problem(a.name, "is empty (name the engine that wrote the dump)");
        else
          strings[a.name] = *v;
        break;
      }
      case AttrType::integer:
      case AttrType::boolean: {
        auto v = read_ints(file, a.name);
        if (!v || v->size() != 1) {
          problem(a.name, "cannot be read as an integer");
          break;
        }
        const int64_t x = (*v)[0];
        if (a.type == AttrType::boolean && x != 0 && x != 1)
          problem(a.name, "is " + std::to_string(x) + ", expected a boolean (0 or 1)");
        else if (a.type == AttrType::integer && (x < INT32_MIN || x > INT32_MAX))
          problem(a.name, "is " + std::to_string(x) + ", outside int32");
        else
          ints[a.name] = x;
        break;
      }
      case AttrType::real: {
        auto v = read_real(file, a.name);
        if (!v) problem(a.name, "cannot be read as a real");
        else reals[a.name] = *v;
        break;
      }
      case AttrType::int_array: {
        auto v = read_ints(file, a.name);
        if (!v) problem(a.name, "cannot be read as integers");
        else arrays[a.name] = *v;
        break;
      }
    }
  }

  if (ints.count("format_version") &&
      (ints["format_version"] < kDumpFormatOldestVersion || ints["format_version"] > kDumpFormatVersion))
    problem("format_version", "is " + std::to_string(ints["format_version"]) + ", this diffrun reads versions " +
                                  std::to_string(kDumpFormatOldestVersion) + " to " + std::to_string(kDumpFormatVersion));

  // The config, when every part of it is there and sane.
  bool config_ok = strings.count("arch") && strings.count("rope_type") && reals.count("rope_theta") &&
                   reals.count("rms_eps");
  for (const char* k : {"n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "n_vocab", "n_ctx"}) {
    if (!ints.count(k)) {
      config_ok = false;
    } else if (ints[k] <= 0) {
      problem(k, "is " + std::to_string(ints[k]) + ", expected a positive integer");
      config_ok = false;
    }
  }
  for (const char* k : {"tied_output", "qkv_bias", "qk_norm"})
    if (!ints.count(k)) config_ok = false;
  for (const char* k : {"rope_theta", "rms_eps"}) {
    if (reals.count(k) && !(reals[k] > 0)) {
      problem(k, "is " + std::to_string(reals[k]) + ", expected a positive real");
      config_ok = false;
    }
  }
  if (ints.count("n_head") && ints.count("n_head_kv") && ints["n_head_kv"] > 0 &&
      ints["n_head"] % ints["n_head_kv"] != 0) {
    problem("n_head_kv", "is " + std::to_string(ints["n_head_kv"]) + ", which does not divide n_head = " +
                             std::to_string(ints["n_head"]));
    config_ok = false;
  }
  if (config_ok) {
    ModelConfig c;
    for (Arch a : all_archs())
      if (strings["arch"] == arch_name(a)) c.arch = a;
    set_arch_features(c);
    c.n_layer = static_cast<int>(ints["n_layer"]);
    c.n_embd = static_cast<int>(ints["n_embd"]);
    c.n_head = static_cast<int>(ints["n_head"]);
    c.n_head_kv = static_cast<int>(ints["n_head_kv"]);
    c.head_dim = static_cast<int>(ints["head_dim"]);
    c.n_ff = static_cast<int>(ints["n_ff"]);
    c.n_vocab = static_cast<int>(ints["n_vocab"]);
    c.n_ctx = static_cast<int>(ints["n_ctx"]);
    c.rope_theta = reals["rope_theta"];
    c.rope_type = strings["rope_type"] == rope_type_name(RopeType::neox) ? RopeType::neox : RopeType::norm;
    c.rms_eps = reals["rms_eps"];
    c.tied_output = ints["tied_output"] != 0;
    c.qkv_bias = ints["qkv_bias"] != 0;
    c.qk_norm = ints["qk_norm"] != 0;
    r.config = c;
  }

  auto ids = [&](const char* k) -> std::optional<std::vector<int32_t>> {
    if (!arrays.count(k)) return std::nullopt;
    std::vector<int32_t> out;
    for (int64_t x : arrays[k]) {
      if (x < 0 || (r.config && x >= r.config->n_vocab)) {
        problem(k, "holds id " + std::to_string(x) + ", outside the vocabulary 0.." +
                       (r.config ? std::to_string(r.config->n_vocab - 1) : std::string("n_vocab-1")));
        return std::nullopt;
      }
      out.push_back(static_cast<int32_t>(x));
    }
    return out;
  };
  if (auto t = ids("token_ids")) {
    if (t->empty()) problem("token_ids", "is empty (the prompt has at least one token)");
    r.token_ids = *t;
  }
  r.all_token_ids = ids("all_token_ids");
  if (r.all_token_ids && !r.token_ids.empty() &&
      (r.all_token_ids->size() < r.token_ids.size() ||
       !std::equal(r.token_ids.begin(), r.token_ids.end(), r.all_token_ids->begin())))
    problem("all_token_ids", "does not start with token_ids (it holds the prompt, then one id per decode step)");
  if (arrays.count("argmax")) {
    r.argmax.emplace();
    for (int64_t x : arrays["argmax"]) r.argmax->push_back(static_cast<int32_t>(x));
  }
  return r;
}

std::string check_checkpoint(const ModelConfig& cfg, std::string_view name, int layer, std::span<const int64_t> shape,
                             std::string_view layout, int64_t n_tokens, int64_t n_kv, std::vector<int64_t>* canonical) {
  const ParsedCheckpointName parsed = parse_checkpoint_name(name);
  const CheckpointKind* kind = find_checkpoint_kind(parsed.base);
  if (!kind) {
    // "attn_norm_0": the layer joined with '_' instead of '-'.
    std::string hint;
    const size_t sep = name.find_last_of("_ .");
    if (sep != std::string_view::npos && sep + 1 < name.size() &&
        name.find_first_not_of("0123456789", sep + 1) == std::string_view::npos) {
      const std::string guess = std::string(name.substr(0, sep)) + "-" + std::string(name.substr(sep + 1));
      const CheckpointKind* k = find_checkpoint_kind(parse_checkpoint_name(guess).base);
      if (k && k->per_layer) hint = "; did you mean '" + guess + "'?";
    }
    return "'" + printable(name, 64) + "' is not a checkpoint name of the vocabulary (diffrun vocab lists them" +
           (hint.empty() ? ")" : ")" + hint);
  }
  if (parsed.layer != layer)
    return "the name says layer " + std::to_string(parsed.layer) + " but the layer given is " + std::to_string(layer);
  try {
    checkpoint_order(cfg, parsed.base, parsed.layer);
  } catch (const InputError& e) {
    return e.what();
  }
  const std::vector<std::string> vocab_dims = layout_dims(kind->layout);
  const std::vector<int64_t> vocab_shape = checkpoint_shape(cfg, *kind, n_tokens, n_kv);
  const std::vector<std::string> dims = layout.empty() ? vocab_dims : layout_dims(layout);
  {
    auto a = dims, b = vocab_dims;
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    if (a != b)
      return "layout '" + std::string(layout) + "' is not a permutation of the vocabulary's '" + kind->layout + "'";
  }
  std::vector<int64_t> expected;
  for (const auto& d : dims)
    expected.push_back(vocab_shape[std::find(vocab_dims.begin(), vocab_dims.end(), d) - vocab_dims.begin()]);
  if (canonical) *canonical = expected;
  if (std::equal(shape.begin(), shape.end(), expected.begin(), expected.end())) return "";
  // [T, H*Dh]: the per-head pair merged, in the vocabulary's order.
  if (dims == vocab_dims) {
    for (size_t i = 0; i + 1 < dims.size(); ++i) {
      if (dims[i + 1] != "Dh" || (dims[i] != "H" && dims[i] != "Hkv")) continue;
      std::vector<int64_t> merged(expected.begin(), expected.begin() + i);
      merged.push_back(expected[i] * expected[i + 1]);
      merged.insert(merged.end(), expected.begin() + i + 2, expected.end());
      if (std::equal(shape.begin(), shape.end(), merged.begin(), merged.end())) return "";
    }
  }
  std::string what = "shape " + shape_text(shape) + " does not fit layout '" +
                     (layout.empty() ? std::string(kind->layout) : std::string(layout)) + "' = " +
                     shape_text(expected) + " (T = " + std::to_string(n_tokens) + ", S = " + std::to_string(n_kv) + ")";
  // A permuted layout was given and the dims do not match it: the layout is there, the dims are wrong.
  if (!layout.empty() && layout != kind->layout)
    what += "; the dims do not match the layout given with them (the vocabulary's is '" + std::string(kind->layout) + "')";
  else if (element_count(shape) == element_count(expected))
    what += "; same element count: a permuted array needs its layout attribute";
  return what;
}

ValidateResult validate_dump(const std::string& path, const ValidateOptions& opt) {
  h5::silence();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) throw DumpError(path + ": no such file");
  if (!std::filesystem::is_regular_file(path, ec)) throw DumpError(path + ": not a regular file");
  if (H5Fis_hdf5(path.c_str()) <= 0) {
    h5::detail();
    throw DumpError(path + ": not an HDF5 file (no HDF5 signature: foreign or truncated)");
  }
  Hid fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  H5Pset_fclose_degree(fapl.get(), H5F_CLOSE_STRONG);
  Hid file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()), H5Fclose);
  if (!file.valid()) throw DumpError(path + ": cannot open the HDF5 file (truncated or damaged?)" + h5::detail());

  // Root attributes whose metadata fails HDF5's checksum: the file is damaged, and HDF5 1.10 can loop
  // or read out of bounds on its other attributes (found by fuzz_dump), so nothing more is read.
  if (H5Aexists(file.get(), "format") < 0) {
    const std::string d = h5::detail();
    if (d.find("checksum") != std::string::npos)
      throw DumpError(path + ": damaged: its root attributes cannot be read" + d);
  }
  ValidateResult result;
  RootCheck root = check_root_attributes(file.get());
  if (root.format_version == 1 && !version1_reads_allowed()) throw DumpError(path + ": " + version1_refused());
  result.problems = std::move(root.problems);
  auto problem = [&](const std::string& where, const std::string& what) { result.problems.push_back({where, what}); };
  const std::optional<ModelConfig>& cfg = root.config;

  // Backend facts: the root string attributes the format does not define.
  std::map<std::string, std::string> facts;
  H5Aiterate2(
      file.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr,
      [](hid_t, const char* name, const H5A_info_t*, void* out) -> herr_t {
        if (!find_root_attribute(name)) (*static_cast<std::map<std::string, std::string>*>(out))[name];
        return 0;
      },
      &facts);
  for (auto it = facts.begin(); it != facts.end();) {
    const AttrShape s = inspect_attr(file.get(), it->first.c_str());
    if (s.vlen && !root.vlen_strings_ok)
      problem("root attribute '" + it->first + "'", "is a variable-length string; format version " +
                                                        std::to_string(root.format_version) + " stores fixed-length strings");  // (version 1 is refused above)
    std::optional<std::string> v = s.cls == H5T_STRING && s.n == 1
                                       ? read_string(file.get(), it->first.c_str(), root.vlen_strings_ok)
                                       : std::nullopt;
    if (v) {
      it->second = *v;
      ++it;
    } else {
      it = facts.erase(it);
    }
  }

  // Step groups.
  std::map<int, std::string> steps;
  // Links are checked before anything follows them; a dump that reaches outside itself is refused
  // (exit 2), not listed as a problem (docs/dump-format.md, "What readers refuse").
  auto refuse_links = [&](hid_t group, const std::string& prefix) {
    for (const auto& name : list_links(group))
      if (const std::string refused = link_refusal(group, name); !refused.empty())
        throw DumpError(path + ": '" + prefix + name + "' " + refused);
  };
  const uint64_t file_size = std::filesystem::file_size(path, ec);
  // External or virtual storage, and sizes no real dump has (a compression bomb), are refused (exit 2).
  auto refuse_storage = [&](hid_t ds, const std::string& where) {
    if (const std::string refused = storage_refusal(ds); !refused.empty())
      throw DumpError(path + ": dataset '" + where + "': " + refused);
    Hid t(H5Dget_type(ds), H5Tclose);
    Hid sp(H5Dget_space(ds), H5Sclose);
    const hssize_t n = H5Sget_simple_extent_npoints(sp.get());
    const size_t size = t.valid() ? H5Tget_size(t.get()) : 0;
    h5::detail();
    if (n <= 0 || size == 0) return;
    if (static_cast<uint64_t>(n) > UINT64_MAX / std::max<size_t>(size, 4))
      throw DumpError(path + ": dataset '" + where + "': its shape overflows 64 bits");
    const uint64_t declared = static_cast<uint64_t>(n) * size;
    const uint64_t presented = H5Tget_class(t.get()) == H5T_COMPOUND ? declared : static_cast<uint64_t>(n) * 4;
    if (const std::string refused = size_refusal(ds, declared, presented, file_size); !refused.empty())
      throw DumpError(path + ": dataset '" + where + "': " + refused);
  };
  refuse_links(file.get(), "");
  for (const auto& name : list_links(file.get())) {
    const int step = parse_dump_step_group_name(name);
    if (step < 0) continue;
    if (object_type(file.get(), name) != H5O_TYPE_GROUP) {
      problem(name, "is not a group (a step is a group of datasets)");
      continue;
    }
    if (name.size() < 9) problem(name, "step groups are named with at least 4 digits: '" + dump_step_group_name(step) + "'");
    if (steps.count(step)) {
      problem(name, "a second group for step " + std::to_string(step) + " (with '" + steps[step] + "')");
      continue;
    }
    steps[step] = name;
  }
  if (steps.empty()) problem("/", "no step groups (expected /step_0000, /step_0001, ...)");
  const int last = steps.empty() ? -1 : steps.rbegin()->first;
  for (int s = 0; s <= last; ++s)
    if (!steps.count(s))
      problem(dump_step_group_name(s), "missing: steps are numbered from 0 without gaps (last step is " +
                                           std::to_string(last) + ")");
  if (root.argmax && static_cast<int>(root.argmax->size()) != static_cast<int>(steps.size()) && !steps.empty())
    problem("root attribute 'argmax'", "holds " + std::to_string(root.argmax->size()) + " ids for " +
                                           std::to_string(steps.size()) + " steps (one per step)");
  if (root.all_token_ids && !root.token_ids.empty() && last >= 0 &&
      root.all_token_ids->size() < root.token_ids.size() + static_cast<size_t>(last))
    problem("root attribute 'all_token_ids'",
            "holds " + std::to_string(root.all_token_ids->size()) + " ids; " + std::to_string(last) +
                " decode steps after a prompt of " + std::to_string(root.token_ids.size()) + " need at least " +
                std::to_string(root.token_ids.size() + last));
  if (!cfg && !steps.empty())
    problem("/", "datasets are not checked against the vocabulary: the config attributes are incomplete");

  int64_t kv = 0;        // S after the previous step
  bool kv_known = true;  // false once a step's T is unknown
  for (int s = 0; s <= last; ++s) {
    if (!steps.count(s)) {
      kv_known = false;
      continue;
    }
    const std::string& gname = steps[s];
    ++result.n_steps;
    Hid g(H5Gopen2(file.get(), gname.c_str(), H5P_DEFAULT), H5Gclose);
    if (!g.valid()) {
      problem(gname, "cannot be opened" + h5::detail());
      kv_known = false;
      continue;
    }
    refuse_links(g.get(), gname + "/");
    std::vector<std::string> names = list_links(g.get());
    // Version 2: the datasets' attributes are the step's attribute table.
    const bool v2 = root.format_version >= 2;
    std::map<std::string, AttributeRow> table;
    if (v2) {
      const auto at = std::find(names.begin(), names.end(), kAttributeTable);
      if (at != names.end()) {
        names.erase(at);
        if (object_type(g.get(), kAttributeTable) == H5O_TYPE_DATASET) {
          Hid table_ds(H5Dopen2(g.get(), kAttributeTable, H5P_DEFAULT), H5Dclose);
          if (table_ds.valid()) refuse_storage(table_ds.get(), gname + "/" + kAttributeTable);
        }
        try {
          for (auto& row : read_attribute_table(g.get(), gname, file_size))
            table[row.name] = std::move(row);
        } catch (const DumpError& e) {
          const std::string msg = e.what(), prefix = gname + "/" + kAttributeTable + ": ";
          problem(gname + "/" + kAttributeTable, msg.rfind(prefix, 0) == 0 ? msg.substr(prefix.size()) : msg);
        }
        for (const auto& [tname, row] : table)
          if (std::find(names.begin(), names.end(), tname) == names.end())
            problem(gname + "/" + kAttributeTable, "names '" + tname + "', which the step does not hold");
      }
    }

    // tokens first: T of this step.
    std::optional<int64_t> n_tokens;
    const std::string twhere = gname + "/tokens";
    if (std::find(names.begin(), names.end(), "tokens") == names.end()) {
      problem(twhere, "missing (every step records the ids it was fed, int32 [T])");
    } else if (object_type(g.get(), "tokens") == H5O_TYPE_DATASET) {
      Hid ds(H5Dopen2(g.get(), "tokens", H5P_DEFAULT), H5Dclose);
      if (ds.valid()) refuse_storage(ds.get(), twhere);
      Hid t(H5Dget_type(ds.get()), H5Tclose);
      Hid sp(H5Dget_space(ds.get()), H5Sclose);
      const int rank = H5Sget_simple_extent_ndims(sp.get());
      hsize_t n = 0;
      if (H5Tget_class(t.get()) != H5T_INTEGER) {
        problem(twhere, std::string("is ") + class_text(H5Tget_class(t.get())) + ", expected int32 ids");
      } else if (rank != 1) {
        problem(twhere, "has rank " + std::to_string(rank) + ", expected 1 ([T])");
      } else {
        if (H5Tget_size(t.get()) != 4 || H5Tget_sign(t.get()) != H5T_SGN_2)
          problem(twhere, "is an integer of " + std::to_string(H5Tget_size(t.get())) + " bytes, expected int32");
        H5Sget_simple_extent_dims(sp.get(), &n, nullptr);
        std::vector<int32_t> v(n);
        if (n == 0) {
          problem(twhere, "is empty (a step feeds at least one token)");
        } else if (H5Dread(ds.get(), H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()) < 0) {
          problem(twhere, "cannot be read" + h5::detail());
        } else {
          n_tokens = static_cast<int64_t>(n);
          if (s == 0 && !root.token_ids.empty() && v != root.token_ids)
            problem(twhere, "differs from the root attribute token_ids (step 0 is the prompt)");
          if (s > 0 && n != 1) problem(twhere, "holds " + std::to_string(n) + " ids; a decode step feeds one");
          if (s > 0 && n == 1 && root.all_token_ids) {
            const size_t at = root.token_ids.size() + static_cast<size_t>(s) - 1;
            if (at < root.all_token_ids->size() && (*root.all_token_ids)[at] != v[0])
              problem(twhere, "is " + std::to_string(v[0]) + " but all_token_ids says " +
                                  std::to_string((*root.all_token_ids)[at]) + " for this step");
          }
          if (cfg)
            for (int32_t id : v)
              if (id < 0 || id >= cfg->n_vocab) {
                problem(twhere, "holds id " + std::to_string(id) + ", outside the vocabulary 0.." +
                                    std::to_string(cfg->n_vocab - 1));
                break;
              }
        }
      }
    }
    if (n_tokens) kv += *n_tokens;
    else kv_known = false;
    // Layout ambiguity warnings of this step, one per message: the first dataset and how many more.
    std::vector<std::pair<DumpProblem, int>> ambiguous;

    for (const auto& name : names) {
      const std::string where = gname + "/" + name;
      if (object_type(g.get(), name) != H5O_TYPE_DATASET) {
        problem(where, "is not a dataset");
        continue;
      }
      ++result.n_datasets;
      Hid ds(H5Dopen2(g.get(), name.c_str(), H5P_DEFAULT), H5Dclose);
      if (!ds.valid()) {
        problem(where, "cannot be opened" + h5::detail());
        continue;
      }
      refuse_storage(ds.get(), where);
      // The data, read once as compare reads it: what validate calls valid, compare can read.
      if (const std::string p = read_problem(ds.get()); !p.empty()) {
        problem(where, p);
        continue;
      }
      if (opt.mapped && opt.mapped(ForeignName{name, names, cfg, facts})) continue;
      const ParsedCheckpointName parsed = parse_checkpoint_name(name);
      const CheckpointKind* kind = find_checkpoint_kind(parsed.base);
      if (!kind) {
        problem(where, opt.mapped ? "not a checkpoint name of the vocabulary nor of the name map"
                                  : "not a checkpoint name of the vocabulary (diffrun vocab lists them; "
                                    "foreign names need --names)");
        continue;
      }

      // Dataset attributes (each optional): the dataset's row of the attribute table (version 2),
      // else attributes of the dataset (version 1).
      std::optional<int64_t> order, layer, row_offset;
      std::optional<std::string> layout, native, dtype_attr;
      if (v2) {
        if (const auto it = table.find(name); it != table.end()) {
          const AttributeRow& row = it->second;
          order = row.attrs.order, layer = row.attrs.layer, row_offset = row.attrs.row_offset;
          if (!row.attrs.layout.empty()) layout = row.attrs.layout;
          if (!row.attrs.native_dtype.empty()) native = row.attrs.native_dtype;
          if (!row.dtype.empty()) dtype_attr = row.dtype;
        }
      } else {
        const AttrShape order_a = inspect_attr(ds.get(), "order");
        const AttrShape layer_a = inspect_attr(ds.get(), "layer");
        const AttrShape layout_a = inspect_attr(ds.get(), "layout");
        const AttrShape native_a = inspect_attr(ds.get(), "native_dtype");
        const AttrShape dtype_a = inspect_attr(ds.get(), "dtype");
        const AttrShape row_offset_a = inspect_attr(ds.get(), "row_offset");
        auto scalar_int = [&](const char* attr, const AttrShape& a) -> std::optional<int64_t> {
          if (!a.exists) return std::nullopt;
          if (a.cls != H5T_INTEGER || a.n != 1) {
            problem(where, std::string("attribute '") + attr + "' " + "is " + class_text(a.cls) +
                               (a.n != 1 ? " array" : "") + ", expected a scalar integer");
            return std::nullopt;
          }
          auto v = read_ints(ds.get(), attr);
          return v && v->size() == 1 ? std::optional<int64_t>((*v)[0]) : std::nullopt;
        };
        auto scalar_str = [&](const char* attr, const AttrShape& a) -> std::optional<std::string> {
          if (!a.exists) return std::nullopt;
          if (a.cls != H5T_STRING || a.n != 1) {
            problem(where, std::string("attribute '") + attr + "' is " + class_text(a.cls) + ", expected a string");
            return std::nullopt;
          }
          // Variable-length only in a version-1 dump read with DIFFRUN_READ_V1=1: a dump whose
          // format_version is missing or below 1 lands here too (fuzz_dump found HDF5 1.10's damaged
          // global heap through it).
          return read_string(ds.get(), attr, root.vlen_strings_ok);
        };
        order = scalar_int("order", order_a);
        layer = scalar_int("layer", layer_a);
        layout = scalar_str("layout", layout_a);
        native = scalar_str("native_dtype", native_a);
        dtype_attr = scalar_str("dtype", dtype_a);
        row_offset = scalar_int("row_offset", row_offset_a);
      }
      const CheckpointKind* row_kind = find_checkpoint_kind(parsed.base);
      const int rd = row_kind && parsed.base != "tokens" ? row_dim(row_kind->layout) : -1;
      if (row_offset && rd < 0)
        problem(where, "attribute 'row_offset' is only for checkpoints with token or cache rows (kq_soft_max, result_output, "
                       "cache_k, per-token checkpoints)");
      if (layer && *layer != parsed.layer)
        problem(where, "attribute 'layer' is " + std::to_string(*layer) + " but the name says " +
                           std::to_string(parsed.layer));
      if (order && cfg) {
        try {
          const int want = checkpoint_order(*cfg, parsed.base, parsed.layer);
          if (*order != want)
            problem(where, "attribute 'order' is " + std::to_string(*order) + " but the vocabulary puts it at " +
                               std::to_string(want) + " for this config");
        } catch (const InputError&) {
          // reported with the shape check below
        }
      }
      if (native && !parse_stored_dtype(*native))
        problem(where, "attribute 'native_dtype' is \"" + *native + "\", expected \"f16\", \"bf16\", \"f32\", \"f64\" or \"i32\"");
      if (dtype_attr && *dtype_attr != "bf16")
        problem(where, "attribute 'dtype' is \"" + *dtype_attr + "\"; the only value is \"bf16\" (on uint16 data)");

      // Stored dtype.
      Hid t(H5Dget_type(ds.get()), H5Tclose);
      const H5T_class_t cls = H5Tget_class(t.get());
      const size_t size = H5Tget_size(t.get());
      if (name == "tokens") {
        if (layout && *layout != "T") problem(where, "attribute 'layout' is \"" + *layout + "\", expected \"T\"");
        if (order && *order != 0) problem(where, "attribute 'order' is " + std::to_string(*order) + ", expected 0");
        continue;  // the rest was checked above
      }
      if (cls == H5T_FLOAT) {
        if (size == 2) {
          size_t spos = 0, epos = 0, esize = 0, mpos = 0, msize = 0;
          H5Tget_fields(t.get(), &spos, &epos, &esize, &mpos, &msize);
          if (spos != 15 || epos != 10 || esize != 5 || mpos != 0 || msize != 10 || H5Tget_ebias(t.get()) != 15)
            problem(where, "is a 2-byte float that is not IEEE half (float16)");
        } else if (size != 4 && size != 8) {
          problem(where, "is a " + std::to_string(size) + "-byte float; expected float32, float64 or float16");
        }
        if (dtype_attr) problem(where, "attribute 'dtype' = \"bf16\" on float data (it marks uint16 bf16 bits)");
      } else if (cls == H5T_INTEGER && size == 2 && H5Tget_sign(t.get()) == H5T_SGN_NONE) {
        if (!dtype_attr) problem(where, "is uint16 without the attribute dtype = \"bf16\" (bf16 bits are marked so)");
      } else {
        problem(where, std::string("is ") + class_text(cls) + " of " + std::to_string(size) +
                           " bytes; float checkpoints are float32, float64, float16, or bf16 bits in uint16");
      }

      // Shape against the vocabulary.
      if (!cfg) continue;
      Hid sp(H5Dget_space(ds.get()), H5Sclose);
      const int rank = H5Sget_simple_extent_ndims(sp.get());
      std::vector<hsize_t> hd(rank > 0 ? rank : 0);
      if (rank > 0) H5Sget_simple_extent_dims(sp.get(), hd.data(), nullptr);
      const std::vector<int64_t> shape(hd.begin(), hd.end());
      if (!n_tokens || !kv_known) {
        // T or S unknown: only the name is checked.
        try {
          checkpoint_order(*cfg, parsed.base, parsed.layer);
        } catch (const InputError& e) {
          problem(where, e.what());
        }
        continue;
      }
      // row_offset: the dataset holds rows row_offset.. of its row dimension only (T; S for the cache).
      int64_t rows = *n_tokens, kv_rows = kv;
      if (row_offset && rd >= 0) {
        const bool cache = is_cache_layout(row_kind->layout);
        const int64_t total = cache ? kv : *n_tokens;
        if (*row_offset < 0 || *row_offset >= total) {
          problem(where, "attribute 'row_offset' is " + std::to_string(*row_offset) + ", outside the step's " +
                             std::to_string(total) + (cache ? " cache rows" : " token rows"));
          continue;
        }
        (cache ? kv_rows : rows) = total - *row_offset;
      }
      std::vector<int64_t> canonical;
      const std::string p =
          check_checkpoint(*cfg, name, parsed.layer, shape, layout.value_or(""), rows, kv_rows, &canonical);
      if (!p.empty()) {
        problem(where, p);
        continue;
      }
      if (!layout && shape == canonical) {
        std::string wrong, ambiguous_what;
        layout_ambiguity(ds.get(), parsed.base, layout_dims(kind->layout), shape,
                         kv - *n_tokens + (row_offset && rd >= 0 ? *row_offset : 0), &wrong, &ambiguous_what);
        if (!wrong.empty()) problem(where, wrong);
        if (!ambiguous_what.empty()) {
          const auto same = std::find_if(ambiguous.begin(), ambiguous.end(),
                                         [&](const auto& w) { return w.first.what == ambiguous_what; });
          if (same == ambiguous.end()) ambiguous.push_back({{where, ambiguous_what}, 0});
          else ++same->second;
        }
      }
    }
    for (auto& [w, more] : ambiguous) {
      if (more > 0) w.what += " (and " + std::to_string(more) + " more dataset" + (more == 1 ? "" : "s") + " of this step)";
      result.warnings.push_back(std::move(w));
    }
  }
  return result;
}

}  // namespace diffrun
