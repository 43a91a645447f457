#include "io/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "core/memory.h"
#include "io/input_registry.h"

namespace k3 {

const char* file_kind(mode_t m) {
  if (S_ISREG(m)) return "a regular file";
  if (S_ISDIR(m)) return "a directory";
  if (S_ISLNK(m)) return "a symbolic link";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  return "not a regular file";
}

int open_input(const std::string& path, const std::string& what, InputRole role, struct stat* st_out) {
  if (path.empty()) fail("the ", what, " path is empty");
  // O_NONBLOCK: opening a FIFO must not wait for a writer before we can see what it is.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail(path, ": cannot open ", what, " (", std::strerror(errno), ")");
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail(path, ": cannot stat ", what, " (", std::strerror(err), ")");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, ": cannot open ", what, " (it is ", file_kind(st.st_mode), ", not a regular file)");
  }
  const int flags = fcntl(fd, F_GETFL);
  if (flags >= 0) fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  if (role == InputRole::kInput) register_input(fd, path, what);
  if (st_out) *st_out = st;
  return fd;
}

std::string read_file(const std::string& path, const std::string& what, InputRole role) {
  struct stat st;
  const int fd = open_input(path, what, role, &st);
  std::string out;
  try {
    require_memory(uint64_t(st.st_size), path + " (" + what + ")");
    out.resize(size_t(st.st_size));
    size_t got = 0;
    // The size taken above is what is read: a file that another process keeps growing cannot make
    // this read unbounded.
    while (got < out.size()) {
      const ssize_t n = ::read(fd, out.data() + got, out.size() - got);
      if (n < 0) {
        if (errno == EINTR) continue;
        fail(path, ": read error in ", what, " (", std::strerror(errno), ")");
      }
      if (n == 0) break;
      got += size_t(n);
    }
    out.resize(got);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return out;
}

}  // namespace k3
