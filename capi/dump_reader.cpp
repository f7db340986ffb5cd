// The C API dump reader (capi/include/diffrun/dump_writer.h, "Reading a dump") over DumpReader, the reader diffrun itself uses; no exception crosses the ABI.
// DumpReader presents every dataset as float32 in the vocabulary's layout and puts a cache stored as the
// rows each step wrote back together (docs/dump-format.md, "Rows"); this file only adds the handle, the
// lookups by step and name, and the messages.
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "diffrun/dump_writer.h"
#include "dump/dump.hpp"
#include "dump/dump_format.hpp"
#include "model/error.hpp"

struct diffrun_dump_reader {
  std::unique_ptr<diffrun::DumpReader> reader;
  std::string error;
  std::vector<int> steps;
  std::vector<int32_t> ids;    // diffrun_dump_reader_tokens' result
  std::vector<float> data;     // diffrun_dump_reader_get's result
  std::vector<int64_t> dims;
};

namespace {

thread_local std::string t_reader_error;

struct ReaderError {
  int code;
  std::string message;
};

void need(bool ok, int code, const std::string& message) {
  if (!ok) throw ReaderError{code, message};
}

std::string file_of(const diffrun_dump_reader* r) {
  return r && r->reader ? r->reader->path() + ": " : std::string();
}

// Runs `body`, turning every exception into a return code and a message on the handle.
template <class F>
int guard(diffrun_dump_reader* r, F&& body) {
  int code = DIFFRUN_DUMP_OK;
  std::string message;
  try {
    body();
  } catch (const ReaderError& e) {
    code = e.code;
    message = e.message;
  } catch (const diffrun::DumpError& e) {  // names the file (and dataset) itself
    code = DIFFRUN_DUMP_E_IO;
    message = e.what();
  } catch (const diffrun::Error& e) {
    code = DIFFRUN_DUMP_E_IO;
    message = file_of(r) + e.what();
  } catch (const std::bad_alloc&) {
    code = DIFFRUN_DUMP_E_INTERNAL;
    message = file_of(r) + "out of memory";
  } catch (const std::exception& e) {
    code = DIFFRUN_DUMP_E_INTERNAL;
    message = file_of(r) + e.what();
  } catch (...) {
    code = DIFFRUN_DUMP_E_INTERNAL;
    message = file_of(r) + "unknown failure";
  }
  if (code != DIFFRUN_DUMP_OK) {
    t_reader_error = message;
    if (r) r->error = message;
  }
  return code;
}

int null_handle(const char* fn) {
  t_reader_error = std::string(fn) + ": the reader handle is NULL";
  return DIFFRUN_DUMP_E_ARG;
}

std::string steps_text(const std::vector<int>& steps) {
  if (steps.empty()) return "none";
  std::string s;
  for (size_t i = 0; i < steps.size() && i < 8; ++i) s += (i ? ", " : "") + std::to_string(steps[i]);
  if (steps.size() > 8) s += ", ... " + std::to_string(steps.back());
  return s;
}

void need_step(const diffrun_dump_reader* r, int step) {
  for (int s : r->steps)
    if (s == step) return;
  throw ReaderError{DIFFRUN_DUMP_E_STEP, file_of(r) + "no step " + std::to_string(step) + " (group '" +
                                            diffrun::dump_step_group_name(step < 0 ? 0 : step) +
                                            "'); the dump holds steps " + steps_text(r->steps)};
}

}  // namespace

extern "C" {

int diffrun_dump_reader_open(const char* path, diffrun_dump_reader** out) {
  if (!out) {
    t_reader_error = "diffrun_dump_reader_open: out is NULL";
    return DIFFRUN_DUMP_E_ARG;
  }
  *out = nullptr;
  if (!path || !*path) {
    t_reader_error = "diffrun_dump_reader_open: path is NULL or empty";
    return DIFFRUN_DUMP_E_ARG;
  }
  diffrun_dump_reader* r = nullptr;
  const int rc = guard(nullptr, [&] {
    auto h = std::make_unique<diffrun_dump_reader>();
    h->reader = std::make_unique<diffrun::DumpReader>(path);
    h->steps = h->reader->steps();
    r = h.release();
  });
  *out = r;
  return rc;
}

int diffrun_dump_reader_steps(diffrun_dump_reader* r, const int** steps, size_t* n) {
  if (!r) return null_handle("diffrun_dump_reader_steps");
  return guard(r, [&] {
    need(steps != nullptr && n != nullptr, DIFFRUN_DUMP_E_ARG, file_of(r) + "diffrun_dump_reader_steps: steps or n is NULL");
    *steps = r->steps.data();
    *n = r->steps.size();
  });
}

int diffrun_dump_reader_tokens(diffrun_dump_reader* r, int step, const int32_t** ids, size_t* n) {
  if (!r) return null_handle("diffrun_dump_reader_tokens");
  return guard(r, [&] {
    need(ids != nullptr && n != nullptr, DIFFRUN_DUMP_E_ARG, file_of(r) + "diffrun_dump_reader_tokens: ids or n is NULL");
    *ids = nullptr;
    *n = 0;
    need_step(r, step);
    need(r->reader->find(step, "tokens") != nullptr, DIFFRUN_DUMP_E_IO,
         file_of(r) + "dataset '" + diffrun::dump_step_group_name(step) + "/tokens': missing (every step holds its tokens)");
    r->ids = r->reader->read_ids(step, "tokens");
    *ids = r->ids.data();
    *n = r->ids.size();
  });
}

int diffrun_dump_reader_get(diffrun_dump_reader* r, const char* name, int step, const float** data,
                            const int64_t** dims, int* ndim, int64_t* row_offset) {
  if (!r) return null_handle("diffrun_dump_reader_get");
  return guard(r, [&] {
    need(data != nullptr, DIFFRUN_DUMP_E_ARG, file_of(r) + "diffrun_dump_reader_get: data is NULL");
    *data = nullptr;
    if (dims) *dims = nullptr;
    if (ndim) *ndim = 0;
    if (row_offset) *row_offset = 0;
    need(name != nullptr && *name, DIFFRUN_DUMP_E_ARG, file_of(r) + "diffrun_dump_reader_get: the checkpoint name is NULL or empty");
    need_step(r, step);
    const std::string at = file_of(r) + "dataset '" + diffrun::dump_step_group_name(step) + "/" + name + "': ";
    const diffrun::DatasetInfo* info = r->reader->find(step, name);
    need(info != nullptr, DIFFRUN_DUMP_E_CHECKPOINT, at + "not in the dump (step " + std::to_string(step) + " does not hold it)");
    need(!info->is_int, DIFFRUN_DUMP_E_CHECKPOINT,
         at + "holds integer ids, not floats" + (std::string(name) == "tokens" ? " (diffrun_dump_reader_tokens reads them)" : ""));
    std::vector<float> values = r->reader->read(step, name);
    size_t count = 1;
    for (int64_t x : info->shape) count *= static_cast<size_t>(x);
    need(values.size() == count, DIFFRUN_DUMP_E_INTERNAL,
         at + std::to_string(values.size()) + " values read for a shape of " + std::to_string(count));
    r->data = std::move(values);
    r->dims = info->shape;
    *data = r->data.data();
    if (dims) *dims = r->dims.data();
    if (ndim) *ndim = static_cast<int>(r->dims.size());
    if (row_offset) *row_offset = info->row_offset;
  });
}

int diffrun_dump_reader_close(diffrun_dump_reader* r) {
  delete r;
  return DIFFRUN_DUMP_OK;
}

const char* diffrun_dump_reader_last_error(const diffrun_dump_reader* r) {
  return r ? r->error.c_str() : t_reader_error.c_str();
}

}  // extern "C"
