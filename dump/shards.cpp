// A tensor-parallel engine's rank dumps merged into one dump: the set's checks, each checkpoint's merge plan, the reads.
#include "dump/shards.hpp"

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "checkpoints/dump_schema.hpp"
#include "checkpoints/vocabulary.hpp"
#include "model/error.hpp"

namespace diffrun {
namespace {

namespace fs = std::filesystem;

using Readers = std::vector<std::unique_ptr<DumpReader>>;

// How one checkpoint of the merged dump is put together from the ranks' datasets.
struct MergePlan {
  int dim = -1;  // the split letter's index in the presented layout; -1: replicated or partial
  bool partial = false;
  std::vector<int64_t> shape;  // the merged shape
};

std::string where(int step, const std::string& name) { return fmt::format("{}/{}", dump_step_group_name(step), name); }

// Every rank 0..N-1 once, one world size; the readers come back in rank order.
Readers rank_order(Readers readers) {
  const DumpReader& first = *readers.front();
  for (const auto& r : readers) {
    if (!r->meta().rank || !r->meta().world_size)
      throw InputError(fmt::format("{}: not a rank dump (no root attribute '{}' and '{}'); a set of dumps to merge "
                                   "holds one dump per rank of a tensor-parallel run",
                                   r->path(), attr::rank, attr::world_size));
    if (*r->meta().world_size != *first.meta().world_size)
      throw InputError(fmt::format("rank dumps of different world sizes: {} says {} = {}, {} says {}", first.path(),
                                   attr::world_size, *first.meta().world_size, r->path(), *r->meta().world_size));
  }
  const int n = *first.meta().world_size;
  std::vector<std::unique_ptr<DumpReader>> by_rank(static_cast<size_t>(std::max(n, 0)));
  for (auto& r : readers) {
    const int rank = *r->meta().rank;
    if (rank < 0 || rank >= n)
      throw InputError(fmt::format("{}: {} {} is outside 0..{} ({} = {})", r->path(), attr::rank, rank, n - 1,
                                   attr::world_size, n));
    if (by_rank[rank])
      throw InputError(fmt::format("{} and {} are both rank {}", by_rank[rank]->path(), r->path(), rank));
    by_rank[rank] = std::move(r);
  }
  std::vector<int> missing;
  for (int i = 0; i < n; ++i)
    if (!by_rank[i]) missing.push_back(i);
  if (!missing.empty())
    throw InputError(fmt::format("the rank dumps are {} of {} = {}: rank{} {} missing", by_rank.size() - missing.size(),
                                 attr::world_size, n, missing.size() == 1 ? "" : "s", fmt::join(missing, ", ")));
  return by_rank;
}

// The ranks ran one model on one prompt and recorded the same steps.
void check_same_run(const Readers& ranks) {
  const DumpReader& r0 = *ranks.front();
  for (const auto& r : ranks) {
    const auto differs = [&](const char* what) {
      throw InputError(fmt::format("rank dumps {} and {} differ in {}", r0.path(), r->path(), what));
    };
    if (r->meta().model_fingerprint != r0.meta().model_fingerprint) differs(attr::model_fingerprint);
    if (config_attributes(r->meta().config) != config_attributes(r0.meta().config)) differs("their model config");
    if (r->meta().precision != r0.meta().precision) differs(attr::precision);
    if (r->meta().token_ids != r0.meta().token_ids) differs(attr::token_ids);
    if (r->steps() != r0.steps()) differs("their steps");
  }
}

// Where each rank's piece lies along the split letter: the pieces must tile 0..full exactly, pieces of the same
// offset and extent being copies of one slice.
void check_tiling(const std::vector<ShardPiece>& pieces, const std::string& letter, int64_t full,
                  const std::string& at) {
  std::vector<ShardPiece> sorted = pieces;
  std::stable_sort(sorted.begin(), sorted.end(), [](const ShardPiece& a, const ShardPiece& b) { return a.offset < b.offset; });
  int64_t end = 0;
  const ShardPiece* last = nullptr;
  for (const ShardPiece& p : sorted) {
    if (last && p.offset == last->offset && p.extent == last->extent) continue;  // a copy of the same slice
    if (p.offset < end)
      throw InputError(fmt::format("{}: rank {} holds {} {}..{} and rank {} holds {}..{}: the shards overlap", at,
                                   last->rank, letter, last->offset, last->offset + last->extent - 1, p.rank, p.offset,
                                   p.offset + p.extent - 1));
    if (p.offset > end)
      throw InputError(fmt::format("{}: no rank holds {} {}..{} (rank {} starts at {}): a gap between the shards", at,
                                   letter, end, p.offset - 1, p.rank, p.offset));
    end = p.offset + p.extent;
    last = &p;
  }
  if (end != full)
    throw InputError(fmt::format("{}: the shards cover {} 0..{} of {} ({} of the model)", at, letter, end - 1, full,
                                 full));
}

// One checkpoint: the ranks' datasets agree on how they are split; the merged DatasetInfo and its plan.
std::pair<DatasetInfo, MergePlan> plan_checkpoint(const Readers& ranks, const DatasetInfo& d0, int64_t T, int64_t S) {
  const std::string at = fmt::format("{}: {}", ranks.front()->path(), where(d0.step, d0.name));
  DatasetInfo merged = d0;
  MergePlan plan;
  plan.partial = d0.partial;
  std::vector<const DatasetInfo*> each;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const DatasetInfo* d = ranks[i]->find(d0.step, d0.name);
    if (!d)
      throw InputError(fmt::format("rank {} ({}) has no {}, which rank 0 ({}) holds", i, ranks[i]->path(),
                                   where(d0.step, d0.name), ranks.front()->path()));
    if (d->split != d0.split || d->partial != d0.partial || d->layout != d0.layout || d->row_offset != d0.row_offset ||
        d->is_int != d0.is_int)
      throw InputError(fmt::format("{}: rank {} ({}) stores it otherwise than rank 0 (split '{}' / '{}', partial {} / "
                                   "{}, layout {} / {}, row_offset {} / {})",
                                   where(d0.step, d0.name), i, ranks[i]->path(), d0.split, d->split, d0.partial,
                                   d->partial, d0.layout, d->layout, d0.row_offset, d->row_offset));
    each.push_back(d);
    merged.shards.push_back({static_cast<int>(i), ranks[i]->path(), 0, 0});
  }
  if (d0.is_int) return {merged, plan};
  if (!d0.split.empty() && d0.partial)
    throw InputError(fmt::format("{}: both split along {} and partial; a rank's piece is one or the other", at, d0.split));
  const std::vector<std::string> letters = layout_dims(d0.layout);
  const auto letter = std::find(letters.begin(), letters.end(), d0.split);
  if (!d0.split.empty()) {
    if (letter == letters.end() || letters.size() != d0.shape.size())
      throw InputError(fmt::format("{}: split along '{}', which is not a dimension of its layout {}", at, d0.split,
                                   d0.layout));
    plan.dim = static_cast<int>(letter - letters.begin());
    if (d0.split == token_rows_dim() || d0.split == cache_rows_dim())
      throw InputError(fmt::format("{}: split along its row dimension {}; rank dumps split along T or S are not merged",
                                   at, d0.split));
  }
  const std::map<std::string, int64_t> sizes = dim_sizes(ranks.front()->meta().config, T, S);
  const int64_t full = plan.dim >= 0 ? sizes.at(d0.split) : 0;
  for (size_t i = 0; i < each.size(); ++i) {
    std::vector<int64_t> want = d0.shape, have = each[i]->shape;
    if (plan.dim >= 0) {
      want[plan.dim] = have.size() == want.size() ? have[plan.dim] : -1;
      merged.shards[i].offset = each[i]->shard_offset;
      merged.shards[i].extent = want[plan.dim];
    } else {
      merged.shards[i].extent = 0;
    }
    if (have != want)
      throw InputError(fmt::format("{}: rank {} ({}) holds shape [{}], rank 0 [{}]", where(d0.step, d0.name), i,
                                   ranks[i]->path(), fmt::join(have, ", "), fmt::join(d0.shape, ", ")));
  }
  if (plan.dim >= 0) {
    check_tiling(merged.shards, d0.split, full, at);
    merged.shape[plan.dim] = full;
  }
  merged.shard_offset = 0;
  merged.stored_shape = merged.shape;
  plan.shape = merged.shape;
  return {merged, plan};
}

// The merged dump's reads.
class MergedSource final : public DumpReader::Source {
 public:
  MergedSource(Readers ranks, std::map<std::pair<int, std::string>, MergePlan> plans)
      : ranks_(std::move(ranks)), plans_(std::move(plans)) {}

  std::vector<float> read(int step, const std::string& name) const override {
    const MergePlan& p = plans_.at({step, name});
    if (p.partial) return sum(step, name);
    if (p.dim < 0) return ranks_.front()->read(step, name);
    return concatenate(step, name, p);
  }
  std::vector<int32_t> read_ids(int step, const std::string& name) const override {
    return ranks_.front()->read_ids(step, name);
  }
  std::vector<int32_t> int_attribute(const std::string& key) const override { return ranks_.front()->int_attribute(key); }
  std::vector<float> read_rank(int step, const std::string& name, int rank) const override {
    return ranks_.at(static_cast<size_t>(rank))->read(step, name);
  }

 private:
  std::vector<float> sum(int step, const std::string& name) const {
    std::vector<std::vector<float>> values;
    for (const auto& r : ranks_) values.push_back(r->read(step, name));
    return add_partials({values.begin(), values.end()});
  }

  // Each rank's piece placed at its offset along the split dimension; of the copies of a slice several ranks hold,
  // the lowest rank's (placed last), as a replicated checkpoint presents rank 0's.
  std::vector<float> concatenate(int step, const std::string& name, const MergePlan& p) const {
    int64_t total = 1;
    for (int64_t d : p.shape) total *= d;
    std::vector<float> out(static_cast<size_t>(total));
    for (auto it = ranks_.rbegin(); it != ranks_.rend(); ++it) {
      const DumpReader& r = **it;
      place_shard(out, p.shape, p.dim, r.find(step, name)->shard_offset, r.read(step, name));
    }
    return out;
  }

  Readers ranks_;
  std::map<std::pair<int, std::string>, MergePlan> plans_;
};

std::unique_ptr<DumpReader> merge(Readers ranks, const std::string& path) {
  check_same_run(ranks);
  std::map<int, std::vector<DatasetInfo>> steps;
  std::map<std::pair<int, std::string>, MergePlan> plans;
  int64_t S = 0;
  for (int step : ranks.front()->steps()) {
    const DatasetInfo* tokens = ranks.front()->find(step, std::string(kTokensCheckpoint));
    const int64_t T = tokens && !tokens->shape.empty() ? tokens->shape[0] : -1;
    S = T >= 0 && S >= 0 ? S + T : -1;
    for (size_t i = 1; i < ranks.size(); ++i) {
      if (ranks[i]->datasets(step).size() != ranks.front()->datasets(step).size())
        throw InputError(fmt::format("rank {} ({}) holds {} datasets at step {}, rank 0 ({}) {}", i, ranks[i]->path(),
                                     ranks[i]->datasets(step).size(), step, ranks.front()->path(),
                                     ranks.front()->datasets(step).size()));
      if (T >= 0 && ranks[i]->read_ids(step, std::string(kTokensCheckpoint)) != ranks.front()->read_ids(step, std::string(kTokensCheckpoint)))
        throw InputError(fmt::format("rank {} ({}) and rank 0 ({}) were fed different tokens at step {}", i,
                                     ranks[i]->path(), ranks.front()->path(), step));
    }
    for (const DatasetInfo& d0 : ranks.front()->datasets(step)) {
      auto [info, plan] = plan_checkpoint(ranks, d0, T, T >= 0 ? S : -1);
      plans[{step, d0.name}] = std::move(plan);
      steps[step].push_back(std::move(info));
    }
  }
  DumpMeta meta = ranks.front()->meta();
  meta.rank.reset();
  meta.world_size.reset();
  std::vector<std::string> ints = ranks.front()->int_attribute_names();
  return std::make_unique<DumpReader>(path, std::move(meta), std::move(steps), std::move(ints),
                                      std::make_unique<MergedSource>(std::move(ranks), std::move(plans)));
}

}  // namespace

std::vector<std::string> dump_set_paths(const std::vector<std::string>& args) {
  if (args.size() != 1 || !fs::is_directory(args.front())) return args;
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(args.front()))
    if (e.is_regular_file() && e.path().extension() == ".h5") out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out.empty() ? args : out;  // no dumps in it: the reader names the directory as one
}

std::unique_ptr<DumpReader> open_dump_set(const std::vector<std::string>& paths, const NameMap* names) {
  if (paths.empty()) throw InputError("no dump given");
  Readers readers;
  for (const auto& p : paths) readers.push_back(std::make_unique<DumpReader>(p, names));
  if (readers.size() == 1) {
    const DumpMeta& m = readers.front()->meta();
    if (m.world_size && *m.world_size > 1)
      throw InputError(fmt::format("{} is rank {} of a run's {} rank dumps ({} = {}): give all of them, or their "
                                   "directory",
                                   paths.front(), m.rank.value_or(-1), *m.world_size, attr::world_size, *m.world_size));
    return std::move(readers.front());
  }
  const std::string path = fmt::format("{} ({} rank dumps)", fmt::join(paths, " "), paths.size());
  return merge(rank_order(std::move(readers)), path);
}

}  // namespace diffrun
