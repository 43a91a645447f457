// "Non-finite results are an error naming where they first appeared": the inference side.
//
// The forward checks each block's output (the embedding rows, every attn_out and ffn_out, the
// logits) with first_nonfinite (core/finite.h): O(tokens x hidden) integer compares per block,
// against the block's O(tokens x hidden^2) arithmetic. At the first one that holds a NaN or an
// infinity it stops with an error that names the block, the layer and the token row, and then
// names the cause when it is in the weights: it scans that block's tensors (only then, so a healthy
// forward never pays for it) for NaN/Inf values, or for an MXFP4 scale byte 0xFF, which E8M0
// defines as NaN. When every weight there is finite the values overflowed in the arithmetic,
// and the message says so.
#pragma once
#include <cstdint>
#include <string>

#include "io/safetensors.h"
#include "model/config.h"

namespace k3 {

// The first weight among st's tensors of `layer` (-1: the tensors outside every layer: embedding,
// final norm, output AttnRes, lm_head) that holds a non-finite value, as
// "tensor 'NAME' holds NaN at flat index I"; "" when all are finite.
std::string find_nonfinite_weight(const SafeTensors& st, int64_t layer);

// Throws the error for a non-finite value (`value`) first seen in `block` ("embedding",
// "attn_out", "ffn_out" or "logits") of `layer` (-1 for the embedding and the head) at token row
// `row` of the forward, with the weight that explains it when find_nonfinite_weight finds one.
[[noreturn]] void fail_nonfinite(const K3Config& c, const SafeTensors& st, const char* block, int64_t layer,
                                 int64_t row, float value);

// For a forward that checks only its logits (the GPU's): the error for a non-finite logit (`value`,
// logits row `row`), naming the first non-finite weight in forward order (the tensors outside the
// layers, then layer 0, 1, ...), or saying that every weight is finite.
[[noreturn]] void fail_nonfinite_logits(const K3Config& c, const SafeTensors& st, int64_t row, float value,
                                        const std::string& note);

// Checks x[rows x cols] and calls fail_nonfinite at its first non-finite value.
void check_block_finite(const K3Config& c, const SafeTensors& st, const char* block, int64_t layer, const float* x,
                        int64_t rows, int64_t cols);

}  // namespace k3
