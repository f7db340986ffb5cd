// A tensor-parallel engine's rank dumps merged into one dump (docs/dump-format.md, "Shards").
//
// Decisions:
// - Each checkpoint is merged by its own attributes, with one rule (as SGLang's planner turns `h(tp,partial)` into a
//   concat or a sum): split along a letter: the ranks' pieces placed at their offsets; partial: the ranks' values
//   summed (in float64, in rank order, rounded to float32 once); neither: replicated, rank 0's values presented
//   (diff/shards.hpp checks that the other ranks' copies are the same).
// - Pieces of several ranks with the same offset and extent are copies of one slice (KV heads replicated where
//   n_head_kv < world_size), the lowest rank's presented; pieces that overlap otherwise, or leave a gap, refuse the
//   set.
// - The set must be whole and agree: every rank 0..world_size-1 once, one world size, one model, config,
//   precision, prompt and steps, the same tokens and checkpoints in each step. Anything else is an InputError
//   naming the files (exit 2).
// - Splitting along the row dimension (T, or S for the cache) is not merged (a sequence-parallel layout).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "checkpoints/name_map.hpp"
#include "dump/dump.hpp"

namespace diffrun {

// The dumps one side of a comparison names: the files given, or, for one directory, its regular files ending in
// ".h5" in name order (a directory without any: itself, which the reader refuses as a directory).
std::vector<std::string> dump_set_paths(const std::vector<std::string>& args);

// One dump (a single file that is not one rank of several), or the rank dumps `paths` merged. The merged dump's
// path reads "PATHS (N rank dumps)"; its meta is rank 0's without rank and world_size; each merged checkpoint keeps
// its split and partial and lists each rank's piece (DatasetInfo::shards). Throws InputError for a set that
// cannot be merged, DumpError for a file that cannot be read.
std::unique_ptr<DumpReader> open_dump_set(const std::vector<std::string>& paths, const NameMap* names = nullptr);

}  // namespace diffrun
