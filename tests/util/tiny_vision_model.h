// k3-tiny-vision (configs/k3-tiny-vision.json: k3-tiny plus a tiny tower and projector) as `k3 init` writes it for
// a seed, held as a training parameter store: the model the image-text training tests (CPU and GPU) run.
#pragma once
#include <cstdint>
#include <string>

#include "model/config.h"
#include "model/init_random.h"
#include "model/params.h"
#include "model/vision_config.h"
#include "temp_dir.h"

namespace k3test {

inline const std::string kTinyVision = std::string(K3_SOURCE_DIR) + "/configs/k3-tiny-vision.json";
constexpr int32_t kTinyVisionMediaPad = 3861;  // media_placeholder_token_id of k3-tiny-vision

struct TinyVisionModel {
  k3::train::ParamStore P;
  k3::K3Config c;
  k3::VisionConfig vc;
};

inline TinyVisionModel tiny_vision(uint64_t seed) {
  TempDir dir("tiny-vision");
  k3::RandomInitOptions opt;
  opt.seed = seed;
  k3::write_random_model(kTinyVision, dir.file("model"), opt);
  return {k3::train::ParamStore::from_model_dir(dir.file("model")), k3::load_config(dir.file("model/config.json")),
          k3::load_vision_config(dir.file("model"))};
}

}  // namespace k3test
