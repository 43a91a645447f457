// Random K3 checkpoints for any config (`k3 init`): what tests and benchmarks start from.
// Writes a Hugging Face directory (config.json + model.safetensors, release tensor names) that
// Model::load reads back: every tensor of the config's tensor table (tensor_table.h), drawn by its
// initialiser (tensor_init.h, which lists the rules) and stored as the release stores it: BF16,
// F32 for A_log, dt_bias, conv taps, o_norm and the router bias, routed experts optionally MXFP4
// (quantised round-to-nearest per group of 32). Training from scratch draws the same values in
// memory (model/params.h: ParamStore::random_init).
//
// A config with a vision_config also gets the vision tower and projector (tensor_table.h:
// vision_tensor_table), in BF16, drawn after the text model from the same stream: matrices and the
// position table N(0, initializer_range), norm gains 1. The directory then loads with both
// Engine::load and VisionModel::load.
#pragma once
#include <cstdint>
#include <string>

#include "model/config.h"
#include "model/tensor_init.h"

namespace k3 {

// config_path: a config.json (nested or flat); out_dir is created if needed. The written
// config.json is the input file, with a quantization_config added when mxfp4_experts is set, and
// vision_config.text_hidden_size set to the text hidden_size where a vision_config lacks it (one that
// disagrees with the text hidden_size is a k3::Error naming it).
void write_random_model(const std::string& config_path, const std::string& out_dir, const RandomInitOptions& opt);

// A directory holding only a vision tower and projector (as tests/fixtures/vision-tiny): config_path is a
// config.json whose vision_config gives the text width (vision_config.text_hidden_size or a top-level one); out_dir
// gets that config.json and a model.safetensors with every tensor of vision_tensor_table, drawn as k3 init draws a
// model's tower (matrices and the position table N(0, initializer_range), norm gains 1; BF16) from one stream
// seeded with opt.seed. initializer_range is the config's (top level or text_config), else 0.02. What the vision
// tests and benchmarks start from; VisionModel::load and CudaVisionModel::load read it.
void write_random_vision_model(const std::string& config_path, const std::string& out_dir,
                               const RandomInitOptions& opt);

// Round-to-nearest MXFP4 quantisation of one row (cols % 32 == 0): the inverse of mxfp4_decode_row
// on representable values. Each group's scale is the power of two that maps its max |x| into [4, 8);
// exact ties round toward the smaller magnitude (not to even as the OCP spec does).
void mxfp4_encode_row(uint8_t* packed, uint8_t* scales, const float* row, int64_t cols);

}  // namespace k3
