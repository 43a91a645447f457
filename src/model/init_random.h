// Random K3 checkpoints for any config: what tests, benchmarks and (later) training start from.
// Writes a Hugging Face directory (config.json + model.safetensors, release tensor names) that
// Model::load reads back. Matrices ~ N(0, initializer_range) stored BF16 (routed experts optionally
// MXFP4, quantised round-to-nearest per group of 32); norm weights 1; A_log, dt_bias, conv taps and
// the router bias as the reference initialises them in spirit (A in [1, 16], small dt_bias, taps
// ~ U(±1/sqrt(K))). AttnRes pseudo-queries are zero (the paper's init: uniform mixing) unless
// `random_attnres_queries` asks for N(0, initializer_range) ones, which tests use to exercise AttnRes.
#pragma once
#include <cstdint>
#include <string>

#include "model/config.h"

namespace k3 {

struct RandomInitOptions {
  uint64_t seed = 0;
  bool mxfp4_experts = false;
  bool random_attnres_queries = false;
  float router_bias_std = 0.0f;  // nonzero exercises the selection-only bias
};

// config_path: a config.json (nested or flat); out_dir is created if needed. The written
// config.json is the input file, with a quantization_config added when mxfp4_experts is set.
void write_random_model(const std::string& config_path, const std::string& out_dir, const RandomInitOptions& opt);

// Round-to-nearest MXFP4 quantisation of one row (cols % 32 == 0): the inverse of mxfp4_decode_row
// on representable values. Each group's scale is the power of two that maps its max |x| into [4, 8);
// exact ties round toward the smaller magnitude (not to even as the OCP spec does).
void mxfp4_encode_row(uint8_t* packed, uint8_t* scales, const float* row, int64_t cols);

}  // namespace k3
