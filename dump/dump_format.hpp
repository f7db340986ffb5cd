// The dump format's file layer (docs/dump-format.md): attribute table, HDF5 types and attribute reads, one dump file's writer.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "checkpoints/dump_schema.hpp"

namespace diffrun {

// The schema's format name and versions (test_dump_schema checks these constants against it).
inline constexpr const char* kDumpFormat = "diffrun-dump";
inline constexpr int kDumpFormatVersion = 2;      // what DumpFile writes
inline constexpr int kDumpFormatOldestVersion = 1;  // the oldest version readers still read
// Version 1 stored its strings variable-length, which HDF5 1.10 reads from the file's global heap,
// where a damaged file can make the library loop or crash (fuzz/README.md). Readers read a version-1
// dump, or any variable-length string, only when DIFFRUN_READ_V1=1 says its files are trusted.
bool version1_reads_allowed();
// The error for a version-1 dump (or variable-length string) read without DIFFRUN_READ_V1=1.
std::string version1_refused();
// Version 2: each step group's dataset attributes are one table, this compound dataset of the group.
inline constexpr const char* kAttributeTable = "_attributes";
// An integer column's value for "absent" (the dataset has no such attribute).
inline constexpr int32_t kAbsentInt = INT32_MIN;

// The format's root attributes in the schema's order (dump_schema.hpp); any other string attribute is a backend fact.
const std::vector<RootAttribute>& root_attributes();
const RootAttribute* find_root_attribute(std::string_view name);  // nullptr for facts and extras
const std::vector<std::string>& enum_values(const RootAttribute& a);  // its allowed strings; empty: any

// Dtype a dataset is stored in. f16 is IEEE half (h5py's float16), bf16 raw bits in uint16 with the
// dataset attribute dtype = "bf16".
enum class StoredDType { f32, f64, f16, bf16, i32 };
const char* stored_dtype_name(StoredDType d);  // "f32", "f64", "f16", "bf16", "i32"
size_t stored_dtype_size(StoredDType d);
std::optional<StoredDType> parse_stored_dtype(std::string_view name);

std::string dump_step_group_name(int step);           // 12 -> "step_0012"
int parse_dump_step_group_name(std::string_view name);  // "step_0012" -> 12; -1 for any other name

std::string utc_now_iso8601();  // "2026-11-23T05:05:01Z"

// The temporary a dump for `path` is written to before its rename: "<path>.diffrun-tmp-<pid>" (a
// name no other program's temporaries take, so that only diffrun's are ever removed as stale).
inline constexpr const char* kDumpTempInfix = ".diffrun-tmp-";
std::string dump_temporary_path(const std::string& path, long pid);
// A dump written over an existing one holds the old file open over its rename (which then frees nothing) and
// releases it after (DumpFile::finish), which frees it: release_replaced_dump closes the descriptor, at once, or
// once release_replaced_dumps_in_background() was called (diffrun-dump-child calls it) in a process of its own
// after the job it writes for has ended (at most a minute later), so that freeing a large old dump is not in the
// run's time.
void release_replaced_dumps_in_background();
void release_replaced_dump(int fd);
// The pid of a file name "<name>.diffrun-tmp-<digits>", or -1 for any other name.
long dump_temporary_pid(std::string_view file_name);

namespace h5 {

// Turns HDF5's automatic error printing off (errors become DumpError messages instead).
void silence();
// HDF5's innermost error message as " (HDF5: ...)", or "" when none; clears the error stack.
std::string detail();

// An HDF5 identifier closed on scope exit.
class Hid {
 public:
  Hid() = default;
  Hid(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  Hid(Hid&& o) noexcept : id_(std::exchange(o.id_, H5I_INVALID_HID)), close_(o.close_) {}
  Hid& operator=(Hid&& o) noexcept {
    reset();
    id_ = std::exchange(o.id_, H5I_INVALID_HID);
    close_ = o.close_;
    return *this;
  }
  ~Hid() { reset(); }
  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  void reset() {
    if (id_ >= 0 && close_) close_(id_);
    id_ = H5I_INVALID_HID;
  }
  // Closes now and reports whether the close succeeded (file closes flush data).
  bool close() {
    herr_t rc = (id_ >= 0 && close_) ? close_(id_) : 0;
    id_ = H5I_INVALID_HID;
    return rc >= 0;
  }

 private:
  hid_t id_ = H5I_INVALID_HID;
  herr_t (*close_)(hid_t) = nullptr;
};

// A fixed-length UTF-8 string type of max(1, n) bytes, NUL-padded (h5py reads it as bytes).
Hid fixed_string_type(size_t n);
hid_t bool_type();     // h5py's bool: enum of int8 {FALSE = 0, TRUE = 1}
hid_t float16_type();  // IEEE half, as h5py writes numpy.float16

// The one reader of HDF5 attributes (root attributes; version-1 dataset attributes) for DumpReader, the validator
// and the C API; python/diffrun/attributes.py is its Python twin.
// What one attribute is, without reading it.
struct AttrShape {
  bool exists = false;    // H5Aexists
  bool readable = false;  // exists and opens
  H5T_class_t cls = H5T_NO_CLASS;
  size_t size = 0;
  bool is_signed = true;
  int rank = 0;
  hssize_t n = 0;
  bool vlen = false;  // a variable-length string
};
AttrShape inspect_attribute(hid_t obj, const char* name);
// "an integer", "a string", ... for a type class.
const char* class_text(H5T_class_t c);
// A string attribute's value (up to its first NUL); a variable-length one only when `vlen_ok` (format version
// 1 read with DIFFRUN_READ_V1=1): from version 2 on the type is checked before anything is read (HDF5 1.10
// crashes on some damaged global heaps, found by fuzz_dump). nullopt when it is not one string or fails to read.
// Each reader sets `why` (when given) to HDF5's message of a failed read, as detail() gives it.
std::optional<std::string> read_string_attribute(hid_t obj, const char* name, bool vlen_ok, std::string* why = nullptr);
// Integer attribute values as int64 (an enum over integers, h5py's bool, as its integers; with `floats`, a
// float attribute converted by HDF5); nullopt for another class or a failed read.
std::optional<std::vector<int64_t>> read_int_attribute(hid_t obj, const char* name, bool floats = false,
                                                       std::string* why = nullptr);
// A scalar read as a double (nullopt for an attribute of another number of values).
std::optional<double> read_real_attribute(hid_t obj, const char* name, std::string* why = nullptr);
// The names of an object's attributes, in name order.
std::vector<std::string> attribute_names(hid_t obj);

}  // namespace h5

// Attributes of one dataset; an empty optional or string is not written.
struct DatasetAttributes {
  std::optional<int> order;
  std::optional<int> layer;
  std::string layout;
  std::string native_dtype;
  std::optional<int> row_offset;  // kq_soft_max holding its rows from this one on (--softmax-rows)
  // A rank dump's shard (docs/dump-format.md, "Shards"): the layout letter it is split along ("": replicated), its
  // first index along it, and 1 where the values are partial sums that the ranks' all-reduce adds up.
  std::string split;
  std::optional<int> shard_offset;
  std::optional<int> partial;
};

// One row of a step's attribute table (format version 2): the attributes of the dataset `name`.
struct AttributeRow {
  std::string name;
  DatasetAttributes attrs;
  std::string dtype;  // "bf16" on uint16 data holding bfloat16 bits, else ""
};

// What readers refuse (docs/dump-format.md, "What readers refuse"): a dump holds its data itself.
// Why the link `name` of `group` must not be followed, or "" for a hard link: a soft, external or
// user-defined link, asked with H5Lget_info, which reads the link and never its target (an external
// link to a FIFO would block the open; one to another file would read that file as the dump's).
std::string link_refusal(hid_t group, const std::string& name);
// Why the data of an open dataset must not be read, or "": HDF5 external storage (its bytes in
// another file, e.g. /etc/passwd) or a virtual dataset (its data in other datasets or files).
std::string storage_refusal(hid_t dataset);

// What a reader reads of one dataset (docs/dump-format.md, "What readers refuse"): its declared bytes
// must be stored (unfiltered: all of them; filtered: at least 1/kMaxCompressionRatio of them, a ratio
// no real dump reaches, while a compression bomb of zeros reaches about 1000:1; checked above 1 MiB),
// never more than the file holds, and the dataset read as float32 (`presented_bytes`) must fit dataset_read_limit().
inline constexpr uint64_t kMaxCompressionRatio = 256;
// DIFFRUN_MAX_DATASET_MB (MiB) when set to a positive integer, else 4096 (4 GiB).
uint64_t dataset_read_limit();
// Why the dataset must not be read, or "" (the text names sizes, not the file or dataset).
std::string size_refusal(hid_t dataset, uint64_t declared_bytes, uint64_t presented_bytes, uint64_t file_size);

// Reads a step group's attribute table (docs/dump-format.md, "Attribute table"). Checks the table's
// types before reading anything: a 1-D compound dataset with a fixed-length string column `name`,
// optional fixed-length string columns layout, native_dtype, dtype and integer columns order,
// layer, row_offset (kAbsentInt: absent); other columns are ignored. Its bytes must be stored
// (at most `file_size`). Throws DumpError("<group>/_attributes: what is wrong") otherwise, and for
// a name given twice. Returns no rows when the group has no table.
std::vector<AttributeRow> read_attribute_table(hid_t group, const std::string& group_name, uint64_t file_size);

// Writes one dump file: root attributes, /step_NNNN groups, one dataset per checkpoint. Knows the
// file format, not the vocabulary (callers check names and shapes). Writes to
// dump_temporary_path(path, pid), created exclusively (never through an existing name: a symlink
// planted there is refused, not followed; a regular file there is a killed run's leftover, since no
// live process has this pid, and is replaced), and renames to `path` in finish(); abort() or
// destroying an unfinished DumpFile removes the temporary file. An existing `path` that is not a
// regular file (a device, a FIFO, a directory, a socket) is refused, never replaced. Every failure
// throws DumpError naming the file (and dataset).
class DumpFile {
 public:
  // tmp_pid > 0 names the temporary with that pid (a writer process working for that one).
  explicit DumpFile(const std::string& path, long tmp_pid = 0);
  ~DumpFile();
  DumpFile(const DumpFile&) = delete;
  DumpFile& operator=(const DumpFile&) = delete;

  const std::string& path() const;
  const std::string& tmp_path() const;

  // Root attributes; setting one again replaces it.
  void set_string(const std::string& name, const std::string& value);
  void set_int(const std::string& name, int32_t value);
  void set_real(const std::string& name, double value);
  void set_bool(const std::string& name, bool value);
  void set_ints(const std::string& name, std::span<const int32_t> values);
  bool has_attribute(const std::string& name) const;
  void remove_attribute(const std::string& name);
  // Copies the root attributes of another dump (any HDF5 file) for which keep(name) is true, as
  // they are stored there, replacing ours of the same name. Returns the names copied.
  std::vector<std::string> copy_attributes(const std::string& source_path,
                                           const std::function<bool(std::string_view)>& keep);

  // Creates /step_NNNN/name with `shape` from `data` (host values of `type`; bf16 and f16 as their
  // 16-bit patterns); its attributes (plus dtype = "bf16" for bf16) go to the step's attribute
  // table, written by finish(). Throws when the dataset exists or the name is the table's.
  // `data` is copied before this returns; the bytes of a contiguous dataset reach the file from a
  // writer thread, so a failure to write them (a full disk) is thrown by a later write() or finish().
  void write(int step, std::string_view name, StoredDType type, std::span<const int64_t> shape, const void* data,
             const DatasetAttributes& attrs);
  bool has_dataset(int step, std::string_view name) const;
  // 1..9: float datasets written from now on of at least 1024 values are chunked (about 1 MiB a
  // chunk, whole rows of the first dimension), byte-shuffled and gzip-compressed at this level:
  // HDF5's built-in filters, which h5py reads with no plugin. 0 (the default): contiguous.
  void set_compression(int level);

  void finish();  // writes the attribute tables, closes and renames; throws when any fails
  void abort();   // closes and removes the temporary file; never throws
  bool finished() const;
  uint64_t bytes_written() const;
  hid_t hdf5_file() const;  // the open file (for checks that read back what was written)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace diffrun
