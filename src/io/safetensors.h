// Safetensors reading (memory-mapped, lazy) and writing (atomic).
//
// A SafeTensors object opens one `.safetensors` file or a sharded directory
// (`model.safetensors.index.json` + shards) and validates every header completely before
// anything is used: JSON well-formed, dtype known, shape x dtype size == byte span, spans inside
// the file, no two tensors overlapping, header size bounded. Tensor bytes are not read at open:
// the file is mmap'ed and a tensor's pages are faulted in when it is used, so a checkpoint larger
// than RAM can be served.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "io/output_file.h"

namespace k3 {

struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // aligned to dtype_size(dtype)
  size_t nbytes = 0;
  const std::string* file = nullptr;  // which file it lives in (for error messages)
  size_t file_offset = 0;             // absolute byte offset of the data in that file

  int64_t numel() const;
  std::string shape_str() const;  // "[3, 4]"
};

class MappedFile;

class SafeTensors {
 public:
  // path: a .safetensors file, or a directory holding model.safetensors.index.json,
  // or a directory holding exactly one *.safetensors file.
  static SafeTensors open(const std::string& path);
  SafeTensors();
  ~SafeTensors();
  SafeTensors(SafeTensors&&) noexcept;
  SafeTensors& operator=(SafeTensors&&) noexcept;

  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  // Throws k3::Error naming the tensor and the checkpoint when absent.
  const TensorView& get(const std::string& name) const;
  std::vector<std::string> names() const;
  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Copies a float-like tensor (F32/BF16/F16) into f32; checks the shape when `expect` is non-empty.
  std::vector<float> read_f32(const std::string& name, const std::vector<int64_t>& expect = {}) const;
  // Copies an I64 tensor.
  std::vector<int64_t> read_i64(const std::string& name) const;

 private:
  void add_file(const std::string& file, const std::vector<std::string>* expected_names);
  std::string path_;
  std::vector<std::unique_ptr<MappedFile>> files_;
  std::vector<std::unique_ptr<std::vector<uint8_t>>> realigned_;  // copies of misaligned tensors
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write. data must hold numel(shape) * dtype_size(dtype) bytes.
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const void* data;
};

// Writes a .safetensors file through an OutputFile (io/output_file.h: a regular file that is not an
// input, written to a temporary and renamed). A killed writer leaves at worst a stray temporary,
// never a truncated `path`.
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace k3
