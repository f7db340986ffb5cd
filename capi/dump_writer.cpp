// The C API dump writer (capi/include/diffrun/dump_writer.h) over DumpFile, the one implementation of the format; no exception crosses the ABI.
// Checks as it goes, so an engine learns of a mistake at the call that made it: root attributes
// against the format's table when step 0 starts (every problem in one message), each checkpoint's
// name, layer, shape and layout against the vocabulary of the dump's config.
#include "diffrun/dump_writer.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <set>
#include <unordered_set>
#include <string>
#include <utility>
#include <vector>

#include "capi/cuda_driver.hpp"
#include "capi/gather_kernel_ptx.hpp"
#include "checkpoints/dump_schema.hpp"
#include "checkpoints/vocabulary.hpp"
#include "dump/dump_format.hpp"
#include "dump/dump_validate.hpp"
#include "dump/rows.hpp"
#include "model/error.hpp"

namespace diffrun::capi {

// What a put stores once its checks passed: the dataset's name, dtype, shape (the vocabulary's for merged
// heads) and attributes.
struct Checked {
  std::string name;
  StoredDType type = StoredDType::f32;
  std::vector<int64_t> shape;
  DatasetAttributes attrs;
  size_t bytes = 0;
};

// Device puts (diffrun_dump_put_device): the copies land in pinned staging memory and reach the file
// later, from the caller's thread, inside diffrun_dump_step / _flush / _close (HDF5 is called from no
// other thread). One allocation of `size` bytes: immediate puts take space from the bottom (reset to 0
// whenever nothing is pending), the slots of captured graphs from the top (kept until close).
struct Slot {  // a device put captured into a CUDA graph: every launch copies it to base + offset
  std::string name;
  int layer;
  std::vector<int64_t> dims;
  diffrun_dtype dtype;
  size_t offset;
  Checked checked;   // its checks at the capture, which every replay's step repeats only where they can differ
  int64_t n_tokens;  // T at the capture
};

struct Pending {  // a device put on its way to the file
  int step;
  Checked c;
  const char* data;                  // pinned staging memory: the ring, or a graph's slot until settled
  std::shared_ptr<CUevent_st> done;  // recorded after the copy on the caller's stream; null once waited for
  int graph = -1;                    // the graph whose slots hold the data, until copied out
};

struct Staging {
  const CudaDriver* cu = nullptr;
  CUcontext ctx = nullptr;  // where the pinned memory was allocated
  char* base = nullptr;
  size_t size = 0;
  size_t ring_top = 0;      // immediate puts: [0, ring_top) in use
  size_t graph_bottom = 0;  // graph slots: [graph_bottom, size)
  std::vector<CUevent> free_events;
  std::vector<Slot> capturing;             // the slots of the capture in progress
  std::vector<std::vector<Slot>> graphs;   // diffrun_dump_capture_end's graphs
  std::deque<Pending> pending;             // in put order
  // Deferred device puts (diffrun_dump_put_device_deferred), copied at the next diffrun_dump_flush_device.
  struct Noted {
    Checked c;
    unsigned long long src;  // device
    size_t offset;           // in the staging memory: a graph slot (captured), else set at the flush
  };
  std::vector<Noted> noted;
  void* noted_stream = nullptr;
  bool noted_captured = false;
  unsigned long long device_base = 0;  // base as the device addresses it; 0: not mapped
  CUmodule module = nullptr;           // capi/gather_kernel.cu's PTX, loaded in ctx
  CUfunction gather = nullptr;         // null: the flush copies with cuMemcpyDtoHAsync, one per put
  ~Staging();
};

}  // namespace diffrun::capi

struct diffrun_dump {
  std::unique_ptr<diffrun::DumpFile> file;
  std::string error;
  int step = -1;                 // the current step, -1 before the first
  bool step_has_tokens = false;  // the current step recorded its tokens
  int64_t n_tokens = 0;          // T of the current step
  int64_t n_kv = 0;              // S after the current step
  std::optional<diffrun::ModelConfig> config;  // from the root attributes, when step 0 started
  std::vector<int32_t> token_ids;
  std::optional<std::vector<int32_t>> all_token_ids;
  std::vector<int32_t> fed;  // diffrun_dump_step_tokens' result
  std::unordered_set<std::string> step_names;  // what the current step recorded (written, staged or replayed)
  std::unique_ptr<diffrun::capi::Staging> staging;      // device puts: created by the first one
  // diffrun_dump_set_shard: what the next puts hold of their checkpoint in a rank dump.
  std::string shard_split;    // the layout letter split along; "": not split
  int64_t shard_offset = 0;   // the slice's first index along shard_split
  bool shard_partial = false; // partial sums the ranks' all-reduce adds
};

namespace {

using diffrun::AttrType;
using diffrun::capi::Checked;

thread_local std::string t_error;

// A failure with its return code; the message names the file and what is wrong.
struct ApiError {
  int code;
  std::string message;
};

std::string where(const diffrun_dump* d) { return d && d->file ? d->file->path() + ": " : std::string(); }

// Runs `body`, turning every exception into a return code and a message on the handle.
template <class F>
int guard(diffrun_dump* d, F&& body) {
  int code = DIFFRUN_DUMP_OK;
  std::string message;
  try {
    body();
  } catch (const ApiError& e) {
    code = e.code;
    message = e.message;
  } catch (const diffrun::DumpError& e) {
    code = DIFFRUN_DUMP_E_IO;
    message = e.what();
  } catch (const diffrun::Error& e) {
    code = DIFFRUN_DUMP_E_ARG;
    message = where(d) + e.what();
  } catch (const std::bad_alloc&) {
    code = DIFFRUN_DUMP_E_INTERNAL;
    message = where(d) + "out of memory";
  } catch (const std::exception& e) {
    code = DIFFRUN_DUMP_E_INTERNAL;
    message = where(d) + e.what();
  } catch (...) {
    code = DIFFRUN_DUMP_E_INTERNAL;
    message = where(d) + "unknown failure";
  }
  if (code != DIFFRUN_DUMP_OK) {
    t_error = message;
    if (d) d->error = message;
  }
  return code;
}

int null_handle(const char* fn) {
  t_error = std::string(fn) + ": the handle is NULL";
  return DIFFRUN_DUMP_E_ARG;
}

// Throws ApiError{code, message} unless `ok`. A macro so that the message, often a few concatenations,
// is only built when the check fails: a decode step's graph replays hundreds of checked puts.
#define need(ok, code, message)                                 \
  do {                                                          \
    if (!(ok)) throw ApiError{(code), (message)};               \
  } while (0)

std::string str_arg(const char* s, const std::string& what) {
  need(s != nullptr, DIFFRUN_DUMP_E_ARG, what + " is NULL");
  return s;
}

// The format's entry for `name`, checked against the setter used; nullptr for a fact.
const diffrun::RootAttribute* settable(diffrun_dump* d, const std::string& name, AttrType used) {
  need(!name.empty(), DIFFRUN_DUMP_E_ARG, where(d) + "attribute name is empty");
  need(name != diffrun::attr::format && name != diffrun::attr::format_version, DIFFRUN_DUMP_E_META,
       where(d) + "root attribute '" + name + "' is written by the library");
  const diffrun::RootAttribute* a = diffrun::find_root_attribute(name);
  need(d->step < 0 || !a || !a->required, DIFFRUN_DUMP_E_STEP,
       where(d) + "root attribute '" + name + "' set after step 0 started (set the meta first)");
  need((a && a->type == used) || (!a && used == AttrType::string), DIFFRUN_DUMP_E_META,
       where(d) + "root attribute '" + name + "' is " +
           (a ? std::string("a ") + diffrun::attr_type_name(a->type) : std::string("not an attribute of the format")) +
           ", not a " + diffrun::attr_type_name(used));
  return a;
}

const char* dtype_name(diffrun_dtype t) {
  switch (t) {
    case DIFFRUN_F32: return "f32";
    case DIFFRUN_F16: return "f16";
    case DIFFRUN_BF16: return "bf16";
    case DIFFRUN_F64: return "f64";
    case DIFFRUN_I32: return "i32";
  }
  return nullptr;
}

// "f16|bf16|f32|f64": the allowed values of an enum string.
std::string one_of(const std::vector<std::string>& values) {
  std::string s;
  for (const auto& v : values) s += (s.empty() ? "" : "|") + v;
  return s;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

void start_step(diffrun_dump* d, int step) {
  const std::string w = where(d);
  need(step >= 0, DIFFRUN_DUMP_E_STEP, w + "step " + std::to_string(step) + " is negative");
  need(step == d->step + 1, DIFFRUN_DUMP_E_STEP,
       w + "step " + std::to_string(step) + " out of order: steps are 0, 1, 2, ... and the next is " +
           std::to_string(d->step + 1));
  if (d->step >= 0)
    need(d->step_has_tokens, DIFFRUN_DUMP_E_STEP,
         w + "step " + std::to_string(d->step) + " recorded no tokens (put \"tokens\" first in every step)");
  if (step == 0) {
    diffrun::RootCheck root = diffrun::check_root_attributes(d->file->hdf5_file());
    if (!root.problems.empty()) {
      std::string msg = w + "the root attributes are not complete (" + std::to_string(root.problems.size()) +
                        " problem" + (root.problems.size() == 1 ? "" : "s") + "): ";
      for (size_t i = 0; i < root.problems.size(); ++i)
        msg += (i ? "; " : "") + root.problems[i].where + ": " + root.problems[i].what;
      throw ApiError{DIFFRUN_DUMP_E_META, msg};
    }
    d->config = root.config;
    d->token_ids = root.token_ids;
    d->all_token_ids = root.all_token_ids;
  }
  d->step = step;
  d->step_has_tokens = false;
  d->n_tokens = 0;
  d->step_names.clear();
}

std::string dataset_at(const diffrun_dump* d, const std::string& name) {
  return d->file->path() + ": dataset '" + diffrun::dump_step_group_name(d->step < 0 ? 0 : d->step) + "/" + name + "': ";
}

// `name` was recorded in the current step: in the file, or on its way there from the device (steps only
// go forward, so the step's names are all its datasets).
bool recorded(const diffrun_dump* d, const std::string& name) { return d->step_names.count(name) > 0; }

// A put under diffrun_dump_set_shard with a split: the config sized for its slice (diffrun::shard_slice_config);
// nullopt when the put is not split or names no checkpoint (check_checkpoint names that).
std::optional<diffrun::ModelConfig> shard_config(const diffrun_dump* d, const std::string& at, const std::string& name,
                                                 const std::vector<int64_t>& shape, int64_t n_tokens, int64_t n_kv) {
  if (d->shard_split.empty()) return std::nullopt;
  const diffrun::CheckpointKind* kind = diffrun::find_checkpoint_kind(diffrun::parse_checkpoint_name(name).base);
  if (!kind) return std::nullopt;
  diffrun::ModelConfig sharded;
  const std::string problem = diffrun::shard_slice_config(*d->config, kind->layout, d->shard_split, d->shard_offset,
                                                          shape, n_tokens, n_kv, &sharded);
  need(problem.empty(), DIFFRUN_DUMP_E_CHECKPOINT, at + problem);
  return sharded;
}

// The checks of every put, host or device, against the current step: name, dtype, shape and layout
// against the vocabulary, tokens first, each name once. Reads `data` only for tokens (their ids).
Checked check_put(diffrun_dump* d, const char* name_c, int layer, const int64_t* dims, int ndim, diffrun_dtype dtype,
                  const void* data, const char* layout_c, const char* native_c, bool foreign = false,
                  int64_t row_offset = 0) {
  const std::string name = str_arg(name_c, "the checkpoint name");
  const std::string at = dataset_at(d, name);
  const char* type = dtype_name(dtype);
  need(type != nullptr, DIFFRUN_DUMP_E_ARG, at + "unknown dtype " + std::to_string(dtype) +
                                                " (DIFFRUN_F32, _F16, _BF16, _F64 or _I32)");
  need(d->step >= 0, DIFFRUN_DUMP_E_STEP, at + "no step started (call diffrun_dump_step first)");
  need(row_offset == 0 || (name != "tokens" && !foreign), DIFFRUN_DUMP_E_CHECKPOINT,
       at + "row_offset " + std::to_string(row_offset) + ": tokens hold every row of a step");
  need(ndim >= 0 && ndim <= 8, DIFFRUN_DUMP_E_ARG, at + "ndim " + std::to_string(ndim) + " outside 0..8");
  need(ndim == 0 || dims != nullptr, DIFFRUN_DUMP_E_ARG, at + "dims is NULL");
  std::vector<int64_t> shape(dims, dims + ndim);
  for (int64_t x : shape) need(x >= 0, DIFFRUN_DUMP_E_ARG, at + "negative dimension in " + shape_text(shape));
  // The element count, refused when it or its bytes overflow 64 bits ({2^32, 2^32} would wrap to 0
  // elements and pass with data NULL); a zero dimension makes any shape empty.
  int64_t n = 1;
  const bool empty = std::count(shape.begin(), shape.end(), int64_t{0}) > 0;
  for (int64_t x : shape) {
    if (empty) break;
    need(n <= std::numeric_limits<int64_t>::max() / 8 / x, DIFFRUN_DUMP_E_ARG,
         at + "shape " + shape_text(shape) + " overflows: its element count times 8 bytes exceeds 2^63");
    n *= x;
  }
  if (empty) n = 0;
  need(n == 0 || data != nullptr, DIFFRUN_DUMP_E_ARG, at + "data is NULL");
  need(!recorded(d, name), DIFFRUN_DUMP_E_CHECKPOINT, at + "recorded twice in this step");
  std::string native = native_c ? native_c : type;
  need(native != "i32" || dtype == DIFFRUN_I32, DIFFRUN_DUMP_E_ARG, at + "native_dtype \"i32\" is for tokens");
  need(diffrun::parse_stored_dtype(native).has_value(), DIFFRUN_DUMP_E_ARG,
       at + "native_dtype \"" + native + "\" is not one of \"f16\", \"bf16\", \"f32\", \"f64\"");
  const diffrun::ModelConfig& cfg = *d->config;
  const diffrun::StoredDType stored = *diffrun::parse_stored_dtype(type);
  Checked c{name, stored, shape, {}, static_cast<size_t>(n) * diffrun::stored_dtype_size(stored)};

  if (name == "tokens") {
    need(dtype == DIFFRUN_I32, DIFFRUN_DUMP_E_CHECKPOINT, at + "tokens are DIFFRUN_I32 ids, not " + type);
    need(layer == -1, DIFFRUN_DUMP_E_CHECKPOINT, at + "layer " + std::to_string(layer) + " for tokens (-1 outside layers)");
    need(ndim == 1 && n >= 1, DIFFRUN_DUMP_E_CHECKPOINT, at + "shape " + shape_text(shape) + ", expected [T] with T >= 1");
    need(!layout_c || std::string(layout_c) == diffrun::dim_letter::T, DIFFRUN_DUMP_E_CHECKPOINT,
         at + "the layout of tokens is \"" + diffrun::dim_letter::T + "\"");
    const auto* ids = static_cast<const int32_t*>(data);
    for (int64_t i = 0; i < n; ++i)
      if (ids[i] < 0 || ids[i] >= cfg.n_vocab)
        throw ApiError{DIFFRUN_DUMP_E_CHECKPOINT, at + "id " + std::to_string(ids[i]) + " outside the vocabulary 0.." +
                                                      std::to_string(cfg.n_vocab - 1)};
    if (d->step == 0) {
      need(std::vector<int32_t>(ids, ids + n) == d->token_ids, DIFFRUN_DUMP_E_CHECKPOINT,
           at + "step 0's tokens differ from the root attribute token_ids (the prompt)");
    } else {
      need(n == 1, DIFFRUN_DUMP_E_CHECKPOINT, at + std::to_string(n) + " ids; a decode step feeds one");
      const size_t i = d->token_ids.size() + static_cast<size_t>(d->step) - 1;
      if (d->all_token_ids && i < d->all_token_ids->size())
        need(ids[0] == (*d->all_token_ids)[i], DIFFRUN_DUMP_E_CHECKPOINT,
             at + "id " + std::to_string(ids[0]) + " but all_token_ids feeds " +
                 std::to_string((*d->all_token_ids)[i]) + " at this step (teacher forcing)");
    }
    c.attrs = {0, -1, diffrun::dim_letter::T, "i32", std::nullopt, {}, std::nullopt, std::nullopt};
    return c;
  }

  need(dtype != DIFFRUN_I32, DIFFRUN_DUMP_E_CHECKPOINT, at + "DIFFRUN_I32 is for tokens; checkpoints are floats");
  need(d->step_has_tokens, DIFFRUN_DUMP_E_STEP, at + "put \"tokens\" first in every step (T and S come from it)");
  if (foreign) {
    // Stored as given, no order/layer/layout: `diffrun compare --names MAP` maps it.
    c.attrs = {std::nullopt, std::nullopt, "", native, std::nullopt, {}, std::nullopt, std::nullopt};
    return c;
  }
  const std::string layout = layout_c ? layout_c : "";
  // row_offset (diffrun_dump_put_rows): the data hold rows row_offset.. of the row dimension, T (S for the cache).
  int64_t n_tokens = d->n_tokens, n_kv = d->n_kv;
  if (row_offset != 0) {
    const diffrun::CheckpointKind* k = diffrun::find_checkpoint_kind(diffrun::parse_checkpoint_name(name).base);
    if (k) {  // an unknown name is named by check_checkpoint below
      need(diffrun::row_dim(k->layout) >= 0, DIFFRUN_DUMP_E_CHECKPOINT,
           at + "row_offset " + std::to_string(row_offset) + " on a checkpoint without token or cache rows (layout " +
               k->layout + ")");
      const bool cache = diffrun::is_cache_layout(k->layout);
      int64_t& rows = cache ? n_kv : n_tokens;
      need(row_offset > 0 && row_offset < rows && row_offset <= std::numeric_limits<int32_t>::max(),
           DIFFRUN_DUMP_E_CHECKPOINT,
           at + "row_offset " + std::to_string(row_offset) + " outside the step's " + std::to_string(rows) +
               (cache ? " cache rows (S)" : " token rows (T)") + ": 0 <= row_offset < " +
               (cache ? diffrun::dim_letter::S : diffrun::dim_letter::T));
      rows -= row_offset;
    }
  }
  const std::optional<diffrun::ModelConfig> sharded = shard_config(d, at, name, shape, n_tokens, n_kv);
  std::vector<int64_t> canonical;
  const std::string problem =
      diffrun::check_checkpoint(sharded ? *sharded : cfg, name, layer, shape, layout, n_tokens, n_kv, &canonical);
  need(problem.empty(), DIFFRUN_DUMP_E_CHECKPOINT,
       at + problem + (row_offset != 0 ? " (with row_offset " + std::to_string(row_offset) + ")" : std::string()));
  const diffrun::ParsedCheckpointName parsed = diffrun::parse_checkpoint_name(name);
  const diffrun::CheckpointKind* kind = diffrun::find_checkpoint_kind(parsed.base);
  const int order = diffrun::checkpoint_order(cfg, parsed.base, parsed.layer);
  // Merged heads are stored in the vocabulary's shape (same bytes).
  c.shape = canonical;
  c.attrs = {order, layer, layout.empty() ? std::string(kind->layout) : layout, native,
             row_offset != 0 ? std::optional<int>(static_cast<int>(row_offset)) : std::nullopt, d->shard_split,
             d->shard_split.empty() ? std::nullopt : std::optional<int>(static_cast<int>(d->shard_offset)),
             d->shard_partial ? std::optional<int>(1) : std::nullopt};
  return c;
}

void put(diffrun_dump* d, const char* name_c, int layer, const int64_t* dims, int ndim, diffrun_dtype dtype,
         const void* data, const char* layout_c, const char* native_c, bool foreign = false, int64_t row_offset = 0) {
  const Checked c = check_put(d, name_c, layer, dims, ndim, dtype, data, layout_c, native_c, foreign, row_offset);
  d->file->write(d->step, c.name, c.type, c.shape, data, c.attrs);
  d->step_names.insert(c.name);
  if (c.name == "tokens") {
    d->step_has_tokens = true;
    d->n_tokens = c.shape[0];
    d->n_kv += c.shape[0];
  }
}

// ---- device puts --------------------------------------------------------------------------------

using diffrun::capi::CudaDriver;
using diffrun::capi::CUresult;
using diffrun::capi::Pending;
using diffrun::capi::Slot;
using diffrun::capi::Staging;
namespace cu_abi = diffrun::capi;

constexpr size_t kStagingAlign = 256;

// `bytes` rounded up to the staging memory's alignment: the space a put takes.
constexpr size_t staged_size(size_t bytes) { return (bytes + kStagingAlign - 1) / kStagingAlign * kStagingAlign; }

void cuda_check(const CudaDriver* cu, CUresult rc, const std::string& what) {
  if (rc != cu_abi::kCudaSuccess) throw ApiError{DIFFRUN_DUMP_E_CUDA, what + ": " + cu_abi::cuda_error_text(*cu, rc)};
}

const CudaDriver* driver(diffrun_dump* d) {
  std::string why;
  const CudaDriver* cu = cu_abi::cuda_driver(&why);
  need(cu != nullptr, DIFFRUN_DUMP_E_CUDA, where(d) + why);
  return cu;
}

// DIFFRUN_DUMP_STAGING_MB, else 64 MiB.
size_t default_staging_bytes() {
  if (const char* v = std::getenv("DIFFRUN_DUMP_STAGING_MB"); v && *v) {
    char* end = nullptr;
    const unsigned long long mb = std::strtoull(v, &end, 10);
    if (end && *end == '\0' && mb > 0 && mb < (1ull << 20)) return static_cast<size_t>(mb) << 20;
  }
  return size_t(64) << 20;
}

// Whether `stream` is capturing a CUDA graph (cuStreamIsCapturing, legal during any capture).
bool capturing(diffrun_dump* d, const CudaDriver* cu, void* stream, const std::string& at) {
  int status = cu_abi::kStreamCaptureNone;
  cuda_check(cu, cu->cuStreamIsCapturing(static_cast<cu_abi::CUstream>(stream), &status), at + "cuStreamIsCapturing");
  need(status == cu_abi::kStreamCaptureNone || status == cu_abi::kStreamCaptureActive, DIFFRUN_DUMP_E_CUDA,
       at + "the stream's capture was invalidated (an earlier call of the capture failed)");
  return status == cu_abi::kStreamCaptureActive;
}

// The handle's staging memory, allocated (pinned, in the current context) by the first call.
Staging& staging(diffrun_dump* d, size_t bytes) {
  if (d->staging) return *d->staging;
  const CudaDriver* cu = driver(d);
  cu_abi::CUcontext ctx = nullptr;
  cuda_check(cu, cu->cuCtxGetCurrent(&ctx), where(d) + "cuCtxGetCurrent");
  need(ctx != nullptr, DIFFRUN_DUMP_E_CUDA,
       where(d) + "no current CUDA context in this thread: initialize CUDA in it first (cudaSetDevice, or any "
                  "CUDA runtime call that creates the context)");
  if (bytes == 0) bytes = default_staging_bytes();
  bytes = staged_size(bytes);
  void* p = nullptr;
  cuda_check(cu, cu->cuMemHostAlloc(&p, bytes, cu_abi::kMemHostAllocPortable | cu_abi::kMemHostAllocDeviceMap),
             where(d) + "cannot allocate " + std::to_string(bytes) + " bytes of pinned staging memory");
  auto s = std::make_unique<Staging>();
  s->cu = cu;
  s->ctx = ctx;
  s->base = static_cast<char*>(p);
  s->size = s->graph_bottom = bytes;
  // The batched copy of deferred puts: a kernel writing into the staging memory through its device
  // mapping. Where either is unavailable, the flush falls back to one cuMemcpyDtoHAsync per put.
  cu_abi::CUdeviceptr mapped = 0;
  if (cu->cuMemHostGetDevicePointer(&mapped, p, 0) == cu_abi::kCudaSuccess &&
      cu->cuModuleLoadData(&s->module, cu_abi::kGatherPtx) == cu_abi::kCudaSuccess) {
    if (cu->cuModuleGetFunction(&s->gather, s->module, cu_abi::kGatherEntry) == cu_abi::kCudaSuccess)
      s->device_base = mapped;
    else
      s->gather = nullptr;
  }
  d->staging = std::move(s);
  return *d->staging;
}

// An event from the handle's pool (created without timing), back in the pool when the last user lets go.
std::shared_ptr<cu_abi::CUevent_st> take_event(Staging& s, const std::string& at) {
  cu_abi::CUevent e = nullptr;
  if (!s.free_events.empty()) {
    e = s.free_events.back();
    s.free_events.pop_back();
  } else {
    cuda_check(s.cu, s.cu->cuEventCreate(&e, cu_abi::kEventDisableTiming), at + "cuEventCreate");
  }
  Staging* owner = &s;
  return {e, [owner](cu_abi::CUevent x) { owner->free_events.push_back(x); }};
}

std::string pending_at(const diffrun_dump* d, const Pending& p) {
  return d->file->path() + ": dataset '" + diffrun::dump_step_group_name(p.step) + "/" + p.c.name + "': ";
}

void drain(diffrun_dump* d);

// Copies the data of every graph launch out of the graph's slots into the ring (waiting for the launch's
// copies), so that the next launch may overwrite them. Pinned to pinned: no fresh heap pages to fault in
// at every step. When the ring has no room for them all, everything pending goes to the file instead,
// the launches' data straight from their slots.
void settle_graphs(diffrun_dump* d) {
  Staging& s = *d->staging;
  size_t need_bytes = 0;
  for (const Pending& p : s.pending)
    if (p.graph >= 0) need_bytes += staged_size(p.c.bytes);
  if (need_bytes == 0) return;
  if (s.ring_top + need_bytes > s.graph_bottom) {
    drain(d);
    return;
  }
  for (Pending& p : s.pending) {
    if (p.graph < 0) continue;
    if (p.done)
      cuda_check(s.cu, s.cu->cuEventSynchronize(p.done.get()), pending_at(d, p) + "the copy from the device failed");
    char* dst = s.base + s.ring_top;
    std::memcpy(dst, p.data, p.c.bytes);
    s.ring_top += staged_size(p.c.bytes);
    p.data = dst;
    p.done.reset();
    p.graph = -1;
  }
}

// Writes every pending device put to the file, in put order, waiting for each copy; then the ring is empty.
void drain(diffrun_dump* d) {
  Staging& s = *d->staging;
  while (!s.pending.empty()) {
    Pending& p = s.pending.front();
    if (p.done)
      cuda_check(s.cu, s.cu->cuEventSynchronize(p.done.get()), pending_at(d, p) + "the copy from the device failed");
    d->file->write(p.step, p.c.name, p.c.type, p.c.shape, p.data, p.c.attrs);
    s.pending.pop_front();
  }
  s.ring_top = 0;
}

std::string staging_hint(const Staging& s) {
  return " (the staging memory is " + std::to_string(s.size) + " bytes, " + std::to_string(s.size - s.graph_bottom) +
         " of them held by captured graphs: diffrun_dump_set_staging or DIFFRUN_DUMP_STAGING_MB sets its size)";
}

// Space for an immediate put: drains every pending put (waiting for their copies) when the ring is full.
size_t take_ring(diffrun_dump* d, Staging& s, size_t bytes, const std::string& at) {
  const size_t aligned = staged_size(bytes);
  need(aligned <= s.graph_bottom, DIFFRUN_DUMP_E_ARG, at + std::to_string(bytes) + " bytes do not fit" + staging_hint(s));
  if (s.ring_top + aligned > s.graph_bottom) drain(d);
  const size_t offset = s.ring_top;
  s.ring_top += aligned;
  return offset;
}

bool has_letter(const std::string& layout, const char* letter) {
  size_t start = 0;
  while (start <= layout.size()) {
    const size_t end = std::min(layout.find(',', start), layout.size());
    if (layout.compare(start, end - start, letter) == 0) return true;
    start = end + 1;
  }
  return false;
}

// Deferred puts since the last flush must all be of one stream and one side of a capture.
void note_deferred(Staging& s, void* stream, bool captured, const std::string& at) {
  if (s.noted.empty()) {
    s.noted_stream = stream;
    s.noted_captured = captured;
    return;
  }
  need(stream == s.noted_stream, DIFFRUN_DUMP_E_ARG,
       at + "deferred on another stream than the deferred puts before it: diffrun_dump_flush_device their stream first");
  need(captured == s.noted_captured, DIFFRUN_DUMP_E_ARG,
       at + "deferred puts on both sides of a capture's start or end: diffrun_dump_flush_device before "
            "cudaStreamBeginCapture and before cudaStreamEndCapture");
}

void put_device(diffrun_dump* d, const char* name_c, int layer, const int64_t* dims, int ndim, diffrun_dtype dtype,
                const void* device_ptr, void* stream, bool deferred) {
  need(name_c == nullptr || std::strcmp(name_c, "tokens") != 0, DIFFRUN_DUMP_E_ARG,
       where(d) + "tokens are host ids: put them with diffrun_dump_put");
  const Checked c = check_put(d, name_c, layer, dims, ndim, dtype, device_ptr, nullptr, nullptr);
  const std::string at = dataset_at(d, c.name);
  need(c.bytes > 0, DIFFRUN_DUMP_E_CHECKPOINT, at + "no elements");
  const CudaDriver* cu = driver(d);
  const auto src = reinterpret_cast<cu_abi::CUdeviceptr>(device_ptr);
  const auto str = static_cast<cu_abi::CUstream>(stream);
  if (capturing(d, cu, stream, at)) {
    // Nothing that may synchronize or allocate: the copy is captured into fixed slots of the staging memory.
    need(d->staging != nullptr, DIFFRUN_DUMP_E_ARG,
         at + "the first device put is inside a stream capture, where pinned memory cannot be allocated: call "
              "diffrun_dump_set_staging (or put outside the capture) before capturing");
    Staging& s = *d->staging;
    need(!has_letter(c.attrs.layout, diffrun::dim_letter::S), DIFFRUN_DUMP_E_CHECKPOINT,
         at + "its S dimension grows every step but a graph replays fixed shapes: put it outside the capture");
    for (const Slot& x : s.capturing)
      need(x.name != c.name, DIFFRUN_DUMP_E_CHECKPOINT, at + "recorded twice in this capture");
    const size_t aligned = staged_size(c.bytes);
    need(s.ring_top + aligned <= s.graph_bottom, DIFFRUN_DUMP_E_ARG,
         at + "no room for its graph slot (" + std::to_string(c.bytes) + " bytes)" + staging_hint(s) +
             "; diffrun_dump_flush before the capture empties the rest");
    if (deferred) {
      for (const Staging::Noted& x : s.noted)
        need(x.c.name != c.name, DIFFRUN_DUMP_E_CHECKPOINT, at + "recorded twice in this capture");
      note_deferred(s, stream, true, at);
      s.noted.push_back(Staging::Noted{c, src, s.graph_bottom - aligned});
    } else {
      cuda_check(cu, cu->cuMemcpyDtoHAsync(s.base + s.graph_bottom - aligned, src, c.bytes, str),
                 at + "the copy could not be captured (cuMemcpyDtoHAsync)");
    }
    s.graph_bottom -= aligned;
    s.capturing.push_back(
        Slot{c.name, layer, std::vector<int64_t>(dims, dims + ndim), dtype, s.graph_bottom, c, d->n_tokens});
    return;
  }
  Staging& s = staging(d, 0);
  int memory_type = 0;
  const CUresult known = cu->cuPointerGetAttribute(&memory_type, cu_abi::kPointerAttributeMemoryType, src);
  if (known != cu_abi::kCudaSuccess) {
    char p[32];
    std::snprintf(p, sizeof p, "%p", device_ptr);
    throw ApiError{known == cu_abi::kCudaErrorInvalidValue ? DIFFRUN_DUMP_E_ARG : DIFFRUN_DUMP_E_CUDA,
                   at + "device_ptr " + p + " is not memory CUDA knows (" + cu_abi::cuda_error_text(*cu, known) +
                       "); host memory goes through diffrun_dump_put"};
  }
  if (deferred) {
    need(c.bytes <= s.graph_bottom, DIFFRUN_DUMP_E_ARG, at + std::to_string(c.bytes) + " bytes do not fit" + staging_hint(s));
    note_deferred(s, stream, false, at);
    s.noted.push_back(Staging::Noted{c, src, 0});
    d->step_names.insert(c.name);
    return;
  }
  const size_t offset = take_ring(d, s, c.bytes, at);
  cuda_check(cu, cu->cuMemcpyDtoHAsync(s.base + offset, src, c.bytes, str), at + "cuMemcpyDtoHAsync");
  auto done = take_event(s, at);
  cuda_check(cu, cu->cuEventRecord(done.get(), str), at + "cuEventRecord");
  s.pending.push_back(Pending{d->step, c, s.base + offset, std::move(done), -1});
  d->step_names.insert(c.name);
}

// The copies of every deferred put since the last flush, enqueued on `stream`: the gather kernel, up to
// kGatherMaxItems puts a launch, or one cuMemcpyDtoHAsync each where the kernel is unavailable. Outside a
// capture the puts then take ring space and wait for the file like immediate ones; inside one, the copies
// become the graph's nodes, writing the slots noted at the puts.
void flush_device(diffrun_dump* d, void* stream) {
  if (!d->staging || d->staging->noted.empty()) return;
  Staging& s = *d->staging;
  const std::string at = where(d) + "diffrun_dump_flush_device: ";
  need(stream == s.noted_stream, DIFFRUN_DUMP_E_ARG,
       at + "the deferred puts since the last flush were made on another stream");
  const bool cap = capturing(d, s.cu, stream, at);
  need(cap == s.noted_captured, DIFFRUN_DUMP_E_ARG,
       at + (cap ? "inside a capture, but the deferred puts were made outside it: flush before cudaStreamBeginCapture"
                 : "outside a capture, but the deferred puts were made inside one: flush before cudaStreamEndCapture"));
  if (!cap) {
    size_t total = 0;
    for (const Staging::Noted& n : s.noted) total += staged_size(n.c.bytes);
    if (s.ring_top + total > s.graph_bottom) drain(d);
    need(s.ring_top + total <= s.graph_bottom, DIFFRUN_DUMP_E_ARG,
         at + std::to_string(s.noted.size()) + " deferred puts (" + std::to_string(total) + " bytes) do not fit" +
             staging_hint(s) + ": flush more often");
    for (Staging::Noted& n : s.noted) {
      n.offset = s.ring_top;
      s.ring_top += staged_size(n.c.bytes);
    }
  }
  const auto str = static_cast<cu_abi::CUstream>(stream);
  if (s.gather) {
    struct Item {
      unsigned long long src, dst, bytes;
    };
    struct Batch {  // DiffrunGatherBatch
      Item item[cu_abi::kGatherMaxItems];
      int count;
    };
    static_assert(sizeof(Batch) == 1544, "the layout of capi/gather_kernel.cu's parameter");
    for (size_t first = 0; first < s.noted.size(); first += cu_abi::kGatherMaxItems) {
      Batch b{};
      unsigned long long most = 0;
      b.count = static_cast<int>(std::min<size_t>(cu_abi::kGatherMaxItems, s.noted.size() - first));
      for (int i = 0; i < b.count; ++i) {
        const Staging::Noted& n = s.noted[first + static_cast<size_t>(i)];
        b.item[i] = Item{n.src, s.device_base + n.offset, n.c.bytes};
        most = std::max<unsigned long long>(most, n.c.bytes);
      }
      const unsigned threads = 256;
      const unsigned blocks = static_cast<unsigned>(std::clamp<unsigned long long>((most + 16 * threads - 1) / (16 * threads), 1, 128));
      void* params[] = {&b};
      cuda_check(s.cu, s.cu->cuLaunchKernel(s.gather, blocks, static_cast<unsigned>(b.count), 1, threads, 1, 1, 0, str,
                                            params, nullptr),
                 at + "the copy kernel could not be launched");
    }
  } else {
    for (const Staging::Noted& n : s.noted)
      cuda_check(s.cu, s.cu->cuMemcpyDtoHAsync(s.base + n.offset, n.src, n.c.bytes, str),
                 pending_at(d, Pending{d->step, n.c, nullptr, nullptr, -1}) + "cuMemcpyDtoHAsync");
  }
  if (!cap) {
    auto done = take_event(s, at);
    cuda_check(s.cu, s.cu->cuEventRecord(done.get(), str), at + "cuEventRecord");
    for (const Staging::Noted& n : s.noted) s.pending.push_back(Pending{d->step, n.c, s.base + n.offset, done, -1});
  }
  s.noted.clear();
}

// Deferred puts must be flushed before the step ends, the capture's graph is taken, or the dump closes.
void no_unflushed(const diffrun_dump* d, const char* what) {
  if (!d->staging || d->staging->noted.empty()) return;
  throw ApiError{DIFFRUN_DUMP_E_ARG, where(d) + what + ": " + std::to_string(d->staging->noted.size()) +
                                         " deferred device puts not flushed (the first '" +
                                         d->staging->noted.front().c.name +
                                         "'): call diffrun_dump_flush_device on their stream first"};
}

void replay(diffrun_dump* d, int graph, void* stream) {
  const std::string at = where(d) + "graph " + std::to_string(graph) + ": ";
  need(d->staging && graph >= 0 && static_cast<size_t>(graph) < d->staging->graphs.size(), DIFFRUN_DUMP_E_ARG,
       at + "not a graph diffrun_dump_capture_end returned");
  Staging& s = *d->staging;
  need(!capturing(d, s.cu, stream, at), DIFFRUN_DUMP_E_ARG,
       at + "diffrun_dump_replay during a capture (call it after cudaGraphLaunch, outside any capture)");
  const std::vector<Slot>& slots = s.graphs[static_cast<size_t>(graph)];
  if (slots.empty()) return;
  // The capture checked each slot against the vocabulary; what a later step can change is checked again
  // (tokens first, the same T, each name once), all before any is recorded, so that a failure records
  // none of them.
  need(d->step >= 0, DIFFRUN_DUMP_E_STEP, at + "no step started (call diffrun_dump_step first)");
  need(d->step_has_tokens, DIFFRUN_DUMP_E_STEP, at + "put \"tokens\" first in every step (T and S come from it)");
  for (const Slot& x : slots) {
    need(x.n_tokens == d->n_tokens, DIFFRUN_DUMP_E_CHECKPOINT,
         dataset_at(d, x.name) + "captured in a step of " + std::to_string(x.n_tokens) + " tokens, replayed in one of " +
             std::to_string(d->n_tokens) + " (a graph replays fixed shapes)");
    need(!recorded(d, x.name), DIFFRUN_DUMP_E_CHECKPOINT, dataset_at(d, x.name) + "recorded twice in this step");
  }
  auto done = take_event(s, at);
  cuda_check(s.cu, s.cu->cuEventRecord(done.get(), static_cast<cu_abi::CUstream>(stream)), at + "cuEventRecord");
  for (const Slot& x : slots) {
    d->step_names.insert(x.name);
    s.pending.push_back(Pending{d->step, x.checked, s.base + x.offset, done, graph});
  }
}

}  // namespace

diffrun::capi::Staging::~Staging() {
  if (!cu) return;
  CUcontext prev = nullptr;
  const bool pushed = ctx && cu->cuCtxPushCurrent(ctx) == kCudaSuccess;
  // Copies in flight write into the memory freed below: wait for them (errors ignored, a failed
  // engine's context may be gone).
  for (Pending& p : pending)
    if (p.done) cu->cuEventSynchronize(p.done.get());
  pending.clear();  // the events go back to free_events
  for (CUevent e : free_events) cu->cuEventDestroy(e);
  free_events.clear();
  if (base) cu->cuMemFreeHost(base);
  if (module) cu->cuModuleUnload(module);
  if (pushed) cu->cuCtxPopCurrent(&prev);
}

extern "C" {

int diffrun_dump_open(const char* path, diffrun_dump** out) {
  if (!out) {
    t_error = "diffrun_dump_open: out is NULL";
    return DIFFRUN_DUMP_E_ARG;
  }
  *out = nullptr;
  if (!path || !*path) {
    t_error = "diffrun_dump_open: path is NULL or empty";
    return DIFFRUN_DUMP_E_ARG;
  }
  diffrun_dump* d = nullptr;
  const int rc = guard(nullptr, [&] {
    auto h = std::make_unique<diffrun_dump>();
    h->file = std::make_unique<diffrun::DumpFile>(path);
    h->file->set_string(diffrun::attr::format, diffrun::kDumpFormat);
    h->file->set_int(diffrun::attr::format_version, diffrun::kDumpFormatVersion);
    h->file->set_string(diffrun::attr::created_utc, diffrun::utc_now_iso8601());
    h->file->set_string(diffrun::attr::diffrun_version, DIFFRUN_VERSION);
    d = h.release();
  });
  *out = d;
  return rc;
}

int diffrun_dump_copy_meta(diffrun_dump* d, const char* reference_path) {
  if (!d) return null_handle("diffrun_dump_copy_meta");
  return guard(d, [&] {
    const std::string ref = str_arg(reference_path, "the reference path");
    need(d->step < 0, DIFFRUN_DUMP_E_STEP, where(d) + "copy_meta after step 0 started");
    d->file->copy_attributes(ref, [](std::string_view name) {
      const diffrun::RootAttribute* a = diffrun::find_root_attribute(name);
      namespace attr = diffrun::attr;
      return a && name != attr::format && name != attr::format_version && name != attr::backend && name != attr::precision &&
             name != attr::created_utc && name != attr::diffrun_version && name != attr::argmax;
    });
  });
}

int diffrun_dump_set_string(diffrun_dump* d, const char* name, const char* value) {
  if (!d) return null_handle("diffrun_dump_set_string");
  return guard(d, [&] {
    const std::string n = str_arg(name, "the attribute name");
    const std::string v = str_arg(value, where(d) + "the value of '" + n + "'");
    const diffrun::RootAttribute* a = settable(d, n, AttrType::string);
    if (a) {
      const auto allowed = diffrun::enum_values(*a);
      bool ok = allowed.empty();
      for (const auto& x : allowed) ok = ok || x == v;
      if (!ok)
        throw ApiError{DIFFRUN_DUMP_E_META,
                       where(d) + "root attribute '" + n + "': \"" + v + "\" is not one of " + one_of(allowed)};
    }
    d->file->set_string(n, v);
  });
}

int diffrun_dump_set_int(diffrun_dump* d, const char* name, int32_t value) {
  if (!d) return null_handle("diffrun_dump_set_int");
  return guard(d, [&] {
    const std::string n = str_arg(name, "the attribute name");
    settable(d, n, AttrType::integer);
    const bool zero_ok = n == diffrun::attr::rank;  // rank 0 is a rank
    need(value > 0 || (zero_ok && value == 0), DIFFRUN_DUMP_E_META,
         where(d) + "root attribute '" + n + "': " + std::to_string(value) +
             (zero_ok ? " (0 .. world_size - 1)" : " (a positive integer)"));
    d->file->set_int(n, value);
  });
}

int diffrun_dump_set_real(diffrun_dump* d, const char* name, double value) {
  if (!d) return null_handle("diffrun_dump_set_real");
  return guard(d, [&] {
    const std::string n = str_arg(name, "the attribute name");
    settable(d, n, AttrType::real);
    need(value > 0, DIFFRUN_DUMP_E_META, where(d) + "root attribute '" + n + "': " + std::to_string(value) +
                                             " (a positive real)");
    d->file->set_real(n, value);
  });
}

int diffrun_dump_set_bool(diffrun_dump* d, const char* name, int value) {
  if (!d) return null_handle("diffrun_dump_set_bool");
  return guard(d, [&] {
    const std::string n = str_arg(name, "the attribute name");
    settable(d, n, AttrType::boolean);
    need(value == 0 || value == 1, DIFFRUN_DUMP_E_META,
         where(d) + "root attribute '" + n + "': " + std::to_string(value) + " (a boolean: 0 or 1)");
    d->file->set_bool(n, value != 0);
  });
}

int diffrun_dump_set_ids(diffrun_dump* d, const char* name, const int32_t* ids, size_t n) {
  if (!d) return null_handle("diffrun_dump_set_ids");
  return guard(d, [&] {
    const std::string key = str_arg(name, "the attribute name");
    settable(d, key, AttrType::int_array);
    need(n == 0 || ids != nullptr, DIFFRUN_DUMP_E_ARG, where(d) + "root attribute '" + key + "': ids is NULL");
    d->file->set_ints(key, std::span<const int32_t>(ids, n));
  });
}

int diffrun_dump_step_tokens(diffrun_dump* d, int step, const int32_t** ids, size_t* n) {
  if (!d) return null_handle("diffrun_dump_step_tokens");
  return guard(d, [&] {
    need(ids != nullptr && n != nullptr, DIFFRUN_DUMP_E_ARG, where(d) + "ids or n is NULL");
    *ids = nullptr;
    *n = 0;
    need(step >= 0, DIFFRUN_DUMP_E_STEP, where(d) + "step " + std::to_string(step) + " is negative");
    const diffrun::RootCheck root = diffrun::check_root_attributes(d->file->hdf5_file());
    need(!root.token_ids.empty(), DIFFRUN_DUMP_E_META, where(d) + "no token_ids (copy_meta or set_ids first)");
    if (step == 0) {
      d->fed = root.token_ids;
    } else {
      const size_t i = root.token_ids.size() + static_cast<size_t>(step) - 1;
      need(root.all_token_ids.has_value(), DIFFRUN_DUMP_E_STEP,
           where(d) + "no all_token_ids: the ids of decode step " + std::to_string(step) + " are unknown");
      need(i < root.all_token_ids->size(), DIFFRUN_DUMP_E_STEP,
           where(d) + "all_token_ids covers steps 0.." +
               std::to_string(root.all_token_ids->size() - root.token_ids.size()) + ", not step " +
               std::to_string(step));
      d->fed.assign(1, (*root.all_token_ids)[i]);
    }
    *ids = d->fed.data();
    *n = d->fed.size();
  });
}

int diffrun_dump_step(diffrun_dump* d, int step) {
  if (!d) return null_handle("diffrun_dump_step");
  return guard(d, [&] {
    no_unflushed(d, "diffrun_dump_step");
    if (d->staging) {
      // The graphs' slots are free for their next launch; the file catches up when staging is half full.
      settle_graphs(d);
      if (d->staging->ring_top > d->staging->size / 2) drain(d);
    }
    start_step(d, step);
  });
}

int diffrun_dump_put(diffrun_dump* d, const char* name, int layer, const int64_t* dims, int ndim, diffrun_dtype dtype,
                     const void* data) {
  if (!d) return null_handle("diffrun_dump_put");
  return guard(d, [&] { put(d, name, layer, dims, ndim, dtype, data, nullptr, nullptr); });
}

int diffrun_dump_put_ex(diffrun_dump* d, const char* name, int layer, const int64_t* dims, int ndim,
                        diffrun_dtype dtype, const void* data, const char* layout, const char* native_dtype) {
  if (!d) return null_handle("diffrun_dump_put_ex");
  return guard(d, [&] { put(d, name, layer, dims, ndim, dtype, data, layout, native_dtype); });
}

int diffrun_dump_put_foreign(diffrun_dump* d, const char* name, const int64_t* dims, int ndim, diffrun_dtype dtype,
                             const void* data, const char* native_dtype) {
  if (!d) return null_handle("diffrun_dump_put_foreign");
  return guard(d, [&] { put(d, name, -1, dims, ndim, dtype, data, nullptr, native_dtype, true); });
}

int diffrun_dump_set_shard(diffrun_dump* d, const char* split, int64_t shard_offset, int partial) {
  if (!d) return null_handle("diffrun_dump_set_shard");
  return guard(d, [&] {
    const std::string s = split ? split : "";
    need(partial == 0 || partial == 1, DIFFRUN_DUMP_E_ARG,
         where(d) + "diffrun_dump_set_shard: partial is " + std::to_string(partial) + ", expected 0 or 1");
    need(!(partial == 1 && !s.empty()), DIFFRUN_DUMP_E_ARG,
         where(d) + "diffrun_dump_set_shard: a split and partial sums together (a rank's piece is one or the other)");
    need(!s.empty() || shard_offset == 0, DIFFRUN_DUMP_E_ARG,
         where(d) + "diffrun_dump_set_shard: shard_offset " + std::to_string(shard_offset) + " without a split");
    need(shard_offset >= 0 && shard_offset <= std::numeric_limits<int32_t>::max(), DIFFRUN_DUMP_E_ARG,
         where(d) + "diffrun_dump_set_shard: shard_offset " + std::to_string(shard_offset) + ", expected 0 .. 2^31 - 1");
    need(s.empty() || diffrun::find_dim(s) != nullptr, DIFFRUN_DUMP_E_ARG,
         where(d) + "diffrun_dump_set_shard: '" + s + "' is not a dimension letter of the format (diffrun vocab)");
    d->shard_split = s;
    d->shard_offset = shard_offset;
    d->shard_partial = partial == 1;
  });
}

int diffrun_dump_put_rows(diffrun_dump* d, const char* name, int layer, const int64_t* dims, int ndim,
                          diffrun_dtype dtype, const void* data, int64_t row_offset) {
  if (!d) return null_handle("diffrun_dump_put_rows");
  return guard(d, [&] { put(d, name, layer, dims, ndim, dtype, data, nullptr, nullptr, false, row_offset); });
}

int diffrun_dump_set_staging(diffrun_dump* d, size_t bytes) {
  if (!d) return null_handle("diffrun_dump_set_staging");
  return guard(d, [&] {
    if (d->staging) {
      need(bytes == 0 || staged_size(bytes) == d->staging->size,
           DIFFRUN_DUMP_E_ARG,
           where(d) + "the staging memory is allocated already (" + std::to_string(d->staging->size) +
               " bytes): set its size before the first device put");
      return;
    }
    staging(d, bytes);
  });
}

int diffrun_dump_put_device(diffrun_dump* d, const char* name, int layer, const int64_t* dims, int ndim,
                            diffrun_dtype dtype, const void* device_ptr, void* stream) {
  if (!d) return null_handle("diffrun_dump_put_device");
  return guard(d, [&] { put_device(d, name, layer, dims, ndim, dtype, device_ptr, stream, false); });
}

int diffrun_dump_put_device_deferred(diffrun_dump* d, const char* name, int layer, const int64_t* dims, int ndim,
                                     diffrun_dtype dtype, const void* device_ptr, void* stream) {
  if (!d) return null_handle("diffrun_dump_put_device_deferred");
  return guard(d, [&] { put_device(d, name, layer, dims, ndim, dtype, device_ptr, stream, true); });
}

int diffrun_dump_flush_device(diffrun_dump* d, void* stream) {
  if (!d) return null_handle("diffrun_dump_flush_device");
  return guard(d, [&] { flush_device(d, stream); });
}

int diffrun_dump_capture_end(diffrun_dump* d, int* graph) {
  if (!d) return null_handle("diffrun_dump_capture_end");
  return guard(d, [&] {
    need(graph != nullptr, DIFFRUN_DUMP_E_ARG, where(d) + "graph is NULL");
    *graph = -1;
    no_unflushed(d, "diffrun_dump_capture_end");
    Staging& s = staging(d, 0);
    s.graphs.push_back(std::move(s.capturing));
    s.capturing.clear();
    *graph = static_cast<int>(s.graphs.size()) - 1;
  });
}

int diffrun_dump_replay(diffrun_dump* d, int graph, void* stream) {
  if (!d) return null_handle("diffrun_dump_replay");
  return guard(d, [&] { replay(d, graph, stream); });
}

int diffrun_dump_flush(diffrun_dump* d) {
  if (!d) return null_handle("diffrun_dump_flush");
  return guard(d, [&] {
    if (d->staging) drain(d);
  });
}

int diffrun_dump_close(diffrun_dump* d) {
  if (!d) return null_handle("diffrun_dump_close");
  const int rc = guard(d, [&] {
    no_unflushed(d, "diffrun_dump_close");
    if (d->staging) drain(d);
    need(d->step >= 0 && (d->step > 0 || d->step_has_tokens), DIFFRUN_DUMP_E_STEP,
         where(d) + "no step recorded (a dump holds at least step 0 with its tokens)");
    d->file->finish();
  });
  if (rc != DIFFRUN_DUMP_OK) t_error = d->error;
  delete d;  // an unfinished DumpFile removes its temporary file
  return rc;
}

int diffrun_dump_abort(diffrun_dump* d) {
  if (!d) return null_handle("diffrun_dump_abort");
  d->file->abort();
  delete d;
  return DIFFRUN_DUMP_OK;
}

const char* diffrun_dump_last_error(const diffrun_dump* d) { return d ? d->error.c_str() : t_error.c_str(); }

const char* diffrun_dump_strerror(int code) {
  switch (code) {
    case DIFFRUN_DUMP_OK: return "ok";
    case DIFFRUN_DUMP_E_ARG: return "bad argument";
    case DIFFRUN_DUMP_E_IO: return "i/o error";
    case DIFFRUN_DUMP_E_META: return "bad or missing root attribute";
    case DIFFRUN_DUMP_E_STEP: return "step out of order";
    case DIFFRUN_DUMP_E_CHECKPOINT: return "checkpoint does not fit the vocabulary";
    case DIFFRUN_DUMP_E_INTERNAL: return "internal error";
    case DIFFRUN_DUMP_E_CUDA: return "CUDA unavailable or failed";
  }
  return "unknown code";
}

const char* diffrun_dump_version(void) { return DIFFRUN_VERSION; }

}  // extern "C"
