#include "io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "io/file.h"
#include "io/input_registry.h"

namespace k3 {

MappedFile::MappedFile(const std::string& path, const std::string& what) : path_(path) {
  struct stat st;
  fd_ = open_input(path, what, InputRole::kInput, &st);
  try {  // the destructor does not run if the constructor throws: close fd_ here
    size_ = size_t(st.st_size);
    if (size_ > 0) {
      void* p = mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0);
      if (p == MAP_FAILED) fail(path, ": mmap failed: ", std::strerror(errno));
      data_ = static_cast<const uint8_t*>(p);
      register_mapping(data_, size_, path_.c_str());
    }
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

MappedFile::~MappedFile() {
  if (data_) {
    unregister_mapping(data_);
    munmap(const_cast<uint8_t*>(data_), size_);
  }
  if (fd_ >= 0) {
    // A deleted input cannot be overwritten any more; forget it so that a new file reusing its inode
    // is not mistaken for it.
    struct stat st;
    if (fstat(fd_, &st) == 0 && st.st_nlink == 0) unregister_input(fd_);
    ::close(fd_);
  }
}

}  // namespace k3
