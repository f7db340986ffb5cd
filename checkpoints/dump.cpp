// HDF5 dump writer and reader ("diffrun-dump", docs/dump-format.md) on the HDF5 1.10 C API.
// The writer checks checkpoints against the vocabulary and writes through DumpFile
// (checkpoints/dump_format.hpp), the one implementation of the file format, shared with the C API:
// root attributes (meta), groups /step_NNNN, one contiguous float32 (int32 for ids) dataset per
// checkpoint with attributes order, layer, layout, native_dtype. HDF5's automatic error printing is
// turned off; every failure is a DumpError naming the file (and dataset), with HDF5's innermost
// message appended.
#include "checkpoints/dump.hpp"

#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <set>
#include <utility>

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
      if (a.required) k.insert(a.name);
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
  std::unique_ptr<DumpFile> file;

  [[noreturn]] void fail(const std::string& what, std::string_view dataset = {}) const {
    std::string msg = file->path() + ": " + (dataset.empty() ? "" : "dataset '" + std::string(dataset) + "': ") + what;
    throw DumpError(msg + hdf5_detail());
  }

  void write_root_attributes() {
    DumpFile& f = *file;
    const ModelConfig& c = meta.config;
    f.set_string("format", kDumpFormat);
    f.set_int("format_version", meta.format_version);
    f.set_string("backend", meta.backend);
    f.set_string("precision", meta.precision);
    f.set_string("model_path", meta.model_path);
    f.set_string("model_fingerprint", meta.model_fingerprint);
    f.set_string("arch", arch_name(c.arch));
    f.set_int("n_layer", c.n_layer);
    f.set_int("n_embd", c.n_embd);
    f.set_int("n_head", c.n_head);
    f.set_int("n_head_kv", c.n_head_kv);
    f.set_int("head_dim", c.head_dim);
    f.set_int("n_ff", c.n_ff);
    f.set_int("n_vocab", c.n_vocab);
    f.set_int("n_ctx", c.n_ctx);
    f.set_real("rope_theta", c.rope_theta);
    f.set_string("rope_type", rope_type_name(c.rope_type));
    f.set_real("rms_eps", c.rms_eps);
    f.set_bool("tied_output", c.tied_output);
    f.set_bool("qkv_bias", c.qkv_bias);
    f.set_bool("qk_norm", c.qk_norm);
    f.set_string("prompt", meta.prompt);
    f.set_ints("token_ids", meta.token_ids);
    f.set_string("created_utc", meta.created_utc);
    f.set_string("diffrun_version", meta.diffrun_version);
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

DumpWriter::DumpWriter(const std::string& path, const DumpMeta& meta, CheckpointFilter filter)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.meta = meta;
  m.filter = std::move(filter);
  if (m.meta.created_utc.empty()) m.meta.created_utc = utc_now_iso8601();
  if (m.meta.diffrun_version.empty()) m.meta.diffrun_version = DIFFRUN_VERSION;
  m.file = std::make_unique<DumpFile>(path);
  m.write_root_attributes();
}

DumpWriter::~DumpWriter() = default;

bool DumpWriter::wants(std::string_view name) const { return name == "tokens" || impl_->filter.matches(name); }

void DumpWriter::record(int step, std::string_view name, int layer, std::string_view layout,
                        std::span<const int64_t> shape, NativeDType native, std::span<const float> data) {
  if (!wants(name)) return;
  Impl& m = *impl_;
  const int order = m.checked_order(step, name, layer, layout, shape.size());
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) m.fail("negative dimension in its shape", name);
    n *= static_cast<uint64_t>(d);
  }
  if (n != data.size())
    m.fail("shape holds " + std::to_string(n) + " values but " + std::to_string(data.size()) + " were passed", name);
  m.file->write(step, name, StoredDType::f32, shape, data.data(),
                {order, layer, std::string(layout), native_dtype_name(native)});
}

void DumpWriter::record_ids(int step, std::string_view name, std::span<const int32_t> ids) {
  if (!wants(name)) return;
  Impl& m = *impl_;
  const int order = m.checked_order(step, name, -1, "T", 1);
  const int64_t shape[1] = {static_cast<int64_t>(ids.size())};
  m.file->write(step, name, StoredDType::i32, shape, ids.data(), {order, -1, "T", native_dtype_name(NativeDType::i32)});
}

void DumpWriter::set_attribute(const std::string& key, const std::vector<int32_t>& values) {
  Impl& m = *impl_;
  if (m.file->finished()) m.fail("set_attribute('" + key + "') after finish()");
  if (is_format_attribute(key)) m.fail("attribute '" + key + "' is a format attribute");
  m.file->set_ints(key, values);
}

void DumpWriter::finish() { impl_->file->finish(); }

uint64_t DumpWriter::bytes_written() const { return impl_->file->bytes_written(); }

// ---------------------------------------------------------------------------------------------
// Reader

struct DumpReader::Impl {
  static constexpr int kMaxLayers = 4096;
  static constexpr int kMaxDim = 1 << 24;
  std::string path;
  uint64_t file_size = 0;
  Hid file;
  DumpMeta meta;
  std::map<int, std::vector<DatasetInfo>> steps;
  std::vector<std::string> int_attribute_names;

  [[noreturn]] void fail(const std::string& what, std::string_view dataset = {}) const {
    std::string msg = path + ": " + (dataset.empty() ? "" : "dataset '" + std::string(dataset) + "': ") + what;
    throw DumpError(msg + hdf5_detail());
  }

  Hid open_attr(hid_t obj, const char* name, std::string_view where) const {
    if (H5Aexists(obj, name) <= 0)
      fail(std::string("missing attribute '") + name + "'" + (where.empty() ? " (not a diffrun dump?)" : ""), where);
    Hid a(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
    if (!a.valid()) fail(std::string("cannot open attribute '") + name + "'", where);
    return a;
  }

  std::string read_str(hid_t obj, const char* name, std::string_view where = {}) const {
    Hid a = open_attr(obj, name, where);
    Hid ftype(H5Aget_type(a.get()), H5Tclose);
    if (H5Tget_class(ftype.get()) != H5T_STRING) fail(std::string("attribute '") + name + "' is not a string", where);
    Hid space(H5Aget_space(a.get()), H5Sclose);
    if (H5Sget_simple_extent_npoints(space.get()) != 1)
      fail(std::string("attribute '") + name + "' is not a scalar string", where);
    if (H5Tis_variable_str(ftype.get()) > 0) {
      Hid mtype(H5Tcopy(H5T_C_S1), H5Tclose);
      H5Tset_size(mtype.get(), H5T_VARIABLE);
      H5Tset_cset(mtype.get(), H5Tget_cset(ftype.get()));
      char* p = nullptr;
      if (H5Aread(a.get(), mtype.get(), &p) < 0) fail(std::string("cannot read attribute '") + name + "'", where);
      std::string s = p ? p : "";
      H5free_memory(p);
      return s;
    }
    std::string s(H5Tget_size(ftype.get()), '\0');
    if (H5Aread(a.get(), ftype.get(), s.data()) < 0) fail(std::string("cannot read attribute '") + name + "'", where);
    s.resize(std::min(s.size(), s.find('\0')));
    return s;
  }

  std::vector<int32_t> read_ints(hid_t obj, const char* name, std::string_view where = {}) const {
    Hid a = open_attr(obj, name, where);
    Hid ftype(H5Aget_type(a.get()), H5Tclose);
    Hid space(H5Aget_space(a.get()), H5Sclose);
    const hssize_t n = H5Sget_simple_extent_npoints(space.get());
    if (n < 0) fail(std::string("cannot size attribute '") + name + "'", where);
    std::vector<int32_t> v(static_cast<size_t>(n));
    if (H5Tget_class(ftype.get()) == H5T_ENUM) {
      // booleans: read the enum as stored, then convert its integer base type to int64 in place
      Hid base(H5Tget_super(ftype.get()), H5Tclose);
      std::vector<int64_t> buf(v.size());
      if (n > 0 && (H5Aread(a.get(), ftype.get(), buf.data()) < 0 ||
                    H5Tconvert(base.get(), H5T_NATIVE_INT64, v.size(), buf.data(), nullptr, H5P_DEFAULT) < 0))
        fail(std::string("cannot read attribute '") + name + "'", where);
      for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int32_t>(buf[i]);
      return v;
    }
    if (H5Tget_class(ftype.get()) != H5T_INTEGER && H5Tget_class(ftype.get()) != H5T_FLOAT)
      fail(std::string("attribute '") + name + "' is not numeric", where);
    if (n > 0 && H5Aread(a.get(), H5T_NATIVE_INT32, v.data()) < 0)
      fail(std::string("cannot read attribute '") + name + "' as int32", where);
    return v;
  }

  int read_int(hid_t obj, const char* name, std::string_view where = {}) const {
    auto v = read_ints(obj, name, where);
    if (v.size() != 1) fail(std::string("attribute '") + name + "' is not a scalar", where);
    return v[0];
  }

  double read_double(hid_t obj, const char* name) const {
    Hid a = open_attr(obj, name, {});
    double v = 0;
    if (H5Aread(a.get(), H5T_NATIVE_DOUBLE, &v) < 0) fail(std::string("cannot read attribute '") + name + "'");
    return v;
  }

  void read_meta() {
    const hid_t root = file.get();
    if (H5Aexists(root, "format") <= 0) fail("not a diffrun dump (no 'format' root attribute)");
    const std::string format = read_str(root, "format");
    if (format != kDumpFormat) fail("not a diffrun dump (format is '" + format + "', expected '" + kDumpFormat + "')");
    meta.format_version = read_int(root, "format_version");
    if (meta.format_version != kDumpFormatVersion)
      fail("format_version " + std::to_string(meta.format_version) + " is not supported (this diffrun reads version " +
           std::to_string(kDumpFormatVersion) + ")");
    meta.backend = read_str(root, "backend");
    meta.precision = read_str(root, "precision");
    meta.model_path = read_str(root, "model_path");
    meta.model_fingerprint = read_str(root, "model_fingerprint");
    ModelConfig& c = meta.config;
    const std::string arch = read_str(root, "arch");
    bool known = false;
    for (Arch a : {Arch::llama, Arch::qwen2, Arch::qwen3})
      if (arch == arch_name(a)) c.arch = a, known = true;
    if (!known) fail("unknown arch '" + arch + "'");
    c.n_layer = read_int(root, "n_layer");
    c.n_embd = read_int(root, "n_embd");
    c.n_head = read_int(root, "n_head");
    c.n_head_kv = read_int(root, "n_head_kv");
    c.head_dim = read_int(root, "head_dim");
    c.n_ff = read_int(root, "n_ff");
    c.n_vocab = read_int(root, "n_vocab");
    c.n_ctx = read_int(root, "n_ctx");
    c.rope_theta = read_double(root, "rope_theta");
    const std::string rope = read_str(root, "rope_type");
    if (rope == rope_type_name(RopeType::norm)) c.rope_type = RopeType::norm;
    else if (rope == rope_type_name(RopeType::neox)) c.rope_type = RopeType::neox;
    else fail("unknown rope_type '" + rope + "'");
    c.rms_eps = read_double(root, "rms_eps");
    c.tied_output = read_int(root, "tied_output") != 0;
    c.qkv_bias = read_int(root, "qkv_bias") != 0;
    c.qk_norm = read_int(root, "qk_norm") != 0;
    meta.prompt = read_str(root, "prompt");
    meta.token_ids = read_ints(root, "token_ids");
    meta.created_utc = read_str(root, "created_utc");
    meta.diffrun_version = read_str(root, "diffrun_version");
    check_config();

    // Other root attributes: strings are backend facts, integers are set_attribute() arrays.
    std::vector<std::string> names;
    H5Aiterate2(
        root, H5_INDEX_NAME, H5_ITER_INC, nullptr,
        [](hid_t, const char* name, const H5A_info_t*, void* out) -> herr_t {
          static_cast<std::vector<std::string>*>(out)->push_back(name);
          return 0;
        },
        &names);
    for (const auto& n : names) {
      if (reserved_root_attributes().count(n)) continue;
      Hid a(H5Aopen(root, n.c_str(), H5P_DEFAULT), H5Aclose);
      Hid t(H5Aget_type(a.get()), H5Tclose);
      const H5T_class_t cls = H5Tget_class(t.get());
      if (cls == H5T_STRING) meta.facts[n] = read_str(root, n.c_str());
      else if (cls == H5T_INTEGER) int_attribute_names.push_back(n);
    }
  }

  // Sizes everything downstream loops over or allocates by (a dump declaring n_layer = 2e9 once
  // drove compare to 21 GB): each must be positive and within what any real model needs.
  void check_config() const {
    const ModelConfig& c = meta.config;
    const std::pair<const char*, int> dims[] = {{"n_embd", c.n_embd}, {"n_head", c.n_head},
                                                {"n_head_kv", c.n_head_kv}, {"head_dim", c.head_dim},
                                                {"n_ff", c.n_ff}, {"n_vocab", c.n_vocab}, {"n_ctx", c.n_ctx}};
    if (c.n_layer < 1 || c.n_layer > kMaxLayers)
      fail("attribute 'n_layer' is " + std::to_string(c.n_layer) + ", outside 1.." + std::to_string(kMaxLayers));
    for (const auto& [name, v] : dims) {
      if (v < 1 || v > kMaxDim)
        fail(std::string("attribute '") + name + "' is " + std::to_string(v) + ", outside 1.." + std::to_string(kMaxDim));
    }
  }

  // A dataset must hold the bytes its shape declares, so a 230 KB file declaring 2 GB is refused
  // before anything is allocated: unfiltered storage at least the declared size, filtered
  // (compressed) storage at least 1/1100 of it (zlib's best ratio is about 1032:1), and never more
  // storage than the file has.
  void check_storage(hid_t ds, hid_t type, const std::vector<int64_t>& shape, const std::string& where) const {
    uint64_t declared = H5Tget_size(type);
    for (int64_t d : shape) {
      if (d != 0 && declared > UINT64_MAX / static_cast<uint64_t>(d)) fail("its shape overflows 64 bits", where);
      declared *= static_cast<uint64_t>(d);
    }
    if (declared == 0) return;
    Hid dcpl(H5Dget_create_plist(ds), H5Pclose);
    const bool filtered = dcpl.valid() && H5Pget_nfilters(dcpl.get()) > 0;
    const uint64_t stored = H5Dget_storage_size(ds);
    if (stored < (filtered ? declared / 1100 : declared) || stored > file_size) {
      fail("its shape declares " + std::to_string(declared) + " bytes but " + std::to_string(stored) +
               " bytes are stored (file size " + std::to_string(file_size) + "): the dataset lies about its size",
           where);
    }
  }

  void scan_steps() {
    std::vector<std::string> groups;
    if (H5Literate(
            file.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr,
            [](hid_t, const char* name, const H5L_info_t*, void* out) -> herr_t {
              static_cast<std::vector<std::string>*>(out)->push_back(name);
              return 0;
            },
            &groups) < 0)
      fail("cannot list the root group");
    for (const auto& gname : groups) {
      const int step = parse_step_group_name(gname);
      if (step < 0) continue;
      Hid g(H5Gopen2(file.get(), gname.c_str(), H5P_DEFAULT), H5Gclose);
      if (!g.valid()) fail("cannot open group '" + gname + "'");
      std::vector<std::string> names;
      if (H5Literate(
              g.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr,
              [](hid_t, const char* name, const H5L_info_t*, void* out) -> herr_t {
                static_cast<std::vector<std::string>*>(out)->push_back(name);
                return 0;
              },
              &names) < 0)
        fail("cannot list group '" + gname + "'");
      auto& infos = steps[step];
      for (const auto& name : names) {
        const std::string where = gname + "/" + name;
        Hid ds(H5Dopen2(g.get(), name.c_str(), H5P_DEFAULT), H5Dclose);
        if (!ds.valid()) fail("cannot open the dataset", where);
        DatasetInfo info;
        info.step = step;
        info.name = name;
        Hid space(H5Dget_space(ds.get()), H5Sclose);
        const int rank = H5Sget_simple_extent_ndims(space.get());
        if (rank < 0) fail("cannot read its shape", where);
        std::vector<hsize_t> dims(rank);
        H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
        info.shape.assign(dims.begin(), dims.end());
        Hid t(H5Dget_type(ds.get()), H5Tclose);
        const H5T_class_t cls = H5Tget_class(t.get());
        if (cls != H5T_FLOAT && cls != H5T_INTEGER) fail("not a numeric dataset", where);
        check_storage(ds.get(), t.get(), info.shape, where);
        info.is_int = cls == H5T_INTEGER;
        info.order = read_int(ds.get(), "order", where);
        info.layer = read_int(ds.get(), "layer", where);
        info.layout = read_str(ds.get(), "layout", where);
        info.native_dtype = read_str(ds.get(), "native_dtype", where);
        infos.push_back(std::move(info));
      }
      std::sort(infos.begin(), infos.end(), [](const DatasetInfo& a, const DatasetInfo& b) {
        return a.order != b.order ? a.order < b.order : a.name < b.name;
      });
    }
  }

  template <class T>
  std::vector<T> read_dataset(int step, const std::string& name, hid_t mem_type) const {
    const std::string where = step_group_name(step) + "/" + name;
    auto it = steps.find(step);
    const DatasetInfo* info = nullptr;
    if (it != steps.end())
      for (const auto& d : it->second)
        if (d.name == name) info = &d;
    if (!info) fail("no such dataset", where);
    size_t n = 1;
    for (int64_t d : info->shape) n *= static_cast<size_t>(d);
    std::vector<T> out(n);
    Hid ds(H5Dopen2(file.get(), ("/" + where).c_str(), H5P_DEFAULT), H5Dclose);
    if (!ds.valid()) fail("cannot open the dataset", where);
    if (n > 0 && H5Dread(ds.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()) < 0)
      fail("cannot read the data", where);
    return out;
  }
};

DumpReader::DumpReader(const std::string& path) : impl_(std::make_unique<Impl>()) {
  silence_hdf5();
  Impl& m = *impl_;
  m.path = path;
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
  return impl_->read_dataset<float>(step, name, H5T_NATIVE_FLOAT);
}

std::vector<int32_t> DumpReader::read_ids(int step, const std::string& name) const {
  const DatasetInfo* info = find(step, name);
  if (info && !info->is_int) impl_->fail("holds floats, not ids", step_group_name(step) + "/" + name);
  return impl_->read_dataset<int32_t>(step, name, H5T_NATIVE_INT32);
}

std::vector<int32_t> DumpReader::int_attribute(const std::string& key) const {
  const auto& names = impl_->int_attribute_names;
  if (std::find(names.begin(), names.end(), key) == names.end()) return {};
  return impl_->read_ints(impl_->file.get(), key.c_str());
}

const std::vector<std::string>& DumpReader::int_attribute_names() const { return impl_->int_attribute_names; }

}  // namespace diffrun
