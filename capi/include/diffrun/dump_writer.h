/* diffrun dump writer and reader, C API: write a diffrun dump (docs/dump-format.md) from any engine in C, C++ or
 * Rust, and read a reference dump's tensors back (isolation replay). */
#ifndef DIFFRUN_DUMP_WRITER_H
#define DIFFRUN_DUMP_WRITER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define DIFFRUN_DUMP_API __attribute__((visibility("default")))
#else
#define DIFFRUN_DUMP_API
#endif

/* The dump format version this library writes (root attribute format_version). */
#define DIFFRUN_DUMP_FORMAT_VERSION 2

/* One dump being written. Opaque; one handle is not to be used from two threads at once. */
typedef struct diffrun_dump diffrun_dump;

/* Element type of the data passed to diffrun_dump_put, one of DIFFRUN_F32 ... DIFFRUN_I32 (an
 * integer, so that any value passed is well defined and an unknown one is refused). F16 and BF16
 * are passed as their 16-bit patterns (uint16_t) and stored as such (float16, or uint16 with
 * dtype = "bf16"). */
typedef int32_t diffrun_dtype;
enum {
  DIFFRUN_F32 = 0,
  DIFFRUN_F16 = 1,
  DIFFRUN_BF16 = 2,
  DIFFRUN_F64 = 3,
  DIFFRUN_I32 = 4 /* the "tokens" checkpoint only */
};

/* Return codes. Every function returns one; on failure diffrun_dump_last_error says what and where. */
enum {
  DIFFRUN_DUMP_OK = 0,
  DIFFRUN_DUMP_E_ARG = 1,        /* a NULL handle or pointer, an unknown dtype, a bad value */
  DIFFRUN_DUMP_E_IO = 2,         /* a file cannot be created, written, renamed or read */
  DIFFRUN_DUMP_E_META = 3,       /* a root attribute of the wrong type, or missing/invalid when the first step starts */
  DIFFRUN_DUMP_E_STEP = 4,       /* steps out of order (0, 1, 2, ...), a put before any step, a step without tokens */
  DIFFRUN_DUMP_E_CHECKPOINT = 5, /* a name, layer, shape or layout the vocabulary does not allow; a name recorded twice */
  DIFFRUN_DUMP_E_INTERNAL = 6,   /* out of memory or an unexpected failure */
  DIFFRUN_DUMP_E_CUDA = 7        /* device puts: no CUDA driver, device or context, or a CUDA call failed */
};

/* HDF5 in the host process. This library writes through the process's HDF5 library and changes
 * two of its settings; a host engine that uses HDF5 itself must know:
 * - Automatic error printing off: every diffrun_dump_open calls H5Eset_auto2(H5E_DEFAULT, NULL,
 *   NULL), for the calling thread's default error stack (HDF5 built thread-safe; the whole process
 *   otherwise). Failures are reported through diffrun_dump_last_error instead of HDF5's stack
 *   traces on stderr. A host that wants them back sets its own handler again after the call.
 * - No cleanup at exit: the first diffrun_dump_open in a process that has not yet used HDF5 calls
 *   H5dont_atexit(), so HDF5 runs no H5close at exit (after a failed close, e.g. a full disk, that
 *   cleanup crashes). The host closes its own HDF5 files and objects before exiting. In a process
 *   that used HDF5 before, the call has no effect and the host's setting stays. */

/* Creates a dump to be written at `path`: the data go to "<path>.diffrun-tmp-<pid>", created
 * exclusively (a symlink or other file planted at that name is refused, never written through),
 * renamed to `path` by diffrun_dump_close, so an interrupted run never leaves a file that looks
 * whole. An existing `path` that is not a regular file (a device, a FIFO) is refused. Writes format,
 * format_version, created_utc (now) and diffrun_version; the other root attributes come from the
 * setters or diffrun_dump_copy_meta. On failure *out is NULL and diffrun_dump_last_error(NULL)
 * says why. */
DIFFRUN_DUMP_API int diffrun_dump_open(const char* path, diffrun_dump** out);

/* Copies the run's root attributes from a reference dump: model, config, prompt, token_ids,
 * all_token_ids (everything but backend, precision, created_utc, diffrun_version, argmax and the
 * reference's backend facts). Set backend and precision afterwards. A reference in format version 1
 * (variable-length strings) fails unless the environment has DIFFRUN_READ_V1=1
 * (docs/dump-format.md, "Versioning"). */
DIFFRUN_DUMP_API int diffrun_dump_copy_meta(diffrun_dump* d, const char* reference_path);

/* The token ids step `step` is fed, from the root attributes token_ids (step 0, the prompt) and
 * all_token_ids (one id per decode step after it), as copy_meta or the setters left them: the
 * teacher-forcing loop feeds exactly these. *ids points into the handle, valid until the next
 * call with it. DIFFRUN_DUMP_E_STEP past the last step the ids cover, so this runs the loop:
 *   for (int s = 0; diffrun_dump_step_tokens(d, s, &ids, &n) == DIFFRUN_DUMP_OK; ++s) ... */
DIFFRUN_DUMP_API int diffrun_dump_step_tokens(diffrun_dump* d, int step, const int32_t** ids, size_t* n);

/* Root attributes by name (docs/dump-format.md lists them with their types); setting one again
 * replaces it. set_string on a name the format does not define records a backend fact.
 *   strings:  backend, precision ("f16", "bf16", "f32", "f64"), model_path, model_fingerprint,
 *             arch ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "qwen2moe"), rope_type ("norm", "neox"),
 *             prompt, created_utc, diffrun_version, and facts
 *   integers: n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_ctx; models with experts
 *             also n_expert, n_expert_used, n_ff_exp
 *   reals:    rope_theta, rms_eps
 *   booleans: tied_output, qkv_bias, qk_norm (0 or 1)
 *   id arrays: token_ids, all_token_ids, argmax
 * A name used with the wrong setter returns DIFFRUN_DUMP_E_META. */
DIFFRUN_DUMP_API int diffrun_dump_set_string(diffrun_dump* d, const char* name, const char* value);
DIFFRUN_DUMP_API int diffrun_dump_set_int(diffrun_dump* d, const char* name, int32_t value);
DIFFRUN_DUMP_API int diffrun_dump_set_real(diffrun_dump* d, const char* name, double value);
DIFFRUN_DUMP_API int diffrun_dump_set_bool(diffrun_dump* d, const char* name, int value);
DIFFRUN_DUMP_API int diffrun_dump_set_ids(diffrun_dump* d, const char* name, const int32_t* ids, size_t n);

/* Starts step `step`: 0 (the prefill) first, then 1, 2, ... in order. Starting step 0 checks the
 * root attributes (all problems in one message: DIFFRUN_DUMP_E_META); each later step needs the
 * previous one to have recorded its tokens. */
DIFFRUN_DUMP_API int diffrun_dump_step(diffrun_dump* d, int step);

/* Records one checkpoint of the current step: row-major data of shape dims[0..ndim). Put "tokens"
 * first in every step (DIFFRUN_I32, [T], layer -1): T and S come from it. `layer` is the -L of
 * the name, -1 outside layers. The shape must be the vocabulary's (`diffrun vocab`, or
 * `diffrun validate --skeleton MODEL.gguf`) or, for per-head tensors, the heads merged
 * ([T, H*Dh]; stored as [T, H, Dh], same bytes). */
DIFFRUN_DUMP_API int diffrun_dump_put(diffrun_dump* d, const char* name, int layer, const int64_t* dims, int ndim,
                                      diffrun_dtype dtype, const void* data);

/* diffrun_dump_put with the layout of the data (a permutation of the vocabulary's letters, e.g.
 * "H,T,Dh"; NULL = the vocabulary's) and what the engine computed in (native_dtype: "f16",
 * "bf16", "f32", "f64"; NULL = the dtype of the data). */
DIFFRUN_DUMP_API int diffrun_dump_put_ex(diffrun_dump* d, const char* name, int layer, const int64_t* dims, int ndim,
                                         diffrun_dtype dtype, const void* data, const char* layout,
                                         const char* native_dtype);

/* Records a dataset under the engine's own name, outside the vocabulary (a llama.cpp graph node
 * "Qcur-0#3", a Hugging Face module name): stored as given (any shape), with native_dtype (NULL =
 * the dtype of the data) and without order, layer or layout, for `diffrun compare --names MAP` to
 * map to the vocabulary. Only the step, "tokens" first, a float dtype and one name per step are
 * checked. "tokens" itself goes through diffrun_dump_put. */
DIFFRUN_DUMP_API int diffrun_dump_put_foreign(diffrun_dump* d, const char* name, const int64_t* dims, int ndim,
                                              diffrun_dtype dtype, const void* data, const char* native_dtype);

/* diffrun_dump_put for a checkpoint that holds only rows row_offset.. of its row dimension
 * (docs/dump-format.md, "Rows"): the cache positions S of cache_k/cache_v ([S - row_offset, Hkv, Dh];
 * the rows a step wrote are row_offset = S - T), else the tokens T of a checkpoint whose layout has T
 * (kq_soft_max [H, T - row_offset, S], result_output [T - row_offset, V], attn_norm [T - row_offset, D]).
 * dims count the rows held; the dataset gets the attribute row_offset, and readers (diffrun compare,
 * diffrun_dump_reader_get, the Python package) put a cache cut this way back together from the earlier
 * steps. 0 <= row_offset < T (S); 0 is diffrun_dump_put. Refused (DIFFRUN_DUMP_E_CHECKPOINT) for tokens
 * and for a checkpoint without T or S rows (the layout is the vocabulary's). */
DIFFRUN_DUMP_API int diffrun_dump_put_rows(diffrun_dump* d, const char* name, int layer, const int64_t* dims, int ndim,
                                           diffrun_dtype dtype, const void* data, int64_t row_offset);

/* A tensor-parallel rank's dump (docs/dump-format.md, "Shards"): set the root attributes rank
 * (diffrun_dump_set_int; 0 is allowed for it) and world_size with the meta, then call
 * diffrun_dump_set_shard before the puts of a checkpoint the rank holds a piece of:
 *   split         the layout letter its slice is cut along (Megatron: "H" for Qcur, "Hkv" for Kcur, Vcur
 *                 and the cache, "F" for ffn_gate/ffn_up/ffn_swiglu); NULL for no split
 *   shard_offset  the slice's first index along split (0 without a split)
 *   partial       1 where the values are partial sums that the ranks' all-reduce adds (attn_out and
 *                 ffn_out of row-parallel projections), else 0; not with a split
 * The setting holds for every later put of the handle, host or device, until set again;
 * diffrun_dump_set_shard(d, NULL, 0, 0) goes back to whole (replicated) tensors. A split put's dims are
 * its slice's ([T, H/N, Dh] for Qcur on N ranks), checked to lie within the whole dimension.
 * `diffrun compare RANK_DIR REF.h5` merges the ranks' dumps and names a rank whose slice is wrong. */
DIFFRUN_DUMP_API int diffrun_dump_set_shard(diffrun_dump* d, const char* split, int64_t shard_offset, int partial);

/* ---- Device puts: checkpoints in CUDA device memory, recorded without synchronizing the engine ----
 *
 * diffrun_dump_put_device records a checkpoint the engine holds in device memory: it enqueues an
 * asynchronous copy (cuMemcpyDtoHAsync) on the engine's stream into pinned staging memory owned by the
 * handle, and returns. It never synchronizes that stream, and it is legal while the stream captures a
 * CUDA graph (any cudaStreamCaptureMode): then the copy becomes a node of the graph, and every launch of
 * the graph copies the tensor again (see "Graphs" below). The data reach the file later, from the calling
 * thread, inside diffrun_dump_step, _flush and _close: HDF5 is never called from another thread.
 *
 * CUDA at run time only. The library does not link CUDA: the first device call loads the CUDA *driver*
 * (dlopen "libcuda.so.1", cuInit) and uses a dozen of its functions. The driver rather than the runtime,
 * because a process has one driver, shared by every CUDA runtime in it (a static cudart, which CMake links
 * by default, or libcudart.so.12/.13, or torch's): the engine's streams, device pointers and current
 * context are the driver's objects, the same here. So the library builds without the CUDA toolkit, host
 * puts work where there is no GPU, and a device call there fails with DIFFRUN_DUMP_E_CUDA and a message
 * ("CUDA driver not found (...)", "no usable CUDA device (cuInit: CUDA_ERROR_NO_DEVICE ...)").
 *
 * Streams and contexts: `stream` is a cudaStream_t (a CUstream) passed as void*, so this header needs no
 * CUDA include. NULL is the legacy default stream, as in the driver API: an engine built with
 * --default-stream per-thread passes cudaStreamPerThread. The calling thread must have the engine's
 * context current (any CUDA runtime call made in it does that); the staging memory is allocated there.
 *
 * Memory: one pinned host allocation of 64 MiB (DIFFRUN_DUMP_STAGING_MB in the environment, or
 * diffrun_dump_set_staging, sets another size), allocated by the first device call. Immediate puts take
 * its space in order, and so does each graph launch's data when diffrun_dump_step copies it out of the
 * graph's slots; a put that finds it full first writes every pending put to the file (waiting for their
 * copies). A graph's puts hold their slots (their bytes, 256-aligned) until close. One put larger than
 * the free space fails with DIFFRUN_DUMP_E_ARG. The file writes (HDF5, from the calling thread) come
 * when the staging memory is over half full at a diffrun_dump_step, and at close: a staging size that
 * holds every step keeps them out of the decode loop.
 *
 * Ordering: a put's copy reads the device memory when the stream reaches it, so the engine may reuse
 * the buffer for later work on the same stream right away (stream order); work on other streams must
 * wait for it as for any op of that stream. diffrun_dump_step, when the staging memory is over half
 * full, and diffrun_dump_flush / _close wait for the copies (host waits on events recorded after them:
 * the stream itself is never synchronized) and write them. A CUDA error in the engine's own work shows
 * up there as DIFFRUN_DUMP_E_CUDA ("the copy from the device failed: ...").
 *
 * Graphs: while `stream` captures, a put is checked against the current step as usual (start the step
 * and put its tokens before capturing) but records nothing: it adds a slot, a copy node into fixed
 * staging memory. After cudaStreamEndCapture, diffrun_dump_capture_end turns the slots captured since
 * the last one into a graph id. After each cudaGraphLaunch of that graph the engine calls
 * diffrun_dump_replay(d, graph, stream) once: that launch's copies are the current step's checkpoints
 * (each checked against the step again). Chosen over a host node in the graph (cudaLaunchHostFunc),
 * which would stall the GPU at every launch and could not wait or allocate: the host learns of the
 * launch from the engine, cheaply and in order. The slots are fixed addresses, so a launch's data must
 * leave them before the next launch writes them: diffrun_dump_step (the next step) copies them out,
 * waiting for that launch to finish if it has not. Hence the rules:
 * - launch a recording graph at most once per step, and call diffrun_dump_step before launching it
 *   again; diffrun_dump_replay refuses a second launch in the same step ("recorded twice");
 * - to keep the GPU busy while the host copies a step out, capture the step twice (two graph ids, each
 *   with slots of its own) and launch them in turn, each launch before the diffrun_dump_step of its
 *   step: cudaGraphLaunch(g[s % 2]); diffrun_dump_step(s); diffrun_dump_replay(g[s % 2]). The step's
 *   wait for launch s - 1 then overlaps launch s, which writes the other graph's slots
 *   (examples/cuda_engine does this). With one graph, launch it after diffrun_dump_step;
 * - checkpoints whose shape has S (kq_soft_max, cache_k, cache_v) change shape every step and are
 *   refused inside a capture: put them outside it;
 * - the first device put must not be inside a capture (pinned memory cannot be allocated there):
 *   call diffrun_dump_set_staging first, or put something outside the capture first;
 * - the graph's copy nodes write into the handle's staging memory: do not launch the graph after
 *   diffrun_dump_close or _abort (they free it).
 *
 * The per-step cost: one D2H copy per put (a node of the graph), one event record per put outside a
 * graph and one per diffrun_dump_replay, and at diffrun_dump_step the host wait for the previous
 * launch of each graph plus a memcpy of its slots; HDF5 writes come in batches (half the staging
 * memory) or at close. */

/* Allocates the staging memory now, `bytes` of it (0: the default, 64 MiB or DIFFRUN_DUMP_STAGING_MB),
 * in the calling thread's current CUDA context. Not during a stream capture. Calling it again with the
 * same size (or 0) does nothing; another size after the allocation is DIFFRUN_DUMP_E_ARG. */
DIFFRUN_DUMP_API int diffrun_dump_set_staging(diffrun_dump* d, size_t bytes);

/* diffrun_dump_put for data in CUDA memory (`device_ptr`, anything the driver knows: device, managed or
 * pinned host memory), copied asynchronously on `stream` (a cudaStream_t). The same checks as
 * diffrun_dump_put (name, layer, shape, dtype, tokens first, each name once per step), stored the same
 * way; "tokens" are host ids and go through diffrun_dump_put. Outside a capture a pointer CUDA does not
 * know is DIFFRUN_DUMP_E_ARG (pageable host memory goes through diffrun_dump_put); inside one the
 * capture reports it. */
DIFFRUN_DUMP_API int diffrun_dump_put_device(diffrun_dump* d, const char* name, int layer, const int64_t* dims,
                                             int ndim, diffrun_dtype dtype, const void* device_ptr, void* stream);

/* Deferred device puts, for engines that record many checkpoints a step (a graph of a few hundred
 * copy nodes costs a copy-engine round trip each, ~6 us, between two kernels): the same checks and
 * arguments as diffrun_dump_put_device, but nothing is enqueued. The tensor is noted, and
 * diffrun_dump_flush_device(d, stream) copies every tensor noted since the last flush with one kernel
 * launch per 64 of them (a small kernel of the library's own, loaded through the driver, writing into the
 * staging memory's device mapping; where it cannot be loaded, one cuMemcpyDtoHAsync each). The rule
 * that comes with it: a noted tensor's memory must keep its values until the flush is reached in stream
 * order, so flush before an op overwrites a noted buffer (e.g. once a layer, where buffers are reused
 * from layer to layer) and at the end of the step. Every deferred put since the last flush must be on
 * the flush's stream and on the same side of a capture; inside a capture each flush is one kernel node
 * of the graph, and the graph replays like one of immediate puts. diffrun_dump_step, _capture_end and
 * _close refuse to run while deferred puts are not flushed (DIFFRUN_DUMP_E_ARG). */
DIFFRUN_DUMP_API int diffrun_dump_put_device_deferred(diffrun_dump* d, const char* name, int layer,
                                                      const int64_t* dims, int ndim, diffrun_dtype dtype,
                                                      const void* device_ptr, void* stream);
DIFFRUN_DUMP_API int diffrun_dump_flush_device(diffrun_dump* d, void* stream);

/* After cudaStreamEndCapture: the device puts captured since the last call (or the open) form one
 * graph; *graph is its id (0, 1, ...), for diffrun_dump_replay. A capture without device puts gives a
 * graph that records nothing. */
DIFFRUN_DUMP_API int diffrun_dump_capture_end(diffrun_dump* d, int* graph);

/* After each cudaGraphLaunch of `graph` on `stream` (outside any capture): the launch's copies are the
 * current step's checkpoints. Each is checked against the step (T from its tokens) first; on failure
 * none is recorded. */
DIFFRUN_DUMP_API int diffrun_dump_replay(diffrun_dump* d, int graph, void* stream);

/* Waits for every pending device copy and writes it to the file (diffrun_dump_close does it too). */
DIFFRUN_DUMP_API int diffrun_dump_flush(diffrun_dump* d);

/* Finishes the dump: writes the pending device puts, closes it and renames it to its path. Frees the
 * handle (and its staging memory, after waiting for copies in flight), whatever the result;
 * on failure the temporary file is removed and diffrun_dump_last_error(NULL) says why. */
DIFFRUN_DUMP_API int diffrun_dump_close(diffrun_dump* d);

/* Discards the dump: removes the temporary file and frees the handle (waiting for device copies in flight). */
DIFFRUN_DUMP_API int diffrun_dump_abort(diffrun_dump* d);

/* ---- Reading a dump: the reference's tensors for an isolation replay ----
 *
 * diffrun_dump_reader opens any dump read-only (diffrun's, the C API's, the Python package's, another
 * writer's) through diffrun's own reader, the one `diffrun compare` uses: float datasets come back as
 * float32 whatever their stored dtype (f16, bf16, f64), in the vocabulary's layout (a permuted `layout`
 * is permuted back, merged heads split: Qcur is [T, H, Dh]), and a cache_k/cache_v stored as the rows each
 * step wrote (row_offset, docs/dump-format.md "Rows") is put back together from the earlier steps into
 * [S, Hkv, Dh]. The reader refuses what diffrun refuses (not HDF5, not a diffrun dump, another format
 * version, links to other files) with DIFFRUN_DUMP_E_IO and a message naming the file. The isolation
 * replay (docs/dump-format.md, "Isolation replay"): at each checkpoint the engine puts its own output,
 * then continues from the reference's tensor of the same name and step where the reference holds it
 * whole (row_offset 0):
 *   if (diffrun_dump_reader_get(ref, "Qcur-3", step, &x, &dims, &ndim, &row_offset) == DIFFRUN_DUMP_OK &&
 *       row_offset == 0) ... continue from x ...
 * One handle is not to be used from two threads at once. */
typedef struct diffrun_dump_reader diffrun_dump_reader;

/* Opens the dump at `path` read-only. On failure *out is NULL and diffrun_dump_reader_last_error(NULL)
 * says why (DIFFRUN_DUMP_E_IO: missing, not HDF5, not a diffrun dump, damaged; DIFFRUN_DUMP_E_ARG: NULL). */
DIFFRUN_DUMP_API int diffrun_dump_reader_open(const char* path, diffrun_dump_reader** out);

/* The steps the dump holds, ascending (0 the prefill; a dump written with `--dump divergence` may skip
 * some). *steps points into the handle, valid until it is closed. */
DIFFRUN_DUMP_API int diffrun_dump_reader_steps(diffrun_dump_reader* r, const int** steps, size_t* n);

/* The token ids step `step` was fed (its `tokens` dataset). *ids points into the handle, valid until
 * the next diffrun_dump_reader_tokens or _close. DIFFRUN_DUMP_E_STEP when the dump has no such step, so
 * this runs a teacher-forced loop over the reference:
 *   for (int s = 0; diffrun_dump_reader_tokens(ref, s, &ids, &n) == DIFFRUN_DUMP_OK; ++s) ... */
DIFFRUN_DUMP_API int diffrun_dump_reader_tokens(diffrun_dump_reader* r, int step, const int32_t** ids, size_t* n);

/* The checkpoint `name` (e.g. "Qcur-3", "cache_k-0") of step `step`, as float32, row-major in the
 * vocabulary's layout: *data holds the product of dims[0..*ndim) values. *data and *dims point into the
 * handle, valid until the next diffrun_dump_reader_get or _close. *row_offset (may be NULL) is the
 * first row of its row dimension the data hold: 0 for a whole tensor (a cut cache put back together
 * included); > 0 where the dump holds only the last rows (kq_soft_max, result_output or every per-token
 * checkpoint cut by --softmax-rows, --logits-rows, --token-rows; a cache whose earlier rows are in no
 * step): then dims count the rows held. dims and ndim may be NULL too.
 * DIFFRUN_DUMP_E_STEP: the dump has no step `step`; DIFFRUN_DUMP_E_CHECKPOINT: the step holds no float
 * dataset `name` (an isolation replay then keeps the engine's own tensor); DIFFRUN_DUMP_E_IO: the data
 * cannot be read (the message names the file, step and dataset). */
DIFFRUN_DUMP_API int diffrun_dump_reader_get(diffrun_dump_reader* r, const char* name, int step, const float** data,
                                             const int64_t** dims, int* ndim, int64_t* row_offset);

/* Closes the file and frees the handle (NULL: nothing). */
DIFFRUN_DUMP_API int diffrun_dump_reader_close(diffrun_dump_reader* r);

/* The message of the last failure on this reader ("" if none), naming the file, step and dataset; with
 * NULL, the last reader failure in this thread (open, a NULL handle). Valid until the next call with the
 * same handle (or, for NULL, in the same thread). */
DIFFRUN_DUMP_API const char* diffrun_dump_reader_last_error(const diffrun_dump_reader* r);

/* The message of the last failure on this handle ("" if none), naming the file, attribute or
 * dataset; with NULL, the last failure in this thread (open, close, a NULL handle). Valid until
 * the next call with the same handle (or, for NULL, in the same thread). */
DIFFRUN_DUMP_API const char* diffrun_dump_last_error(const diffrun_dump* d);

/* "ok", "bad argument", "i/o error", ... for a return code. */
DIFFRUN_DUMP_API const char* diffrun_dump_strerror(int code);

/* This library's version, e.g. "0.1.0". */
DIFFRUN_DUMP_API const char* diffrun_dump_version(void);

#ifdef __cplusplus
}
#endif

#endif /* DIFFRUN_DUMP_WRITER_H */
