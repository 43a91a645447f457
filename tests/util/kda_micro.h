// A micro KDA configuration for the training tests: `layer_kinds` names each layer (the KDA block
// under test sits wherever the list says KDA), the rest is K3's KDA settings (conv kernel 4, gate
// lower bound -5, rms_norm_eps 1e-5).
#pragma once
#include <cstdint>
#include <vector>

#include "model/config.h"

namespace k3test {

inline k3::K3Config kda_micro_config(int64_t hidden, int64_t heads, int64_t head_dim,
                                     std::vector<k3::AttnKind> layer_kinds) {
  k3::K3Config c;
  c.source = "micro";
  c.hidden_size = hidden;
  c.num_hidden_layers = int64_t(layer_kinds.size());
  c.kda_num_heads = heads;
  c.kda_head_dim = head_dim;
  c.short_conv_kernel_size = 4;
  c.gate_lower_bound = -5.0f;
  c.rms_norm_eps = 1e-5;
  c.layer_kind = std::move(layer_kinds);
  return c;
}

}  // namespace k3test
