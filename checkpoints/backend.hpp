// The interface both backends (CPU reference, CUDA engine) implement; the CLI drives it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "checkpoints/sink.hpp"
#include "model/config.hpp"

namespace diffrun {

// How a backend's last forward() ran, for the dump (root attributes step_graph and step_fused,
// docs/dump-format.md): whether the step was one replay of a captured CUDA graph, and which fused
// kernels it ran, as bits named by the backend's "fused_kernel_bits" fact. A recorded step runs the
// path an unrecorded one runs; these say which path that was.
struct StepPath {
  bool graph = false;
  uint32_t fused = 0;
};

// Tokens the later one-token steps are expected to be fed (step s's token at [s - 1]): the greedy choices of a fast
// engine, published once by the thread that computes them and read by the backends given it (Backend::set_draft).
class Draft {
 public:
  // Tokens known from the start (teacher forcing) published at once; none: the engine publishes them later.
  explicit Draft(std::vector<int32_t> tokens = {}) : tokens_(std::move(tokens)) {}
  void publish(std::vector<int32_t> tokens) {
    std::lock_guard lock(m_);
    tokens_ = std::move(tokens);
  }
  std::vector<int32_t> tokens() const {  // empty until published
    std::lock_guard lock(m_);
    return tokens_;
  }

 private:
  mutable std::mutex m_;
  std::vector<int32_t> tokens_;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string name() const = 0;       // "cpu", "cuda"
  virtual std::string precision() const = 0;  // "f32", "f64", "f16"
  virtual const ModelConfig& config() const = 0;

  // Facts that change numerics, stored as dump root attributes (device name, TF32, math mode...).
  virtual std::map<std::string, std::string> facts() const { return {}; }

  // Runs step `step` on `tokens` (step 0: the whole prompt at positions 0..T-1; later steps: one
  // token at position n_past). Appends to the KV cache, records checkpoints into `sink`, and
  // returns the logits of the last token over the real vocabulary [V].
  virtual std::vector<float> forward(int step, std::span<const int32_t> tokens, Sink& sink) = 0;

  // The path the last forward() took (a backend with one path: the default).
  virtual StepPath last_step_path() const { return {}; }

  // The backend's own greedy choice after the last forward(): the argmax it computed itself over the last
  // token's logits (-1: it computes none, or every logit was NaN). The dump's `argmax` attribute holds it,
  // so that a wrong argmax (not only wrong logits) is caught; the caller's argmax of the logits stands in
  // for a backend that computes none.
  virtual int32_t last_argmax() const { return -1; }

  // A draft of the tokens later steps will be fed. A backend that can compute several one-token steps in one pass,
  // recording for each exactly what that step records alone, may do so where the draft agrees with the fed token;
  // forward() still takes and records one step at a time, and from the first step whose fed token is not the
  // draft's it computes one step at a time again (until reset()). Default: ignored.
  virtual void set_draft(std::shared_ptr<const Draft> draft) {}
  // Before step `step`'s token is fed: such a backend may compute the draft's steps from there now, guessing the
  // draft's token for it (a reference fed by another waits for that token), so that forward() of those steps, fed
  // the draft's tokens, only replays them. `sink` answers what they record. Default: nothing.
  virtual void prepare(int step, const Sink& sink) {}
  // The steps since construction that came out of such passes (for the job's timeline and the tests).
  virtual int steps_from_draft() const { return 0; }

  // Number of positions in the KV cache so far.
  virtual int n_past() const = 0;

  // Positions the KV cache holds (prompt plus decode steps may not exceed it).
  virtual int max_ctx() const { return config().n_ctx; }

  // Empties the KV cache: n_past 0, every row zero as at construction (a reset backend computes what
  // a fresh one does, even where a fault reads rows it never wrote).
  virtual void reset() = 0;
};

}  // namespace diffrun
