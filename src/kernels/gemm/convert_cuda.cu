// f32 <-> bf16 conversions and the embedding gather (convert_cuda.h). Memory-bound grid-stride
// loops: 16-byte packs where the pointers allow, a scalar tail.
#include <cmath>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/pdl_cuda.cuh"
#include "kernels/common/rowwise_cuda.cuh"
#include "kernels/gemm/convert_cuda.h"

namespace k3::gemm::cuda {

namespace {

using rowwise::bf16;

// dst[i] = convert(src[i]); the first n/VEC*VEC elements as packs of VEC, the rest one by one.
template <class Tin, class Tout, int VEC>
__global__ void convert_kernel(Tout* __restrict__ dst, const Tin* __restrict__ src, int64_t n) {
  pdl::wait_then_release();
  const int64_t packs = n / VEC;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = tid; i < packs; i += stride) {
    float v[VEC];
    rowwise::load_vec<Tin, VEC>(v, src + i * VEC);
    rowwise::store_vec<Tout, VEC>(dst + i * VEC, v);
  }
  for (int64_t i = packs * VEC + tid; i < n; i += stride) dst[i] = rowwise::from_f32<Tout>(rowwise::to_f32(src[i]));
}

template <class Tin, class Tout>
void launch_convert(Tout* dst, const Tin* src, int64_t n) {
  K3_CHECK(n >= 0, "convert (cuda): negative length ", n);
  if (n == 0) return;
  K3_CHECK(dst && src, "convert (cuda): null pointer");
  if (rowwise::aligned16(dst) && rowwise::aligned16(src)) {
    pdl::launch(convert_kernel<Tin, Tout, 8>, rowwise::grid_for(n / 8 + 1), 256, 0, dst, src, n);
  } else {
    pdl::launch(convert_kernel<Tin, Tout, 1>, rowwise::grid_for(n), 256, 0, dst, src, n);
  }
  K3_CUDA_LAUNCH_CHECK();
}

// out[t, c..c+VEC) = table[ids[t], c..c+VEC) over a grid-stride loop of (token, pack) pairs.
template <int VEC>
__global__ void embedding_kernel(float* __restrict__ out, const bf16* __restrict__ table,
                                 const int32_t* __restrict__ ids, int64_t T, int64_t V, int64_t D) {
  pdl::wait_then_release();
  const int64_t packs = D / VEC, total = T * packs;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / packs, c = (i - t * packs) * VEC;
    const int64_t id = ids[t];
    float v[VEC];
    if (id >= 0 && id < V) {
      rowwise::load_vec<bf16, VEC>(v, table + id * D + c);
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[k] = NAN;
    }
    rowwise::store_vec<float, VEC>(out + t * D + c, v);
  }
}

}  // namespace

void convert_f32_to_bf16(uint16_t* dst, const float* src, int64_t n) { launch_convert<float, bf16>(dst, src, n); }
void convert_bf16_to_f32(float* dst, const uint16_t* src, int64_t n) { launch_convert<bf16, float>(dst, src, n); }

void embedding_gather(float* out, const uint16_t* table, const int32_t* ids, int64_t T, int64_t V, int64_t D) {
  K3_CHECK(T >= 0 && V >= 0 && D >= 0, "embedding_gather (cuda): negative shape T=", T, " V=", V, " D=", D);
  if (T == 0 || D == 0) return;
  K3_CHECK(out && table && ids, "embedding_gather (cuda): null pointer");
  if (D % 8 == 0 && rowwise::aligned16(table) && rowwise::aligned16(out)) {
    pdl::launch(embedding_kernel<8>, rowwise::grid_for(T * (D / 8)), 256, 0, out, table, ids, T, V, D);
  } else {
    pdl::launch(embedding_kernel<1>, rowwise::grid_for(T * D), 256, 0, out, table, ids, T, V, D);
  }
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::gemm::cuda
