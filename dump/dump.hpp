// HDF5 dump writer (a Sink) and reader, in the format of docs/dump-format.md ("diffrun-dump").
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoints/name_map.hpp"
#include "checkpoints/sink.hpp"
#include "checkpoints/tensor_parallel.hpp"
#include "dump/dump_format.hpp"
#include "dump/rows.hpp"
#include "model/config.hpp"

namespace diffrun {

// Root attributes of a dump.
struct DumpMeta {
  std::string backend;    // "cpu", "cuda", or any other writer's name
  std::string precision;  // "f32", "f64", "f16"
  std::string model_path;
  std::string model_fingerprint;
  ModelConfig config;     // stored as arch, n_layer, n_embd, ... attributes
  std::string prompt;
  std::vector<int32_t> token_ids;  // the prompt's ids
  std::string created_utc;         // filled by the writer when empty
  std::string diffrun_version;     // filled by the writer when empty
  std::map<std::string, std::string> facts;  // backend facts (device, tf32, math mode...)
  int format_version = kDumpFormatVersion;
  // A tensor-parallel engine's rank dump (docs/dump-format.md, "Shards"): its rank and the ranks' count.
  std::optional<int> rank, world_size;
};

// How DumpWriter stores what it is given. A checkpoint cut to its last rows carries the dataset
// attribute row_offset, the first row it holds (docs/dump-format.md, "Rows").
struct DumpWriterOptions {
  // > 0: kq_soft_max keeps only the last softmax_rows query rows of each step ([H, rows, S]); 0: every row.
  int64_t softmax_rows = 0;
  // > 0: result_output keeps only its last logits_rows rows of each step ([rows, V]) (the prefill
  // computes a row per prompt token); 0: every row.
  int64_t logits_rows = 64;
  // > 0: every per-token checkpoint (layout with T; kq_soft_max and result_output too) keeps only
  // its last token_rows rows of each step; 0: every row. The cache is not cut by it.
  int64_t token_rows = 0;
  // false: cache_k/cache_v keep the rows written in the step ([T, Hkv, Dh], row_offset = S - T),
  // which readers put back together into [S, Hkv, Dh]; true: every valid row, every step (what
  // `dump` and the top-level job do unless the dump would pass --max-dump-size).
  bool cache_all_rows = false;
  // 1..9: datasets are chunked and gzip-compressed at this level (deflate, built into HDF5); 0: not.
  int compress = 0;
  // true: the HDF5 calls run in a diffrun-dump-child process (dump/dump_target.hpp), so that
  // dumps written at once do not wait for each other on HDF5's process-wide lock; where that
  // executable is missing, in this process. The file is the same either way. record() then checks
  // names and shapes as before, but an error of the file itself (a full disk) comes from a later call.
  bool child_process = false;
  // A rank dump of a tensor-parallel engine: what each checkpoint of this rank is (split, partial or replicated),
  // stored as its split, shard_offset and partial attributes (docs/dump-format.md, "Shards"). Empty: a whole dump.
  std::function<ShardSpec(std::string_view name)> shard;
};

// Writes to "<path>.diffrun-tmp-<pid>" (created exclusively: DumpFile) and renames to `path` in
// finish(); destroying an unfinished writer removes the temporary file, so an interrupted run never
// leaves a file that looks whole.
// record() checks each checkpoint against the vocabulary (known name for meta.config, layer, layout,
// rank, element count) and throws DumpError naming the file and dataset; its `order` attribute is
// checkpoint_order(meta.config, ...), so filtered dumps keep the canonical order. wants() is the
// filter, except that `tokens` is always recorded. Facts must not reuse a format attribute's name.
class DumpWriter final : public Sink {
 public:
  DumpWriter(const std::string& path, const DumpMeta& meta, CheckpointFilter filter = {},
             DumpWriterOptions options = {});
  ~DumpWriter() override;
  bool wants(std::string_view name) const override;
  void record(int step, std::string_view name, int layer, std::string_view layout,
              std::span<const int64_t> shape, NativeDType native, std::span<const float> data) override;
  void record_ids(int step, std::string_view name, std::span<const int32_t> ids) override;
  // Root attributes known only at the end (e.g. all token ids, per-step argmax) can be set here.
  void set_attribute(const std::string& key, const std::vector<int32_t>& values);
  void finish();
  uint64_t bytes_written() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Where one rank's shard lies in a checkpoint merged from rank dumps (dump/shards.hpp).
struct ShardPiece {
  int rank = 0;
  std::string path;    // the rank's dump
  int64_t offset = 0;  // along DatasetInfo::split (0 for a replicated or partial checkpoint)
  int64_t extent = 0;  // the shard's size along it (0 for a replicated or partial one: the whole checkpoint)
};

// One dataset as the reader presents it: under its vocabulary name, in the vocabulary's layout
// where it can be brought there (see DumpReader), else as stored.
struct DatasetInfo {
  int step;
  std::string name;
  int order;
  int layer;
  std::string layout;
  std::string native_dtype;
  std::vector<int64_t> shape;
  bool is_int;
  std::string source;        // the dataset's name in the file ("Qcur-0#3" under a name map)
  std::string stored_dtype;  // "float32", "float64", "float16", "bfloat16", "int32", "int64", ...
  std::vector<int64_t> stored_shape;
  // The dataset holds only rows row_offset.. of its row dimension (T; S for cache_k/cache_v), and
  // `shape` counts those (docs/dump-format.md, "Rows"). A cache holding the rows its step wrote is
  // presented whole ([S, Hkv, Dh], row_offset 0) when the steps before it hold the other rows.
  int64_t row_offset = 0;
  // A rank dump's shard (docs/dump-format.md, "Shards"): the layout letter it is split along ("": replicated, or
  // partial), its first index along it, whether it holds partial sums awaiting the ranks' all-reduce. A checkpoint
  // merged from rank dumps keeps split and partial, and lists each rank's piece in `shards` (empty: one file).
  std::string split;
  int64_t shard_offset = 0;
  bool partial = false;
  std::vector<ShardPiece> shards;
};

// Reads dumps of any writer, tolerantly (docs/dump-format.md):
// - float datasets stored as float32, float64, float16 or bfloat16 (a uint16 or 16-bit opaque
//   dataset with attribute dtype = "bf16") are read as float32; integer datasets are ids;
// - per dataset, `order`, `layer`, `native_dtype` and `layout` are optional: order and layer come
//   from the vocabulary (the name), native_dtype defaults to the stored dtype, layout to the
//   vocabulary's;
// - a checkpoint of the vocabulary is presented in the vocabulary's layout: a `layout` attribute
//   that permutes the vocabulary's letters is permuted back, merged dimensions ("T,H*Dh", or no
//   layout and an array of the right element count such as [T, H*Dh]) are split, leading
//   dimensions of size 1 are squeezed. Anything else stays as stored, so that only a real
//   element-count mismatch shows as a shape mismatch;
// - with a name map, each dataset is renamed, dropped or reshaped by its rule (name_map.hpp);
//   names no rule matches are kept as they are.
// T is the length of the step's `tokens`, S the sum of T over the steps up to this one.
class DumpReader {
 public:
  // Throws DumpError naming the file (not HDF5, not a diffrun dump, unsupported version).
  explicit DumpReader(const std::string& path, const NameMap* names = nullptr);
  // What a dump not read from one file reads from: rank dumps merged (dump/shards.hpp).
  struct Source {
    virtual ~Source() = default;
    virtual std::vector<float> read(int step, const std::string& name) const = 0;
    virtual std::vector<int32_t> read_ids(int step, const std::string& name) const = 0;
    virtual std::vector<int32_t> int_attribute(const std::string& key) const = 0;
    // One rank's shard of a merged checkpoint as that rank's reader presents it.
    virtual std::vector<float> read_rank(int step, const std::string& name, int rank) const = 0;
  };
  // A dump presented from `source`: `path` names it in reports, `steps` are its datasets by step.
  DumpReader(std::string path, DumpMeta meta, std::map<int, std::vector<DatasetInfo>> steps,
             std::vector<std::string> int_attribute_names, std::unique_ptr<const Source> source);
  ~DumpReader();
  const std::string& path() const;
  const DumpMeta& meta() const;
  std::vector<int> steps() const;
  // Datasets of one step, sorted by `order`.
  std::vector<DatasetInfo> datasets(int step) const;
  const DatasetInfo* find(int step, const std::string& name) const;
  // Reads one dataset (throws DumpError naming file and dataset).
  std::vector<float> read(int step, const std::string& name) const;
  std::vector<int32_t> read_ids(int step, const std::string& name) const;
  // One rank's shard of a checkpoint merged from rank dumps (DatasetInfo::shards); of a dump read from one file, read().
  std::vector<float> read_rank(int step, const std::string& name, int rank) const;
  std::vector<int32_t> int_attribute(const std::string& key) const;  // empty when absent
  // Datasets a name map dropped (step, name in the file), for reports.
  const std::vector<std::pair<int, std::string>>& dropped() const;
  // Root attributes written by DumpWriter::set_attribute (integer arrays outside the format's set).
  const std::vector<std::string>& int_attribute_names() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace diffrun
