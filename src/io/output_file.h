// The one way k3cpp writes a file: safetensors (logits, gradients, models, checkpoints), JSON and
// text outputs, token shards, rank files. What it guarantees:
//
//   - Only regular files are replaced. An existing OUT that is a device (/dev/null), a FIFO, a
//     socket, a directory or a symbolic link is refused: replacing it by rename() would turn a
//     device node into a plain file (as root) or swap a link for a copy.
//   - Never an input. An OUT that this process has read (io/input_registry.h: same device and
//     inode, whatever the path) is refused, so `--out MODEL/model.safetensors` cannot destroy the
//     model it was computed from.
//   - Atomic. The bytes go to a temporary file in OUT's own directory (so rename() stays within
//     one filesystem), named `.OUT.tmp.<64 random bits>` and created with O_CREAT | O_EXCL |
//     O_NOFOLLOW: a file or symbolic link planted at a guessed name cannot redirect the write. The
//     temporary is fsynced, renamed over OUT, and the directory fsynced. A killed writer leaves at
//     most a stray temporary, never a truncated OUT; a failed one removes its temporary.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace k3 {

// Throws k3::Error naming path when it cannot take an output (see above): empty, an existing
// non-regular file or link, an input of this process, or a parent that is not a directory. Commands
// call it on their output flags before long work; OutputFile checks again when it commits.
void check_output_path(const std::string& path);

class OutputFile {
 public:
  explicit OutputFile(const std::string& path);  // check_output_path, then creates the temporary
  ~OutputFile();                                 // removes the temporary unless committed
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  void write(const void* data, size_t n);
  const std::string& temp_path() const { return tmp_; }  // `.NAME.tmp.<16 hex digits>` beside path
  // fsync, the final check of the target, rename over it, fsync of the directory.
  void commit();

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

// Creates path as a new, empty file for writing (O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode 0666
// less the umask): whatever already stands at path, a file or a symbolic link to anywhere, makes it
// fail with EEXIST and is left untouched. Returns the descriptor, or -1 with errno set.
int create_new_file(const std::string& path);

// Throws k3::Error naming `what` when the filesystem holding path (or its nearest existing parent)
// has fewer than `bytes` free.
void require_disk_space(const std::string& path, uint64_t bytes, const std::string& what);

// Writes `bytes` to path through an OutputFile.
void write_file_atomic(const std::string& path, std::string_view bytes);

// Opens path for appending records (O_APPEND | O_NOFOLLOW, created when absent); it must be a regular
// file when present. Returns the descriptor; the caller closes it.
int open_append(const std::string& path);
// Writes all of `bytes` to fd (at the end, for one from open_append), naming path on failure.
void append_all(int fd, std::string_view bytes, const std::string& path);

}  // namespace k3
