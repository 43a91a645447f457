// Tensor maps for TMA (tensor_map_cuda.h), encoded through the runtime's driver entry point, so
// nothing links against libcuda.
#include "kernels/common/tensor_map_cuda.h"

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime.h>

#include "core/cuda_check.cuh"
#include "core/error.h"

namespace k3::cuda_tma {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    K3_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    K3_CHECK(q == cudaDriverEntryPointSuccess && f != nullptr, "cuda: cuTensorMapEncodeTiled not found");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

}  // namespace

CUtensorMap bf16_3d_sw128(const void* base, uint64_t d0, uint64_t d1, uint64_t d2, uint64_t stride1, uint64_t stride2,
                          uint32_t box0, uint32_t box1, const char* what) {
  K3_CHECK(box0 * 2 <= 128 && box0 >= 8 && box1 >= 1 && box1 <= 256, "cuda: tensor map of ", what, ": box ", box0,
           " x ", box1, " does not fit the 128-byte swizzle");
  CUtensorMap m;
  const cuuint64_t dims[3] = {d0, d1, d2};
  const cuuint64_t strides[2] = {stride1, stride2};  // bytes, dims 1 and 2
  const cuuint32_t box[3] = {box0, box1, 1};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r = encode_fn()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims, strides, box,
                                 elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  K3_CHECK(r == CUDA_SUCCESS, "cuda: cuTensorMapEncodeTiled failed (", int(r), ") for ", what, " [", d2, ", ", d1, ", ",
           d0, "] strides ", stride1, ", ", stride2);
  return m;
}

}  // namespace k3::cuda_tma
