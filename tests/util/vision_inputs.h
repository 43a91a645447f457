// Inputs shared by the vision tests (test_vision, test_cuda_vision): the fixture's pixels, random pixels for any
// grids, a BF16 copy of a vision checkpoint (what the GPU path and the CPU's bf16 twin both read), and a random
// tower written by the project's init (model/init_random.h: write_random_vision_model).
#pragma once
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "compare.h"
#include "core/dtype.h"
#include "io/file.h"
#include "io/safetensors.h"
#include "model/init_random.h"
#include "model/vision.h"
#include "random.h"

namespace k3test {

struct VisionPixels {
  std::vector<float> patches;  // [L, 3, p, p]
  int64_t L = 0;
  std::vector<k3::VisionGrid> grids;
};

// tests/fixtures/vision-tiny's pixels.safetensors: six items (the table's grid, grids resized up, down and to
// other aspect ratios, a 2-frame and a 3-frame clip).
inline VisionPixels vision_fixture_pixels() {
  const k3::SafeTensors in = k3::SafeTensors::open(fixture("vision-tiny/pixels.safetensors"));
  VisionPixels p;
  p.patches = in.read_f32("pixel_patches");
  p.L = in.get("pixel_patches").shape[0];
  const std::vector<int64_t> g = in.read_i64("grid_thws");
  for (size_t i = 0; i + 2 < g.size(); i += 3) p.grids.push_back({g[i], g[i + 1], g[i + 2]});
  return p;
}

// Normalised pixels in (-1, 1) (tanh of N(0, 1) draws) for every patch of grids, deterministic in seed.
inline VisionPixels random_vision_pixels(const k3::VisionConfig& c, const std::vector<k3::VisionGrid>& grids,
                                         uint64_t seed) {
  VisionPixels p;
  p.grids = grids;
  for (const k3::VisionGrid& g : grids) p.L += g.patches();
  const std::vector<double> r = randn(p.L * c.patch_values(), seed);
  p.patches.resize(r.size());
  for (size_t i = 0; i < r.size(); ++i) p.patches[i] = float(std::tanh(r[i]));
  return p;
}

// dst_dir/config.json (src_dir's) and dst_dir/model.safetensors: every tensor of src_dir's checkpoint rounded
// to BF16 (to nearest even), so a model that rounds its weights to bf16 (the GPU path) and one that uses them
// as stored (the CPU) read the same values.
inline void write_bf16_copy(const std::string& src_dir, const std::string& dst_dir) {
  std::filesystem::create_directories(dst_dir);
  std::filesystem::copy_file(std::filesystem::path(src_dir) / "config.json",
                             std::filesystem::path(dst_dir) / "config.json",
                             std::filesystem::copy_options::overwrite_existing);
  const k3::SafeTensors st = k3::SafeTensors::open(src_dir);
  std::vector<std::vector<uint16_t>> data;
  std::vector<k3::TensorToWrite> out;
  const std::vector<std::string> names = st.names();
  data.reserve(names.size());
  for (const std::string& n : names) {
    const std::vector<float> f = st.read_f32(n);
    std::vector<uint16_t>& b = data.emplace_back(f.size());
    for (size_t i = 0; i < f.size(); ++i) b[i] = k3::f32_to_bf16(f[i]);
    out.push_back({n, k3::DType::BF16, st.get(n).shape, b.data()});
  }
  k3::write_safetensors((std::filesystem::path(dst_dir) / "model.safetensors").string(), out);
}

// A random tower and projector in dir (write_random_vision_model) for vision_config `vc` (the release's field
// names; its kinds default to the release's) and the text width `text_hidden`.
inline void write_random_tower(const std::string& dir, const nlohmann::json& vc, int64_t text_hidden, uint64_t seed) {
  nlohmann::json j = {{"vision_config", vc}, {"text_hidden_size", text_hidden}};
  std::filesystem::create_directories(dir);
  const std::string cfg = (std::filesystem::path(dir) / "in-config.json").string();
  std::ofstream(cfg) << j.dump(2);
  k3::RandomInitOptions o;
  o.seed = seed;
  k3::write_random_vision_model(cfg, dir, o);
  std::filesystem::remove(cfg);
}

}  // namespace k3test
