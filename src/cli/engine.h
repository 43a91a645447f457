// The --device and --precision flags that every command running the model shares, and loading the
// engine they name (model/engine.h) with progress lines on stderr.
#pragma once
#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "model/engine.h"
#include "tokenizer/tokenizer.h"

namespace k3::cli {

struct DeviceOptions {
  std::string device = "cpu";  // cpu | cuda
  std::string precision;       // f32 | bf16; empty: f32 on the CPU, bf16 on the GPU
};
void add_device_options(CLI::App* sub, DeviceOptions& o);
EngineOptions engine_options(const DeviceOptions& o);

// Prints a loading line to stderr (device, precision, weight bytes on the GPU).
std::unique_ptr<Engine> load_engine(const std::string& model_dir, const DeviceOptions& o);

// The tokenizer for text prompts: tokenizer_dir when given, else the model directory's own; an error
// names what is missing, or a tokenizer with more ids than the model's vocabulary.
Tokenizer load_tokenizer(const std::string& model_dir, const std::string& tokenizer_dir, const K3Config& cfg);

}  // namespace k3::cli
