#include "model/release_layout.h"

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "core/dtype.h"
#include "core/error.h"
#include "io/output_file.h"

namespace k3 {

int64_t release_shard_of(const std::string& name, int64_t layers) {
  if (name.rfind("vision_tower.", 0) == 0) return layers + 3;
  if (name.rfind("mm_projector.", 0) == 0) return layers + 2;
  for (const char* prefix : {"language_model.model.layers.", "model.layers."}) {
    const std::string p = prefix;
    if (name.rfind(p, 0) != 0) continue;
    const size_t dot = name.find('.', p.size());
    int64_t l = -1;
    try {
      l = std::stoll(name.substr(p.size(), dot - p.size()));
    } catch (const std::exception&) {
      fail("release layout: tensor '", name, "' has no layer number");
    }
    if (l < 0 || l >= layers) fail("release layout: tensor '", name, "' is outside the model's ", layers, " layers");
    return l + 1;
  }
  return layers + 1;  // embedding, head, final norm, output AttnRes
}

std::string release_shard_file(int64_t shard, int64_t shards) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05lld-of-%06lld.safetensors", (long long)shard, (long long)shards);
  return buf;
}

void remove_model_weights(const std::string& out_dir, const std::set<std::string>& keep) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(out_dir)) return;
  std::vector<fs::path> stale;
  for (const fs::directory_entry& e : fs::directory_iterator(out_dir)) {
    const std::string n = e.path().filename().string();
    const bool shard = n.rfind("model-", 0) == 0 && n.find("-of-") != std::string::npos && n.size() > 12 &&
                       n.compare(n.size() - 12, 12, ".safetensors") == 0;
    if ((shard || n == "model.safetensors" || n == "model.safetensors.index.json") && !keep.count(n))
      stale.push_back(e.path());
  }
  for (const fs::path& p : stale) fs::remove(p);
}

void write_release_shards(const std::string& out_dir, const std::vector<TensorToWrite>& tensors, int64_t layers,
                          const std::map<std::string, std::string>& metadata) {
  namespace fs = std::filesystem;
  const int64_t shards = layers + 3;
  std::vector<std::vector<TensorToWrite>> by_shard(static_cast<size_t>(shards) + 1);
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t total = 0;
  for (const TensorToWrite& t : tensors) {
    const int64_t s = release_shard_of(t.name, layers);
    by_shard[size_t(s)].push_back(t);
    weight_map[t.name] = release_shard_file(s, shards);
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    total += n * int64_t(dtype_size(t.dtype));
  }
  std::set<std::string> written = {"model.safetensors.index.json"};
  for (int64_t s = 1; s <= shards; ++s)  // a shard with no tensor (no vision tower) is not written
    if (!by_shard[size_t(s)].empty()) {
      written.insert(release_shard_file(s, shards));
      write_safetensors((fs::path(out_dir) / release_shard_file(s, shards)).string(), by_shard[size_t(s)], metadata);
    }
  const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  write_file_atomic((fs::path(out_dir) / "model.safetensors.index.json").string(), index.dump(1) + "\n");
  remove_model_weights(out_dir, written);
}

}  // namespace k3
