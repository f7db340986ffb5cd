// The dump format's file layer on the HDF5 1.10 C API: the root-attribute table and DumpFile, the one writer of dump files.
// Strings are scalar fixed-length UTF-8, sized to the value (h5py reads them as bytes); a step's
// dataset attributes are one compound table per step group (format version 2); booleans are h5py's enum
// {FALSE=0, TRUE=1} over int8 (h5py reads numpy.bool_); float16 is h5py's half type. Datasets are
// contiguous, uncompressed (or chunked with shuffle + deflate, set_compression), without fill values
// or timestamps.
#include "dump/dump_format.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <map>
#include <set>

#include "model/error.hpp"
#include "model/file_check.hpp"

namespace diffrun {

const std::vector<RootAttribute>& root_attributes() { return dump_schema().root; }

const RootAttribute* find_root_attribute(std::string_view name) {
  for (const auto& a : root_attributes())
    if (name == a.name) return &a;
  return nullptr;
}

const std::vector<std::string>& enum_values(const RootAttribute& a) { return a.values; }

const char* stored_dtype_name(StoredDType d) {
  switch (d) {
    case StoredDType::f32: return "f32";
    case StoredDType::f64: return "f64";
    case StoredDType::f16: return "f16";
    case StoredDType::bf16: return "bf16";
    case StoredDType::i32: return "i32";
  }
  return "?";
}

size_t stored_dtype_size(StoredDType d) {
  switch (d) {
    case StoredDType::f64: return 8;
    case StoredDType::f16:
    case StoredDType::bf16: return 2;
    default: return 4;
  }
}

std::optional<StoredDType> parse_stored_dtype(std::string_view name) {
  for (StoredDType d : {StoredDType::f32, StoredDType::f64, StoredDType::f16, StoredDType::bf16, StoredDType::i32})
    if (name == stored_dtype_name(d)) return d;
  return std::nullopt;
}

bool version1_reads_allowed() {
  const char* v = std::getenv("DIFFRUN_READ_V1");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

std::string version1_refused() {
  return "format version 1 stores variable-length strings, which HDF5 1.10 can loop or crash on when the file is "
         "damaged; set DIFFRUN_READ_V1=1 to read a version-1 dump you trust (docs/dump-format.md, \"Versioning\")";
}

std::string dump_step_group_name(int step) {
  std::array<char, 32> buf{};
  std::snprintf(buf.data(), buf.size(), "step_%04d", step);
  return buf.data();
}

int parse_dump_step_group_name(std::string_view name) {
  constexpr std::string_view prefix = "step_";
  if (name.size() <= prefix.size() || name.substr(0, prefix.size()) != prefix) return -1;
  int step = 0;
  for (char c : name.substr(prefix.size())) {
    if (c < '0' || c > '9' || step > 100000000) return -1;
    step = step * 10 + (c - '0');
  }
  return step;
}

std::string utc_now_iso8601() {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  std::array<char, 32> buf{};
  std::strftime(buf.data(), buf.size(), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf.data();
}

namespace {

std::atomic<bool> g_release_replaced_in_background{false};

// Waits until process `pid` has ended or `limit_s` seconds have passed. Only async-signal-safe calls (a forked
// child of a process with threads runs it).
void wait_for_end(pid_t pid, int limit_s) {
#if defined(SYS_pidfd_open)
  if (const int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); fd >= 0) {
    pollfd p{fd, POLLIN, 0};
    while (::poll(&p, 1, limit_s * 1000) < 0 && errno == EINTR) {
    }
    ::close(fd);
    return;
  }
#endif
  for (int i = 0; i < limit_s * 20 && (::kill(pid, 0) == 0 || errno == EPERM); ++i) {
    const timespec tick{0, 50'000'000};
    ::nanosleep(&tick, nullptr);
  }
}

}  // namespace

void release_replaced_dumps_in_background() { g_release_replaced_in_background = true; }

void release_replaced_dump(int fd) {
  if (!g_release_replaced_in_background) {
    ::close(fd);
    return;
  }
  // A grandchild holds the descriptor and ends; this process waits only for the child between, which ends at once.
  // The grandchild closes every other descriptor first (so that nobody waits on a pipe or socket it inherited) and
  // closes this one, which frees the old dump, only once the job this dump child writes for (its parent) has ended,
  // at most kReplacedWaitSeconds later, at the lowest CPU and I/O priority: freeing a large file's blocks and pages
  // while the job still wrote its other dumps held them back (bench/NOTES.md). A grandchild killed on the way frees it
  // as it ends. Only async-signal-safe calls after the fork (this process may have other threads).
  constexpr int kReplacedWaitSeconds = 60;
  const pid_t job = ::getppid();
  const pid_t child = ::fork();
  if (child == 0) {
    if (::fork() == 0) {
      for (int other = 0; other < 1024; ++other)
        if (other != fd) ::close(other);
      if (job > 1) wait_for_end(job, kReplacedWaitSeconds);
      ::setpriority(PRIO_PROCESS, 0, 19);
#if defined(SYS_ioprio_set)
      constexpr int kIoprioWhoProcess = 1, kIoprioClassIdle = 3, kIoprioClassShift = 13;
      ::syscall(SYS_ioprio_set, kIoprioWhoProcess, 0, kIoprioClassIdle << kIoprioClassShift);
#endif
      ::close(fd);
    }
    ::_exit(0);
  }
  ::close(fd);  // the grandchild has its own
  if (child < 0) return;
  int status = 0;
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
}

std::string dump_temporary_path(const std::string& path, long pid) {
  return path + kDumpTempInfix + std::to_string(pid);
}

long dump_temporary_pid(std::string_view file_name) {
  const size_t at = file_name.rfind(kDumpTempInfix);
  const size_t from = at == std::string_view::npos ? 0 : at + std::strlen(kDumpTempInfix);
  if (at == std::string_view::npos || at == 0 || from == file_name.size()) return -1;
  long pid = 0;
  for (size_t i = from; i < file_name.size(); ++i) {
    if (file_name[i] < '0' || file_name[i] > '9' || pid > 1'000'000'000) return -1;
    pid = pid * 10 + (file_name[i] - '0');
  }
  return pid;
}

namespace {

// What an existing non-regular file is ("a character device"), or "" for a regular file or none.
std::string non_regular_kind(const struct stat& st) {
  if (S_ISREG(st.st_mode)) return {};
  if (S_ISDIR(st.st_mode)) return "a directory";
  if (S_ISFIFO(st.st_mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(st.st_mode)) return "a character device";
  if (S_ISBLK(st.st_mode)) return "a block device";
  if (S_ISSOCK(st.st_mode)) return "a socket";
  if (S_ISLNK(st.st_mode)) return "a symbolic link";
  return "not a regular file";
}

}  // namespace

namespace h5 {

void silence() {
  // Before anything initializes the library: no exit-time cleanup. HDF5 cannot recover from a file
  // close that failed (a full disk): the file stays registered half-closed, and the cleanup that
  // H5_term_library runs at exit crashes on it (exit 139 after the right "No space left on
  // device" error). diffrun closes every file it opens itself. When the process used HDF5 before
  // (a C API host), this fails harmlessly and the host's setting stays.
  static const bool once = [] {
    H5dont_atexit();
    return true;
  }();
  (void)once;
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}

std::string detail() {
  std::string d;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_DOWNWARD,
      [](unsigned, const H5E_error2_t* e, void* out) -> herr_t {
        if (e->desc && *e->desc) *static_cast<std::string*>(out) = e->desc;
        return 0;
      },
      &d);
  H5Eclear2(H5E_DEFAULT);
  // A failed system call is described over several lines (time, descriptor, buffer address...):
  // keep its first words and the system's message ("file write failed: No space left on device").
  if (const size_t at = d.find("error message = '"); at != std::string::npos) {
    const size_t begin = at + 17, end = d.find('\'', begin);
    d = d.substr(0, std::min(d.find(':'), d.size())) + ": " + d.substr(begin, end == std::string::npos ? end : end - begin);
  }
  for (char& c : d)
    if (c == '\n' || c == '\r') c = ' ';
  return d.empty() ? std::string() : " (HDF5: " + d + ")";
}

namespace {

struct Types {
  Hid boolean, half;
  Types() {
    boolean = Hid(H5Tenum_create(H5T_NATIVE_INT8), H5Tclose);
    int8_t f = 0, t = 1;
    H5Tenum_insert(boolean.get(), "FALSE", &f);
    H5Tenum_insert(boolean.get(), "TRUE", &t);
    // h5py's float16, step by step as h5py builds it (h5t.pyx)
    half = Hid(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
    H5Tset_fields(half.get(), 15, 10, 5, 0, 10);
    H5Tset_size(half.get(), 2);
    H5Tset_ebias(half.get(), 15);
  }
};

const Types& types() {
  static const Types t;
  return t;
}

}  // namespace

hid_t bool_type() { return types().boolean.get(); }
hid_t float16_type() { return types().half.get(); }

Hid fixed_string_type(size_t n) {
  Hid t(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(t.get(), std::max<size_t>(n, 1));
  H5Tset_cset(t.get(), H5T_CSET_UTF8);
  H5Tset_strpad(t.get(), H5T_STR_NULLPAD);
  return t;
}

AttrShape inspect_attribute(hid_t obj, const char* name) {
  AttrShape s;
  s.exists = H5Aexists(obj, name) > 0;
  if (!s.exists) return s;
  Hid a(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  if (!a.valid()) return s;
  s.readable = true;
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

namespace {

// Sets *why to HDF5's message of the failure that just happened (before any other HDF5 call clears it).
template <typename T>
std::optional<T> failed(std::string* why) {
  const std::string d = detail();
  if (why) *why = d;
  return std::nullopt;
}

}  // namespace

std::optional<std::string> read_string_attribute(hid_t obj, const char* name, bool vlen_ok, std::string* why) {
  Hid a(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  if (!a.valid()) return failed<std::string>(why);
  Hid ftype(H5Aget_type(a.get()), H5Tclose);
  Hid space(H5Aget_space(a.get()), H5Sclose);
  if (H5Tget_class(ftype.get()) != H5T_STRING || H5Sget_simple_extent_npoints(space.get()) != 1) return std::nullopt;
  const htri_t vlen = H5Tis_variable_str(ftype.get());
  if (vlen < 0) return failed<std::string>(why);
  if (vlen > 0 && !vlen_ok) return std::nullopt;
  if (vlen > 0) {
    Hid mtype(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(mtype.get(), H5T_VARIABLE);
    H5Tset_cset(mtype.get(), H5Tget_cset(ftype.get()));
    char* p = nullptr;
    if (H5Aread(a.get(), mtype.get(), &p) < 0) return failed<std::string>(why);
    std::string s = p ? p : "";
    H5free_memory(p);
    return s;
  }
  std::string s(H5Tget_size(ftype.get()), '\0');
  if (H5Aread(a.get(), ftype.get(), s.data()) < 0) return failed<std::string>(why);
  s.resize(std::min(s.size(), s.find('\0')));
  return s;
}

std::optional<std::vector<int64_t>> read_int_attribute(hid_t obj, const char* name, bool floats, std::string* why) {
  using Ints = std::vector<int64_t>;
  Hid a(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  if (!a.valid()) return failed<Ints>(why);
  Hid ftype(H5Aget_type(a.get()), H5Tclose);
  Hid space(H5Aget_space(a.get()), H5Sclose);
  const hssize_t n = H5Sget_simple_extent_npoints(space.get());
  if (n < 0) return failed<Ints>(why);
  Ints v(static_cast<size_t>(n));
  if (n == 0) return v;
  const H5T_class_t cls = H5Tget_class(ftype.get());
  if (cls == H5T_ENUM) {
    // read the enum as stored, then convert its integer base type to int64 in place
    Hid base(H5Tget_super(ftype.get()), H5Tclose);
    if (H5Aread(a.get(), ftype.get(), v.data()) < 0 ||
        H5Tconvert(base.get(), H5T_NATIVE_INT64, v.size(), v.data(), nullptr, H5P_DEFAULT) < 0)
      return failed<Ints>(why);
    return v;
  }
  if (cls != H5T_INTEGER && !(floats && cls == H5T_FLOAT)) return std::nullopt;
  if (H5Aread(a.get(), H5T_NATIVE_INT64, v.data()) < 0) return failed<Ints>(why);
  return v;
}

std::optional<double> read_real_attribute(hid_t obj, const char* name, std::string* why) {
  Hid a(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  if (!a.valid()) return failed<double>(why);
  Hid space(H5Aget_space(a.get()), H5Sclose);
  if (H5Sget_simple_extent_npoints(space.get()) != 1) return std::nullopt;  // one value read into one double
  double v = 0;
  if (H5Aread(a.get(), H5T_NATIVE_DOUBLE, &v) < 0) return failed<double>(why);
  return v;
}

std::vector<std::string> attribute_names(hid_t obj) {
  std::vector<std::string> names;
  H5Aiterate2(
      obj, H5_INDEX_NAME, H5_ITER_INC, nullptr,
      [](hid_t, const char* name, const H5A_info_t*, void* out) -> herr_t {
        static_cast<std::vector<std::string>*>(out)->push_back(name);
        return 0;
      },
      &names);
  return names;
}

}  // namespace h5

using h5::Hid;

std::string link_refusal(hid_t group, const std::string& name) {
  H5L_info_t info{};
  if (H5Lget_info(group, name.c_str(), &info, H5P_DEFAULT) < 0) return "cannot be read as a link" + h5::detail();
  if (info.type == H5L_TYPE_HARD) return {};
  if (info.type == H5L_TYPE_SOFT) {
    std::string target(info.u.val_size + 1, '\0');
    if (H5Lget_val(group, name.c_str(), target.data(), target.size(), H5P_DEFAULT) < 0) target.clear();
    target.resize(strnlen(target.data(), target.size()));
    return "is a soft link (to " + printable(target) + "); a dump holds no links, readers refuse them";
  }
  if (info.type == H5L_TYPE_EXTERNAL) {
    std::string what = "is an external link";
    std::vector<char> buf(info.u.val_size + 1, '\0');
    const char *file = nullptr, *object = nullptr;
    unsigned flags = 0;
    if (H5Lget_val(group, name.c_str(), buf.data(), buf.size(), H5P_DEFAULT) >= 0 &&
        H5Lunpack_elink_val(buf.data(), buf.size(), &flags, &file, &object) >= 0 && file && object)
      what += " (to " + printable(file) + ", object " + printable(object) + ")";
    h5::detail();
    return what + ": a dump holds its data itself, readers refuse links to other files";
  }
  return "is a user-defined link (type " + std::to_string(static_cast<int>(info.type)) +
         "); a dump holds no links, readers refuse them";
}

std::string storage_refusal(hid_t dataset) {
  Hid dcpl(H5Dget_create_plist(dataset), H5Pclose);
  if (!dcpl.valid()) return "its storage cannot be read" + h5::detail();
  if (const int n = H5Pget_external_count(dcpl.get()); n != 0) {
    std::string file;
    if (n > 0) {
      char name[1024] = {};
      off_t offset = 0;
      hsize_t size = 0;
      if (H5Pget_external(dcpl.get(), 0, sizeof name, name, &offset, &size) >= 0) file = name;
    }
    h5::detail();
    return "stores its data in " + (file.empty() ? std::string("another file") : "the external file " + printable(file)) +
           " (HDF5 external storage): a dump holds its data itself, readers refuse it";
  }
  if (H5Pget_layout(dcpl.get()) == H5D_VIRTUAL)
    return "is a virtual dataset (its data lives in other datasets or files): a dump holds its data itself, "
           "readers refuse it";
  return {};
}

uint64_t dataset_read_limit() {
  if (const char* v = std::getenv("DIFFRUN_MAX_DATASET_MB"); v && *v) {
    char* end = nullptr;
    const unsigned long long mb = std::strtoull(v, &end, 10);
    if (end && *end == '\0' && mb > 0 && mb < (uint64_t(1) << 44)) return mb << 20;
  }
  return uint64_t(4096) << 20;
}

std::string size_refusal(hid_t dataset, uint64_t declared, uint64_t presented, uint64_t file_size) {
  if (declared == 0) return {};
  Hid dcpl(H5Dget_create_plist(dataset), H5Pclose);
  const bool filtered = dcpl.valid() && H5Pget_nfilters(dcpl.get()) > 0;
  const uint64_t stored = H5Dget_storage_size(dataset);
  h5::detail();
  if (stored > file_size || (!filtered && stored < declared))
    return "its shape declares " + std::to_string(declared) + " bytes but " + std::to_string(stored) +
           " bytes are stored (file size " + std::to_string(file_size) + "): the dataset lies about its size";
  // (a dataset of at most 1 MiB costs nothing to read, whatever its ratio: a small one of zeros may
  // compress beyond it)
  if (filtered && declared > (uint64_t(1) << 20) && stored < declared / kMaxCompressionRatio)
    return "its shape declares " + std::to_string(declared) + " bytes but only " + std::to_string(stored) +
           " bytes are stored, compressed " + std::to_string(declared / std::max<uint64_t>(stored, 1)) +
           ":1; no real dump compresses beyond " + std::to_string(kMaxCompressionRatio) +
           ":1 (a compression bomb?), refused before anything is read";
  const uint64_t limit = dataset_read_limit();
  if (presented > limit)
    return "reading it takes " + std::to_string(presented >> 20) + " MiB, more than the limit of " +
           std::to_string(limit >> 20) + " MiB per dataset (DIFFRUN_MAX_DATASET_MB raises it)";
  return {};
}

std::vector<AttributeRow> read_attribute_table(hid_t group, const std::string& group_name, uint64_t file_size) {
  const std::string where = group_name + "/" + kAttributeTable;
  auto fail = [&](const std::string& what) -> void { throw DumpError(where + ": " + what + h5::detail()); };
  std::vector<AttributeRow> rows;
  if (H5Lexists(group, kAttributeTable, H5P_DEFAULT) <= 0) return rows;
  if (const std::string refused = link_refusal(group, kAttributeTable); !refused.empty()) fail(refused);
  H5O_info_t oinfo;
  if (H5Oget_info_by_name(group, kAttributeTable, &oinfo, H5P_DEFAULT) < 0 || oinfo.type != H5O_TYPE_DATASET)
    fail("is not a dataset (the attribute table is a compound dataset)");
  Hid ds(H5Dopen2(group, kAttributeTable, H5P_DEFAULT), H5Dclose);
  if (!ds.valid()) fail("cannot be opened");
  if (const std::string refused = storage_refusal(ds.get()); !refused.empty()) fail(refused);
  Hid type(H5Dget_type(ds.get()), H5Tclose);
  if (H5Tget_class(type.get()) != H5T_COMPOUND) fail("is not a compound dataset (one row per dataset of the step)");
  Hid space(H5Dget_space(ds.get()), H5Sclose);
  if (H5Sget_simple_extent_ndims(space.get()) != 1) fail("is not one-dimensional (one row per dataset of the step)");
  hsize_t n = 0;
  H5Sget_simple_extent_dims(space.get(), &n, nullptr);
  // The bytes the table declares must be stored (a damaged header declaring 2^40 rows is refused
  // before anything is allocated).
  const size_t row_size = H5Tget_size(type.get());
  if (row_size == 0 || n > (uint64_t(64) << 20) / row_size) fail("declares " + std::to_string(n) + " rows of " + std::to_string(row_size) + " bytes: more than 64 MiB");
  const uint64_t declared = n * row_size;
  if (const std::string refused = size_refusal(ds.get(), declared, declared, file_size); !refused.empty()) fail(refused);
  rows.resize(n);
  if (n == 0) return rows;

  // The table is read once as stored, with the file's own type as the memory type: HDF5 converts
  // nothing (a compound conversion of a damaged file type was a use-after-free inside HDF5 1.10,
  // found by fuzz_dump), and each known column is decoded here from the row bytes after its member's
  // type, offset and size were checked. Variable-length members are refused unread (they would be
  // converted, from the global heap).
  const int members = H5Tget_nmembers(type.get());
  if (members < 0) fail("cannot list its columns");
  struct Column {
    Hid type;
    size_t offset = 0;
  };
  std::function<bool(hid_t)> variable = [&](hid_t t) -> bool {
    const H5T_class_t cls = H5Tget_class(t);
    if (cls == H5T_VLEN || cls == H5T_REFERENCE || cls == H5T_NO_CLASS || cls < 0) return true;
    if (cls == H5T_STRING) return H5Tis_variable_str(t) != 0;
    if (cls == H5T_ARRAY || cls == H5T_ENUM) {
      Hid base(H5Tget_super(t), H5Tclose);
      return !base.valid() || variable(base.get());
    }
    if (cls == H5T_COMPOUND) {
      const int k = H5Tget_nmembers(t);
      if (k < 0) return true;
      for (int i = 0; i < k; ++i) {
        Hid m(H5Tget_member_type(t, static_cast<unsigned>(i)), H5Tclose);
        if (!m.valid() || variable(m.get())) return true;
      }
    }
    return false;
  };
  std::map<std::string, Column> columns;
  for (int i = 0; i < members; ++i) {
    char* mname = H5Tget_member_name(type.get(), static_cast<unsigned>(i));
    const std::string col = mname ? std::string(mname) : std::string();
    H5free_memory(mname);
    Hid mt(H5Tget_member_type(type.get(), static_cast<unsigned>(i)), H5Tclose);
    if (!mt.valid()) fail("cannot read the type of its column " + std::to_string(i));
    if (H5Tget_class(mt.get()) == H5T_STRING && H5Tis_variable_str(mt.get()) != 0)
      fail("column '" + printable(col) + "' is a variable-length string (format version 2 stores fixed-length strings)");
    if (variable(mt.get()))
      fail("column '" + printable(col) + "' holds variable-length data (format version 2 stores fixed-length strings and integers)");
    const size_t offset = H5Tget_member_offset(type.get(), static_cast<unsigned>(i));
    const size_t size = H5Tget_size(mt.get());
    if (size == 0 || offset > row_size || size > row_size - offset)
      fail("column '" + printable(col) + "' lies outside its " + std::to_string(row_size) + "-byte rows");
    columns[col] = Column{std::move(mt), offset};
  }
  std::vector<unsigned char> raw(n * row_size);
  if (H5Dread(ds.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, raw.data()) < 0) fail("cannot be read");
  auto strings = [&](const char* col, bool required, auto set) {
    const auto it = columns.find(col);
    if (it == columns.end()) {
      if (required) fail(std::string("has no column '") + col + "'");
      return;
    }
    const hid_t t = it->second.type.get();
    if (H5Tget_class(t) != H5T_STRING) fail(std::string("column '") + col + "' is not a string");
    const size_t size = H5Tget_size(t);
    if (size > 65536) fail(std::string("column '") + col + "' has strings of " + std::to_string(size) + " bytes");
    for (hsize_t i = 0; i < n; ++i) {
      const char* p = reinterpret_cast<const char*>(raw.data() + i * row_size + it->second.offset);
      std::string v(p, strnlen(p, size));
      if (H5Tget_strpad(t) == H5T_STR_SPACEPAD) v.erase(v.find_last_not_of(' ') + 1);
      set(rows[i], std::move(v));
    }
  };
  auto ints = [&](const char* col, auto set) {
    const auto it = columns.find(col);
    if (it == columns.end()) return;
    const hid_t t = it->second.type.get();
    const size_t size = H5Tget_size(t);
    const H5T_order_t order = H5Tget_order(t);
    if (H5Tget_class(t) != H5T_INTEGER || (size != 1 && size != 2 && size != 4 && size != 8) ||
        (order != H5T_ORDER_LE && order != H5T_ORDER_BE) || H5Tget_precision(t) != 8 * size || H5Tget_offset(t) != 0)
      fail(std::string("column '") + col + "' is not an integer of 1, 2, 4 or 8 bytes");
    const bool is_signed = H5Tget_sign(t) == H5T_SGN_2;
    for (hsize_t i = 0; i < n; ++i) {
      const unsigned char* p = raw.data() + i * row_size + it->second.offset;
      uint64_t bits = 0;
      for (size_t b = 0; b < size; ++b) bits |= uint64_t(p[order == H5T_ORDER_LE ? b : size - 1 - b]) << (8 * b);
      int64_t v = static_cast<int64_t>(bits);
      if (is_signed && size < 8 && (bits >> (8 * size - 1)) & 1) v = static_cast<int64_t>(bits | (~uint64_t(0) << (8 * size)));
      if (!is_signed && size == 8 && bits > uint64_t(INT64_MAX)) v = INT64_MAX;
      if (v == kAbsentInt) continue;
      if (v < INT32_MIN || v > INT32_MAX)
        fail(std::string("column '") + col + "' holds " + std::to_string(v) + ", outside int32");
      set(rows[i], static_cast<int>(v));
    }
  };
  strings("name", true, [](AttributeRow& r, std::string v) { r.name = std::move(v); });
  strings(column::layout, false, [](AttributeRow& r, std::string v) { r.attrs.layout = std::move(v); });
  strings(column::native_dtype, false, [](AttributeRow& r, std::string v) { r.attrs.native_dtype = std::move(v); });
  strings(column::dtype, false, [](AttributeRow& r, std::string v) { r.dtype = std::move(v); });
  ints(column::order, [](AttributeRow& r, int v) { r.attrs.order = v; });
  ints(column::layer, [](AttributeRow& r, int v) { r.attrs.layer = v; });
  ints(column::row_offset, [](AttributeRow& r, int v) { r.attrs.row_offset = v; });
  strings(column::split, false, [](AttributeRow& r, std::string v) { r.attrs.split = std::move(v); });
  ints(column::shard_offset, [](AttributeRow& r, int v) { r.attrs.shard_offset = v; });
  ints(column::partial, [](AttributeRow& r, int v) { r.attrs.partial = v; });
  std::set<std::string_view> seen;
  for (const auto& r : rows) {
    if (r.name.empty()) fail("a row without a name");
    if (!seen.insert(r.name).second) fail("names '" + printable(r.name) + "' twice");
  }
  return rows;
}

namespace {

// The raw data of contiguous datasets, written by a thread with pwrite at the offset HDF5 allocated
// for it (H5Dget_offset), so that the thread calling DumpFile::write spends its time on HDF5's
// metadata alone and the two overlap. HDF5 never reads or writes these bytes itself (no fill
// values, no H5Dwrite). put() copies the data (the caller's buffer is free when it returns) into a
// reused buffer and waits while more than kMaxQueued bytes are on their way.
class DataWriter {
 public:
  explicit DataWriter(int fd) : fd_(fd), thread_([this] { loop(); }) {}
  ~DataWriter() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_.notify_all();
    thread_.join();
  }

  // Queues `bytes` bytes at file offset `offset`; `where` names the dataset in an error.
  void put(uint64_t offset, const void* data, size_t bytes, const std::string& where) {
    Buffer buf;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (queued_ + bytes > kMaxQueued && !jobs_.empty()) work_.notify_one();
      room_.wait(lock, [&] { return queued_ + bytes <= kMaxQueued || jobs_.empty(); });
      // A spare buffer of the size class, else a new one.
      std::vector<Buffer>& spare = spare_[size_class(bytes)];
      if (!spare.empty()) {
        buf = std::move(spare.back());
        spare.pop_back();
        spare_bytes_ -= buf.capacity;
      }
      queued_ += bytes;
    }
    if (!buf.data) buf = Buffer(size_t(1) << size_class(bytes));  // uninitialized: the copy below fills it
    buf.size = bytes;
    std::memcpy(buf.data.get(), data, bytes);
    bool wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back({offset, std::move(buf), where});
      // The thread sleeps only when it found no job: no wake-up call while it works, and a sleeping
      // one is woken for a batch (a wake-up costs more than writing a small dataset), or by drain().
      wake = idle_ && (queued_ >= kWakeBytes || jobs_.size() >= kWakeJobs);
    }
    if (wake) work_.notify_one();
  }

  // Waits until everything queued is written; returns the first failure ("" when none).
  std::string drain() {
    std::unique_lock<std::mutex> lock(mu_);
    work_.notify_one();
    room_.wait(lock, [&] { return jobs_.empty() && !busy_; });
    return error_;
  }
  std::string error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  static constexpr size_t kMaxQueued = size_t(256) << 20;
  static constexpr size_t kMaxSpare = size_t(256) << 20;
  static constexpr size_t kWakeBytes = size_t(4) << 20;
  static constexpr size_t kWakeJobs = 64;
  struct Buffer {
    Buffer() = default;
    explicit Buffer(size_t n) : data(new unsigned char[n]), capacity(n) {}
    std::unique_ptr<unsigned char[]> data;
    size_t capacity = 0, size = 0;
  };
  struct Job {
    uint64_t offset;
    Buffer bytes;
    std::string where;
  };

  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      idle_ = true;
      work_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      idle_ = false;
      if (jobs_.empty()) return;  // stop_
      Job job = std::move(jobs_.front());
      jobs_.pop_front();
      busy_ = true;
      const bool failed = !error_.empty();
      lock.unlock();
      std::string err;
      if (!failed) err = write_all(job);  // after a failure the rest is dropped: the dump is lost anyway
      lock.lock();
      busy_ = false;
      if (error_.empty() && !err.empty()) error_ = err;
      queued_ -= job.bytes.size;
      if (spare_bytes_ + job.bytes.capacity <= kMaxSpare) {
        spare_bytes_ += job.bytes.capacity;
        spare_[size_class(job.bytes.size)].push_back(std::move(job.bytes));
      }
      room_.notify_all();
    }
  }

  std::string write_all(const Job& job) const {
    const unsigned char* p = job.bytes.data.get();
    size_t left = job.bytes.size;
    off_t at = static_cast<off_t>(job.offset);
    while (left > 0) {
      const ssize_t n = ::pwrite(fd_, p, left, at);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return "dataset '" + job.where + "': cannot write the data (file write failed: " +
                         std::string(n < 0 ? std::strerror(errno) : "nothing written") + ")";
      p += n, left -= static_cast<size_t>(n), at += n;
    }
    return {};
  }

  const int fd_;
  std::mutex mu_;
  std::condition_variable work_, room_;
  std::deque<Job> jobs_;
  // Buffers are powers of two of at least 4 KiB; spare ones are kept per size (class = log2).
  static int size_class(size_t bytes) {
    int c = 12;
    while ((size_t(1) << c) < bytes) ++c;
    return c;
  }
  std::array<std::vector<Buffer>, 64> spare_;
  size_t queued_ = 0, spare_bytes_ = 0;
  bool stop_ = false, busy_ = false, idle_ = false;
  std::string error_;
  std::thread thread_;  // last: started once the rest is set up
};

// Whether this host stores floats and integers as the dump does (little-endian), so that data can
// go to the file as it is in memory.
bool little_endian_host() {
  static const bool le = H5Tget_order(H5T_NATIVE_FLOAT) == H5T_ORDER_LE && H5Tget_order(H5T_NATIVE_INT32) == H5T_ORDER_LE &&
                         H5Tget_order(H5T_NATIVE_UINT16) == H5T_ORDER_LE;
  return le;
}

}  // namespace

struct DumpFile::Impl {
  std::string path;
  std::string tmp_path;
  Hid file;
  Hid dcpl;    // dataset creation: contiguous, no fill, no timestamps
  Hid scalar;  // scalar dataspace for attributes
  int compress = 0;  // gzip level of float datasets, 0: contiguous
  int step = -1;
  Hid group;   // the group of `step`
  std::set<std::string, std::less<>> step_names;  // datasets written in `step`
  std::set<int> steps_started;
  std::map<int, std::vector<AttributeRow>> tables;  // each step's attribute table, written by finish()
  uint64_t bytes = 0;
  bool finished = false;
  dev_t tmp_dev = 0;                    // the temporary file as created (checked before the rename)
  ino_t tmp_ino = 0;
  int fd = -1;                          // the temporary file, for the data writer
  std::unique_ptr<DataWriter> data;     // raw data of contiguous datasets

  ~Impl() { abort(); }

  // Stops the data writer and closes its descriptor; returns its first failure ("" when none).
  std::string stop_data() noexcept {
    std::string err;
    if (data) {
      err = data->drain();
      data.reset();
    }
    if (fd >= 0) ::close(fd);
    fd = -1;
    return err;
  }

  void abort() noexcept {
    stop_data();
    group.reset();
    file.reset();
    if (!finished && !tmp_path.empty()) {
      std::error_code ec;
      std::filesystem::remove(tmp_path, ec);
    }
    finished = true;
  }

  [[noreturn]] void fail(const std::string& what, std::string_view dataset = {}) const {
    std::string msg = path + ": " + (dataset.empty() ? "" : "dataset '" + std::string(dataset) + "': ") + what;
    throw DumpError(msg + h5::detail());
  }

  // An existing `path` that is not a regular file is never replaced (a root `dump --out /dev/null`
  // would swap the device node for a regular file); a symlink to a regular file, or to nothing, is.
  void check_target() const {
    struct stat st{};
    if (::stat(path.c_str(), &st) != 0) return;
    if (const std::string kind = non_regular_kind(st); !kind.empty())
      fail("exists and is " + kind + ", not a regular file: a dump replaces only a regular file");
  }

  void check_open(const std::string& what) const {
    if (finished || !file.valid()) fail(what + " after the dump was closed");
  }

  void attr_raw(hid_t obj, const std::string& name, hid_t file_type, hid_t mem_type, hid_t space, const void* value,
                std::string_view where) {
    if (obj == file.get() && H5Aexists(obj, name.c_str()) > 0 && H5Adelete(obj, name.c_str()) < 0)
      fail("cannot replace attribute '" + name + "'", where);
    Hid a(H5Acreate2(obj, name.c_str(), file_type, space, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
    if (!a.valid() || H5Awrite(a.get(), mem_type, value) < 0) fail("cannot write attribute '" + name + "'", where);
  }
  void attr_str(hid_t obj, const std::string& name, const std::string& value, std::string_view where = {}) {
    const Hid t = h5::fixed_string_type(value.size());
    std::string padded = value;
    padded.resize(std::max<size_t>(value.size(), 1), '\0');
    attr_raw(obj, name, t.get(), t.get(), scalar.get(), padded.data(), where);
  }

  // Each step's attribute table: a compound dataset, one row per dataset in the order written,
  // strings fixed-length and sized to the longest value of the column.
  void write_tables() {
    for (const auto& [s, rows] : tables) {
      const std::string where = dump_step_group_name(s) + "/" + kAttributeTable;
      size_t name_n = 1, layout_n = 1, native_n = 1, dtype_n = 1, split_n = 1;
      for (const auto& r : rows) {
        split_n = std::max(split_n, r.attrs.split.size());
        name_n = std::max(name_n, r.name.size());
        layout_n = std::max(layout_n, r.attrs.layout.size());
        native_n = std::max(native_n, r.attrs.native_dtype.size());
        dtype_n = std::max(dtype_n, r.dtype.size());
      }
      // Packed rows: name, order, layer, layout, native_dtype, row_offset, dtype, split, shard_offset, partial.
      const size_t o_order = name_n, o_layer = o_order + 4, o_layout = o_layer + 4, o_native = o_layout + layout_n,
                   o_row = o_native + native_n, o_dtype = o_row + 4, o_split = o_dtype + dtype_n,
                   o_shard = o_split + split_n, o_partial = o_shard + 4, row = o_partial + 4;
      const Hid s_name = h5::fixed_string_type(name_n), s_layout = h5::fixed_string_type(layout_n),
                s_native = h5::fixed_string_type(native_n), s_dtype = h5::fixed_string_type(dtype_n),
                s_split = h5::fixed_string_type(split_n);
      Hid ftype(H5Tcreate(H5T_COMPOUND, row), H5Tclose), mtype(H5Tcreate(H5T_COMPOUND, row), H5Tclose);
      for (auto [t, ints] : {std::pair{ftype.get(), H5T_STD_I32LE}, std::pair{mtype.get(), H5T_NATIVE_INT32}}) {
        if (H5Tinsert(t, "name", 0, s_name.get()) < 0 || H5Tinsert(t, column::order, o_order, ints) < 0 ||
            H5Tinsert(t, column::layer, o_layer, ints) < 0 || H5Tinsert(t, column::layout, o_layout, s_layout.get()) < 0 ||
            H5Tinsert(t, column::native_dtype, o_native, s_native.get()) < 0 || H5Tinsert(t, column::row_offset, o_row, ints) < 0 ||
            H5Tinsert(t, column::dtype, o_dtype, s_dtype.get()) < 0 || H5Tinsert(t, column::split, o_split, s_split.get()) < 0 ||
            H5Tinsert(t, column::shard_offset, o_shard, ints) < 0 || H5Tinsert(t, column::partial, o_partial, ints) < 0)
          fail("cannot build the attribute table's type", where);
      }
      std::vector<char> buf(rows.size() * row, '\0');
      for (size_t i = 0; i < rows.size(); ++i) {
        char* p = buf.data() + i * row;
        const AttributeRow& r = rows[i];
        auto put_int = [&](size_t at, const std::optional<int>& v) {
          const int32_t x = v.value_or(kAbsentInt);
          std::memcpy(p + at, &x, 4);
        };
        std::memcpy(p, r.name.data(), r.name.size());
        put_int(o_order, r.attrs.order);
        put_int(o_layer, r.attrs.layer);
        std::memcpy(p + o_layout, r.attrs.layout.data(), r.attrs.layout.size());
        std::memcpy(p + o_native, r.attrs.native_dtype.data(), r.attrs.native_dtype.size());
        put_int(o_row, r.attrs.row_offset);
        std::memcpy(p + o_dtype, r.dtype.data(), r.dtype.size());
        std::memcpy(p + o_split, r.attrs.split.data(), r.attrs.split.size());
        put_int(o_shard, r.attrs.shard_offset);
        put_int(o_partial, r.attrs.partial);
      }
      hsize_t n = rows.size();
      Hid space(H5Screate_simple(1, &n, nullptr), H5Sclose);
      Hid g(H5Gopen2(file.get(), dump_step_group_name(s).c_str(), H5P_DEFAULT), H5Gclose);
      if (!space.valid() || !g.valid()) fail("cannot open its step group", where);
      Hid ds(H5Dcreate2(g.get(), kAttributeTable, ftype.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
             H5Dclose);
      if (!ds.valid() || (n > 0 && H5Dwrite(ds.get(), mtype.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data()) < 0))
        fail("cannot write the attribute table", where);
    }
    tables.clear();
  }
  void attr_int(hid_t obj, const std::string& name, int32_t value, std::string_view where = {}) {
    attr_raw(obj, name, H5T_STD_I32LE, H5T_NATIVE_INT32, scalar.get(), &value, where);
  }

  hid_t group_for(int s) {
    if (s == step) return group.get();
    if (s < 0) fail("negative step " + std::to_string(s));
    group.reset();
    step_names.clear();
    const std::string gname = dump_step_group_name(s);
    if (steps_started.count(s)) {
      // A step resumed after another one: reopen its group and its names.
      group = Hid(H5Gopen2(file.get(), gname.c_str(), H5P_DEFAULT), H5Gclose);
      if (!group.valid()) fail("cannot reopen group '" + gname + "'");
      H5Literate(
          group.get(), H5_INDEX_NAME, H5_ITER_NATIVE, nullptr,
          [](hid_t, const char* name, const H5L_info_t*, void* out) -> herr_t {
            static_cast<std::set<std::string, std::less<>>*>(out)->insert(name);
            return 0;
          },
          &step_names);
    } else {
      group = Hid(H5Gcreate2(file.get(), gname.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
      if (!group.valid()) fail("cannot create group '" + gname + "'");
      steps_started.insert(s);
    }
    step = s;
    return group.get();
  }
};

DumpFile::DumpFile(const std::string& path, long tmp_pid) : impl_(std::make_unique<Impl>()) {
  h5::silence();
  Impl& m = *impl_;
  m.path = path;
  m.tmp_path = dump_temporary_path(path, tmp_pid > 0 ? tmp_pid : static_cast<long>(::getpid()));
  m.finished = true;  // until the temporary is created: nothing to remove
  m.check_target();
  // The temporary is created exclusively: H5F_ACC_EXCL opens with O_CREAT | O_EXCL, which fails on
  // any existing name, a symlink (dangling or not) included, so nothing planted there is written
  // through. A regular file there is a leftover of a killed process that had this pid (no live
  // process has it), replaced; anything else is refused.
  struct stat st{};
  if (::lstat(m.tmp_path.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode) || st.st_nlink != 1)
      m.fail("cannot create the temporary '" + m.tmp_path + "': it exists and is " +
             (S_ISREG(st.st_mode) ? std::string("a file with other hard links") : non_regular_kind(st)) +
             ", which a dump never writes through (remove it)");
    ::unlink(m.tmp_path.c_str());
  }
  Hid fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  // v1.8+ object headers: large attributes (long token_ids) and many root attributes are allowed.
  H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V18, H5F_LIBVER_LATEST);
  H5Pset_fclose_degree(fapl.get(), H5F_CLOSE_STRONG);
  m.file = Hid(H5Fcreate(m.tmp_path.c_str(), H5F_ACC_EXCL, H5P_DEFAULT, fapl.get()), H5Fclose);
  if (!m.file.valid()) {
    const bool exists = ::lstat(m.tmp_path.c_str(), &st) == 0;
    m.fail("cannot create '" + m.tmp_path + "' " +
           (exists ? std::string("(something was created at its name meanwhile: refused, not written through)")
                   : std::string("(directory missing or not writable?)")));
  }
  m.finished = false;
  // HDF5's own descriptor of the file it created (the sec2 driver's), shared with the data writer:
  // opening the name again could reach another file put there meanwhile.
  int hdf5_fd = -1;
  if (void* handle = nullptr; H5Fget_vfd_handle(m.file.get(), H5P_DEFAULT, &handle) >= 0 && handle)
    hdf5_fd = *static_cast<int*>(handle);
  if (hdf5_fd < 0 || ::fstat(hdf5_fd, &st) != 0) m.fail("cannot get the descriptor of '" + m.tmp_path + "'");
  m.tmp_dev = st.st_dev;
  m.tmp_ino = st.st_ino;
  m.dcpl = Hid(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  H5Pset_layout(m.dcpl.get(), H5D_CONTIGUOUS);
  // Space allocated at creation, so that its offset is known and the data writer fills it.
  H5Pset_alloc_time(m.dcpl.get(), H5D_ALLOC_TIME_EARLY);
  if (little_endian_host()) {
    m.fd = ::fcntl(hdf5_fd, F_DUPFD_CLOEXEC, 0);
    if (m.fd >= 0) m.data = std::make_unique<DataWriter>(m.fd);
  }
  H5Pset_fill_time(m.dcpl.get(), H5D_FILL_TIME_NEVER);
  H5Pset_obj_track_times(m.dcpl.get(), false);
  m.scalar = Hid(H5Screate(H5S_SCALAR), H5Sclose);
}

DumpFile::~DumpFile() = default;

const std::string& DumpFile::path() const { return impl_->path; }
const std::string& DumpFile::tmp_path() const { return impl_->tmp_path; }

void DumpFile::set_string(const std::string& name, const std::string& value) {
  impl_->check_open("setting attribute '" + name + "'");
  impl_->attr_str(impl_->file.get(), name, value);
}

void DumpFile::set_int(const std::string& name, int32_t value) {
  impl_->check_open("setting attribute '" + name + "'");
  impl_->attr_int(impl_->file.get(), name, value);
}

void DumpFile::set_real(const std::string& name, double value) {
  Impl& m = *impl_;
  m.check_open("setting attribute '" + name + "'");
  m.attr_raw(m.file.get(), name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, m.scalar.get(), &value, {});
}

void DumpFile::set_bool(const std::string& name, bool value) {
  Impl& m = *impl_;
  m.check_open("setting attribute '" + name + "'");
  int8_t v = value ? 1 : 0;
  m.attr_raw(m.file.get(), name, h5::bool_type(), h5::bool_type(), m.scalar.get(), &v, {});
}

void DumpFile::set_ints(const std::string& name, std::span<const int32_t> values) {
  Impl& m = *impl_;
  m.check_open("setting attribute '" + name + "'");
  hsize_t n = values.size();
  Hid space(H5Screate_simple(1, &n, nullptr), H5Sclose);
  if (!space.valid()) m.fail("cannot create the dataspace of attribute '" + name + "'");
  m.attr_raw(m.file.get(), name, H5T_STD_I32LE, H5T_NATIVE_INT32, space.get(), values.data(), {});
}

bool DumpFile::has_attribute(const std::string& name) const {
  return impl_->file.valid() && H5Aexists(impl_->file.get(), name.c_str()) > 0;
}

void DumpFile::remove_attribute(const std::string& name) {
  Impl& m = *impl_;
  m.check_open("removing attribute '" + name + "'");
  if (has_attribute(name) && H5Adelete(m.file.get(), name.c_str()) < 0) m.fail("cannot remove attribute '" + name + "'");
}

std::vector<std::string> DumpFile::copy_attributes(const std::string& source_path,
                                                   const std::function<bool(std::string_view)>& keep) {
  Impl& m = *impl_;
  m.check_open("copying attributes");
  // stat only: a FIFO is never opened (that would block) and is named as what it is.
  if (const std::string problem = regular_file_problem(source_path); !problem.empty())
    throw DumpError(source_path + ": " + (problem == "does not exist" ? std::string("no such file") : problem));
  if (H5Fis_hdf5(source_path.c_str()) <= 0) {
    h5::detail();
    throw DumpError(source_path + ": not an HDF5 file (no HDF5 signature: foreign or truncated)");
  }
  // The close degree of diffrun's readers (DumpReader, the validator): HDF5 refuses to open a file again with
  // another one, so a C API host holding the reference open in a diffrun_dump_reader can copy its meta.
  Hid fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  H5Pset_fclose_degree(fapl.get(), H5F_CLOSE_STRONG);
  Hid src(H5Fopen(source_path.c_str(), H5F_ACC_RDONLY, fapl.get()), H5Fclose);
  if (!src.valid()) throw DumpError(source_path + ": cannot open the HDF5 file" + h5::detail());
  const std::vector<std::string> names = h5::attribute_names(src.get());
  std::vector<std::string> copied;
  for (const auto& name : names) {
    if (!keep(name)) continue;
    Hid a(H5Aopen(src.get(), name.c_str(), H5P_DEFAULT), H5Aclose);
    if (!a.valid()) throw DumpError(source_path + ": cannot open attribute '" + name + "'" + h5::detail());
    Hid type(H5Aget_type(a.get()), H5Tclose);
    Hid space(H5Aget_space(a.get()), H5Sclose);
    const hssize_t n = H5Sget_simple_extent_npoints(space.get());
    const size_t size = H5Tget_size(type.get());
    if (n < 0 || size == 0) throw DumpError(source_path + ": cannot size attribute '" + name + "'" + h5::detail());
    // The format stores no variable-length data: a scalar variable-length string (how version 1
    // stored strings) is written as a fixed-length one; other variable-length attributes are left out.
    if (H5Tis_variable_str(type.get()) > 0) {
      if (n != 1) continue;
      if (!version1_reads_allowed())
        throw DumpError(source_path + ": attribute '" + name + "' is a variable-length string: " + version1_refused());
      std::string why;
      const std::optional<std::string> value = h5::read_string_attribute(src.get(), name.c_str(), true, &why);
      if (!value) throw DumpError(source_path + ": cannot read attribute '" + name + "'" + why);
      m.attr_str(m.file.get(), name, *value);
      copied.push_back(name);
      continue;
    }
    if (H5Tdetect_class(type.get(), H5T_VLEN) > 0 || H5Tdetect_class(type.get(), H5T_REFERENCE) > 0) continue;
    std::vector<unsigned char> buf(static_cast<size_t>(n) * size + 1);
    if (n > 0 && H5Aread(a.get(), type.get(), buf.data()) < 0)
      throw DumpError(source_path + ": cannot read attribute '" + name + "'" + h5::detail());
    m.attr_raw(m.file.get(), name, type.get(), type.get(), space.get(), buf.data(), {});
    copied.push_back(name);
  }
  return copied;
}

void DumpFile::write(int step, std::string_view name, StoredDType type, std::span<const int64_t> shape,
                     const void* data, const DatasetAttributes& attrs) {
  Impl& m = *impl_;
  const std::string where = dump_step_group_name(step) + "/" + std::string(name);
  if (m.finished || !m.file.valid()) m.fail("write after the dump was closed", where);
  if (name.empty() || name.find('/') != std::string_view::npos || name == "." || name == "..")
    m.fail("not a valid dataset name (empty, or holds '/')", where);
  if (name == kAttributeTable) m.fail("the name of the step's attribute table", where);
  hid_t g = m.group_for(step);
  if (m.step_names.count(name)) m.fail("recorded twice in this step", where);
  std::vector<hsize_t> dims;
  hsize_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) m.fail("negative dimension in its shape", where);
    dims.push_back(static_cast<hsize_t>(d));
    n *= static_cast<hsize_t>(d);
  }
  hid_t file_type = H5T_IEEE_F32LE, mem_type = H5T_NATIVE_FLOAT;
  switch (type) {
    case StoredDType::f32: break;
    case StoredDType::f64: file_type = H5T_IEEE_F64LE, mem_type = H5T_NATIVE_DOUBLE; break;
    case StoredDType::f16: file_type = mem_type = h5::float16_type(); break;
    case StoredDType::bf16: file_type = H5T_STD_U16LE, mem_type = H5T_NATIVE_UINT16; break;
    case StoredDType::i32: file_type = H5T_STD_I32LE, mem_type = H5T_NATIVE_INT32; break;
  }
  Hid space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
  if (!space.valid()) m.fail("cannot create its dataspace", where);
  const std::string dname(name);
  Hid chunked;
  if (m.compress > 0 && type != StoredDType::i32 && n >= 1024) {
    // Chunks of whole rows of the first dimension, about 1 MiB each.
    std::vector<hsize_t> chunk = dims;
    const hsize_t row = n / dims[0] * stored_dtype_size(type);
    chunk[0] = std::clamp<hsize_t>((hsize_t(1) << 20) / std::max<hsize_t>(row, 1), 1, dims[0]);
    chunked = Hid(H5Pcopy(m.dcpl.get()), H5Pclose);
    if (!chunked.valid() || H5Pset_chunk(chunked.get(), static_cast<int>(chunk.size()), chunk.data()) < 0 ||
        H5Pset_shuffle(chunked.get()) < 0 || H5Pset_deflate(chunked.get(), static_cast<unsigned>(m.compress)) < 0)
      m.fail("cannot set up its compression", where);
  }
  const hid_t dcpl = chunked.valid() ? chunked.get() : m.dcpl.get();
  Hid ds(H5Dcreate2(g, dname.c_str(), file_type, space.get(), H5P_DEFAULT, dcpl, H5P_DEFAULT), H5Dclose);
  if (!ds.valid()) m.fail("cannot create the dataset", where);
  if (n > 0) {
    const haddr_t offset = m.data && !chunked.valid() ? H5Dget_offset(ds.get()) : HADDR_UNDEF;
    if (offset != HADDR_UNDEF) {
      if (const std::string err = m.data->error(); !err.empty()) m.fail(err);
      m.data->put(offset, data, n * stored_dtype_size(type), where);
    } else if (H5Dwrite(ds.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0) {
      m.fail("cannot write the data", where);
    }
  }
  m.tables[step].push_back({dname, attrs, type == StoredDType::bf16 ? "bf16" : ""});
  m.step_names.insert(dname);
  m.bytes += n * stored_dtype_size(type);
}

bool DumpFile::has_dataset(int step, std::string_view name) const {
  const Impl& m = *impl_;
  // "" or a path would name the step group itself or another object, never a dataset of the step.
  if (!m.file.valid() || name.empty() || name.find('/') != std::string_view::npos || name == "." || name == "..")
    return false;
  std::string p = dump_step_group_name(step);
  if (H5Lexists(m.file.get(), p.c_str(), H5P_DEFAULT) <= 0) return false;
  p.push_back('/');
  p.append(name);
  return H5Lexists(m.file.get(), p.c_str(), H5P_DEFAULT) > 0;
}

void DumpFile::set_compression(int level) {
  if (level < 0 || level > 9) impl_->fail("compression level " + std::to_string(level) + " is outside 0..9");
  impl_->compress = level;
}

void DumpFile::finish() {
  Impl& m = *impl_;
  if (m.finished) return;
  m.group.reset();
  m.write_tables();
  if (const std::string err = m.stop_data(); !err.empty()) m.fail(err);
  if (!m.file.close()) m.fail("cannot close '" + m.tmp_path + "'");
  // The name still holds the file written (not one put there meanwhile), and the target is still
  // not a device, FIFO or directory.
  struct stat st{};
  if (::lstat(m.tmp_path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_dev != m.tmp_dev || st.st_ino != m.tmp_ino)
    m.fail("the temporary '" + m.tmp_path + "' was replaced or removed while the dump was written; not renamed");
  m.check_target();
  // The dump this one replaces is held open and moved aside before the rename, so that neither frees it: freeing a
  // large file's blocks and cached pages is slow (the 7B shape's job: 0.2-1.3 s for its five 774 MB dumps, in its
  // last second), and a rename over an existing file makes ext4 write the new file's data out first (auto_da_alloc:
  // the Qwen2.5-0.5B shape's job took 0.16-0.25 s longer over its last run's dumps than into a new directory;
  // bench/NOTES.md). The path is absent only between the two renames; a failed second one puts the old dump back.
  // Then the aside name is removed and closing the descriptor frees the old dump (release_replaced_dump: in a dump
  // child, after the job's end).
  int replaced = -1;
  std::string aside;
  if (struct stat old{}; ::lstat(m.path.c_str(), &old) == 0 && S_ISREG(old.st_mode) && old.st_nlink == 1) {
    replaced = ::open(m.path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    aside = dump_temporary_path(m.path + ".replaced", static_cast<long>(::getpid()));
    if (replaced >= 0 && ::rename(m.path.c_str(), aside.c_str()) != 0) {  // then the rename replaces it, as before
      ::close(replaced);
      replaced = -1;
    }
  }
  std::error_code ec;
  std::filesystem::rename(m.tmp_path, m.path, ec);
  if (replaced >= 0) {
    if (ec) {
      ::rename(aside.c_str(), m.path.c_str());
      ::close(replaced);
    } else {
      ::unlink(aside.c_str());
      release_replaced_dump(replaced);
    }
  }
  if (ec) m.fail("cannot rename '" + m.tmp_path + "' to it: " + ec.message());
  m.finished = true;
}

void DumpFile::abort() { impl_->abort(); }

bool DumpFile::finished() const { return impl_->finished; }

uint64_t DumpFile::bytes_written() const { return impl_->bytes; }

hid_t DumpFile::hdf5_file() const { return impl_->file.get(); }

}  // namespace diffrun
