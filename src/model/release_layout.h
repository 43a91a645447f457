// The released checkpoint's file layout (K3-ARCHITECTURE.md §4): `model-000NN-of-000096.safetensors` and
// `model.safetensors.index.json`. For a config of L layers the layout has L + 3 shards: layer l in shard l + 1,
// the embedding, head, final norm and output AttnRes in shard L + 1 (94 for the release's 93 layers), the
// projector in L + 2 and the vision tower in L + 3. Within a shard tensors lie in name order, which puts one
// expert's six MXFP4 tensors back to back (w1 packed, w1 scale, w2 packed, w2 scale, w3 packed, w3 scale), as in
// the release. `k3 init --release-shards` writes it: a release-shaped synthetic checkpoint at any width.
#pragma once
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "io/safetensors.h"

namespace k3 {

// The shard (1-based) of tensor `name` in the release layout of a model with `layers` layers.
int64_t release_shard_of(const std::string& name, int64_t layers);
// "model-00003-of-000096.safetensors" (the release's five- and six-digit numbers).
std::string release_shard_file(int64_t shard, int64_t shards);

// Writes `tensors` into out_dir as the release's shards plus model.safetensors.index.json (its weight_map and
// total_size), each file atomically and the index last, so a directory without its index is an unfinished write.
// Then the weight files of another layout (or another layer count) left in out_dir are removed: nothing is deleted
// before the new checkpoint is complete.
void write_release_shards(const std::string& out_dir, const std::vector<TensorToWrite>& tensors, int64_t layers,
                          const std::map<std::string, std::string>& metadata);

// Removes the model weight files of out_dir (model.safetensors, model.safetensors.index.json,
// model-*-of-*.safetensors) not named in `keep`: after a checkpoint is written, what an earlier one in another
// layout left there.
void remove_model_weights(const std::string& out_dir, const std::set<std::string>& keep);

}  // namespace k3
