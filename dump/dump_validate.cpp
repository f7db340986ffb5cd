// Dump validation against docs/dump-format.md on the HDF5 C API: every root attribute, step group and dataset, all problems listed.
// Every attribute, type, allowed value, limit, letter, kind and architecture comes from the dump schema
// (dump_schema.hpp); python/diffrun/validate.py runs the same checks in the same order with the same words
// (DESIGN.md, "One validator"). Reads every dataset's data once, in blocks of rows (as compare would read it),
// within the readers' size limits.
#include "dump/dump_validate.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include "checkpoints/vocabulary.hpp"
#include "dump/dump_format.hpp"
#include "dump/rows.hpp"
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

std::string quoted_values(const std::vector<std::string>& values) {
  std::string s;
  for (size_t i = 0; i < values.size(); ++i)
    s += (i == 0 ? "" : i + 1 == values.size() ? " or " : ", ") + ("\"" + values[i] + "\"");
  return s;
}

// "a string", "a string: \"norm\" or \"neox\"", "an int32 scalar" (the schema's wording).
std::string expected_text(const RootAttribute& a) {
  const std::string& text = dump_schema().expected.at(attr_type_name(a.type));
  return a.values.empty() ? text : text + ": " + quoted_values(a.values);
}

using h5::class_text;

// Checks the stored type of one root attribute; "" when it fits.
std::string type_problem(const RootAttribute& a, const h5::AttrShape& s) {
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
  const size_t ih = at(dim_letter::H), it = at(dim_letter::T), is = at(dim_letter::S);
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
  if (base == kAttentionProbsKind && shape.size() == 3 && element_count(shape) <= (int64_t(16) << 20)) {
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


using ProblemFn = std::function<void(const std::string& name, const std::string& what)>;

// One root attribute's value, checked against its type's reading and its allowed values; null (and a problem)
// when it is not usable.
nlohmann::json read_root_value(hid_t file, const RootAttribute& a, bool vlen_ok, const ProblemFn& problem) {
  const char* n = a.name.c_str();
  switch (a.type) {
    case AttrType::string: {
      const auto v = h5::read_string_attribute(file, n, vlen_ok);
      if (!v) problem(a.name, "cannot be read as a string");
      else if (!a.values.empty() && std::find(a.values.begin(), a.values.end(), *v) == a.values.end())
        problem(a.name, "is \"" + *v + "\", expected " + quoted_values(a.values));
      else if (!a.nonempty.empty() && v->empty())
        problem(a.name, "is empty (" + a.nonempty + ")");
      else
        return *v;
      return nullptr;
    }
    case AttrType::integer:
    case AttrType::boolean: {
      const auto v = h5::read_int_attribute(file, n);
      if (!v || v->size() != 1) {
        problem(a.name, "cannot be read as an integer");
        return nullptr;
      }
      const int64_t x = (*v)[0];
      if (a.type == AttrType::boolean && x != 0 && x != 1)
        problem(a.name, "is " + std::to_string(x) + ", expected a boolean (0 or 1)");
      else if (a.type == AttrType::integer && (x < INT32_MIN || x > INT32_MAX))
        problem(a.name, "is " + std::to_string(x) + ", outside int32");
      else
        return x;
      return nullptr;
    }
    case AttrType::real: {
      const auto v = h5::read_real_attribute(file, n);
      if (!v) problem(a.name, "cannot be read as a real");
      return v ? nlohmann::json(*v) : nlohmann::json();
    }
    case AttrType::int_array: {
      const auto v = h5::read_int_attribute(file, n);
      if (!v) problem(a.name, "cannot be read as integers");
      return v ? nlohmann::json(*v) : nlohmann::json();
    }
  }
  return nullptr;
}

// The config, when every config attribute is there and sane; each insane one is a problem.
std::optional<ModelConfig> check_config(const nlohmann::json& values, const ProblemFn& problem) {
  bool ok = true;
  for (const RootAttribute& a : root_attributes()) {
    if (!a.config) continue;
    if (!values.contains(a.name)) {
      ok = ok && !a.required;  // an optional one (the experts' sizes) is absent for a dense model
      continue;
    }
    const nlohmann::json& v = values.at(a.name);
    if (a.type == AttrType::integer && v.get<int64_t>() <= 0) {
      problem(a.name, "is " + std::to_string(v.get<int64_t>()) + ", expected a positive integer");
      ok = false;
    } else if (a.type == AttrType::integer && a.max > 0 && v.get<int64_t>() > a.max) {
      problem(a.name, "is " + std::to_string(v.get<int64_t>()) + ", outside 1.." + std::to_string(a.max) +
                          (a.max_why.empty() ? "" : " (" + a.max_why + ")"));
      ok = false;
    } else if (a.positive && !(v.get<double>() > 0)) {
      problem(a.name, "is " + std::to_string(v.get<double>()) + ", expected a positive real");
      ok = false;
    }
  }
  for (const RootAttribute& a : root_attributes()) {
    if (!a.config || a.divides.empty() || !values.contains(a.name) || !values.contains(a.divides)) continue;
    const int64_t x = values.at(a.name).get<int64_t>(), whole = values.at(a.divides).get<int64_t>();
    if (x > 0 && whole % x != 0) {
      problem(a.name, "is " + std::to_string(x) + ", which does not divide " + a.divides + " = " + std::to_string(whole));
      ok = false;
    }
  }
  if (!ok) return std::nullopt;
  return config_from_attributes(values);
}

// The id arrays: within the vocabulary, the prompt not empty, the ids of every step starting with it.
void check_ids(RootCheck& r, const nlohmann::json& values, const ProblemFn& problem) {
  std::vector<std::string> arrays;  // the integer arrays in the schema's order: token_ids, all_token_ids, argmax
  std::map<std::string, std::optional<std::vector<int32_t>>> ids;
  for (const RootAttribute& a : root_attributes()) {
    if (a.type != AttrType::int_array) continue;
    arrays.push_back(a.name);
    if (!values.contains(a.name)) continue;
    std::vector<int32_t> out;
    bool ok = true;
    for (int64_t x : values.at(a.name).get<std::vector<int64_t>>()) {
      if (a.ids && (x < 0 || (r.config && x >= r.config->n_vocab))) {
        problem(a.name, "holds id " + std::to_string(x) + ", outside the vocabulary 0.." +
                            (r.config ? std::to_string(r.config->n_vocab - 1) : std::string("n_vocab-1")));
        ok = false;
        break;
      }
      out.push_back(static_cast<int32_t>(x));
    }
    if (!ok) continue;
    if (!a.nonempty.empty() && out.empty()) problem(a.name, "is empty (" + a.nonempty + ")");
    ids[a.name] = std::move(out);
  }
  if (arrays.size() != 3) throw std::logic_error("dump_schema.json: expected the id arrays token_ids, all_token_ids, argmax");
  const std::string &prompt = arrays[0], &every = arrays[1], &argmax = arrays[2];
  if (ids.count(prompt) && ids[prompt]) r.token_ids = *ids[prompt];
  if (ids.count(every)) r.all_token_ids = ids[every];
  if (r.all_token_ids && !r.token_ids.empty() &&
      (r.all_token_ids->size() < r.token_ids.size() ||
       !std::equal(r.token_ids.begin(), r.token_ids.end(), r.all_token_ids->begin())))
    problem(every, "does not start with " + prompt + " (it holds the prompt, then one id per decode step)");
  if (ids.count(argmax)) r.argmax = ids[argmax];
}

// A rank dump's rank and world size: both or neither, 0 <= rank < world_size.
void check_rank(RootCheck& r, const nlohmann::json& values, const ProblemFn& problem) {
  if (values.contains(attr::rank)) r.rank = values.at(attr::rank).get<int64_t>();
  if (values.contains(attr::world_size)) r.world_size = values.at(attr::world_size).get<int64_t>();
  if (r.rank.has_value() != r.world_size.has_value()) {
    problem(r.rank ? attr::world_size : attr::rank,
            std::string("missing: a rank dump has both ") + attr::rank + " and " + attr::world_size);
    return;
  }
  if (!r.rank) return;
  const int64_t max = find_root_attribute(attr::world_size)->max;
  if (*r.world_size < 1 || *r.world_size > max)
    problem(attr::world_size, "is " + std::to_string(*r.world_size) + ", outside 1.." + std::to_string(max));
  else if (*r.rank < 0 || *r.rank >= *r.world_size)
    problem(attr::rank, "is " + std::to_string(*r.rank) + ", outside 0.." + std::to_string(*r.world_size - 1) +
                            " (world_size " + std::to_string(*r.world_size) + ")");
}

}  // namespace

RootCheck check_root_attributes(hid_t file) {
  RootCheck r;
  const ProblemFn problem = [&](const std::string& name, const std::string& what) {
    r.problems.push_back({"root attribute '" + name + "'", what});
  };
  // The version first: from version 2 on, strings are fixed-length and a variable-length one is
  // reported without being read.
  const std::string& version = root_attributes().at(1).name;  // format_version
  if (const h5::AttrShape s = h5::inspect_attribute(file, version.c_str()); s.readable && s.cls == H5T_INTEGER && s.n == 1)
    if (auto v = h5::read_int_attribute(file, version.c_str()); v && v->size() == 1 && (*v)[0] >= 1 && (*v)[0] <= INT32_MAX)
      r.format_version = static_cast<int>((*v)[0]);
  r.vlen_strings_ok = r.format_version == 1 && version1_reads_allowed();
  if (r.format_version == 1 && !r.vlen_strings_ok) problem(version, "is 1: " + version1_refused());
  nlohmann::json values = nlohmann::json::object();
  for (const RootAttribute& a : root_attributes()) {
    const h5::AttrShape s = h5::inspect_attribute(file, a.name.c_str());
    if (!s.readable) {
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
    if (nlohmann::json v = read_root_value(file, a, r.vlen_strings_ok, problem); !v.is_null()) values[a.name] = std::move(v);
  }
  if (values.contains(version) &&
      (values[version].get<int64_t>() < kDumpFormatOldestVersion || values[version].get<int64_t>() > kDumpFormatVersion))
    problem(version, "is " + std::to_string(values[version].get<int64_t>()) + ", this diffrun reads versions " +
                         std::to_string(kDumpFormatOldestVersion) + " to " + std::to_string(kDumpFormatVersion));
  r.config = check_config(values, problem);
  check_ids(r, values, problem);
  check_rank(r, values, problem);
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
      const DimLetter *head = find_dim(dims[i]), *head_dim = find_dim(dims[i + 1]);
      if (!head || !head->heads || !head_dim || !head_dim->head_dim) continue;
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

std::string shard_slice_config(const ModelConfig& cfg, std::string_view layout, const std::string& split,
                               int64_t offset, std::span<const int64_t> shape, int64_t n_tokens, int64_t n_kv,
                               ModelConfig* out) {
  const std::vector<std::string> letters = layout_dims(layout);
  const DimLetter* d = find_dim(split);
  if (std::find(letters.begin(), letters.end(), split) == letters.end() || !d || d->attribute.empty())
    return "attribute 'split' is '" + split + "', expected a letter of its layout " + std::string(layout) +
           " other than " + token_rows_dim() + " and " + cache_rows_dim();
  const std::map<std::string, int64_t> sizes = dim_sizes(cfg, n_tokens, n_kv);
  int64_t others = 1, count = 1;
  for (const auto& l : letters)
    if (l != split) others *= sizes.at(l);
  for (int64_t x : shape) count *= x;
  const int64_t full = sizes.at(split);
  if (others <= 0 || count % others != 0 || count / others < 1 || count / others > full)
    return "holds " + std::to_string(count) + " values, not a slice along " + split + " of layout " +
           std::string(layout) + " (" + split + " = " + std::to_string(full) + ")";
  const int64_t extent = count / others;
  if (offset + extent > full)
    return "attribute 'shard_offset' is " + std::to_string(offset) + ": its slice " + split + " " +
           std::to_string(offset) + ".." + std::to_string(offset + extent - 1) + " passes " + split + " = " +
           std::to_string(full);
  nlohmann::json values = config_attributes(cfg);
  values[d->attribute] = extent;
  *out = config_from_attributes(values);
  return "";
}

namespace {

// One dump being validated: the open file, what its root says, and the result so far.
struct Validation {
  Validation(const std::string& p, const ValidateOptions& o, Hid f) : path(p), opt(o), file(std::move(f)) {}
  const std::string& path;
  const ValidateOptions& opt;
  Hid file;
  uint64_t file_size = 0;
  RootCheck root;
  std::map<std::string, std::string> facts;
  ValidateResult result;

  const std::optional<ModelConfig>& cfg() const { return root.config; }
  void problem(const std::string& where, const std::string& what) { result.problems.push_back({where, what}); }

  // Links are checked before anything follows them; a dump that reaches outside itself is refused
  // (exit 2), not listed as a problem (docs/dump-format.md, "What readers refuse").
  void refuse_links(hid_t group, const std::string& prefix) const {
    for (const auto& name : list_links(group))
      if (const std::string refused = link_refusal(group, name); !refused.empty())
        throw DumpError(path + ": '" + prefix + name + "' " + refused);
  }

  // External or virtual storage, and sizes no real dump has (a compression bomb), are refused (exit 2).
  void refuse_storage(hid_t ds, const std::string& where) const {
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
  }
};

Hid open_for_validation(const std::string& path) {
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
  if (H5Aexists(file.get(), root_attributes().front().name.c_str()) < 0) {
    const std::string d = h5::detail();
    if (d.find("checksum") != std::string::npos)
      throw DumpError(path + ": damaged: its root attributes cannot be read" + d);
  }
  return file;
}

// Backend facts: the root string attributes the format does not define.
void read_facts(Validation& v) {
  for (const auto& name : h5::attribute_names(v.file.get())) {
    if (find_root_attribute(name)) continue;
    const h5::AttrShape s = h5::inspect_attribute(v.file.get(), name.c_str());
    if (s.vlen && !v.root.vlen_strings_ok)
      v.problem("root attribute '" + name + "'", "is a variable-length string; format version " +
                                                     std::to_string(v.root.format_version) +
                                                     " stores fixed-length strings");  // (version 1 is refused before)
    if (s.cls != H5T_STRING || s.n != 1) continue;
    if (auto value = h5::read_string_attribute(v.file.get(), name.c_str(), v.root.vlen_strings_ok))
      v.facts[name] = *value;
  }
}

// The step groups by number, each problem of their names and numbering listed.
std::map<int, std::string> find_steps(Validation& v) {
  std::map<int, std::string> steps;
  for (const auto& name : list_links(v.file.get())) {
    const int step = parse_dump_step_group_name(name);
    if (step < 0) continue;
    if (object_type(v.file.get(), name) != H5O_TYPE_GROUP) {
      v.problem(name, "is not a group (a step is a group of datasets)");
      continue;
    }
    if (name.size() < 9) v.problem(name, "step groups are named with at least 4 digits: '" + dump_step_group_name(step) + "'");
    if (steps.count(step)) {
      v.problem(name, "a second group for step " + std::to_string(step) + " (with '" + steps[step] + "')");
      continue;
    }
    steps[step] = name;
  }
  if (steps.empty()) v.problem("/", "no step groups (expected /step_0000, /step_0001, ...)");
  const int last = steps.empty() ? -1 : steps.rbegin()->first;
  for (int s = 0; s <= last; ++s)
    if (!steps.count(s))
      v.problem(dump_step_group_name(s), "missing: steps are numbered from 0 without gaps (last step is " +
                                             std::to_string(last) + ")");
  const RootCheck& root = v.root;
  if (root.argmax && static_cast<int>(root.argmax->size()) != static_cast<int>(steps.size()) && !steps.empty())
    v.problem("root attribute 'argmax'", "holds " + std::to_string(root.argmax->size()) + " ids for " +
                                             std::to_string(steps.size()) + " steps (one per step)");
  if (root.all_token_ids && !root.token_ids.empty() && last >= 0 &&
      root.all_token_ids->size() < root.token_ids.size() + static_cast<size_t>(last))
    v.problem("root attribute 'all_token_ids'",
              "holds " + std::to_string(root.all_token_ids->size()) + " ids; " + std::to_string(last) +
                  " decode steps after a prompt of " + std::to_string(root.token_ids.size()) + " need at least " +
                  std::to_string(root.token_ids.size() + last));
  if (!v.cfg() && !steps.empty())
    v.problem("/", "datasets are not checked against the vocabulary: the config attributes are incomplete");
  return steps;
}

// A version-2 step's attribute table by dataset name (`names` loses the table's own name); its problems listed.
std::map<std::string, AttributeRow> step_table(Validation& v, hid_t g, const std::string& gname,
                                               std::vector<std::string>& names) {
  std::map<std::string, AttributeRow> table;
  const auto at = std::find(names.begin(), names.end(), kAttributeTable);
  if (at == names.end()) return table;
  names.erase(at);
  const std::string where = gname + "/" + kAttributeTable;
  if (object_type(g, kAttributeTable) == H5O_TYPE_DATASET) {
    Hid table_ds(H5Dopen2(g, kAttributeTable, H5P_DEFAULT), H5Dclose);
    if (table_ds.valid()) v.refuse_storage(table_ds.get(), where);
  }
  try {
    for (auto& row : read_attribute_table(g, gname, v.file_size)) table[row.name] = std::move(row);
  } catch (const DumpError& e) {
    const std::string msg = e.what(), prefix = where + ": ";
    v.problem(where, msg.rfind(prefix, 0) == 0 ? msg.substr(prefix.size()) : msg);
  }
  for (const auto& [tname, row] : table)
    if (std::find(names.begin(), names.end(), tname) == names.end())
      v.problem(where, "names '" + tname + "', which the step does not hold");
  return table;
}

// A step's `tokens`: its T when they are usable, every problem listed.
std::optional<int64_t> check_tokens(Validation& v, hid_t g, int s, const std::string& gname,
                                    const std::vector<std::string>& names) {
  const RootCheck& root = v.root;
  const std::string twhere = gname + "/" + std::string(kTokensCheckpoint);
  const char* tokens = kTokensCheckpoint.data();
  if (std::find(names.begin(), names.end(), kTokensCheckpoint) == names.end()) {
    v.problem(twhere, "missing (every step records the ids it was fed, int32 [T])");
    return std::nullopt;
  }
  if (object_type(g, tokens) != H5O_TYPE_DATASET) return std::nullopt;
  Hid ds(H5Dopen2(g, tokens, H5P_DEFAULT), H5Dclose);
  if (ds.valid()) v.refuse_storage(ds.get(), twhere);
  Hid t(H5Dget_type(ds.get()), H5Tclose);
  Hid sp(H5Dget_space(ds.get()), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(sp.get());
  if (H5Tget_class(t.get()) != H5T_INTEGER) {
    v.problem(twhere, std::string("is ") + class_text(H5Tget_class(t.get())) + ", expected int32 ids");
    return std::nullopt;
  }
  if (rank != 1) {
    v.problem(twhere, "has rank " + std::to_string(rank) + ", expected 1 ([T])");
    return std::nullopt;
  }
  if (H5Tget_size(t.get()) != 4 || H5Tget_sign(t.get()) != H5T_SGN_2)
    v.problem(twhere, "is an integer of " + std::to_string(H5Tget_size(t.get())) + " bytes, expected int32");
  hsize_t n = 0;
  H5Sget_simple_extent_dims(sp.get(), &n, nullptr);
  std::vector<int32_t> ids(n);
  if (n == 0) {
    v.problem(twhere, "is empty (a step feeds at least one token)");
    return std::nullopt;
  }
  if (H5Dread(ds.get(), H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, ids.data()) < 0) {
    v.problem(twhere, "cannot be read" + h5::detail());
    return std::nullopt;
  }
  if (s == 0 && !root.token_ids.empty() && ids != root.token_ids)
    v.problem(twhere, "differs from the root attribute token_ids (step 0 is the prompt)");
  if (s > 0 && n != 1) v.problem(twhere, "holds " + std::to_string(n) + " ids; a decode step feeds one");
  if (s > 0 && n == 1 && root.all_token_ids) {
    const size_t at = root.token_ids.size() + static_cast<size_t>(s) - 1;
    if (at < root.all_token_ids->size() && (*root.all_token_ids)[at] != ids[0])
      v.problem(twhere, "is " + std::to_string(ids[0]) + " but all_token_ids says " +
                            std::to_string((*root.all_token_ids)[at]) + " for this step");
  }
  if (v.cfg())
    for (int32_t id : ids)
      if (id < 0 || id >= v.cfg()->n_vocab) {
        v.problem(twhere, "holds id " + std::to_string(id) + ", outside the vocabulary 0.." +
                              std::to_string(v.cfg()->n_vocab - 1));
        break;
      }
  return static_cast<int64_t>(n);
}

// The attributes of one dataset, each optional (docs/dump-format.md, "Dataset attributes").
struct DatasetAttrs {
  std::optional<int64_t> order, layer, row_offset;
  std::optional<std::string> layout, native, dtype;
  std::optional<std::string> split;  // a rank dump's shard (docs/dump-format.md, "Shards")
  std::optional<int64_t> shard_offset, partial;
};

// Version 1: attributes of the dataset itself, their types checked.
DatasetAttrs version1_attributes(Validation& v, hid_t ds, const std::string& where) {
  std::map<std::string, std::optional<int64_t>> ints;
  std::map<std::string, std::optional<std::string>> strings;
  for (const RootAttribute& a : dump_schema().dataset) {
    const h5::AttrShape s = h5::inspect_attribute(ds, a.name.c_str());
    if (!s.readable) continue;
    if (a.type == AttrType::integer) {
      if (s.cls != H5T_INTEGER || s.n != 1) {
        v.problem(where, "attribute '" + a.name + "' is " + class_text(s.cls) + (s.n != 1 ? " array" : "") +
                             ", expected a scalar integer");
        continue;
      }
      const auto x = h5::read_int_attribute(ds, a.name.c_str());
      if (x && x->size() == 1) ints[a.name] = (*x)[0];
    } else {
      if (s.cls != H5T_STRING || s.n != 1) {
        v.problem(where, "attribute '" + a.name + "' is " + class_text(s.cls) + ", expected a string");
        continue;
      }
      // Variable-length only in a version-1 dump read with DIFFRUN_READ_V1=1: a dump whose format_version is
      // missing or below 1 lands here too (fuzz_dump found HDF5 1.10's damaged global heap through it).
      strings[a.name] = h5::read_string_attribute(ds, a.name.c_str(), v.root.vlen_strings_ok);
    }
  }
  const auto i = [&](const char* n) { return ints.count(n) ? ints[n] : std::nullopt; };
  const auto t = [&](const char* n) { return strings.count(n) ? strings[n] : std::nullopt; };
  return {i(column::order),  i(column::layer), i(column::row_offset), t(column::layout),      t(column::native_dtype),
          t(column::dtype),  t(column::split), i(column::shard_offset), i(column::partial)};
}

DatasetAttrs table_attributes(const std::map<std::string, AttributeRow>& table, const std::string& name) {
  DatasetAttrs d;
  if (const auto it = table.find(name); it != table.end()) {
    const AttributeRow& row = it->second;
    d.order = row.attrs.order, d.layer = row.attrs.layer, d.row_offset = row.attrs.row_offset;
    if (!row.attrs.layout.empty()) d.layout = row.attrs.layout;
    if (!row.attrs.native_dtype.empty()) d.native = row.attrs.native_dtype;
    if (!row.dtype.empty()) d.dtype = row.dtype;
    if (!row.attrs.split.empty()) d.split = row.attrs.split;
    d.shard_offset = row.attrs.shard_offset, d.partial = row.attrs.partial;
  }
  return d;
}

// A shard's attributes (docs/dump-format.md, "Shards"): in a rank dump, split along a letter of the layout other
// than the row dimension, partial 0 or 1 and not with split, shard_offset only with split. The slice's place along
// the split letter is checked with the shape (check_shape).
void check_shard_attributes(Validation& v, const std::string& where, const DatasetAttrs& a) {
  if (!a.split && !a.shard_offset && !a.partial) return;
  if (!v.root.world_size)
    v.problem(where, std::string("shard attributes in a dump without the root attributes ") + attr::rank + " and " +
                         attr::world_size);
  if (a.partial && *a.partial != 0 && *a.partial != 1)
    v.problem(where, "attribute 'partial' is " + std::to_string(*a.partial) + ", expected 0 or 1");
  if (a.partial && *a.partial == 1 && a.split)
    v.problem(where, "attributes 'split' and 'partial' together: a rank's piece is a slice or a partial sum");
  if (a.shard_offset && !a.split) v.problem(where, "attribute 'shard_offset' without 'split'");
  if (a.shard_offset && *a.shard_offset < 0)
    v.problem(where, "attribute 'shard_offset' is " + std::to_string(*a.shard_offset) + ", expected >= 0");
}

// The dataset attributes against the name and the vocabulary (`rd`: the kind's row dimension, -1 for none).
void check_dataset_attributes(Validation& v, const std::string& where, const ParsedCheckpointName& parsed,
                              const DatasetAttrs& a, int rd) {
  if (a.row_offset && rd < 0)
    v.problem(where, "attribute 'row_offset' is only for checkpoints with token or cache rows (kq_soft_max, "
                     "result_output, cache_k, per-token checkpoints)");
  if (a.layer && *a.layer != parsed.layer)
    v.problem(where, "attribute 'layer' is " + std::to_string(*a.layer) + " but the name says " +
                         std::to_string(parsed.layer));
  if (a.order && v.cfg()) {
    try {
      const int want = checkpoint_order(*v.cfg(), parsed.base, parsed.layer);
      if (*a.order != want)
        v.problem(where, "attribute 'order' is " + std::to_string(*a.order) + " but the vocabulary puts it at " +
                             std::to_string(want) + " for this config");
    } catch (const InputError&) {
      // reported with the shape check
    }
  }
  const std::vector<std::string>& natives = dataset_attribute(column::native_dtype).values;
  if (a.native && std::find(natives.begin(), natives.end(), *a.native) == natives.end())
    v.problem(where, "attribute 'native_dtype' is \"" + *a.native + "\", expected " + quoted_values(natives));
  const std::string& bf16 = dataset_attribute(column::dtype).values.at(0);
  if (a.dtype && *a.dtype != bf16)
    v.problem(where, "attribute 'dtype' is \"" + *a.dtype + "\"; the only value is \"" + bf16 + "\" (on uint16 data)");
  check_shard_attributes(v, where, a);
}

// The stored dtype of a float checkpoint.
void check_stored_dtype(Validation& v, hid_t ds, const std::string& where, const DatasetAttrs& a) {
  Hid t(H5Dget_type(ds), H5Tclose);
  const H5T_class_t cls = H5Tget_class(t.get());
  const size_t size = H5Tget_size(t.get());
  if (cls == H5T_FLOAT) {
    if (size == 2) {
      size_t spos = 0, epos = 0, esize = 0, mpos = 0, msize = 0;
      H5Tget_fields(t.get(), &spos, &epos, &esize, &mpos, &msize);
      if (spos != 15 || epos != 10 || esize != 5 || mpos != 0 || msize != 10 || H5Tget_ebias(t.get()) != 15)
        v.problem(where, "is a 2-byte float that is not IEEE half (float16)");
    } else if (size != 4 && size != 8) {
      v.problem(where, "is a " + std::to_string(size) + "-byte float; expected float32, float64 or float16");
    }
    if (a.dtype) v.problem(where, "attribute 'dtype' = \"bf16\" on float data (it marks uint16 bf16 bits)");
  } else if (cls == H5T_INTEGER && size == 2 && H5Tget_sign(t.get()) == H5T_SGN_NONE) {
    if (!a.dtype) v.problem(where, "is uint16 without the attribute dtype = \"bf16\" (bf16 bits are marked so)");
  } else {
    v.problem(where, std::string("is ") + class_text(cls) + " of " + std::to_string(size) +
                         " bytes; float checkpoints are float32, float64, float16, or bf16 bits in uint16");
  }
}

// What a step knows while its datasets are checked.
struct StepState {
  int step = 0;
  std::string gname;
  std::vector<std::string> names;
  std::map<std::string, AttributeRow> table;
  bool v2 = false;
  std::optional<int64_t> n_tokens;
  int64_t kv = 0;  // S after the step
  bool kv_known = true;
  // Layout ambiguity warnings, one per message: the first dataset and how many more.
  std::vector<std::pair<DumpProblem, int>> ambiguous;
};

// A rank's slice along `split` (shard_slice_config), its problem reported. False when there is one.
bool shard_config(Validation& v, const std::string& where, const CheckpointKind& kind, const std::string& split,
                  int64_t offset, const std::vector<int64_t>& shape, int64_t rows, int64_t kv_rows,
                  std::optional<ModelConfig>& out) {
  ModelConfig sharded;
  const std::string p = shard_slice_config(*v.cfg(), kind.layout, split, offset, shape, rows, kv_rows, &sharded);
  if (!p.empty()) {
    v.problem(where, p);
    return false;
  }
  out = sharded;
  return true;
}

// The shape of a float checkpoint against the vocabulary (T and S known), then its layout's ambiguity.
void check_shape(Validation& v, hid_t ds, const std::string& where, const std::string& name,
                 const ParsedCheckpointName& parsed, const CheckpointKind& kind, const DatasetAttrs& a, int rd,
                 StepState& st) {
  Hid sp(H5Dget_space(ds), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(sp.get());
  std::vector<hsize_t> hd(rank > 0 ? rank : 0);
  if (rank > 0) H5Sget_simple_extent_dims(sp.get(), hd.data(), nullptr);
  const std::vector<int64_t> shape(hd.begin(), hd.end());
  // row_offset: the dataset holds rows row_offset.. of its row dimension only (T; S for the cache).
  int64_t rows = *st.n_tokens, kv_rows = st.kv;
  if (a.row_offset && rd >= 0) {
    const bool cache = is_cache_layout(kind.layout);
    const int64_t total = cache ? st.kv : *st.n_tokens;
    if (*a.row_offset < 0 || *a.row_offset >= total) {
      v.problem(where, "attribute 'row_offset' is " + std::to_string(*a.row_offset) + ", outside the step's " +
                           std::to_string(total) + (cache ? " cache rows" : " token rows"));
      return;
    }
    (cache ? kv_rows : rows) = total - *a.row_offset;
  }
  std::optional<ModelConfig> sharded;
  if (a.split && !shard_config(v, where, kind, *a.split, a.shard_offset.value_or(0), shape, rows, kv_rows, sharded)) return;
  std::vector<int64_t> canonical;
  const std::string p = check_checkpoint(sharded ? *sharded : *v.cfg(), name, parsed.layer, shape,
                                         a.layout.value_or(""), rows, kv_rows, &canonical);
  if (!p.empty()) {
    v.problem(where, p);
    return;
  }
  if (a.layout || shape != canonical) return;
  std::string wrong, ambiguous_what;
  layout_ambiguity(ds, parsed.base, layout_dims(kind.layout), shape,
                   st.kv - *st.n_tokens + (a.row_offset && rd >= 0 ? *a.row_offset : 0), &wrong, &ambiguous_what);
  if (!wrong.empty()) v.problem(where, wrong);
  if (ambiguous_what.empty()) return;
  const auto same = std::find_if(st.ambiguous.begin(), st.ambiguous.end(),
                                 [&](const auto& w) { return w.first.what == ambiguous_what; });
  if (same == st.ambiguous.end()) st.ambiguous.push_back({{where, ambiguous_what}, 0});
  else ++same->second;
}

// One dataset of a step: its data read once (as compare reads it), its name, attributes, dtype and shape.
void check_dataset(Validation& v, hid_t g, const std::string& name, StepState& st) {
  const std::string where = st.gname + "/" + name;
  if (object_type(g, name) != H5O_TYPE_DATASET) {
    v.problem(where, "is not a dataset");
    return;
  }
  ++v.result.n_datasets;
  Hid ds(H5Dopen2(g, name.c_str(), H5P_DEFAULT), H5Dclose);
  if (!ds.valid()) {
    v.problem(where, "cannot be opened" + h5::detail());
    return;
  }
  v.refuse_storage(ds.get(), where);
  // The data, read once as compare reads it: what validate calls valid, compare can read.
  if (const std::string p = read_problem(ds.get()); !p.empty()) {
    v.problem(where, p);
    return;
  }
  if (v.opt.mapped && v.opt.mapped(ForeignName{name, st.names, v.cfg(), v.facts})) return;
  const ParsedCheckpointName parsed = parse_checkpoint_name(name);
  const CheckpointKind* kind = find_checkpoint_kind(parsed.base);
  if (!kind) {
    v.problem(where, v.opt.mapped ? "not a checkpoint name of the vocabulary nor of the name map"
                                  : "not a checkpoint name of the vocabulary (diffrun vocab lists them; "
                                    "foreign names need --names)");
    return;
  }
  // Dataset attributes (each optional): the dataset's row of the attribute table (version 2), else
  // attributes of the dataset (version 1).
  const DatasetAttrs a = st.v2 ? table_attributes(st.table, name) : version1_attributes(v, ds.get(), where);
  const bool tokens = name == kTokensCheckpoint;
  const int rd = tokens ? -1 : row_dim(kind->layout);
  check_dataset_attributes(v, where, parsed, a, rd);
  if (tokens) {
    if (a.layout && *a.layout != kind->layout)
      v.problem(where, "attribute 'layout' is \"" + *a.layout + "\", expected \"" + kind->layout + "\"");
    if (a.order && *a.order != 0) v.problem(where, "attribute 'order' is " + std::to_string(*a.order) + ", expected 0");
    return;  // the rest was checked with the step's tokens
  }
  check_stored_dtype(v, ds.get(), where, a);
  if (!v.cfg()) return;
  if (!st.n_tokens || !st.kv_known) {
    // T or S unknown: only the name is checked.
    try {
      checkpoint_order(*v.cfg(), parsed.base, parsed.layer);
    } catch (const InputError& e) {
      v.problem(where, e.what());
    }
    return;
  }
  check_shape(v, ds.get(), where, name, parsed, *kind, a, rd, st);
}

// One step group: its table, its tokens, then every dataset. `kv`/`kv_known`: S before the step, updated.
void check_step(Validation& v, int s, const std::string& gname, int64_t& kv, bool& kv_known) {
  ++v.result.n_steps;
  Hid g(H5Gopen2(v.file.get(), gname.c_str(), H5P_DEFAULT), H5Gclose);
  if (!g.valid()) {
    v.problem(gname, "cannot be opened" + h5::detail());
    kv_known = false;
    return;
  }
  v.refuse_links(g.get(), gname + "/");
  StepState st;
  st.step = s;
  st.gname = gname;
  st.names = list_links(g.get());
  // Version 2: the datasets' attributes are the step's attribute table.
  st.v2 = v.root.format_version >= 2;
  if (st.v2) st.table = step_table(v, g.get(), gname, st.names);
  st.n_tokens = check_tokens(v, g.get(), s, gname, st.names);
  if (st.n_tokens) kv += *st.n_tokens;
  else kv_known = false;
  st.kv = kv;
  st.kv_known = kv_known;
  for (const auto& name : st.names) check_dataset(v, g.get(), name, st);
  for (auto& [w, more] : st.ambiguous) {
    if (more > 0) w.what += " (and " + std::to_string(more) + " more dataset" + (more == 1 ? "" : "s") + " of this step)";
    v.result.warnings.push_back(std::move(w));
  }
}

}  // namespace

ValidateResult validate_dump(const std::string& path, const ValidateOptions& opt) {
  Validation v(path, opt, open_for_validation(path));
  v.root = check_root_attributes(v.file.get());
  if (v.root.format_version == 1 && !version1_reads_allowed()) throw DumpError(path + ": " + version1_refused());
  v.result.problems = std::move(v.root.problems);
  read_facts(v);
  std::error_code ec;
  v.file_size = std::filesystem::file_size(path, ec);
  v.refuse_links(v.file.get(), "");
  const std::map<int, std::string> steps = find_steps(v);
  const int last = steps.empty() ? -1 : steps.rbegin()->first;
  int64_t kv = 0;        // S after the previous step
  bool kv_known = true;  // false once a step's T is unknown
  for (int s = 0; s <= last; ++s) {
    if (const auto it = steps.find(s); it != steps.end()) check_step(v, s, it->second, kv, kv_known);
    else kv_known = false;
  }
  return std::move(v.result);
}

}  // namespace diffrun
