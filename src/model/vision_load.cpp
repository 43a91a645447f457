// load_vision_encoder (model/engine.h): the tower and projector on the engine's device.
#include "model/cuda/vision_cuda.h"
#include "model/engine.h"
#include "model/vision.h"

namespace k3 {

std::unique_ptr<VisionEncoder> load_vision_encoder(const std::string& dir, Device device) {
  if (device == Device::CUDA) return CudaVisionModel::load(dir);
  return VisionModel::load(dir);
}

}  // namespace k3
