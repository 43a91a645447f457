// The model a command runs on: the CPU engine (model/model.h) or the GPU one (model/cuda/cuda_model.h),
// chosen by --device and --precision, which `logits` and `generate` share.
#pragma once
#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <vector>

#include "model/cuda/cuda_model.h"
#include "model/generate.h"
#include "model/model.h"

namespace k3::cli {

struct DeviceOptions {
  std::string device = "cpu";     // cpu | cuda
  std::string precision;           // cuda only: bf16 (the default) | f32
};
void add_device_options(CLI::App* sub, DeviceOptions& o);

class Engine {
 public:
  // Prints a loading line to stderr (device, precision, weight bytes on the GPU).
  static Engine load(const std::string& model_dir, const DeviceOptions& o);
  const K3Config& config() const;
  std::string description() const;  // "cpu" or "cuda (bf16)"
  // Full forward of equal-or-unequal rows from fresh caches; logits of every position, rows in order.
  std::vector<float> forward_fresh(const std::vector<std::vector<int32_t>>& rows);
  // A new single-sequence session for generate(): each call appends tokens and returns the last logits.
  AppendFn session();

 private:
  std::shared_ptr<Model> cpu_;
  std::shared_ptr<CudaModel> gpu_;
};

}  // namespace k3::cli
