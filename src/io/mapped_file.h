// A read-only memory-mapped file (safetensors, token shards): pages are read on demand, so files
// larger than RAM work. Errors name the file. The file must be a regular file (io/file.h); it is
// registered as an input, and a truncation while mapped is reported by name instead of an
// anonymous SIGBUS (io/input_registry.h).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace k3 {

class MappedFile {
 public:
  // what: the file's role in messages ("model weights", "token shard").
  explicit MappedFile(const std::string& path, const std::string& what = "file");
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();
  const std::string& path() const { return path_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  std::string path_;
  int fd_ = -1;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace k3
