// Checks that a path names a regular file of a sane size before anything opens it for reading.
#include "model/file_check.hpp"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include <fmt/core.h>

namespace diffrun {

std::string regular_file_problem(const std::string& path, uint64_t max_bytes) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return "does not exist";
    return fmt::format("cannot be read: {}", std::strerror(errno));
  }
  if (S_ISDIR(st.st_mode)) return "is a directory, not a regular file";
  if (S_ISFIFO(st.st_mode)) return "is a FIFO (named pipe), not a regular file";
  if (S_ISCHR(st.st_mode)) return "is a character device, not a regular file";
  if (S_ISBLK(st.st_mode)) return "is a block device, not a regular file";
  if (S_ISSOCK(st.st_mode)) return "is a socket, not a regular file";
  if (!S_ISREG(st.st_mode)) return "is not a regular file";
  if (max_bytes > 0 && static_cast<uint64_t>(st.st_size) > max_bytes) {
    return fmt::format("is {} bytes, more than the {} bytes such a file may have", st.st_size, max_bytes);
  }
  return {};
}

}  // namespace diffrun
