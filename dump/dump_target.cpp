// DumpTarget in this process (DumpFile) or in a diffrun-dump-child process, and the child's loop.
//
// The two talk over a Unix stream socket (the child's standard input). Each message is a frame: a
// 16-byte header (tag, payload length) and its payload. The parent sends open, attribute, write and
// finish frames; the child answers open and finish with a reply frame (ok and the bytes written, or
// an error), and sends an error reply on its own when any other frame fails, then removes its
// temporary and exits. The parent reads that reply when a send fails (the child is gone) or at finish.
#include "dump/dump_target.hpp"

#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <vector>

#include "dump/dump_format.hpp"
#include "model/error.hpp"

extern char** environ;

namespace diffrun {

namespace {

// ---------------------------------------------------------------------------------------------
// In this process

class LocalTarget final : public DumpTarget {
 public:
  LocalTarget(const std::string& path, int compress) : file_(path) { file_.set_compression(compress); }
  const std::string& path() const override { return file_.path(); }
  void set_string(const std::string& name, const std::string& value) override { file_.set_string(name, value); }
  void set_int(const std::string& name, int32_t value) override { file_.set_int(name, value); }
  void set_real(const std::string& name, double value) override { file_.set_real(name, value); }
  void set_bool(const std::string& name, bool value) override { file_.set_bool(name, value); }
  void set_ints(const std::string& name, std::span<const int32_t> values) override { file_.set_ints(name, values); }
  void write(int step, std::string_view name, StoredDType type, std::span<const int64_t> shape, const void* data,
             const DatasetAttributes& attrs) override {
    file_.write(step, name, type, shape, data, attrs);
  }
  void finish() override { file_.finish(); }
  bool finished() const override { return file_.finished(); }
  uint64_t bytes_written() const override { return file_.bytes_written(); }
  bool in_process() const override { return true; }

 private:
  DumpFile file_;
};

// ---------------------------------------------------------------------------------------------
// The wire

enum Tag : uint32_t { kOpen = 1, kString, kInt, kReal, kBool, kInts, kWrite, kFinish, kReply };

struct FrameHeader {
  uint32_t tag = 0;
  uint32_t reserved = 0;
  uint64_t length = 0;  // payload bytes after the header
};
static_assert(sizeof(FrameHeader) == 16);

constexpr uint64_t kMaxFrame = uint64_t{1} << 40;  // a sanity bound on a payload's length

// A payload being built: little-endian PODs and length-prefixed strings (both ends are this host).
class Encoder {
 public:
  template <typename T>
  Encoder& put(T v) {
    buf_.append(reinterpret_cast<const char*>(&v), sizeof(T));
    return *this;
  }
  Encoder& str(std::string_view s) {
    put<uint64_t>(s.size());
    buf_.append(s.data(), s.size());
    return *this;
  }
  Encoder& opt(const std::optional<int>& v) {
    put<uint8_t>(v.has_value());
    return put<int32_t>(v.value_or(0));
  }
  void pad8() { buf_.append((8 - buf_.size() % 8) % 8, '\0'); }
  const std::string& bytes() const { return buf_; }

 private:
  std::string buf_;
};

// Reads a payload; a short or malformed one throws DumpError naming `where`.
class Decoder {
 public:
  Decoder(const char* p, size_t n, const std::string& where) : p_(p), end_(p + n), where_(where) {}
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  std::string str() {
    const auto n = get<uint64_t>();
    need(n);
    std::string s(p_, n);
    p_ += n;
    return s;
  }
  std::optional<int> opt() {
    const bool has = get<uint8_t>() != 0;
    const int v = get<int32_t>();
    return has ? std::optional<int>(v) : std::nullopt;
  }
  void align8(const char* base) {
    const size_t used = static_cast<size_t>(p_ - base);
    need((8 - used % 8) % 8);
    p_ += (8 - used % 8) % 8;
  }
  const char* take(uint64_t n) {
    need(n);
    const char* at = p_;
    p_ += n;
    return at;
  }

 private:
  void need(uint64_t n) const {
    if (static_cast<uint64_t>(end_ - p_) < n) throw DumpError(where_ + ": a malformed message from the dump writer's other end");
  }
  const char* p_;
  const char* end_;
  std::string where_;
};

// Sends every byte of `iov` (MSG_NOSIGNAL: a closed peer is an error, not SIGPIPE). False on failure.
bool send_all(int fd, iovec* iov, int n) {
  while (n > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(n);
    const ssize_t w = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    auto left = static_cast<size_t>(w);
    while (n > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --n;
    }
    if (n > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return true;
}

bool send_frame(int fd, Tag tag, const std::string& payload, const void* data = nullptr, size_t data_bytes = 0) {
  FrameHeader h;
  h.tag = tag;
  h.length = payload.size() + data_bytes;
  iovec iov[3] = {{&h, sizeof h}, {const_cast<char*>(payload.data()), payload.size()}, {const_cast<void*>(data), data_bytes}};
  return send_all(fd, iov, data_bytes > 0 ? 3 : 2);
}

// Reads exactly n bytes; false at the end of input (or an error) before them.
bool recv_all(int fd, void* out, size_t n) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// One frame into `payload`; nullopt at a clean or broken end of input.
std::optional<uint32_t> recv_frame(int fd, std::vector<char>& payload) {
  FrameHeader h;
  if (!recv_all(fd, &h, sizeof h) || h.length > kMaxFrame) return std::nullopt;
  payload.resize(h.length);
  if (!recv_all(fd, payload.data(), h.length)) return std::nullopt;
  return h.tag;
}

std::string reply_ok(uint64_t bytes) {
  Encoder e;
  e.put<uint8_t>(1).put<uint64_t>(bytes);
  return e.bytes();
}

std::string reply_error(const std::string& what) {
  Encoder e;
  e.put<uint8_t>(0).str(what);
  return e.bytes();
}

// ---------------------------------------------------------------------------------------------
// The parent's side

class ChildTarget final : public DumpTarget {
 public:
  ChildTarget(std::string path, std::string exe, pid_t pid, int fd)
      : path_(std::move(path)), exe_(std::move(exe)), pid_(pid), fd_(fd) {}
  ~ChildTarget() override {
    // Unfinished: the end of input makes the child remove its temporary; waiting for it keeps the
    // promise that the temporary is gone when the writer is.
    ::shutdown(fd_, SHUT_WR);
    std::vector<char> ignored;
    while (recv_frame(fd_, ignored)) {
    }
    ::close(fd_);
    reap();
  }
  ChildTarget(const ChildTarget&) = delete;
  ChildTarget& operator=(const ChildTarget&) = delete;

  // The reply to open (sent by child_dump_target).
  void expect_opened() { read_reply(); }

  const std::string& path() const override { return path_; }
  void set_string(const std::string& name, const std::string& value) override {
    send(kString, Encoder().str(name).str(value).bytes());
  }
  void set_int(const std::string& name, int32_t value) override { send(kInt, Encoder().str(name).put<int32_t>(value).bytes()); }
  void set_real(const std::string& name, double value) override { send(kReal, Encoder().str(name).put<double>(value).bytes()); }
  void set_bool(const std::string& name, bool value) override { send(kBool, Encoder().str(name).put<uint8_t>(value).bytes()); }
  void set_ints(const std::string& name, std::span<const int32_t> values) override {
    Encoder e;
    e.str(name).put<uint64_t>(values.size());
    for (int32_t v : values) e.put<int32_t>(v);
    send(kInts, e.bytes());
  }
  void write(int step, std::string_view name, StoredDType type, std::span<const int64_t> shape, const void* data,
             const DatasetAttributes& attrs) override {
    uint64_t n = 1;
    for (int64_t d : shape) n *= static_cast<uint64_t>(std::max<int64_t>(d, 0));
    const uint64_t data_bytes = n * stored_dtype_size(type);
    Encoder e;
    e.put<int32_t>(step).str(name).put<uint8_t>(static_cast<uint8_t>(type)).put<uint32_t>(static_cast<uint32_t>(shape.size()));
    for (int64_t d : shape) e.put<int64_t>(d);
    e.opt(attrs.order).opt(attrs.layer).str(attrs.layout).str(attrs.native_dtype).opt(attrs.row_offset);
    e.str(attrs.split).opt(attrs.shard_offset).opt(attrs.partial);
    e.put<uint64_t>(data_bytes);
    e.pad8();
    if (finished_) throw DumpError(path_ + ": dataset '" + std::string(name) + "': write after the dump was closed");
    if (!send_frame(fd_, kWrite, e.bytes(), data, data_bytes)) child_failed();
    bytes_ += data_bytes;
  }
  void finish() override {
    if (finished_) return;
    send(kFinish, {});
    bytes_ = read_reply();
    finished_ = true;
  }
  bool finished() const override { return finished_; }
  uint64_t bytes_written() const override { return bytes_; }
  bool in_process() const override { return false; }

 private:
  void send(Tag tag, const std::string& payload) {
    if (finished_) throw DumpError(path_ + ": a change after the dump was closed");
    if (!send_frame(fd_, tag, payload)) child_failed();
  }

  // The child's reply: its bytes written, or its error thrown as DumpError.
  uint64_t read_reply() {
    std::vector<char> payload;
    const auto tag = recv_frame(fd_, payload);
    if (!tag || *tag != kReply) gone();
    Decoder d(payload.data(), payload.size(), path_);
    if (d.get<uint8_t>() == 0) throw_child_error(d.str());
    return d.get<uint64_t>();
  }

  // A send failed: the child has ended, after an error reply unless it crashed.
  [[noreturn]] void child_failed() {
    std::vector<char> payload;
    const auto tag = recv_frame(fd_, payload);
    if (tag && *tag == kReply) {
      Decoder d(payload.data(), payload.size(), path_);
      if (d.get<uint8_t>() == 0) throw_child_error(d.str());
    }
    gone();
  }

  [[noreturn]] void throw_child_error(const std::string& what) {
    finished_ = true;  // nothing more goes to the child; its temporary is removed
    throw DumpError(what);
  }

  [[noreturn]] void gone() {
    finished_ = true;
    const int status = reap();
    std::string how = "ended";
    if (status >= 0 && WIFSIGNALED(status)) how = "was killed by signal " + std::to_string(WTERMSIG(status));
    else if (status >= 0 && WIFEXITED(status)) how = "exited with status " + std::to_string(WEXITSTATUS(status));
    throw DumpError(path_ + ": the dump writer process (" + exe_ + ") " + how + " before it finished the file");
  }

  int reap() {
    if (pid_ <= 0) return status_;
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
    status_ = status;
    return status;
  }

  std::string path_, exe_;
  pid_t pid_;
  int fd_;
  int status_ = -1;
  bool finished_ = false;
  uint64_t bytes_ = 0;
};

}  // namespace

std::unique_ptr<DumpTarget> local_dump_target(const std::string& path, int compress) {
  return std::make_unique<LocalTarget>(path, compress);
}

std::string dump_child_executable() {
  if (const char* v = std::getenv("DIFFRUN_DUMP_CHILD"); v && *v) return ::access(v, X_OK) == 0 ? v : "";
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "";
  const std::filesystem::path exe = self.parent_path() / "diffrun-dump-child";
  return ::access(exe.c_str(), X_OK) == 0 ? exe.string() : "";
}

std::unique_ptr<DumpTarget> child_dump_target(const std::string& path, int compress) {
  const std::string exe = dump_child_executable();
  if (exe.empty()) return nullptr;
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return nullptr;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, sv[1], STDIN_FILENO);  // dup2 leaves close-on-exec off
  char* argv[] = {const_cast<char*>(exe.c_str()), nullptr};
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(sv[1]);
  if (rc != 0) {
    ::close(sv[0]);
    return nullptr;
  }
  auto target = std::make_unique<ChildTarget>(path, exe, pid, sv[0]);
  Encoder e;
  e.str(path).put<int64_t>(::getpid()).put<int32_t>(compress);
  if (!send_frame(sv[0], kOpen, e.bytes())) {
    // Gone before its first frame (not this executable?): the reply-less end is thrown below.
  }
  target->expect_opened();
  return target;
}

// ---------------------------------------------------------------------------------------------
// The child's side

int dump_child_main(int fd) {
  // The parent handles interrupts (it removes the temporary and exits, and this process then reads
  // the end of its input); a broken socket is an error of send, not a signal.
  ::signal(SIGINT, SIG_IGN);
  ::signal(SIGTERM, SIG_IGN);
  ::signal(SIGPIPE, SIG_IGN);
  release_replaced_dumps_in_background();
  std::unique_ptr<DumpFile> file;
  std::vector<char> payload;
  std::string where = "diffrun-dump-child";
  const auto answer = [fd](const std::string& reply) { send_frame(fd, kReply, reply); };
  try {
    for (;;) {
      const auto tag = recv_frame(fd, payload);
      if (!tag) return 0;  // the parent is gone or gave up: ~DumpFile removes the temporary
      Decoder d(payload.data(), payload.size(), where);
      if (*tag != kOpen && !file) throw DumpError(where + ": a message before the file was opened");
      switch (*tag) {
        case kOpen: {
          if (file) throw DumpError(where + ": a second open");
          const std::string path = d.str();
          const auto pid = d.get<int64_t>();
          const int compress = d.get<int32_t>();
          where = path;
          file = std::make_unique<DumpFile>(path, static_cast<long>(pid));
          file->set_compression(compress);
          answer(reply_ok(0));
          break;
        }
        case kString: {
          const std::string name = d.str();
          file->set_string(name, d.str());
          break;
        }
        case kInt: {
          const std::string name = d.str();
          file->set_int(name, d.get<int32_t>());
          break;
        }
        case kReal: {
          const std::string name = d.str();
          file->set_real(name, d.get<double>());
          break;
        }
        case kBool: {
          const std::string name = d.str();
          file->set_bool(name, d.get<uint8_t>() != 0);
          break;
        }
        case kInts: {
          const std::string name = d.str();
          const auto n = d.get<uint64_t>();
          const char* at = d.take(n * sizeof(int32_t));
          std::vector<int32_t> values(n);
          std::memcpy(values.data(), at, n * sizeof(int32_t));
          file->set_ints(name, values);
          break;
        }
        case kWrite: {
          const int step = d.get<int32_t>();
          const std::string name = d.str();
          const auto type = static_cast<StoredDType>(d.get<uint8_t>());
          if (static_cast<int>(type) > static_cast<int>(StoredDType::i32)) throw DumpError(where + ": an unknown stored dtype");
          std::vector<int64_t> shape(d.get<uint32_t>());
          for (int64_t& s : shape) s = d.get<int64_t>();
          DatasetAttributes attrs;
          attrs.order = d.opt();
          attrs.layer = d.opt();
          attrs.layout = d.str();
          attrs.native_dtype = d.str();
          attrs.row_offset = d.opt();
          attrs.split = d.str();
          attrs.shard_offset = d.opt();
          attrs.partial = d.opt();
          const auto bytes = d.get<uint64_t>();
          d.align8(payload.data());
          file->write(step, name, type, shape, d.take(bytes), attrs);
          break;
        }
        case kFinish:
          file->finish();
          answer(reply_ok(file->bytes_written()));
          return 0;
        default:
          throw DumpError(where + ": an unknown message (tag " + std::to_string(*tag) + ")");
      }
    }
  } catch (const std::exception& e) {
    file.reset();  // removes the temporary before the parent hears of the error
    answer(reply_error(e.what()));
  }
  return 0;
}

}  // namespace diffrun
