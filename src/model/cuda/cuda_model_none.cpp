// model/cuda/cuda_model.h in a build without the CUDA backend: loading says so.
#ifndef K3_HAVE_CUDA
#include "core/error.h"
#include "model/cuda/cuda_model.h"

namespace k3 {

struct CudaSequenceCache::Impl {};
CudaSequenceCache::~CudaSequenceCache() = default;
int64_t CudaSequenceCache::length() const { return 0; }
size_t CudaSequenceCache::bytes() const { return 0; }
size_t CudaModel::sequence_bytes(int64_t) const { return 0; }
struct CudaStateCopy::Impl {};
CudaStateCopy::CudaStateCopy(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaStateCopy::~CudaStateCopy() = default;
size_t CudaStateCopy::bytes() const { return 0; }
std::unique_ptr<CudaStateCopy> CudaModel::copy_state(const CudaSequenceCache&, int64_t) const {
  fail("CudaModel: no CUDA backend");
}
void CudaModel::restore_state(CudaSequenceCache&, const std::vector<const CudaStateCopy*>&) const {
  fail("CudaModel: no CUDA backend");
}

struct CudaModel::Impl {};
CudaModel::CudaModel() = default;
CudaModel::~CudaModel() = default;

std::unique_ptr<CudaModel> CudaModel::load(const std::string&, GpuPrecision) {
  fail(
      "the GPU model cannot start: this k3 was built without the CUDA backend (nvcc not found at build time, or "
      "-DK3_CUDA=OFF)");
}
std::unique_ptr<CudaModel> CudaModel::load(const std::string& c, const std::string&, GpuPrecision p) {
  return load(c, p);
}
const K3Config& CudaModel::config() const { fail("CudaModel: no CUDA backend"); }
GpuPrecision CudaModel::precision() const { fail("CudaModel: no CUDA backend"); }
size_t CudaModel::weight_bytes() const { return 0; }
void CudaModel::set_profile(bool) { fail("CudaModel: no CUDA backend"); }
void CudaModel::set_reference(bool) { fail("CudaModel: no CUDA backend"); }
bool CudaModel::reference() const { return false; }
const BlockTimings& CudaModel::timings() const { fail("CudaModel: no CUDA backend"); }
void CudaModel::reset_timings() {}
std::unique_ptr<CudaSequenceCache> CudaModel::new_cache() const { fail("CudaModel: no CUDA backend"); }
std::vector<std::unique_ptr<CudaSequenceCache>> CudaModel::new_caches(int64_t) const {
  fail("CudaModel: no CUDA backend");
}
std::vector<float> CudaModel::forward(const std::vector<CudaSequenceCache*>&, const std::vector<std::vector<int32_t>>&,
                                      bool, const ForwardHooks*) {
  fail("CudaModel: no CUDA backend");
}
std::vector<PickResult> CudaModel::forward_pick(const std::vector<CudaSequenceCache*>&,
                                                const std::vector<std::vector<int32_t>>&, const std::vector<TokenPick>&,
                                                const ForwardHooks*) {
  fail("CudaModel: no CUDA backend");
}
void CudaModel::reset_cache(CudaSequenceCache&) const { fail("CudaModel: no CUDA backend"); }
void CudaModel::set_graphs(bool) {}
std::string CudaModel::graphs_off_reason() const { return "no CUDA backend"; }
int64_t CudaModel::graph_count() const { return 0; }

}  // namespace k3
#endif  // K3_HAVE_CUDA
