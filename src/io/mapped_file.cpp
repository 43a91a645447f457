#include "io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace k3 {

MappedFile::MappedFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) fail(path, ": cannot open: ", std::strerror(errno));
  try {  // the destructor does not run if the constructor throws: close fd_ here
    struct stat st;
    if (fstat(fd_, &st) != 0) fail(path, ": cannot stat: ", std::strerror(errno));
    if (!S_ISREG(st.st_mode)) fail(path, ": not a regular file");
    size_ = size_t(st.st_size);
    if (size_ > 0) {
      void* p = mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0);
      if (p == MAP_FAILED) fail(path, ": mmap failed: ", std::strerror(errno));
      data_ = static_cast<const uint8_t*>(p);
    }
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

MappedFile::~MappedFile() {
  if (data_) munmap(const_cast<uint8_t*>(data_), size_);
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace k3
