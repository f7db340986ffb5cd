// The C API compiled as C++: a teacher-forced copy of a reference dump (copy_meta, its tokens, its tensors as merged heads and f64).
// Reads the reference with the HDF5 C API only, the way an outside engine would; `diffrun compare`
// of the copy against the reference must then find every checkpoint equal.
#include <diffrun/dump_writer.h>
#include <hdf5.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

int n_checks = 0, n_failed = 0;

void check(bool ok, const std::string& what) {
  ++n_checks;
  if (!ok) {
    ++n_failed;
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

// Aborts an unclosed dump on scope exit.
struct Closer {
  void operator()(diffrun_dump* d) const { diffrun_dump_abort(d); }
};
using Dump = std::unique_ptr<diffrun_dump, Closer>;

struct Entry {
  int order;
  std::string name;
  int layer;
};

// A step's datasets from its attribute table (format version 2: the compound dataset _attributes,
// one row per dataset, fixed-length string names) with their order and layer columns.
std::vector<Entry> read_table(hid_t g) {
  std::vector<Entry> out;
  hid_t ds = H5Dopen2(g, "_attributes", H5P_DEFAULT);
  check(ds >= 0, "the step has an attribute table");
  if (ds < 0) return out;
  hid_t ftype = H5Dget_type(ds);
  hid_t name_t = H5Tget_member_type(ftype, static_cast<unsigned>(H5Tget_member_index(ftype, "name")));
  const size_t name_n = H5Tget_size(name_t);
  const size_t row = name_n + 2 * sizeof(int32_t);
  hid_t mtype = H5Tcreate(H5T_COMPOUND, row);
  H5Tinsert(mtype, "name", 0, name_t);
  H5Tinsert(mtype, "order", name_n, H5T_NATIVE_INT32);
  H5Tinsert(mtype, "layer", name_n + sizeof(int32_t), H5T_NATIVE_INT32);
  hid_t space = H5Dget_space(ds);
  const hssize_t n = H5Sget_simple_extent_npoints(space);
  std::vector<char> buf(static_cast<size_t>(n) * row);
  check(H5Dread(ds, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data()) >= 0, "read the attribute table");
  for (hssize_t i = 0; i < n; ++i) {
    const char* p = buf.data() + i * row;
    Entry e;
    e.name.assign(p, strnlen(p, name_n));
    std::memcpy(&e.order, p + name_n, sizeof(int32_t));
    std::memcpy(&e.layer, p + name_n + sizeof(int32_t), sizeof(int32_t));
    out.push_back(e);
  }
  H5Sclose(space);
  H5Tclose(mtype);
  H5Tclose(name_t);
  H5Tclose(ftype);
  H5Dclose(ds);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s REFERENCE.h5 OUT.h5\n", argv[0]);
    return 2;
  }
  const std::string ref = argv[1], out = argv[2];
  diffrun_dump* raw = nullptr;
  check(diffrun_dump_open(out.c_str(), &raw) == DIFFRUN_DUMP_OK, std::string("open: ") + diffrun_dump_last_error(nullptr));
  Dump d(raw);
  check(diffrun_dump_copy_meta(d.get(), (ref + ".missing").c_str()) == DIFFRUN_DUMP_E_IO &&
            std::string(diffrun_dump_last_error(d.get())).find("no such file") != std::string::npos,
        "copy_meta of a missing file");
  check(diffrun_dump_copy_meta(d.get(), ref.c_str()) == DIFFRUN_DUMP_OK,
        std::string("copy_meta: ") + diffrun_dump_last_error(d.get()));
  check(diffrun_dump_step(d.get(), 0) == DIFFRUN_DUMP_E_META &&
            std::string(diffrun_dump_last_error(d.get())).find("'backend': missing") != std::string::npos,
        "backend is not copied");
  diffrun_dump_set_string(d.get(), "backend", "capi-copy");
  diffrun_dump_set_string(d.get(), "precision", "f32");

  hid_t file = H5Fopen(ref.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  check(file >= 0, "open the reference");
  for (int step = 0;; ++step) {
    char gname[32];
    std::snprintf(gname, sizeof gname, "step_%04d", step);
    if (H5Lexists(file, gname, H5P_DEFAULT) <= 0) break;
    check(diffrun_dump_step(d.get(), step) == DIFFRUN_DUMP_OK, std::string("step: ") + diffrun_dump_last_error(d.get()));
    hid_t g = H5Gopen2(file, gname, H5P_DEFAULT);
    std::vector<Entry> entries = read_table(g);
    std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.order < b.order; });
    for (const Entry& e : entries) {
      hid_t ds = H5Dopen2(g, e.name.c_str(), H5P_DEFAULT);
      hid_t space = H5Dget_space(ds);
      const int rank = H5Sget_simple_extent_ndims(space);
      std::vector<hsize_t> hd(rank);
      H5Sget_simple_extent_dims(space, hd.data(), nullptr);
      std::vector<int64_t> dims(hd.begin(), hd.end());
      size_t n = 1;
      for (hsize_t x : hd) n *= x;
      const int layer = e.layer;
      int rc;
      if (e.name == "tokens") {
        std::vector<int32_t> ids(n);
        H5Dread(ds, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, ids.data());
        const int32_t* fed = nullptr;
        size_t n_fed = 0;
        check(diffrun_dump_step_tokens(d.get(), step, &fed, &n_fed) == DIFFRUN_DUMP_OK &&
                  std::vector<int32_t>(fed, fed + n_fed) == ids,
              "step_tokens gives the reference's tokens of step " + std::to_string(step));
        rc = diffrun_dump_put(d.get(), "tokens", -1, dims.data(), 1, DIFFRUN_I32, ids.data());
      } else if (rank == 3 && e.name.rfind("Qcur", 0) == 0) {
        std::vector<float> v(n);  // [T, H*Dh], as most engines hold it
        H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
        const int64_t merged[2] = {dims[0], dims[1] * dims[2]};
        rc = diffrun_dump_put(d.get(), e.name.c_str(), layer, merged, 2, DIFFRUN_F32, v.data());
      } else if (e.name.rfind("ffn_", 0) == 0) {
        std::vector<double> v(n);
        H5Dread(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
        rc = diffrun_dump_put_ex(d.get(), e.name.c_str(), layer, dims.data(), rank, DIFFRUN_F64, v.data(), nullptr, "f32");
      } else {
        std::vector<float> v(n);
        H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
        rc = diffrun_dump_put(d.get(), e.name.c_str(), layer, dims.data(), rank, DIFFRUN_F32, v.data());
      }
      check(rc == DIFFRUN_DUMP_OK, e.name + ": " + diffrun_dump_last_error(d.get()));
      H5Sclose(space);
      H5Dclose(ds);
    }
    H5Gclose(g);
  }
  H5Fclose(file);
  {
    const int32_t* fed = nullptr;
    size_t n_fed = 0;
    check(diffrun_dump_step_tokens(d.get(), 3, &fed, &n_fed) == DIFFRUN_DUMP_E_STEP && fed == nullptr,
          std::string("no ids past the last step: ") + diffrun_dump_last_error(d.get()));
  }
  check(diffrun_dump_close(d.release()) == DIFFRUN_DUMP_OK, std::string("close: ") + diffrun_dump_last_error(nullptr));
  std::printf("test_capi_cpp: %d checks, %d failed\n", n_checks, n_failed);
  return n_failed == 0 ? 0 : 1;
}
