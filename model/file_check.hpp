// Checks that a path names a regular file of a sane size before anything opens it for reading.
#pragma once

#include <cstdint>
#include <string>

namespace diffrun {

// Empty when `path` is a regular file of at most `max_bytes` bytes (0: no limit); otherwise what is
// wrong, worded to follow "<path>: ", e.g. "is a FIFO, not a regular file" or "does not exist".
// Uses stat only, so a FIFO or a device is never opened (opening a FIFO blocks until a writer comes).
std::string regular_file_problem(const std::string& path, uint64_t max_bytes = 0);

}  // namespace diffrun
