// The --device and --precision flags that every command running the model shares, and loading the
// engine they name (model/engine.h) with progress lines on stderr.
#pragma once
#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "model/engine.h"

namespace k3::cli {

struct DeviceOptions {
  std::string device = "cpu";  // cpu | cuda
  std::string precision;       // f32 | bf16; empty: f32 on the CPU, bf16 on the GPU
};
void add_device_options(CLI::App* sub, DeviceOptions& o);
EngineOptions engine_options(const DeviceOptions& o);

// Prints a loading line to stderr (device, precision, weight bytes on the GPU).
std::unique_ptr<Engine> load_engine(const std::string& model_dir, const DeviceOptions& o);

}  // namespace k3::cli
