// model/cuda/vision_cuda.h in a build without the CUDA backend: loading says so.
#ifndef K3_HAVE_CUDA
#include "core/error.h"
#include "model/cuda/vision_cuda.h"

namespace k3 {

namespace {
[[noreturn]] void no_cuda() {
  fail(
      "the GPU vision tower cannot start: this k3 was built without the CUDA backend (nvcc not found at build time, "
      "or -DK3_CUDA=OFF)");
}
}  // namespace

struct CudaVisionModel::Impl {};
std::unique_ptr<CudaVisionModel> CudaVisionModel::load(const std::string&) { no_cuda(); }
CudaVisionModel::CudaVisionModel(const VisionConfig&, const SafeTensors&) { no_cuda(); }
CudaVisionModel::~CudaVisionModel() = default;
const VisionConfig& CudaVisionModel::config() const { no_cuda(); }
std::string CudaVisionModel::description() const { return "cuda (bf16)"; }
size_t CudaVisionModel::weight_bytes() const { return 0; }
size_t CudaVisionModel::scratch_bytes() const { return 0; }
void CudaVisionModel::set_attention_kernel(vision::cuda::AttnKernel) { no_cuda(); }
std::vector<VisionItem> CudaVisionModel::encode(const float*, int64_t, const std::vector<VisionGrid>&,
                                                const VisionTrace&) const {
  no_cuda();
}
int64_t CudaVisionModel::encode_on_device(const float*, int64_t, const std::vector<VisionGrid>&) const { no_cuda(); }

}  // namespace k3
#endif  // K3_HAVE_CUDA
