// model/cuda/training/cuda_train_model.h in a build without the CUDA backend: creating says so.
#ifndef K3_HAVE_CUDA
#include "core/error.h"
#include "model/cuda/training/cuda_train_model.h"

namespace k3 {

struct CudaTrainModel::Impl {};
CudaTrainModel::CudaTrainModel() = default;
CudaTrainModel::~CudaTrainModel() = default;

std::unique_ptr<CudaTrainModel> CudaTrainModel::create(const K3Config&, const train::ParamStore&, GpuPrecision) {
  fail(
      "GPU training cannot start: this k3 was built without the CUDA backend (nvcc not found at build time, or "
      "-DK3_CUDA=OFF)");
}
const K3Config& CudaTrainModel::config() const { fail("CudaTrainModel: no CUDA backend"); }
GpuPrecision CudaTrainModel::precision() const { fail("CudaTrainModel: no CUDA backend"); }
double CudaTrainModel::loss(const std::vector<std::vector<int32_t>>&, bool, double, const GpuStepHooks*,
                            std::vector<std::vector<double>>*, const std::vector<GpuInputRows>*,
                            const std::vector<train::TokenMask>*, const std::vector<train::TokenWeights>*) {
  fail("CudaTrainModel: no CUDA backend");
}
double CudaTrainModel::image_text_loss(const std::vector<train::ImageTextSequence>&, const VisionConfig&, bool, double,
                                       const GpuStepHooks*, int64_t*) {
  fail("CudaTrainModel: no CUDA backend");
}
float* CudaTrainModel::values_device() { fail("CudaTrainModel: no CUDA backend"); }
float* CudaTrainModel::grads_device() { fail("CudaTrainModel: no CUDA backend"); }
int64_t CudaTrainModel::numel() const { return 0; }
void CudaTrainModel::zero_grads() { fail("CudaTrainModel: no CUDA backend"); }
void CudaTrainModel::values_changed() { fail("CudaTrainModel: no CUDA backend"); }
void CudaTrainModel::upload(const train::ParamStore&) { fail("CudaTrainModel: no CUDA backend"); }
void CudaTrainModel::download_values(train::ParamStore&) const { fail("CudaTrainModel: no CUDA backend"); }
void CudaTrainModel::download_grads(train::ParamStore&) const { fail("CudaTrainModel: no CUDA backend"); }
gemm::cuda::GemmContext& CudaTrainModel::gemm() { fail("CudaTrainModel: no CUDA backend"); }
void CudaTrainModel::set_recompute(const std::vector<bool>&) { fail("CudaTrainModel: no CUDA backend"); }
void CudaTrainModel::set_batch_invariant(bool) { fail("CudaTrainModel: no CUDA backend"); }
bool CudaTrainModel::batch_invariant() const { return false; }
size_t CudaTrainModel::parameter_bytes() const { return 0; }
int64_t CudaTrainModel::grouped_expert_layers() const { return 0; }

}  // namespace k3
#endif  // K3_HAVE_CUDA
