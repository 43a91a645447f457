#include "model/cache.h"

namespace k3 {

SequenceCache SequenceCache::fresh(const K3Config& c) {
  SequenceCache s;
  const size_t L = size_t(c.num_hidden_layers);
  s.kda.resize(L);
  s.mla.resize(L);
  const size_t HD = size_t(c.kda_dim()), tail = size_t(c.short_conv_kernel_size - 1) * HD;
  for (size_t l = 0; l < L; ++l) {
    if (c.layer_kind[l] != AttnKind::KDA) continue;
    s.kda[l].q_tail.assign(tail, 0.0f);
    s.kda[l].k_tail.assign(tail, 0.0f);
    s.kda[l].v_tail.assign(tail, 0.0f);
    s.kda[l].state.assign(size_t(c.kda_num_heads * c.kda_head_dim * c.kda_head_dim), 0.0);
  }
  return s;
}

size_t SequenceCache::bytes_at(const K3Config& c, int64_t tokens) {
  size_t b = 0;
  const size_t HD = size_t(c.kda_dim()), tail = size_t(c.short_conv_kernel_size - 1) * HD;
  const size_t state = size_t(c.kda_num_heads) * size_t(c.kda_head_dim) * size_t(c.kda_head_dim);
  const size_t row = size_t(c.kv_lora_rank + c.qk_rope_head_dim);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    b += c.layer_kind[size_t(l)] == AttnKind::KDA ? 3 * tail * 4 + state * 8 : size_t(tokens) * row * 4;
  return b;
}

size_t SequenceCache::bytes() const {
  size_t b = 0;
  for (auto& k : kda) b += (k.q_tail.size() + k.k_tail.size() + k.v_tail.size()) * 4 + k.state.size() * 8;
  for (auto& m : mla) b += m.rows.size() * 4;
  return b;
}

}  // namespace k3
