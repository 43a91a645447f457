#include "io/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

#include "core/error.h"

namespace k3 {

DirectoryLock::DirectoryLock(const std::string& dir, const std::string& purpose) {
  namespace fs = std::filesystem;
  if (dir.empty()) fail("the ", purpose, " path is empty");
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) fail(dir, ": the ", purpose, " exists and is not a directory");
  fs::create_directories(dir, ec);
  if (ec) fail(dir, ": cannot create the ", purpose, " (", ec.message(), ")");
  const std::string path = (fs::path(dir) / ".lock").string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, 0644);
  if (fd_ < 0) fail(path, ": cannot open the lock of the ", purpose, " (", std::strerror(errno), ")");
  struct stat st;
  if (fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    fail(path, ": the lock of the ", purpose, " is not a regular file");
  }
  if (flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char buf[32] = {0};
    const ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);
    ::close(fd_);
    fd_ = -1;
    if (err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS) {  // a filesystem without locks (some NFS)
      std::fprintf(stderr,
                   "warning: %s: this filesystem cannot lock the %s (%s); make sure no other k3 process "
                   "uses it at the same time\n",
                   path.c_str(), purpose.c_str(), std::strerror(err));
      return;
    }
    if (err != EWOULDBLOCK) fail(path, ": cannot lock the ", purpose, " (", std::strerror(err), ")");
    std::string pid = n > 0 ? std::string(buf, size_t(n)) : "";
    while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
    fail(dir, ": the ", purpose, " is in use by another k3 process", pid.empty() ? "" : " (pid " + pid + ")",
         "; wait for it to finish, or choose another directory");
  }
  const std::string me = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) == 0) {
    const ssize_t w = ::pwrite(fd_, me.data(), me.size(), 0);
    (void)w;  // the pid is for messages only
  }
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the flock
}

}  // namespace k3
