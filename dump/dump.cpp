// HDF5 dump writer and reader ("diffrun-dump", docs/dump-format.md) on the HDF5 1.10 C API.
// The writer checks checkpoints against the vocabulary and writes through DumpFile
// (dump/dump_format.hpp), the one implementation of the file format, shared with the C API:
// root attributes (meta), groups /step_NNNN, one contiguous float32 (int32 for ids) dataset per
// checkpoint, their order, layer, layout and native_dtype in the step's attribute table (format
// version 2; the reader also reads version 1, where they are dataset attributes). HDF5's automatic error printing is
// turned off; every failure is a DumpError naming the file (and dataset), with HDF5's innermost
// message appended.
#include "dump/dump.hpp"

#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <mutex>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <optional>
#include <set>
#include <utility>

#include "dump/dump_target.hpp"
#include "model/error.hpp"
#include "model/file_check.hpp"

namespace diffrun {

namespace {

// The root attributes every dump holds (docs/dump-format.md); any other string attribute is a
// backend fact, any other integer array an extra (all_token_ids, argmax).
const std::set<std::string, std::less<>>& reserved_root_attributes() {
  static const std::set<std::string, std::less<>> keys = [] {
    std::set<std::string, std::less<>> k;
    for (const auto& a : root_attributes())
      if (a.required || a.config || a.shard) k.insert(a.name);  // the optional config and shard ones too
    return k;
  }();
  return keys;
}
bool is_format_attribute(const std::string& key) { return reserved_root_attributes().count(key) > 0; }

void silence_hdf5() { h5::silence(); }
std::string hdf5_detail() { return h5::detail(); }
using h5::Hid;
std::string step_group_name(int step) { return dump_step_group_name(step); }
int parse_step_group_name(std::string_view name) { return parse_dump_step_group_name(name); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Writer

struct DumpWriter::Impl {
  DumpMeta meta;
  CheckpointFilter filter;
  DumpWriterOptions options;
  std::unique_ptr<DumpTarget> file;
  std::map<int, int64_t> step_tokens;  // T of each step, from its `tokens` (the cache's new rows)
  std::vector<float> scratch;          // rows gathered for a cut

  [[noreturn]] void fail(const std::string& what, std::string_view dataset = {}) const {
    std::string msg = file->path() + ": " + (dataset.empty() ? "" : "dataset '" + std::string(dataset) + "': ") + what;
    throw DumpError(msg + hdf5_detail());
  }

  void write_root_attributes() {
    DumpTarget& f = *file;
    if (meta.format_version < kDumpFormatVersion)
      fail("format_version " + std::to_string(meta.format_version) + ": this writer writes version " +
           std::to_string(kDumpFormatVersion));
    f.set_string(attr::format, kDumpFormat);
    f.set_int(attr::format_version, meta.format_version);
    f.set_string(attr::backend, meta.backend);
    f.set_string(attr::precision, meta.precision);
    f.set_string(attr::model_path, meta.model_path);
    f.set_string(attr::model_fingerprint, meta.model_fingerprint);
    const nlohmann::ordered_json config = config_attributes(meta.config);
    for (const auto& [name, value] : config.items()) {
      const RootAttribute& a = *find_root_attribute(name);
      if (a.type == AttrType::string) f.set_string(name, value.get<std::string>());
      else if (a.type == AttrType::real) f.set_real(name, value.get<double>());
      else if (a.type == AttrType::boolean) f.set_bool(name, value.get<bool>());
      else f.set_int(name, value.get<int32_t>());
    }
    f.set_string(attr::prompt, meta.prompt);
    f.set_ints(attr::token_ids, meta.token_ids);
    f.set_string(attr::created_utc, meta.created_utc);
    f.set_string(attr::diffrun_version, meta.diffrun_version);
    if (meta.rank) f.set_int(attr::rank, *meta.rank);
    if (meta.world_size) f.set_int(attr::world_size, *meta.world_size);
    for (const auto& [key, value] : meta.facts) {
      if (is_format_attribute(key)) fail("backend fact '" + key + "' collides with a format attribute");
      f.set_string(key, value);
    }
  }

  // Order of `name` for this config, checking it against the vocabulary (layer, layout, rank).
  int checked_order(int s, std::string_view name, int layer, std::string_view layout, size_t rank) {
    const std::string where = step_group_name(s) + "/" + std::string(name);
    const ParsedCheckpointName parsed = parse_checkpoint_name(name);
    if (parsed.layer != layer)
      fail("name says layer " + std::to_string(parsed.layer) + " but the backend passed layer " + std::to_string(layer),
           where);
    const CheckpointKind* kind = find_checkpoint_kind(parsed.base);
    int order = 0;
    try {
      order = checkpoint_order(meta.config, parsed.base, parsed.layer);
    } catch (const InputError& e) {
      fail(e.what(), where);
    }
    if (layout != kind->layout)
      fail("layout '" + std::string(layout) + "' differs from the vocabulary's '" + kind->layout + "'", where);
    if (layout_dims(layout).size() != rank)
      fail("shape has " + std::to_string(rank) + " dimensions but layout '" + std::string(layout) + "' names " +
               std::to_string(layout_dims(layout).size()),
           where);
    return order;
  }
};

namespace {

// An HDF5 built without its thread-safety option must not be entered by two threads at once: the
// pipeline writes each pair's dumps from that pair's thread, so there every writer call holds this
// lock. A thread-safe HDF5 (Debian's, conda-forge's) serializes itself and the lock stays untaken.
std::unique_lock<std::recursive_mutex> hdf5_lock() {
  static const bool threadsafe = [] {
    hbool_t ts = false;
    return H5is_library_threadsafe(&ts) >= 0 && ts;
  }();
  static std::recursive_mutex m;
  return threadsafe ? std::unique_lock<std::recursive_mutex>() : std::unique_lock<std::recursive_mutex>(m);
}

// The lock for a writer's calls: none when its file is written by a child process.
std::unique_lock<std::recursive_mutex> hdf5_lock(const DumpTarget* target) {
  return target && !target->in_process() ? std::unique_lock<std::recursive_mutex>() : hdf5_lock();
}

}  // namespace

DumpWriter::DumpWriter(const std::string& path, const DumpMeta& meta, CheckpointFilter filter,
                       DumpWriterOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.meta = meta;
  m.filter = std::move(filter);
  m.options = options;
  if (m.meta.created_utc.empty()) m.meta.created_utc = utc_now_iso8601();
  if (m.meta.diffrun_version.empty()) m.meta.diffrun_version = DIFFRUN_VERSION;
  if (options.child_process) m.file = child_dump_target(path, options.compress);
  const auto lock = hdf5_lock(m.file.get());
  if (!m.file) m.file = local_dump_target(path, options.compress);
  m.write_root_attributes();
}

DumpWriter::~DumpWriter() {
  const auto lock = hdf5_lock(impl_->file.get());
  impl_.reset();
}

bool DumpWriter::wants(std::string_view name) const { return impl_->filter.records(name); }

void DumpWriter::record(int step, std::string_view name, int layer, std::string_view layout,
                        std::span<const int64_t> shape, NativeDType native, std::span<const float> data) {
  if (!wants(name)) return;
  const auto lock = hdf5_lock(impl_->file.get());
  Impl& m = *impl_;
  const int order = m.checked_order(step, name, layer, layout, shape.size());
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) m.fail("negative dimension in its shape", name);
    n *= static_cast<uint64_t>(d);
  }
  if (n != data.size())
    m.fail("shape holds " + std::to_string(n) + " values but " + std::to_string(data.size()) + " were passed", name);
  DatasetAttributes attrs{order, layer, std::string(layout), native_dtype_name(native), std::nullopt, {}, std::nullopt, std::nullopt};
  if (m.options.shard) {
    const ShardSpec spec = m.options.shard(name);
    attrs.split = spec.split;
    if (!spec.split.empty()) attrs.shard_offset = static_cast<int>(spec.offset);
    if (spec.partial) attrs.partial = 1;
  }
  // Row cuts (DumpWriterOptions): the last rows of the row dimension, from row_offset on.
  const int rd = row_dim(layout);
  if (rd >= 0 && static_cast<size_t>(rd) < shape.size() && shape[rd] > 0) {
    const int64_t rows = shape[rd];
    int64_t keep = rows;
    if (is_cache_layout(layout)) {
      auto t = m.step_tokens.find(step);
      if (!m.options.cache_all_rows && t != m.step_tokens.end()) keep = std::min<int64_t>(rows, t->second);
    } else {
      keep = kept_rows(parse_checkpoint_name(name).base,
                       rows, {m.options.softmax_rows, m.options.logits_rows, m.options.token_rows});
    }
    if (keep < rows) {
      int64_t outer = 1, inner = 1;
      for (int i = 0; i < rd; ++i) outer *= shape[i];
      for (size_t i = rd + 1; i < shape.size(); ++i) inner *= shape[i];
      std::vector<int64_t> cropped(shape.begin(), shape.end());
      cropped[rd] = keep;
      attrs.row_offset = static_cast<int>(rows - keep);
      const float* src = data.data() + (rows - keep) * inner;
      if (outer > 1) {
        m.scratch.resize(static_cast<size_t>(outer * keep * inner));
        for (int64_t i = 0; i < outer; ++i)
          std::copy_n(data.data() + (i * rows + (rows - keep)) * inner, keep * inner, m.scratch.data() + i * keep * inner);
        src = m.scratch.data();
      }
      m.file->write(step, name, StoredDType::f32, cropped, src, attrs);
      return;
    }
  }
  m.file->write(step, name, StoredDType::f32, shape, data.data(), attrs);
}

void DumpWriter::record_ids(int step, std::string_view name, std::span<const int32_t> ids) {
  if (!wants(name)) return;
  const auto lock = hdf5_lock(impl_->file.get());
  Impl& m = *impl_;
  const int order = m.checked_order(step, name, -1, dim_letter::T, 1);
  if (name == "tokens") m.step_tokens[step] = static_cast<int64_t>(ids.size());
  const int64_t shape[1] = {static_cast<int64_t>(ids.size())};
  m.file->write(step, name, StoredDType::i32, shape, ids.data(), {order, -1, dim_letter::T, native_dtype_name(NativeDType::i32), std::nullopt, {}, std::nullopt, std::nullopt});
}

void DumpWriter::set_attribute(const std::string& key, const std::vector<int32_t>& values) {
  const auto lock = hdf5_lock(impl_->file.get());
  Impl& m = *impl_;
  if (m.file->finished()) m.fail("set_attribute('" + key + "') after finish()");
  if (is_format_attribute(key)) m.fail("attribute '" + key + "' is a format attribute");
  m.file->set_ints(key, values);
}

void DumpWriter::finish() {
  const auto lock = hdf5_lock(impl_->file.get());
  impl_->file->finish();
}

uint64_t DumpWriter::bytes_written() const { return impl_->file->bytes_written(); }

// ---------------------------------------------------------------------------------------------
// Reader

struct DumpReader::Impl {
  std::string path;
  uint64_t file_size = 0;
  Hid file;
  DumpMeta meta;
  std::map<int, std::vector<DatasetInfo>> steps;
  std::vector<std::string> int_attribute_names;
  // Version 1 stored strings as variable-length ones; from version 2 on they are refused before
  // they are read (HDF5 1.10 crashes on some damaged global heaps, found by fuzz_dump).
  bool vlen_strings_ok = version1_reads_allowed();  // until format_version says otherwise

  [[noreturn]] void fail(const std::string& what, std::string_view dataset = {}) const {
    std::string msg = path + ": " + (dataset.empty() ? "" : "dataset '" + std::string(dataset) + "': ") + what;
    throw DumpError(msg + hdf5_detail());
  }

  // The attribute's shape, failing when it is missing or cannot be opened.
  h5::AttrShape existing_attr(hid_t obj, const char* name, std::string_view where) const {
    const h5::AttrShape s = h5::inspect_attribute(obj, name);
    if (!s.exists)
      fail(std::string("missing attribute '") + name + "'" + (where.empty() ? " (not a diffrun dump?)" : ""), where);
    if (!s.readable) fail(std::string("cannot open attribute '") + name + "'", where);
    return s;
  }

  std::string read_str(hid_t obj, const char* name, std::string_view where = {}) const {
    const h5::AttrShape s = existing_attr(obj, name, where);
    if (s.cls != H5T_STRING) fail(std::string("attribute '") + name + "' is not a string", where);
    if (s.n != 1) fail(std::string("attribute '") + name + "' is not a scalar string", where);
    if (s.vlen && !vlen_strings_ok)
      fail(std::string(where.empty() ? "root attribute '" : "attribute '") + name + "' is a variable-length string; " +
               (meta.format_version >= 2 ? "format version " + std::to_string(meta.format_version) +
                                               " stores fixed-length strings"
                                         : version1_refused()),
           where);
    std::string why;
    std::optional<std::string> v = h5::read_string_attribute(obj, name, vlen_strings_ok, &why);
    if (!v) fail(std::string("cannot read attribute '") + name + "'" + why, where);
    return *v;
  }

  std::vector<int32_t> read_ints(hid_t obj, const char* name, std::string_view where = {}) const {
    const h5::AttrShape s = existing_attr(obj, name, where);
    if (s.n < 0) fail(std::string("cannot size attribute '") + name + "'", where);
    if (s.cls != H5T_ENUM && s.cls != H5T_INTEGER && s.cls != H5T_FLOAT)
      fail(std::string("attribute '") + name + "' is not numeric", where);
    std::string why;
    const auto v = h5::read_int_attribute(obj, name, true, &why);
    if (!v)
      fail(std::string("cannot read attribute '") + name + "'" + (s.cls == H5T_ENUM ? "" : " as int32") + why, where);
    std::vector<int32_t> out;
    for (int64_t x : *v) out.push_back(static_cast<int32_t>(std::clamp<int64_t>(x, INT32_MIN, INT32_MAX)));
    return out;
  }

  int read_int(hid_t obj, const char* name, std::string_view where = {}) const {
    auto v = read_ints(obj, name, where);
    if (v.size() != 1) fail(std::string("attribute '") + name + "' is not a scalar", where);
    return v[0];
  }

  double read_double(hid_t obj, const char* name) const {
    if (existing_attr(obj, name, {}).n != 1) fail(std::string("attribute '") + name + "' is not a scalar");
    std::string why;
    const std::optional<double> v = h5::read_real_attribute(obj, name, &why);
    if (!v) fail(std::string("cannot read attribute '") + name + "'" + why);
    return *v;
  }

  void read_meta() {
    const hid_t root = file.get();
    if (H5Aexists(root, attr::format) <= 0) fail("not a diffrun dump (no 'format' root attribute)");
    // The version first: it says whether strings may be variable-length (version 1) before any is read.
    if (H5Aexists(root, attr::format_version) > 0) {
      meta.format_version = read_int(root, attr::format_version);
      if (meta.format_version < kDumpFormatOldestVersion || meta.format_version > kDumpFormatVersion)
        fail("format_version " + std::to_string(meta.format_version) + " is not supported (this diffrun reads versions " +
             std::to_string(kDumpFormatOldestVersion) + " to " + std::to_string(kDumpFormatVersion) + ")");
      if (meta.format_version < 2 && !version1_reads_allowed()) fail(version1_refused());
      vlen_strings_ok = meta.format_version < 2;
    }
    const std::string format = read_str(root, attr::format);
    if (format != kDumpFormat) fail("not a diffrun dump (format is '" + format + "', expected '" + kDumpFormat + "')");
    meta.format_version = read_int(root, attr::format_version);
    if (meta.format_version < kDumpFormatOldestVersion || meta.format_version > kDumpFormatVersion)
      fail("format_version " + std::to_string(meta.format_version) + " is not supported (this diffrun reads versions " +
           std::to_string(kDumpFormatOldestVersion) + " to " + std::to_string(kDumpFormatVersion) + ")");
    meta.backend = read_str(root, attr::backend);
    meta.precision = read_str(root, attr::precision);
    meta.model_path = read_str(root, attr::model_path);
    meta.model_fingerprint = read_str(root, attr::model_fingerprint);
    // The config attributes, in the schema's order; an enum string outside its values is refused.
    nlohmann::json config;
    for (const RootAttribute& a : root_attributes()) {
      if (!a.config) continue;
      const char* n = a.name.c_str();
      if (!a.required && H5Aexists(root, n) <= 0) continue;  // an expert size of a dense model
      switch (a.type) {
        case AttrType::string: {
          const std::string v = read_str(root, n);
          if (!a.values.empty() && std::find(a.values.begin(), a.values.end(), v) == a.values.end())
            fail("unknown " + a.name + " '" + v + "'");
          config[a.name] = v;
          break;
        }
        case AttrType::real: config[a.name] = read_double(root, n); break;
        case AttrType::boolean: config[a.name] = read_int(root, n) != 0; break;
        default: config[a.name] = read_int(root, n); break;
      }
    }
    meta.config = config_from_attributes(config);
    meta.prompt = read_str(root, attr::prompt);
    meta.token_ids = read_ints(root, attr::token_ids);
    meta.created_utc = read_str(root, attr::created_utc);
    meta.diffrun_version = read_str(root, attr::diffrun_version);
    if (H5Aexists(root, attr::rank) > 0) meta.rank = read_int(root, attr::rank);
    if (H5Aexists(root, attr::world_size) > 0) meta.world_size = read_int(root, attr::world_size);
    check_config();

    // Other root attributes: strings are backend facts, integers are set_attribute() arrays.
    const std::vector<std::string> names = h5::attribute_names(root);
    for (const auto& n : names) {
      if (reserved_root_attributes().count(n)) continue;
      const H5T_class_t cls = h5::inspect_attribute(root, n.c_str()).cls;
      if (cls == H5T_STRING) meta.facts[n] = read_str(root, n.c_str());
      else if (cls == H5T_INTEGER) int_attribute_names.push_back(n);
    }
  }

  // Sizes everything downstream loops over or allocates by (a dump declaring n_layer = 2e9 once
  // drove compare to 21 GB): each must be positive and within what any real model needs.
  void check_config() const {
    const nlohmann::ordered_json values = config_attributes(meta.config);
    for (const RootAttribute& a : root_attributes()) {
      if (!a.config || a.type != AttrType::integer || !values.contains(a.name)) continue;
      const int64_t v = values.at(a.name).get<int64_t>();
      if (v < 1 || v > a.max)
        fail("attribute '" + a.name + "' is " + std::to_string(v) + ", outside 1.." + std::to_string(a.max));
    }
  }

  // A dataset must hold the bytes its shape declares, so a 230 KB file declaring 2 GB is refused
  // before anything is allocated (size_refusal: unfiltered storage at least the declared size,
  // filtered storage at least 1/kMaxCompressionRatio of it, never more than the file has, and the
  // float32 read within dataset_read_limit()).
  void check_storage(hid_t ds, hid_t type, const std::vector<int64_t>& shape, const std::string& where) const {
    uint64_t declared = H5Tget_size(type);
    for (int64_t d : shape) {
      if (d != 0 && declared > UINT64_MAX / static_cast<uint64_t>(d)) fail("its shape overflows 64 bits", where);
      declared *= static_cast<uint64_t>(d);
    }
    // Read as float32 (ids as int32): 4 bytes an element whatever the stored size.
    const uint64_t presented = declared / std::max<size_t>(H5Tget_size(type), 1) * 4;
    if (const std::string refused = size_refusal(ds, declared, presented, file_size); !refused.empty())
      fail(refused, where);
  }

  // How a stored dataset becomes the presented one.
  struct Transform {
    bool bf16 = false;       // uint16/opaque words holding bfloat16
    bool transpose = false;  // the bytes hold the stored shape's last two dims swapped
    std::vector<int64_t> dims;  // row-major dims of the (transposed-back) data, merged groups split
    std::vector<int64_t> keep;  // extent kept of each (a crop keeps the first ones)
    std::vector<int> perm;      // presented dim i is data dim perm[i]
  };
  std::map<std::pair<int, std::string>, Transform> transforms;
  // A cache put back together: rows [from, to) of each step's dataset, in row order.
  struct Piece {
    int step;
    int64_t from, to;
  };
  std::map<std::pair<int, std::string>, std::vector<Piece>> pieces;
  std::map<std::pair<int, std::string>, int64_t> stored_row_offset;  // as the file says (0 when absent)
  // Rows read for an assembled cache, kept: every later step needs them again.
  mutable std::map<std::pair<int, std::string>, std::vector<float>> piece_data;
  mutable std::mutex piece_mutex;
  std::vector<std::pair<int, std::string>> dropped;
  const NameMap* names = nullptr;
  std::unique_ptr<const DumpReader::Source> source;  // a merged dump: its reads

  // One dataset as found in the file, before names and layouts are resolved.
  struct Raw {
    std::string source;
    std::vector<int64_t> shape;
    bool is_int = false, bf16 = false;
    std::string stored_dtype;
    std::optional<int> order, layer, row_offset;
    std::optional<std::string> layout, native_dtype;
    std::string split;
    std::optional<int> shard_offset, partial;
  };

  std::optional<std::string> opt_str(hid_t obj, const char* name, std::string_view where) const {
    if (H5Aexists(obj, name) <= 0) return std::nullopt;
    return read_str(obj, name, where);
  }
  std::optional<int> opt_int(hid_t obj, const char* name, std::string_view where) const {
    if (H5Aexists(obj, name) <= 0) return std::nullopt;
    return read_int(obj, name, where);
  }

  // `row`: the dataset's row of the step's attribute table (version 2; nullptr: none). Version 1
  // dumps carry the attributes on the datasets.
  Raw read_raw(hid_t g, const std::string& gname, const std::string& name, const AttributeRow* row) const {
    const std::string where = gname + "/" + name;
    Hid ds(H5Dopen2(g, name.c_str(), H5P_DEFAULT), H5Dclose);
    if (!ds.valid()) fail("cannot open the dataset", where);
    if (const std::string refused = storage_refusal(ds.get()); !refused.empty()) fail(refused, where);
    Raw r;
    r.source = name;
    Hid space(H5Dget_space(ds.get()), H5Sclose);
    const int rank = H5Sget_simple_extent_ndims(space.get());
    if (rank < 0) fail("cannot read its shape", where);
    std::vector<hsize_t> dims(rank);
    H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
    r.shape.assign(dims.begin(), dims.end());
    Hid t(H5Dget_type(ds.get()), H5Tclose);
    const H5T_class_t cls = H5Tget_class(t.get());
    const size_t size = H5Tget_size(t.get());
    const bool v1 = meta.format_version < 2;
    const std::optional<std::string> dtype_attr =
        v1 ? opt_str(ds.get(), column::dtype, where)
           : (row && !row->dtype.empty() ? std::optional<std::string>(row->dtype) : std::nullopt);
    if (dtype_attr && *dtype_attr == "bf16") {
      if ((cls != H5T_INTEGER && cls != H5T_OPAQUE) || size != 2)
        fail("attribute dtype = \"bf16\" on a dataset that is not 16-bit unsigned integer or opaque", where);
      r.bf16 = true;
      r.stored_dtype = "bfloat16";
    } else if (cls == H5T_FLOAT) {
      size_t spos, epos, esize, mpos, msize;
      H5Tget_fields(t.get(), &spos, &epos, &esize, &mpos, &msize);
      r.stored_dtype = size == 2 && esize == 8 ? "bfloat16" : "float" + std::to_string(size * 8);
    } else if (cls == H5T_INTEGER) {
      r.is_int = true;
      r.stored_dtype = (H5Tget_sign(t.get()) == H5T_SGN_NONE ? "uint" : "int") + std::to_string(size * 8);
    } else {
      fail("not a numeric dataset (a 16-bit dataset holding bfloat16 needs the attribute dtype = \"bf16\")", where);
    }
    check_storage(ds.get(), t.get(), r.shape, where);
    if (v1) {
      r.order = opt_int(ds.get(), column::order, where);
      r.layer = opt_int(ds.get(), column::layer, where);
      r.layout = opt_str(ds.get(), column::layout, where);
      r.native_dtype = opt_str(ds.get(), column::native_dtype, where);
      r.row_offset = opt_int(ds.get(), column::row_offset, where);
      r.split = opt_str(ds.get(), column::split, where).value_or("");
      r.shard_offset = opt_int(ds.get(), column::shard_offset, where);
      r.partial = opt_int(ds.get(), column::partial, where);
    } else if (row) {
      r.split = row->attrs.split;
      r.shard_offset = row->attrs.shard_offset;
      r.partial = row->attrs.partial;
      r.order = row->attrs.order;
      r.layer = row->attrs.layer;
      if (!row->attrs.layout.empty()) r.layout = row->attrs.layout;
      if (!row->attrs.native_dtype.empty()) r.native_dtype = row->attrs.native_dtype;
      r.row_offset = row->attrs.row_offset;
    }
    return r;
  }

  // Sizes of the layout letters at a step (T and S when the step's tokens are known).
  std::map<std::string, int64_t> letter_sizes(int64_t T, int64_t S) const { return dim_sizes(meta.config, T, S); }

  // Plans how `raw` (vocabulary kind `kind`) becomes the kind's layout; false when it cannot
  // (the dataset is then presented as stored). `layout` is the stored layout ("" = the kind's).
  bool plan(const CheckpointKind& kind, const std::string& layout, const std::vector<std::string>& crop,
            const std::map<std::string, int64_t>& sizes, std::vector<int64_t> shape, Transform& t,
            std::vector<int64_t>& out_shape) const {
    const std::vector<std::string> want = layout_dims(kind.layout);
    const std::vector<std::vector<std::string>> groups =
        layout_factors(layout.empty() ? std::string_view(kind.layout) : std::string_view(layout));
    std::vector<std::string> flat;
    for (const auto& g : groups) flat.insert(flat.end(), g.begin(), g.end());
    std::vector<std::string> a = flat, b = want;
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    if (a != b) return false;  // not the kind's letters: nothing to permute to
    while (shape.size() > groups.size() && shape.front() == 1) shape.erase(shape.begin());
    auto size_of = [&](const std::string& l) -> int64_t {
      auto it = sizes.find(l);
      return it == sizes.end() ? -1 : it->second;
    };
    t.dims.clear();
    t.keep.clear();
    // With no layout given, dims that are not the kind's sizes ([1, T, H*Dh] for T,H,Dh) fall back
    // to the reshape by element count below.
    bool grouped = shape.size() == groups.size();
    if (grouped && layout.empty()) {
      for (size_t i = 0; i < groups.size(); ++i) {
        const int64_t n = size_of(groups[i][0]);
        const bool cropped = std::count(crop.begin(), crop.end(), groups[i][0]) && shape[i] > n;
        if (n >= 0 && shape[i] != n && !cropped) grouped = false;
      }
    }
    if (grouped) {
      for (size_t i = 0; i < groups.size(); ++i) {
        if (groups[i].size() == 1) {
          int64_t keep = shape[i];
          const int64_t want_n = size_of(groups[i][0]);
          if (want_n >= 0 && shape[i] > want_n && std::count(crop.begin(), crop.end(), groups[i][0])) keep = want_n;
          t.dims.push_back(shape[i]);
          t.keep.push_back(keep);
          continue;
        }
        int64_t prod = 1;
        for (const auto& l : groups[i]) {
          const int64_t n = size_of(l);
          if (n < 0) return false;
          prod *= n;
        }
        if (prod != shape[i]) return false;
        for (const auto& l : groups[i]) {
          t.dims.push_back(size_of(l));
          t.keep.push_back(size_of(l));
        }
      }
    } else {
      // Another rank: a plain reshape when the element count is the kind's ([T, H*Dh] for [T, H, Dh]).
      if (!layout.empty() && layout != kind.layout) return false;
      t.dims.clear();
      int64_t have = 1, need = 1;
      for (int64_t d : shape) have *= d;
      for (const auto& l : want) {
        const int64_t n = size_of(l);
        if (n < 0) return false;
        need *= n;
        t.dims.push_back(n);
      }
      if (have != need) return false;
      flat = want;
      t.keep = t.dims;
    }
    t.perm.clear();
    out_shape.clear();
    for (const auto& l : want) {
      const int i = static_cast<int>(std::find(flat.begin(), flat.end(), l) - flat.begin());
      t.perm.push_back(i);
      out_shape.push_back(t.keep[i]);
    }
    return true;
  }

  // Every dataset of every step group as found in the file (links checked before anything follows them).
  std::map<int, std::vector<Raw>> read_raws() const {
    std::map<int, std::vector<Raw>> raws;
    for (const auto& gname : list_group(file.get(), "the root group")) {
      // Every link is checked before anything follows it (docs/dump-format.md, "What readers refuse").
      if (const std::string refused = link_refusal(file.get(), gname); !refused.empty())
        fail("'" + gname + "' " + refused);
      const int step = parse_step_group_name(gname);
      if (step < 0) continue;
      Hid g(H5Gopen2(file.get(), gname.c_str(), H5P_DEFAULT), H5Gclose);
      if (!g.valid()) fail("cannot open group '" + gname + "'");
      const std::vector<std::string> names = list_group(g.get(), "group '" + gname + "'");
      for (const auto& name : names)
        if (const std::string refused = link_refusal(g.get(), name); !refused.empty()) fail(refused, gname + "/" + name);
      auto& list = raws[step];
      if (meta.format_version < 2) {
        for (const auto& name : names) list.push_back(read_raw(g.get(), gname, name, nullptr));
        continue;
      }
      std::vector<AttributeRow> table;
      try {
        table = read_attribute_table(g.get(), gname, file_size);
      } catch (const DumpError& e) {
        fail(e.what());
      }
      std::map<std::string, const AttributeRow*> by_name;
      for (const auto& row : table) by_name[row.name] = &row;
      // Rows naming no dataset of the step (one deleted afterwards) are ignored; validate reports them.
      for (const auto& name : names) {
        if (name == kAttributeTable) continue;
        const auto it = by_name.find(name);
        list.push_back(read_raw(g.get(), gname, name, it == by_name.end() ? nullptr : it->second));
      }
    }
    return raws;
  }

  std::vector<std::string> list_group(hid_t group, const std::string& what) const {
    std::vector<std::string> names;
    if (H5Literate(
            group, H5_INDEX_NAME, H5_ITER_INC, nullptr,
            [](hid_t, const char* name, const H5L_info_t*, void* out) -> herr_t {
              static_cast<std::vector<std::string>*>(out)->push_back(name);
              return 0;
            },
            &names) < 0)
      fail("cannot list " + what);
    return names;
  }

  // A dataset under the name it is presented as: the map's rule for it, else its own name.
  struct Named {
    Raw* raw;
    std::string name;
    const NameRule* rule;
  };

  // The names of a step's datasets (repeats counted per base name); datasets the map drops are left out.
  std::vector<Named> name_step(int step, std::vector<Raw>& list) {
    std::map<std::string, int> repeats;
    for (const auto& r : list) {
      auto [base, k] = split_occurrence(r.source);
      repeats[base] = std::max(repeats[base], k);
    }
    std::vector<Named> named;
    std::set<std::string> taken;
    for (auto& r : list) {
      std::optional<NameMapping> m;
      if (names) {
        auto [base, k] = split_occurrence(r.source);
        m = names->map(base, k, repeats[base], meta.config.arch, meta.facts);
      }
      if (m && m->drop) {
        dropped.emplace_back(step, r.source);
        continue;
      }
      const std::string name = m ? m->name : r.source;
      if (!taken.insert(name).second)
        fail("two datasets are presented as '" + name + "' (the name map maps both to it)",
             step_group_name(step) + "/" + r.source);
      named.push_back({&r, name, m ? m->rule : nullptr});
    }
    return named;
  }

  // How one dataset of a step is presented (its transform recorded): T and S of the step (-1: unknown),
  // `foreign` counts the datasets outside the vocabulary so far.
  DatasetInfo present(int step, const Named& n, int64_t T, int64_t S, const std::map<std::string, int64_t>& sizes,
                      int& foreign) {
    const Raw& r = *n.raw;
    const std::string where = step_group_name(step) + "/" + r.source;
    DatasetInfo info;
    info.step = step;
    info.name = n.name;
    info.source = r.source;
    info.is_int = r.is_int;
    info.stored_dtype = r.stored_dtype;
    info.stored_shape = r.shape;
    info.shape = r.shape;
    // Absent native_dtype: the stored dtype's name in the format's terms ("float16" -> "f16").
    static const std::map<std::string, std::string> short_names = {
        {"float16", "f16"}, {"bfloat16", "bf16"}, {"float32", "f32"}, {"float64", "f64"}, {"int32", "i32"}};
    const auto short_name = short_names.find(r.stored_dtype);
    info.native_dtype = r.native_dtype.value_or(short_name != short_names.end() ? short_name->second : r.stored_dtype);
    const ParsedCheckpointName parsed = parse_checkpoint_name(n.name);
    const CheckpointKind* kind = find_checkpoint_kind(parsed.base);
    if (kind && !kind->per_layer && parsed.layer >= 0) kind = nullptr;  // "embd-3" is not embd
    if (kind && r.is_int && parsed.base != kTokensCheckpoint)
      fail("integer data (" + r.stored_dtype + ") for a float checkpoint (bfloat16 stored as uint16 needs the attribute dtype = \"bf16\")",
           where);
    info.layer = r.layer.value_or(kind && kind->per_layer ? parsed.layer : -1);
    if (r.order) {
      info.order = *r.order;
    } else {
      info.order = 1000000 + foreign++;  // outside the vocabulary: after it, in file order
      if (kind) {
        try {
          info.order = checkpoint_order(meta.config, parsed.base, parsed.layer);
        } catch (const InputError&) {
        }
      }
    }
    Transform t;
    t.bf16 = r.bf16;
    t.transpose = n.rule && n.rule->transpose;
    if (t.transpose && r.shape.size() < 2) fail("the name map transposes a dataset of rank < 2", where);
    const std::string stored_layout = n.rule && !n.rule->layout.empty() ? n.rule->layout : r.layout.value_or("");
    info.layout = stored_layout.empty() && kind ? kind->layout : stored_layout;
    std::vector<int64_t> shape;
    // row_offset: the dataset holds rows row_offset.. of its row dimension only (T; S for the
    // cache), docs/dump-format.md "Rows".
    auto step_sizes = sizes;
    if (r.row_offset && kind && !r.is_int && row_dim(kind->layout) >= 0) {
      const std::string letter = layout_dims(kind->layout)[row_dim(kind->layout)];
      const bool cache = letter == cache_rows_dim();
      const int64_t total = cache ? (T >= 0 ? S : -1) : T;
      if (*r.row_offset < 0 || (total >= 0 && *r.row_offset >= total))
        fail("attribute 'row_offset' = " + std::to_string(*r.row_offset) + " is outside the step's " +
                 std::to_string(total) + (cache ? " cache rows" : " token rows"),
             where);
      info.row_offset = *r.row_offset;
      if (total >= 0) step_sizes[letter] = total - *r.row_offset;
    }
    if (kind && !r.is_int) shard_sizes(*kind, r, where, step_sizes, info);
    if (kind && !r.is_int &&
        plan(*kind, stored_layout, n.rule ? n.rule->crop : std::vector<std::string>{}, step_sizes, r.shape, t, shape)) {
      info.shape = shape;
      info.layout = kind->layout;
    } else {
      t.dims = r.shape;
      t.keep = r.shape;
      t.perm.clear();
      for (size_t i = 0; i < r.shape.size(); ++i) t.perm.push_back(static_cast<int>(i));
    }
    transforms[{step, n.name}] = std::move(t);
    stored_row_offset[{step, n.name}] = info.row_offset;
    return info;
  }

  // A rank's shard (docs/dump-format.md, "Shards"): its split letter's size is the shard's extent, the
  // data's element count over the other letters' sizes, so that the layout is planned as for a whole checkpoint.
  void shard_sizes(const CheckpointKind& kind, const Raw& r, const std::string& where,
                   std::map<std::string, int64_t>& sizes, DatasetInfo& info) const {
    info.partial = r.partial.value_or(0) != 0;
    info.shard_offset = r.shard_offset.value_or(0);
    info.split = r.split;
    if (r.split.empty()) return;
    const std::vector<std::string> letters = layout_dims(kind.layout);
    if (std::find(letters.begin(), letters.end(), r.split) == letters.end())
      fail("attribute 'split' is '" + r.split + "', not a letter of the layout " + kind.layout, where);
    int64_t others = 1, count = 1;
    for (const auto& l : letters) {
      if (l == r.split) continue;
      const auto it = sizes.find(l);
      if (it == sizes.end()) return;  // T or S unknown
      others *= it->second;
    }
    for (int64_t d : r.shape) count *= d;
    if (others > 0 && count % others == 0) sizes[r.split] = count / others;
  }

  void scan_steps() {
    std::map<int, std::vector<Raw>> raws = read_raws();
    int64_t S = 0;  // positions after the step
    for (auto& [step, list] : raws) {
      const std::vector<Named> named = name_step(step, list);
      int64_t T = -1;
      for (const auto& n : named)
        if (n.name == kTokensCheckpoint && n.raw->is_int && !n.raw->shape.empty()) T = n.raw->shape[0];
      S = T >= 0 && S >= 0 ? S + T : -1;  // unknown from a step without tokens on
      const auto sizes = letter_sizes(T, T >= 0 ? S : -1);
      auto& infos = steps[step];
      int foreign = 0;
      for (const auto& n : named) infos.push_back(present(step, n, T, S, sizes, foreign));
      std::sort(infos.begin(), infos.end(), [](const DatasetInfo& a, const DatasetInfo& b) {
        return a.order != b.order ? a.order < b.order : a.name < b.name;
      });
    }
    assemble_caches();
  }

  // The cache rows a step wrote (cache_k/cache_v with row_offset, DumpWriter's default) are put
  // back together with the rows of the steps before it into [S, Hkv, Dh], when those steps hold
  // every earlier row; otherwise the dataset stays the rows it holds (row_offset).
  void assemble_caches() {
    // Latest step first: the steps before it still hold their rows as stored.
    for (auto st = steps.rbegin(); st != steps.rend(); ++st) {
      const int step = st->first;
      for (auto& info : st->second) {
        if (info.row_offset <= 0 || !is_cache_layout(info.layout) || info.shape.size() != 3) continue;
        std::vector<Piece> parts;
        int64_t need = info.row_offset;  // rows 0..need-1 still missing
        for (auto it = std::make_reverse_iterator(steps.find(step)); it != steps.rend() && need > 0; ++it) {
          const DatasetInfo* prev = nullptr;
          for (const auto& d : it->second)
            if (d.name == info.name) prev = &d;
          const auto stored_from = stored_row_offset.find({it->first, info.name});
          if (!prev || stored_from == stored_row_offset.end() || prev->shape.size() != 3 ||
              stored_from->second + prev->shape[0] < need)
            break;
          const int64_t from = stored_from->second;
          parts.push_back({it->first, from, need});
          need = from;
        }
        if (need > 0) continue;
        std::reverse(parts.begin(), parts.end());
        parts.push_back({step, info.row_offset, info.row_offset + info.shape[0]});
        info.shape[0] += info.row_offset;
        info.row_offset = 0;
        pieces[{step, info.name}] = std::move(parts);
      }
    }
  }

  const DatasetInfo* find_info(int step, const std::string& name) const {
    auto it = steps.find(step);
    if (it != steps.end())
      for (const auto& d : it->second)
        if (d.name == name) return &d;
    return nullptr;
  }

  std::vector<int32_t> read_ids(int step, const std::string& name) const {
    const std::string where = step_group_name(step) + "/" + name;
    const DatasetInfo* info = find_info(step, name);
    if (!info) fail("no such dataset", where);
    size_t n = 1;
    for (int64_t d : info->stored_shape) n *= static_cast<size_t>(d);
    std::vector<int32_t> out(n);
    const std::string path_in_file = "/" + step_group_name(step) + "/" + info->source;
    Hid ds(H5Dopen2(file.get(), path_in_file.c_str(), H5P_DEFAULT), H5Dclose);
    if (!ds.valid()) fail("cannot open the dataset", where);
    if (n > 0 && H5Dread(ds.get(), H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()) < 0)
      fail("cannot read the data", where);
    return out;
  }

  std::vector<float> read_floats(int step, const std::string& name) const {
    auto p = pieces.find({step, name});
    if (p == pieces.end()) return read_stored(step, name);
    const DatasetInfo* info = find_info(step, name);
    const size_t row = static_cast<size_t>(info->shape[1] * info->shape[2]);
    std::vector<float> out;
    out.reserve(static_cast<size_t>(info->shape[0]) * row);
    for (const Piece& piece : p->second) {
      const int64_t from = stored_row_offset.at({piece.step, name});
      const auto append = [&](const std::vector<float>& rows) {
        out.insert(out.end(), rows.begin() + static_cast<std::ptrdiff_t>((piece.from - from) * row),
                   rows.begin() + static_cast<std::ptrdiff_t>((piece.to - from) * row));
      };
      if (piece.step == step) {
        append(read_stored(step, name));
        continue;
      }
      std::lock_guard<std::mutex> lock(piece_mutex);
      auto cached = piece_data.find({piece.step, name});
      if (cached == piece_data.end()) cached = piece_data.emplace(std::make_pair(piece.step, name), read_stored(piece.step, name)).first;
      append(cached->second);
    }
    return out;
  }

  // One dataset as stored (its rows only), in the vocabulary's layout.
  std::vector<float> read_stored(int step, const std::string& name) const {
    const std::string where = step_group_name(step) + "/" + name;
    const DatasetInfo* info = find_info(step, name);
    if (!info) fail("no such dataset", where);
    const Transform& t = transforms.at({step, name});
    size_t n = 1;
    for (int64_t d : info->stored_shape) n *= static_cast<size_t>(d);
    std::vector<float> raw(n);
    const std::string path_in_file = "/" + step_group_name(step) + "/" + info->source;
    Hid ds(H5Dopen2(file.get(), path_in_file.c_str(), H5P_DEFAULT), H5Dclose);
    if (!ds.valid()) fail("cannot open the dataset", where);
    if (n > 0) {
      if (t.bf16) {
        std::vector<uint16_t> words(n);
        Hid ftype(H5Dget_type(ds.get()), H5Tclose);
        const hid_t mem = H5Tget_class(ftype.get()) == H5T_OPAQUE ? ftype.get() : H5T_NATIVE_UINT16;
        if (H5Dread(ds.get(), mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, words.data()) < 0) fail("cannot read the data", where);
        for (size_t i = 0; i < n; ++i) {
          const uint32_t bits = static_cast<uint32_t>(words[i]) << 16;
          std::memcpy(&raw[i], &bits, sizeof bits);
        }
      } else if (H5Dread(ds.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, raw.data()) < 0) {
        fail("cannot read the data", where);
      }
    }
    if (t.transpose) {
      // The bytes are [.., b, a] for a stored shape [.., a, b]: transpose each matrix back.
      const auto& s = info->stored_shape;
      const size_t a = static_cast<size_t>(s[s.size() - 2]), b = static_cast<size_t>(s[s.size() - 1]);
      std::vector<float> fixed(n);
      const size_t mats = a * b == 0 ? 0 : n / (a * b);
      for (size_t m = 0; m < mats; ++m)
        for (size_t i = 0; i < a; ++i)
          for (size_t j = 0; j < b; ++j) fixed[m * a * b + i * b + j] = raw[m * a * b + j * a + i];
      raw.swap(fixed);
    }
    // Gather: crop each data dim to `keep`, present the dims in `perm` order.
    bool identity = true;
    for (size_t i = 0; i < t.perm.size(); ++i) identity &= t.perm[i] == static_cast<int>(i) && t.keep[i] == t.dims[i];
    if (identity) return raw;
    const size_t rank = t.dims.size();
    std::vector<size_t> stride(rank, 1);
    for (size_t i = rank; i-- > 1;) stride[i - 1] = stride[i] * static_cast<size_t>(t.dims[i]);
    size_t total = 1;
    for (int64_t k : t.keep) total *= static_cast<size_t>(k);
    std::vector<float> out(total);
    std::vector<size_t> idx(rank, 0);  // index over presented dims
    for (size_t o = 0; o < total; ++o) {
      size_t src = 0;
      for (size_t i = 0; i < rank; ++i) src += idx[i] * stride[t.perm[i]];
      out[o] = raw[src];
      for (size_t i = rank; i-- > 0;) {
        if (++idx[i] < static_cast<size_t>(t.keep[t.perm[i]])) break;
        idx[i] = 0;
      }
    }
    return out;
  }
};

DumpReader::DumpReader(const std::string& path, const NameMap* names) : impl_(std::make_unique<Impl>()) {
  silence_hdf5();
  Impl& m = *impl_;
  m.path = path;
  m.names = names;
  // stat only: a FIFO is never opened (that would block), a directory is named as one.
  if (std::string problem = regular_file_problem(path); !problem.empty())
    m.fail(problem == "does not exist" ? "no such file" : problem);
  std::error_code ec;
  m.file_size = std::filesystem::file_size(path, ec);
  if (H5Fis_hdf5(path.c_str()) <= 0) m.fail("not an HDF5 file (no HDF5 signature: foreign or truncated)");
  Hid fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  H5Pset_fclose_degree(fapl.get(), H5F_CLOSE_STRONG);
  m.file = Hid(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()), H5Fclose);
  if (!m.file.valid()) m.fail("cannot open the HDF5 file (truncated or damaged?)");
  m.read_meta();
  m.scan_steps();
}

DumpReader::~DumpReader() = default;

DumpReader::DumpReader(std::string path, DumpMeta meta, std::map<int, std::vector<DatasetInfo>> steps,
                       std::vector<std::string> int_attribute_names, std::unique_ptr<const Source> source)
    : impl_(std::make_unique<Impl>()) {
  impl_->path = std::move(path);
  impl_->meta = std::move(meta);
  impl_->steps = std::move(steps);
  impl_->int_attribute_names = std::move(int_attribute_names);
  impl_->source = std::move(source);
}

const std::string& DumpReader::path() const { return impl_->path; }
const DumpMeta& DumpReader::meta() const { return impl_->meta; }

std::vector<int> DumpReader::steps() const {
  std::vector<int> s;
  for (const auto& [step, infos] : impl_->steps) s.push_back(step);
  return s;
}

std::vector<DatasetInfo> DumpReader::datasets(int step) const {
  auto it = impl_->steps.find(step);
  if (it == impl_->steps.end()) impl_->fail("no step " + std::to_string(step) + " (group '" + step_group_name(step) + "')");
  return it->second;
}

const DatasetInfo* DumpReader::find(int step, const std::string& name) const {
  auto it = impl_->steps.find(step);
  if (it == impl_->steps.end()) return nullptr;
  for (const auto& d : it->second)
    if (d.name == name) return &d;
  return nullptr;
}

std::vector<float> DumpReader::read(int step, const std::string& name) const {
  if (impl_->source) return impl_->source->read(step, name);
  return impl_->read_floats(step, name);
}

std::vector<float> DumpReader::read_rank(int step, const std::string& name, int rank) const {
  if (impl_->source) return impl_->source->read_rank(step, name, rank);
  return impl_->read_floats(step, name);
}

std::vector<int32_t> DumpReader::read_ids(int step, const std::string& name) const {
  const DatasetInfo* info = find(step, name);
  if (info && !info->is_int) impl_->fail("holds floats, not ids", step_group_name(step) + "/" + name);
  if (impl_->source) return impl_->source->read_ids(step, name);
  return impl_->read_ids(step, name);
}

std::vector<int32_t> DumpReader::int_attribute(const std::string& key) const {
  const auto& names = impl_->int_attribute_names;
  if (std::find(names.begin(), names.end(), key) == names.end()) return {};
  if (impl_->source) return impl_->source->int_attribute(key);
  return impl_->read_ints(impl_->file.get(), key.c_str());
}

const std::vector<std::string>& DumpReader::int_attribute_names() const { return impl_->int_attribute_names; }

const std::vector<std::pair<int, std::string>>& DumpReader::dropped() const { return impl_->dropped; }

}  // namespace diffrun
