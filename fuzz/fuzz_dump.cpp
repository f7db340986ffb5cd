// libFuzzer target for the HDF5 dump reader and validator: any bytes must read or give a diffrun Error, within bounded memory.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <hdf5.h>

#include "checkpoints/name_map.hpp"
#include "dump/dump.hpp"
#include "dump/dump_validate.hpp"
#include "model/error.hpp"

namespace {

// The input as a file (HDF5 opens paths): one per process, in $FUZZ_DUMP_DIR or /dev/shm.
const std::string& scratch_path() {
  static const std::string path = [] {
    const char* dir = std::getenv("FUZZ_DUMP_DIR");
    return std::string(dir && *dir ? dir : "/dev/shm") + "/fuzz_dump-" + std::to_string(::getpid()) + ".h5";
  }();
  return path;
}

// Everything compare, show and ls read: the metadata, every step's datasets, each one's data.
void read_all(const std::string& path, const diffrun::NameMap* names) {
  const diffrun::DumpReader r(path, names);
  for (int step : r.steps()) {
    for (const diffrun::DatasetInfo& d : r.datasets(step)) {
      if (d.is_int) r.read_ids(step, d.name);
      else r.read(step, d.name);
    }
  }
  for (const std::string& key : r.int_attribute_names()) r.int_attribute(key);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const diffrun::NameMap llamacpp = diffrun::NameMap::load("llamacpp");
  const std::string& path = scratch_path();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    read_all(path, nullptr);
  } catch (const diffrun::Error&) {
  }
  // The same bytes through the llama.cpp name map (reshapes, crops, drops) and the validator.
  try {
    read_all(path, &llamacpp);
  } catch (const diffrun::Error&) {
  }
  try {
    diffrun::validate_dump(path);
  } catch (const diffrun::Error&) {
  }
  std::remove(path.c_str());  // fork mode runs many processes: leave no file behind
  return 0;
}
