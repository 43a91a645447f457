#include "io/output_file.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/memory.h"
#include "io/file.h"
#include "io/input_registry.h"

namespace k3 {

namespace {

namespace fs = std::filesystem;

std::string parent_of(const std::string& path) {
  const fs::path p = fs::path(path).parent_path();
  return p.empty() ? "." : p.string();
}

// The checks on an existing target; `st` is its lstat.
void check_existing_target(const std::string& path, const struct stat& st) {
  if (S_ISLNK(st.st_mode))
    fail(path,
         ": is a symbolic link; an output is written to a new file renamed into place, which would replace "
         "the link rather than its target: give the target's own path");
  if (!S_ISREG(st.st_mode)) fail(path, ": is ", file_kind(st.st_mode), "; k3 writes outputs only as regular files");
  if (std::optional<InputInfo> in = find_input(st))
    fail(path, ": is an input of this command (", in->what, in->path != path ? ", read as " + in->path : std::string(),
         "); writing the output there would destroy it: choose another path");
}

std::string random_suffix() {
  uint64_t r = 0;
  if (getrandom(&r, sizeof r, 0) != ssize_t(sizeof r)) {
    // No entropy source: O_EXCL still refuses a planted name, so fall back on a weaker mix.
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    r = uint64_t(ts.tv_nsec) * 0x9E3779B97F4A7C15ull ^ uint64_t(::getpid()) << 32 ^ uint64_t(ts.tv_sec);
  }
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", (unsigned long long)r);
  return b;
}

void fsync_directory(const std::string& dir) {
  const int d = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d < 0) return;  // the rename is done; a directory that cannot be opened cannot be synced either
  ::fsync(d);
  ::close(d);
}

}  // namespace

int create_new_file(const std::string& path) {
  return ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
}

void check_output_path(const std::string& path) {
  if (path.empty()) fail("the output path is empty");
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0) check_existing_target(path, st);
  else if (errno != ENOENT) fail(path, ": cannot write output (", std::strerror(errno), ")");
  const std::string dir = parent_of(path);
  if (::stat(dir.c_str(), &st) != 0)
    fail(path, ": cannot write output: directory '", dir, "' ",
         errno == ENOENT ? "does not exist" : std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) fail(path, ": cannot write output: '", dir, "' is not a directory");
}

OutputFile::OutputFile(const std::string& path) : path_(path) {
  check_output_path(path);
  // Keep the temporary's name within NAME_MAX whatever the length of OUT's.
  const std::string base = fs::path(path).filename().string().substr(0, 200);
  for (int attempt = 0; attempt < 16 && fd_ < 0; ++attempt) {
    tmp_ = (fs::path(parent_of(path)) / ("." + base + ".tmp." + random_suffix())).string();
    fd_ = create_new_file(tmp_);
    if (fd_ < 0 && errno != EEXIST)
      fail(path, ": cannot create the temporary file ", tmp_, " (", std::strerror(errno), ")");
  }
  if (fd_ < 0) fail(path, ": cannot create a temporary file beside it (16 names taken)");
  // An output that replaces a file keeps that file's permissions.
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) ::fchmod(fd_, st.st_mode & 07777);
}

OutputFile::~OutputFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !tmp_.empty()) ::unlink(tmp_.c_str());
}

void OutputFile::write(const void* data, size_t n) {
  K3_ASSERT(fd_ >= 0 && !committed_);
  append_all(fd_, std::string_view(static_cast<const char*>(data), n), path_);
}

void OutputFile::commit() {
  K3_ASSERT(fd_ >= 0 && !committed_);
  if (::fsync(fd_) != 0) fail(path_, ": fsync failed (", std::strerror(errno), ")");
  if (::close(fd_) != 0) {
    fd_ = -1;
    fail(path_, ": close failed (", std::strerror(errno), ")");
  }
  fd_ = -1;
  // The target may have changed since the constructor looked (another process, a long job).
  struct stat st;
  if (::lstat(path_.c_str(), &st) == 0) check_existing_target(path_, st);
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0)
    fail(path_, ": rename from the temporary file failed (", std::strerror(errno), ")");
  committed_ = true;
  fsync_directory(parent_of(path_));
}

void require_disk_space(const std::string& path, uint64_t bytes, const std::string& what) {
  fs::path p = fs::absolute(path);
  std::error_code ec;
  while (!fs::exists(p, ec) && p.has_parent_path() && p.parent_path() != p) p = p.parent_path();
  struct statvfs sv;
  if (::statvfs(p.c_str(), &sv) != 0) return;  // cannot tell: the write will say
  const uint64_t free_bytes = uint64_t(sv.f_bavail) * uint64_t(sv.f_frsize);
  if (bytes > free_bytes)
    fail(what, " needs ", format_bytes(bytes), " of disk at ", path, ", but only ", format_bytes(free_bytes),
         " is free");
}

void write_file_atomic(const std::string& path, std::string_view bytes) {
  OutputFile f(path);
  f.write(bytes.data(), bytes.size());
  f.commit();
}

int open_append(const std::string& path) {
  if (path.empty()) fail("the output path is empty");
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, 0666);
  if (fd < 0)
    fail(path, ": cannot open for appending (", errno == ELOOP ? "it is a symbolic link" : std::strerror(errno), ")");
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail(path, ": cannot stat (", std::strerror(err), ")");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, ": cannot append to it: it is ", file_kind(st.st_mode), ", not a regular file");
  }
  const int flags = fcntl(fd, F_GETFL);
  if (flags >= 0) fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

void append_all(int fd, std::string_view bytes, const std::string& path) {
  const char* c = bytes.data();
  size_t n = bytes.size();
  while (n > 0) {
    const ssize_t w = ::write(fd, c, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail(path, ": write failed (", std::strerror(errno), ")");
    }
    c += w;
    n -= size_t(w);
  }
}

}  // namespace k3
