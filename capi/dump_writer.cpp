// The C API dump writer (capi/include/diffrun/dump_writer.h) over DumpFile, the one implementation of the format; no exception crosses the ABI.
// Checks as it goes, so an engine learns of a mistake at the call that made it: root attributes
// against the format's table when step 0 starts (every problem in one message), each checkpoint's
// name, layer, shape and layout against the vocabulary of the dump's config.
#include "diffrun/dump_writer.h"

#include <exception>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "checkpoints/dump_format.hpp"
#include "checkpoints/dump_validate.hpp"
#include "checkpoints/vocabulary.hpp"
#include "model/error.hpp"

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
};

namespace {

using diffrun::AttrType;

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

void need(bool ok, int code, const std::string& message) {
  if (!ok) throw ApiError{code, message};
}

std::string str_arg(const char* s, const std::string& what) {
  need(s != nullptr, DIFFRUN_DUMP_E_ARG, what + " is NULL");
  return s;
}

// The format's entry for `name`, checked against the setter used; nullptr for a fact.
const diffrun::RootAttribute* settable(diffrun_dump* d, const std::string& name, AttrType used) {
  need(!name.empty(), DIFFRUN_DUMP_E_ARG, where(d) + "attribute name is empty");
  need(name != "format" && name != "format_version", DIFFRUN_DUMP_E_META,
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
}

void put(diffrun_dump* d, const char* name_c, int layer, const int64_t* dims, int ndim, diffrun_dtype dtype,
         const void* data, const char* layout_c, const char* native_c, bool foreign = false) {
  const std::string name = str_arg(name_c, "the checkpoint name");
  const std::string at = d->file->path() + ": dataset '" + diffrun::dump_step_group_name(d->step < 0 ? 0 : d->step) +
                         "/" + name + "': ";
  const char* type = dtype_name(dtype);
  need(type != nullptr, DIFFRUN_DUMP_E_ARG, at + "unknown dtype " + std::to_string(dtype) +
                                                " (DIFFRUN_F32, _F16, _BF16, _F64 or _I32)");
  need(d->step >= 0, DIFFRUN_DUMP_E_STEP, at + "no step started (call diffrun_dump_step first)");
  need(ndim >= 0 && ndim <= 8, DIFFRUN_DUMP_E_ARG, at + "ndim " + std::to_string(ndim) + " outside 0..8");
  need(ndim == 0 || dims != nullptr, DIFFRUN_DUMP_E_ARG, at + "dims is NULL");
  std::vector<int64_t> shape(dims, dims + ndim);
  int64_t n = 1;
  for (int64_t x : shape) {
    need(x >= 0, DIFFRUN_DUMP_E_ARG, at + "negative dimension in " + shape_text(shape));
    n *= x;
  }
  need(n == 0 || data != nullptr, DIFFRUN_DUMP_E_ARG, at + "data is NULL");
  need(!d->file->has_dataset(d->step, name), DIFFRUN_DUMP_E_CHECKPOINT, at + "recorded twice in this step");
  std::string native = native_c ? native_c : type;
  need(native != "i32" || dtype == DIFFRUN_I32, DIFFRUN_DUMP_E_ARG, at + "native_dtype \"i32\" is for tokens");
  need(diffrun::parse_stored_dtype(native).has_value(), DIFFRUN_DUMP_E_ARG,
       at + "native_dtype \"" + native + "\" is not one of \"f16\", \"bf16\", \"f32\", \"f64\"");
  const diffrun::ModelConfig& cfg = *d->config;

  if (name == "tokens") {
    need(dtype == DIFFRUN_I32, DIFFRUN_DUMP_E_CHECKPOINT, at + "tokens are DIFFRUN_I32 ids, not " + type);
    need(layer == -1, DIFFRUN_DUMP_E_CHECKPOINT, at + "layer " + std::to_string(layer) + " for tokens (-1 outside layers)");
    need(ndim == 1 && n >= 1, DIFFRUN_DUMP_E_CHECKPOINT, at + "shape " + shape_text(shape) + ", expected [T] with T >= 1");
    need(!layout_c || std::string(layout_c) == "T", DIFFRUN_DUMP_E_CHECKPOINT, at + "the layout of tokens is \"T\"");
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
    d->file->write(d->step, name, diffrun::StoredDType::i32, shape, data, {0, -1, "T", "i32", std::nullopt});
    d->step_has_tokens = true;
    d->n_tokens = n;
    d->n_kv += n;
    return;
  }

  need(dtype != DIFFRUN_I32, DIFFRUN_DUMP_E_CHECKPOINT, at + "DIFFRUN_I32 is for tokens; checkpoints are floats");
  need(d->step_has_tokens, DIFFRUN_DUMP_E_STEP, at + "put \"tokens\" first in every step (T and S come from it)");
  if (foreign) {
    // Stored as given, no order/layer/layout: `diffrun compare --names MAP` maps it.
    d->file->write(d->step, name, *diffrun::parse_stored_dtype(type), shape, data, {std::nullopt, std::nullopt, "", native, std::nullopt});
    return;
  }
  const std::string layout = layout_c ? layout_c : "";
  std::vector<int64_t> canonical;
  const std::string problem =
      diffrun::check_checkpoint(cfg, name, layer, shape, layout, d->n_tokens, d->n_kv, &canonical);
  need(problem.empty(), DIFFRUN_DUMP_E_CHECKPOINT, at + problem);
  const diffrun::ParsedCheckpointName parsed = diffrun::parse_checkpoint_name(name);
  const diffrun::CheckpointKind* kind = diffrun::find_checkpoint_kind(parsed.base);
  const int order = diffrun::checkpoint_order(cfg, parsed.base, parsed.layer);
  // Merged heads are stored in the vocabulary's shape (same bytes).
  d->file->write(d->step, name, *diffrun::parse_stored_dtype(type), canonical, data,
                 {order, layer, layout.empty() ? std::string(kind->layout) : layout, native, std::nullopt});
}

}  // namespace

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
    h->file->set_string("format", diffrun::kDumpFormat);
    h->file->set_int("format_version", diffrun::kDumpFormatVersion);
    h->file->set_string("created_utc", diffrun::utc_now_iso8601());
    h->file->set_string("diffrun_version", DIFFRUN_VERSION);
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
      return a && name != "format" && name != "format_version" && name != "backend" && name != "precision" &&
             name != "created_utc" && name != "diffrun_version" && name != "argmax";
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
                       where(d) + "root attribute '" + n + "': \"" + v + "\" is not one of " + a->values};
    }
    d->file->set_string(n, v);
  });
}

int diffrun_dump_set_int(diffrun_dump* d, const char* name, int32_t value) {
  if (!d) return null_handle("diffrun_dump_set_int");
  return guard(d, [&] {
    const std::string n = str_arg(name, "the attribute name");
    settable(d, n, AttrType::integer);
    need(value > 0, DIFFRUN_DUMP_E_META, where(d) + "root attribute '" + n + "': " + std::to_string(value) +
                                             " (a positive integer)");
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
  return guard(d, [&] { start_step(d, step); });
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

int diffrun_dump_close(diffrun_dump* d) {
  if (!d) return null_handle("diffrun_dump_close");
  const int rc = guard(d, [&] {
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
  }
  return "unknown code";
}

const char* diffrun_dump_version(void) { return DIFFRUN_VERSION; }

}  // extern "C"
