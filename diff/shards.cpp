// Checkpoints merged from rank dumps: the copies of each slice compared, each rank's slice judged by the rule.
#include "diff/shards.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "checkpoints/tensor_parallel.hpp"
#include "checkpoints/vocabulary.hpp"
#include "dump/rows.hpp"

namespace diffrun::diff {
namespace {

// Whether `a` against `b` (shape, layout) fails the rule; its rel_l2 into `rel_l2`.
bool fails(std::span<const float> a, std::span<const float> b, const std::vector<int64_t>& shape,
           const CheckpointResult& r, const ToleranceRule& rule, const DimSizes& dims, double& rel_l2) {
  const TensorMetrics m = compute_metrics(a, b, shape, r.layout, dims, rule.element);
  rel_l2 = m.rel_l2;
  const std::vector<BoundCheck> checks = check_bounds(m, rule, r.positions, r.bound_scale);
  return std::any_of(checks.begin(), checks.end(), [](const BoundCheck& k) { return !k.pass; });
}

// The groups of ranks (indices into engine.shards) holding copies of one slice that are not all the same bits.
std::vector<std::vector<size_t>> disagreeing_copies(const DatasetInfo& engine, const DumpReader& reader) {
  std::map<std::pair<int64_t, int64_t>, std::vector<size_t>> holders;
  for (size_t i = 0; i < engine.shards.size(); ++i)
    holders[{engine.shards[i].offset, engine.shards[i].extent}].push_back(i);
  std::vector<std::vector<size_t>> out;
  for (const auto& [slice_at, ranks] : holders) {
    if (ranks.size() < 2) continue;
    const std::vector<float> first = reader.read_rank(engine.step, engine.name, engine.shards[ranks[0]].rank);
    for (size_t k = 1; k < ranks.size(); ++k) {
      const std::vector<float> copy = reader.read_rank(engine.step, engine.name, engine.shards[ranks[k]].rank);
      if (copy.size() != first.size() || std::memcmp(copy.data(), first.data(), copy.size() * sizeof(float)) != 0) {
        out.push_back(ranks);
        break;
      }
    }
  }
  return out;
}

// A rank's own piece (`shape`: as compared) with the rows the comparison kept: those from r.row_offset on.
std::vector<float> own_piece(const DumpReader& reader, const DatasetInfo& engine, const CheckpointResult& r, int rank,
                             std::vector<int64_t> shape) {
  std::vector<float> v = reader.read_rank(engine.step, engine.name, rank);
  const int rd = row_dim(r.layout);
  const int64_t drop = r.row_offset - engine.row_offset;
  if (drop <= 0 || rd < 0 || static_cast<size_t>(rd) >= shape.size()) return v;
  shape[rd] += drop;
  return take_slice(v, shape, rd, drop, shape[rd]);
}

}  // namespace

void judge_ranks(CheckpointResult& r, const DatasetInfo& engine, const DumpReader& reader, std::span<const float> b,
                 const ToleranceSet& tolerances, const DimSizes& dims) {
  if (!r.metrics || engine.shards.empty()) return;
  RankBlame blame;
  blame.split = engine.split;
  blame.partial = engine.partial;
  for (const ShardPiece& p : engine.shards)
    blame.ranks.push_back({p.rank, p.path, p.offset, p.offset + p.extent, std::numeric_limits<double>::quiet_NaN()});
  const std::vector<std::vector<size_t>> disagreeing = engine.partial ? std::vector<std::vector<size_t>>{}
                                                                      : disagreeing_copies(engine, reader);
  if (!disagreeing.empty()) {
    r.status = CheckpointStatus::fail;
    r.checks.push_back({"replicas", "equal across the ranks holding a slice", static_cast<double>(disagreeing.size()),
                        0.0, false});
  }
  if (!r.failed()) return;
  const ToleranceRule& rule = tolerances.rule_for(r.name);
  const std::vector<std::string> letters = layout_dims(r.layout);
  const auto at = std::find(letters.begin(), letters.end(), engine.split);
  if (engine.partial) {
    blame.note = fmt::format("partial sums of {} ranks: the sum's error cannot be told apart by rank (the layer's "
                             "column-parallel input shows which rank's inputs were wrong)",
                             engine.shards.size());
  } else if (engine.split.empty() || (at != letters.end() && letters.size() == r.shape_reference.size())) {
    // Each rank's own piece (not the merged tensor, which presents one copy of a slice several ranks hold) against
    // the same slice of the reference.
    const int dim = engine.split.empty() ? -1 : static_cast<int>(at - letters.begin());
    for (RankShare& s : blame.ranks) {
      std::vector<int64_t> shape = r.shape_reference;
      DimSizes slice_dims = dims;
      std::vector<float> cut;
      std::span<const float> theirs = b;
      if (dim >= 0) {
        shape[dim] = s.to - s.from;
        slice_dims[engine.split] = shape[dim];
        cut = take_slice(b, r.shape_reference, dim, s.from, s.to);
        theirs = cut;
      }
      const std::vector<float> mine = own_piece(reader, engine, r, s.rank, shape);
      if (mine.size() == theirs.size()) s.failed = fails(mine, theirs, shape, r, rule, slice_dims, s.rel_l2);
    }
  }
  // Of copies that disagree, those failing alone are to blame; where none does, each of them.
  for (const std::vector<size_t>& group : disagreeing) {
    const bool any_fails = std::any_of(group.begin(), group.end(), [&](size_t i) { return blame.ranks[i].failed; });
    for (size_t i : group) blame.ranks[i].copy_differs = !any_fails || blame.ranks[i].failed;
  }
  for (const RankShare& s : blame.ranks)
    if (s.failed || s.copy_differs) blame.blamed.push_back(s.rank);
  if (blame.blamed.empty() && blame.note.empty())
    blame.note = "no rank's slice fails alone: the error is spread over the ranks";
  r.ranks = std::move(blame);
}

std::string blamed_ranks_text(const RankBlame& blame) {
  std::vector<std::string> parts;
  for (const RankShare& s : blame.ranks) {
    if (!s.failed && !s.copy_differs) continue;
    std::string text = fmt::format("rank {}", s.rank);
    if (!blame.split.empty()) text += fmt::format(" ({} {}..{})", blame.split, s.from, s.to - 1);
    if (!std::isnan(s.rel_l2)) text += fmt::format(", rel_l2 {:.3g}", s.rel_l2);
    if (s.copy_differs) text += ", its copy differs from the other ranks'";
    parts.push_back(std::move(text));
  }
  return fmt::format("{}", fmt::join(parts, "; "));
}

}  // namespace diffrun::diff
