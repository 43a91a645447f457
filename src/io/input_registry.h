// The files this process has read: every read_file() and MappedFile registers its file here, so
// that the one output writer (io/output_file.h) can refuse to replace an input of the same command
// (`k3 logits --out MODEL/model.safetensors`, `k3 data --out IN IN`), whatever path names it: a
// file is identified by device and inode, not by its path, so links and relative paths do not hide
// it. A new file that reuses the inode of an input deleted since is told apart by the input's path
// and its ctime at registration.
//
// It also backs the SIGBUS handler of memory-mapped inputs: a file truncated while mapped makes the
// next read of a lost page raise SIGBUS; the handler names the file instead of dying silently.
#pragma once
#include <sys/stat.h>

#include <cstddef>
#include <optional>
#include <string>

namespace k3 {

// Records the open file `fd` (read from `path`, in the role `what`: "config", "model weights"...).
void register_input(int fd, const std::string& path, const std::string& what);
// Forgets the file open as `fd` (used when a mapped input is closed after being deleted).
void unregister_input(int fd);

struct InputInfo {
  std::string path, what;
};
// The input that `st` (from stat) describes, if this process has read it.
std::optional<InputInfo> find_input(const struct stat& st);

// Memory-mapped ranges, for the SIGBUS handler (installed by the first call). `path` must stay valid
// until unregister_mapping(begin).
void register_mapping(const void* begin, size_t len, const char* path);
void unregister_mapping(const void* begin);

}  // namespace k3
