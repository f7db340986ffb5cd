// Where a DumpWriter's file operations go: a DumpFile in this process, or one in a child process
// (the diffrun-dump-child executable). HDF5 serializes every call of a process behind one lock, so a
// run that writes several dumps at once (the top-level job: up to five) writes each from a process
// of its own; the files are the same byte for byte apart from HDF5's own bookkeeping.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "dump/dump_format.hpp"

namespace diffrun {

// The DumpFile operations DumpWriter uses (dump/dump_format.hpp says what each does).
class DumpTarget {
 public:
  virtual ~DumpTarget() = default;
  virtual const std::string& path() const = 0;
  virtual void set_string(const std::string& name, const std::string& value) = 0;
  virtual void set_int(const std::string& name, int32_t value) = 0;
  virtual void set_real(const std::string& name, double value) = 0;
  virtual void set_bool(const std::string& name, bool value) = 0;
  virtual void set_ints(const std::string& name, std::span<const int32_t> values) = 0;
  virtual void write(int step, std::string_view name, StoredDType type, std::span<const int64_t> shape,
                     const void* data, const DatasetAttributes& attrs) = 0;
  virtual void finish() = 0;
  virtual bool finished() const = 0;
  virtual uint64_t bytes_written() const = 0;
  virtual bool in_process() const = 0;  // true: HDF5 is called here (under its lock)
};

// A DumpFile of this process at `path` ("<path>.diffrun-tmp-<pid>" until finish()).
std::unique_ptr<DumpTarget> local_dump_target(const std::string& path, int compress);

// A DumpFile at `path` in a diffrun-dump-child process, its temporary named with this process's pid
// (so the interrupt handlers that remove this process's temporaries remove it too). Throws DumpError
// when the file cannot be created; returns null when the executable (dump_child_executable()) is
// missing or cannot be started: the caller writes in this process instead.
// Errors the child meets later (a full disk) are thrown by a later call or by finish(). Destroying an
// unfinished target makes the child remove the temporary before the destructor returns; so does
// this process dying, as the child then reads the end of its input.
std::unique_ptr<DumpTarget> child_dump_target(const std::string& path, int compress);

// diffrun-dump-child beside this process's executable, or "" when there is none. DIFFRUN_DUMP_CHILD
// names another one.
std::string dump_child_executable();

// The child's side: serves one dump over the connected socket `fd` until finish or the end of its
// input. Returns the process's exit code (0 also after an error, which it reports over the socket).
int dump_child_main(int fd);

}  // namespace diffrun
