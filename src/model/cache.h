// Per-sequence decoding state of the K3 text model.
//   KDA layer: the last K-1 pre-conv inputs of q, k and v (conv tails) and the recurrent
//              state [H, Dk, Dv]: fixed size, whatever the context length.
//   MLA layer: per past token the 576-wide absorbed cache row [normalised latent (R) | k_rot (Dr)].
// AttnRes carries nothing across tokens.
#pragma once
#include <cstdint>
#include <vector>

#include "model/config.h"

namespace k3 {

struct KdaLayerCache {
  std::vector<float> q_tail, k_tail, v_tail;  // [K-1, H*D] each
  std::vector<double> state;                  // [H, Dk, Dv], fp64 on the CPU (see kernels/kda/kda_cpu.cpp)
};

struct MlaLayerCache {
  std::vector<float> rows;  // [length, R + Dr]
};

struct SequenceCache {
  int64_t length = 0;              // tokens consumed so far
  std::vector<KdaLayerCache> kda;  // [num_layers] (used at KDA layers)
  std::vector<MlaLayerCache> mla;  // [num_layers] (used at MLA layers)

  static SequenceCache fresh(const K3Config& c);
  size_t bytes() const;
  // bytes() of a sequence of `tokens` tokens.
  static size_t bytes_at(const K3Config& c, int64_t tokens);
};

// Rows [row0, row0 + n) of a batch belong to one sequence with this cache.
struct Segment {
  int64_t row0 = 0, n = 0;
  SequenceCache* cache = nullptr;
};

}  // namespace k3
