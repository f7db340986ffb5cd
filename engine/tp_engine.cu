// The tensor-parallel engine: N one-GPU engines on their slices, one thread each (see engine/tp_engine.hpp).
#include "engine/tp_engine.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include "checkpoints/dump_schema.hpp"
#include "checkpoints/tensor_parallel.hpp"
#include "checkpoints/vocabulary.hpp"
#include "engine/cuda_check.cuh"
#include "engine/tp_comm.cuh"
#include "model/error.hpp"
#include "model/gguf.hpp"

namespace diffrun {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

namespace {

using engine::TpRank;

// One persistent thread per rank, each bound to its device: run(fn) calls fn(r) on thread r for every rank and
// returns when all have, rethrowing the first exception thrown.
class RankThreads {
 public:
  explicit RankThreads(int world) {
    for (int r = 0; r < world; ++r) threads_.emplace_back([this, r] { loop(r); });
  }
  ~RankThreads() {
    {
      std::lock_guard lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

  void run(const std::function<void(int)>& fn) {
    {
      std::unique_lock lock(m_);
      job_ = &fn;
      pending_ = static_cast<int>(threads_.size());
      first_error_ = nullptr;
      ++generation_;
    }
    cv_.notify_all();
    std::unique_lock lock(m_);
    done_cv_.wait(lock, [&] { return pending_ == 0; });
    job_ = nullptr;
    if (first_error_) std::rethrow_exception(first_error_);
  }

 private:
  void loop(int r) {
    uint64_t seen = 0;
    bool bound = false;
    for (;;) {
      const std::function<void(int)>* job = nullptr;
      {
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
      }
      try {
        if (!bound) {
          CUDA_CHECK(cudaSetDevice(r));
          bound = true;
        }
        (*job)(r);
      } catch (...) {
        std::lock_guard lock(m_);
        if (!first_error_) first_error_ = std::current_exception();  // the first in time: the cause
      }
      std::lock_guard lock(m_);
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }

  std::vector<std::thread> threads_;
  std::exception_ptr first_error_;
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

// One rank's checkpoints of a step, kept in the order recorded, for the merge into a whole tensor. Its storage
// is kept from step to step (a decode step's records fit the last one's), so that recording does not page in
// fresh memory each step.
class RankCollector final : public Sink {
 public:
  struct Record {
    std::string name;
    int layer;
    std::string layout;
    std::vector<int64_t> shape;
    NativeDType native;
    std::vector<float> data;
  };
  // A new step, whose records go to `downstream` once merged. A rank other than 0 (`slice` given) keeps only its
  // split and partial checkpoints: the merge presents rank 0's copy of a replicated one.
  void begin(const Sink& downstream, const TpSlice* slice) {
    downstream_ = &downstream;
    slice_ = slice;
    count = 0;
    id_records.clear();
  }
  bool wants(std::string_view name) const override {
    if (!downstream_->wants(name)) return false;
    if (slice_ == nullptr) return true;
    const ShardSpec spec = megatron_shard(name, *slice_);
    return spec.partial || !spec.split.empty();
  }
  void record(int, std::string_view name, int layer, std::string_view layout, std::span<const int64_t> shape,
              NativeDType native, std::span<const float> data) override {
    if (count == records.size()) records.emplace_back();
    Record& r = records[count++];
    r.name.assign(name);
    r.layer = layer;
    r.layout.assign(layout);
    r.shape.assign(shape.begin(), shape.end());
    r.native = native;
    r.data.assign(data.begin(), data.end());
  }
  void record_ids(int, std::string_view name, std::span<const int32_t> ids) override {
    id_records.emplace_back(std::string(name), std::vector<int32_t>(ids.begin(), ids.end()));
  }
  std::vector<Record> records;  // the first `count` are this step's
  size_t count = 0;
  std::vector<std::pair<std::string, std::vector<int32_t>>> id_records;

 private:
  const Sink* downstream_ = nullptr;
  const TpSlice* slice_ = nullptr;
};

class TpEngineImpl final : public TpCudaEngine {
 public:
  TpEngineImpl(const GgufFile& file, const ModelConfig& cfg, const std::string& precision, int max_ctx, int world,
               const FaultSet& faults, const std::vector<TpFault>& tp_faults)
      : cfg_(cfg), world_(world), threads_(world) {
    const int64_t unit = f_unit(file, cfg);
    for (int r = 0; r < world; ++r) slices_.push_back(tp_slice(cfg, r, world, unit));
    // DIFFRUN_TP_ALLREDUCE=none: the step without its communication, for a benchmark's split of the time only.
    const char* mode = std::getenv("DIFFRUN_TP_ALLREDUCE");
    const std::string_view all_reduce = mode != nullptr && *mode != '\0' ? mode : "nccl";
    if (all_reduce != "nccl" && all_reduce != "none")
      throw InputError("DIFFRUN_TP_ALLREDUCE=" + std::string(all_reduce) +
                       ": the tensor-parallel all-reduce is nccl (the default) or none (timing only)");
    const bool no_all_reduce = world > 1 && all_reduce == "none";
    if (no_all_reduce)
      std::fprintf(stderr, "diffrun: DIFFRUN_TP_ALLREDUCE=none: the ranks never add their partial sums; every value "
                           "after the first layer's attention is wrong (timing only)\n");
    comms_ = world > 1 ? engine::nccl_comms(world) : std::vector<void*>{nullptr};
    ranks_.resize(static_cast<size_t>(world));
    std::vector<TpRank> ranks;
    std::vector<FaultSet> rank_faults(size_t(world), faults);
    for (int r = 0; r < world; ++r) {
      const TpSlice& s = slices_[size_t(r)];
      ranks.push_back(TpRank{{s, s, s}, comms_[size_t(r)]});
      ranks.back().no_all_reduce = no_all_reduce;
    }
    // The tensor-parallel faults (faults/tp_faults.hpp): what each changes on which rank.
    TpRank& last = ranks.back();
    for (TpFault f : tp_faults) {
      switch (f) {
        case TpFault::wq_shard_offset: last.cut.q_rows = slices_[0]; break;
        case TpFault::attn_allreduce_skipped: for (TpRank& r : ranks) r.skip_attn_allreduce = true; break;
        case TpFault::ffn_allreduce_twice: for (TpRank& r : ranks) r.ffn_allreduce_twice = true; break;
        case TpFault::kv_head_wrong_rank:
          last.cut.kv_rows.kv0 = (last.cut.slice.kv0 + 1) % cfg.n_head_kv;
          last.cut.kv_rows.kv1 = last.cut.kv_rows.kv0 + 1;
          break;
        case TpFault::rope_position_offset: rank_faults.back().add(Fault::rope_fused_position_off); break;
        case TpFault::stale_kv_row: rank_faults.back().add(Fault::kv_cache_pos0); break;
      }
    }
    try {
      run_ranks([&](int r) {
        ranks_[size_t(r)] = engine::make_cuda_engine_rank(file, cfg, precision, max_ctx, rank_faults[size_t(r)],
                                                          ranks[size_t(r)]);
      });
    } catch (...) {
      release();
      throw;
    }
    facts_ = ranks_[0]->facts();
    facts_["tensor_parallel"] = std::to_string(world) + " ranks (NCCL " + engine::nccl_version() +
                                "), Megatron layout; checkpoints merged from the ranks' (partial sums added in "
                                "float64 in rank order); embedding and lm head replicated";
    std::string injected;
    for (TpFault f : tp_faults) injected += std::string(injected.empty() ? "" : ",") + tp_fault_info(f).name;
    if (!injected.empty()) facts_["injected_faults"] = injected;
  }
  ~TpEngineImpl() override { release(); }

  // The FFN's split unit: the down projection's quantization block (its rows are cut there), at least 64
  // channels (the dense GEMV's vector loads).
  static int64_t f_unit(const GgufFile& file, const ModelConfig& cfg) {
    int64_t unit = 64;
    for (int l = 0; l < cfg.n_layer; ++l) {
      const TensorInfo* t = file.find_tensor(tensor_name(TensorRole::w_down, l));
      if (t) unit = std::max<int64_t>(unit, ggml_block_elements(t->type));
    }
    return unit;
  }

  std::string name() const override { return "cuda"; }
  std::string precision() const override { return ranks_[0]->precision(); }
  const ModelConfig& config() const override { return cfg_; }
  std::map<std::string, std::string> facts() const override { return facts_; }
  int n_past() const override { return ranks_[0]->n_past(); }
  int max_ctx() const override { return ranks_[0]->max_ctx(); }
  void reset() override {
    run_ranks([&](int r) { ranks_[size_t(r)]->reset(); });
  }
  int32_t last_argmax() const override { return ranks_[0]->last_argmax(); }
  uint64_t weight_bytes() const override { return ranks_[0]->weight_bytes(); }  // what one GPU reads a step
  StepPath last_step_path() const override { return ranks_[0]->last_step_path(); }
  int world_size() const override { return world_; }
  const CudaEngine& rank(int r) const override { return *ranks_.at(size_t(r)); }
  TpSlice slice(int r) const override { return slices_.at(size_t(r)); }

  std::vector<float> forward(int step, std::span<const int32_t> tokens, Sink& sink) override {
    std::vector<float> logits;
    step_ranks(step, sink, [&](int r, Sink& s) {
      if (r == 0) logits = ranks_[0]->forward(step, tokens, s);
      else ranks_[size_t(r)]->forward_argmax(step, tokens, s);  // the same logits as rank 0's: not copied out
    });
    return logits;
  }

  int32_t forward_argmax(int step, std::span<const int32_t> tokens, Sink& sink) override {
    step_ranks(step, sink, [&](int r, Sink& s) { ranks_[size_t(r)]->forward_argmax(step, tokens, s); });
    return ranks_[0]->last_argmax();
  }

 private:
  // Runs one step on every rank, each recording where `sink` says (see engine/tp_engine.hpp).
  void step_ranks(int step, Sink& sink, const std::function<void(int, Sink&)>& fn) {
    if (auto* ranked = dynamic_cast<RankSinks*>(&sink)) {
      if (ranked->world_size() != world_)
        throw InputError("a tensor-parallel engine of " + std::to_string(world_) + " ranks was given " +
                         std::to_string(ranked->world_size()) + " rank sinks");
      run_ranks([&](int r) { fn(r, ranked->rank(r)); });
      return;
    }
    if (collectors_.empty()) collectors_.resize(size_t(world_));
    for (int r = 0; r < world_; ++r) collectors_[size_t(r)].begin(sink, r == 0 ? nullptr : &slices_[size_t(r)]);
    run_ranks([&](int r) { fn(r, collectors_[size_t(r)]); });
    merge_into(step, collectors_, sink);
  }

  // The ranks' checkpoints of a step as whole tensors, in rank 0's order.
  void merge_into(int step, std::vector<RankCollector>& ranks, Sink& sink) {
    for (const auto& [name, ids] : ranks[0].id_records) sink.record_ids(step, name, ids);
    std::vector<size_t> next(ranks.size(), 0);  // ranks 1..: their next record (split and partial ones only)
    // Rank r's record of rank 0's record i (the same checkpoint, in the same order).
    const auto of_rank = [&](size_t r, size_t i) -> const RankCollector::Record& {
      if (r == 0) return ranks[0].records[i];
      if (next[r] >= ranks[r].count || ranks[r].records[next[r]].name != ranks[0].records[i].name)
        throw Error("tensor-parallel merge: rank " + std::to_string(r) + " did not record " + ranks[0].records[i].name);
      return ranks[r].records[next[r]];
    };
    for (size_t i = 0; i < ranks[0].count; ++i) {
      const RankCollector::Record& r0 = ranks[0].records[i];
      const ShardSpec spec0 = megatron_shard(r0.name, slices_[0]);
      if (spec0.split.empty() && !spec0.partial) {  // replicated: rank 0's
        sink.record(step, r0.name, r0.layer, r0.layout, r0.shape, r0.native, r0.data);
        continue;
      }
      std::vector<const RankCollector::Record*> piece(ranks.size());
      for (size_t r = 0; r < ranks.size(); ++r) piece[r] = &of_rank(r, i);
      for (size_t r = 1; r < ranks.size(); ++r) ++next[r];
      if (spec0.partial) {
        std::vector<std::span<const float>> pieces;
        for (const RankCollector::Record* p : piece) pieces.emplace_back(p->data);
        sink.record(step, r0.name, r0.layer, r0.layout, r0.shape, r0.native, add_partials(pieces));
        continue;
      }
      const std::vector<std::string> dims = layout_dims(r0.layout);
      const auto at = std::find(dims.begin(), dims.end(), spec0.split);
      if (at == dims.end() || dims.size() != r0.shape.size())
        throw Error("tensor-parallel merge: " + r0.name + " has no dimension " + spec0.split);
      const size_t d = size_t(at - dims.begin());
      std::vector<int64_t> shape = r0.shape;
      shape[d] = dim_size(cfg_, spec0.split, -1, -1);  // the whole model's H, Hkv or F
      int64_t total = 1;
      for (int64_t e : shape) total *= e;
      std::vector<float>& whole = merged_;
      whole.resize(size_t(total));
      for (int r = world_ - 1; r >= 0; --r)  // copies of one slice (KV heads where Hkv < N): rank 0's last
        place_shard(whole, shape, int(d), megatron_shard(r0.name, slices_[size_t(r)]).offset, piece[size_t(r)]->data);
      sink.record(step, r0.name, r0.layer, r0.layout, shape, r0.native, whole);
    }
    for (size_t r = 1; r < ranks.size(); ++r)
      if (next[r] != ranks[r].count)
        throw Error("tensor-parallel merge: rank " + std::to_string(r) + " recorded checkpoints rank 0 did not");
  }

  // fn(r) on every rank's thread. A rank that throws aborts every communicator first, so that the other ranks'
  // all-reduces, which would wait for it forever, return; the engine is then spent (every later call throws).
  void run_ranks(const std::function<void(int)>& fn) {
    if (!spent_.empty()) throw Error("the tensor-parallel engine stopped after an error on a rank: " + spent_);
    // One tensor-parallel step at a time in the process (the top-level job runs two engines at once): NCCL
    // kernels of two communicators on the same GPUs, each waiting for its peers, can deadlock when interleaved.
    static std::mutex one_at_a_time;
    std::lock_guard serial(one_at_a_time);
    std::atomic<bool> aborted{false};
    try {
      threads_.run([&](int r) {
        try {
          fn(r);
        } catch (...) {
          if (!aborted.exchange(true))
            for (void* c : comms_) engine::nccl_abort(c);
          throw;
        }
      });
    } catch (const std::exception& e) {
      if (aborted) {
        comms_.clear();  // aborted: freed
        spent_ = e.what();
      }
      throw;
    }
  }

  void release() {
    ranks_.clear();
    for (void* c : comms_) engine::nccl_destroy(c);
    comms_.clear();
  }

  ModelConfig cfg_;
  int world_;
  RankThreads threads_;
  std::vector<TpSlice> slices_;
  std::vector<void*> comms_;
  std::vector<std::unique_ptr<CudaEngine>> ranks_;
  std::map<std::string, std::string> facts_;
  std::string spent_;  // the error that ended the engine ("": none)
  std::vector<RankCollector> collectors_;  // each rank's records of a merged step, kept from step to step
  std::vector<float> merged_;              // one merged checkpoint
};

}  // namespace

void check_tp(const GgufFile& file, const ModelConfig& cfg, int world, bool with_faults,
              const std::vector<TpFault>& tp_faults) {
  const std::string tp = "--tp " + std::to_string(world);
  if (world < 1) throw InputError(tp + ": the number of ranks must be at least 1");
  for (TpFault f : tp_faults)
    if (const std::string why = tp_fault_refusal(f, cfg, world); !why.empty())
      throw InputError(std::string("--inject ") + tp_fault_info(f).name + " does not apply: " + why);
  const int devices = cuda_device_count();
  if (devices < world)
    throw InputError(tp + " needs " + std::to_string(world) + " GPUs; this host has " + std::to_string(devices));
  if (world == 1) return;
  const std::string why = tp_refusal(cfg, world, TpEngineImpl::f_unit(file, cfg));
  if (!why.empty()) throw InputError(tp + ": " + why);
  // Wo's rows are cut at head boundaries: in a block format each rank's columns must be whole blocks.
  const int64_t cols = int64_t(cfg.n_head / world) * cfg.head_dim;
  for (int l = 0; l < cfg.n_layer; ++l) {
    const TensorInfo* wo = file.find_tensor(tensor_name(TensorRole::wo, l));
    if (wo && cols % ggml_block_elements(wo->type) != 0)
      throw InputError(tp + ": " + wo->name + " is " + ggml_type_name(wo->type) + " (blocks of " +
                       std::to_string(ggml_block_elements(wo->type)) + "), and each rank's " + std::to_string(cols) +
                       " columns of it (" + std::to_string(cfg.n_head / world) + " heads of " +
                       std::to_string(cfg.head_dim) + ") do not fall on block boundaries");
  }
  if (with_faults)
    throw InputError(tp + ": fault injection runs on one GPU (the tensor-parallel fault catalog is not built)");
  if (!engine::nccl_built()) engine::nccl_comms(world);  // throws, saying how to build with NCCL
}

std::unique_ptr<TpCudaEngine> make_tp_cuda_engine(const GgufFile& file, const ModelConfig& cfg,
                                                  const std::string& precision, int max_ctx, int world,
                                                  const FaultSet& faults, const std::vector<TpFault>& tp_faults) {
  check_tp(file, cfg, world, !faults.empty(), tp_faults);
  return std::make_unique<TpEngineImpl>(file, cfg, precision, max_ctx, world, faults, tp_faults);
}

}  // namespace diffrun
