// Internals of the GPU model (cuda_model.h), shared by its .cpp files: the device weights, the
// device cache, the per-forward scratch arena and the layer functions. Plain C++ over the kernels'
// launcher headers; only compiled with the CUDA backend.
#pragma once
#ifdef K3_HAVE_CUDA
#include <initializer_list>
#include <memory>
#include <type_traits>
#include <vector>

#include "core/cuda.h"
#include "io/safetensors.h"
#include "kernels/gemm/linear_cuda.h"
#include "kernels/gemm/linear_rows_cuda.h"
#include "kernels/moe/moe_cuda.h"
#include "model/cuda/cuda_model.h"
#include "model/weights.h"

namespace k3::gpu {

using bf16 = uint16_t;

// The activation type of a precision: bf16 bits for BF16, float for F32.
template <class T>
constexpr DType dtype_of() {
  return std::is_same_v<T, float> ? DType::F32 : DType::BF16;
}

// A matrix [rows, cols] (PyTorch [out, in]) on the device: bf16 in the BF16 path, fp64 in the F32
// path (the exact GEMM's operand, see linear_cuda.h: linear_exact).
struct DevMatrix {
  cuda::DeviceBuffer<uint8_t> buf;
  int64_t rows = 0, cols = 0;
  bool empty() const { return rows == 0; }
  template <class W>
  const W* as() const {
    return reinterpret_cast<const W*>(buf.data());
  }
};

// All experts' w1, w3 or w2 stacked [E, rows, cols]: bf16 or MXFP4 as stored (BF16 path), fp64 (F32 path).
struct DevExperts {
  cuda::DeviceBuffer<uint8_t> data, scales;  // scales: MXFP4 only
  bool mxfp4 = false;
  int64_t rows = 0, cols = 0;
  moe::cuda::ExpertLinear linear() const;     // BF16 path
  const double* expert_f64(int64_t e) const;  // F32 path
};

using DevVector = cuda::DeviceBuffer<float>;

struct KdaDev {
  DevMatrix q_proj, k_proj, v_proj, f_a_proj, f_b_proj, b_proj, g_proj, o_proj;
  DevVector q_conv, k_conv, v_conv, A_log, dt_bias, o_norm;
};
struct MlaDev {
  DevMatrix q_a_proj, q_b_proj, q_proj, kv_a_proj_with_mqa, kv_b_proj, g_proj, o_proj;
  DevVector q_a_layernorm, kv_a_layernorm;
};
struct GluDev {
  DevMatrix gate_proj, up_proj, down_proj;
  bool empty() const { return gate_proj.empty(); }
};
struct MoeDev {
  DevMatrix router, latent_down, latent_up;
  DevVector router_bias, latent_norm;
  DevExperts w1, w3, w2;
  GluDev shared;
};
struct LayerDev {
  DevVector input_layernorm, post_attention_layernorm, attn_res_query, mlp_res_query;
  KdaDev kda;
  MlaDev mla;
  GluDev dense;
  MoeDev moe;
};
struct WeightsDev {
  cuda::DeviceBuffer<uint8_t> embed;  // [V, D]: bf16 (BF16 path) or fp32 (F32 path)
  DevMatrix lm_head;
  DevVector norm, output_res_query;
  std::vector<LayerDev> layers;
  size_t bytes = 0;
};

// Uploads every tensor the forward pass reads. Prints nothing; throws k3::Error on a format the
// path cannot take (MXFP4 experts whose width is not a multiple of 32, say).
WeightsDev upload_weights(const K3Config& c, const ModelWeights& w, GpuPrecision p);

// Per-forward scratch: a stack allocator over device chunks. reset() at the start of each forward;
// rewind(mark) after each block hands the block's scratch back, so the peak is the persistent buffers
// plus the largest block, not the sum over layers. Reuse is safe without waiting because every kernel
// runs on the one default stream, in order. When a forward outgrew the first chunk, reset() replaces
// the chunks by one of the high-water size, so steady-state decoding never calls cudaMalloc.
class DeviceArena {
 public:
  struct Mark {
    size_t chunks = 0, used = 0, in_use = 0;
  };
  void reset();
  Mark mark() const { return Mark{chunks_.size(), used_, in_use_}; }
  void rewind(const Mark& m);
  void* take_bytes(size_t bytes);
  size_t reserved_bytes() const;  // device memory held now (all chunks)
  size_t peak_bytes() const { return peak_; }
  template <class T>
  T* take(int64_t n) {
    return static_cast<T*>(take_bytes(size_t(n) * sizeof(T)));
  }

 private:
  std::vector<cuda::DeviceBuffer<uint8_t>> chunks_;
  size_t used_ = 0;    // in the last chunk
  size_t in_use_ = 0;  // bytes taken and not rewound, this forward
  size_t peak_ = 0;    // the most in use at once, ever
};

// The device state of a pool of sequences (made together by CudaModel::new_caches): each KDA layer's tails
// and state hold every place back to back, each MLA layer's rows are per place. A decode step over any of
// the pool's sequences runs the per-sequence steps (conv, KDA core, the MLA cache append and the absorbed
// decode) once for all of them (PooledDecode); a prefill over consecutive members with equal token counts
// runs the conv and the KDA core once.
struct KdaPoolDev {
  DevVector q_tail, k_tail, v_tail;  // [B][K-1][H*D] fp32
  DevVector state;                   // [B][H][Dk][Dv] fp32
};
struct MlaPoolDev {
  // Each place's rows [capacity][ldc] of the activation type, [latent (R) | k_rot (Dr) | pad], grown on its own
  // (geometrically), so one long sequence does not make room for the whole pool.
  std::vector<cuda::DeviceBuffer<uint8_t>> rows;  // [places]
  std::vector<int64_t> capacity;                  // [places]
};
struct CachePool {
  int64_t B = 0;    // places: the sequences made together, and one more (pad) that decode graphs fill up with
  int64_t pad = 0;  // the padding place (B - 1), never a sequence's
  std::vector<KdaPoolDev> kda;  // [num_layers] (used at KDA layers)
  std::vector<MlaPoolDev> mla;  // [num_layers] (used at MLA layers)
};
// Room for `need` rows at a place of a pool's layer (grown geometrically; old rows kept, the buffer moves).
void reserve_rows(MlaPoolDev& mp, int64_t place, int64_t need, int64_t ldc, size_t esize);
// Index of MLA layer `layer` among the model's MLA layers.
int64_t mla_ordinal(const K3Config& c, int64_t layer);

// A decode step's sequences of one pool, run by one launch per step of the attention blocks whatever their
// places in the pool and their lengths: segments 0..B-1 (rows 0..B-1, one new token each), sequence b at pool
// place slot[b] holding p0[b] tokens with its MLA rows at rows[.][b] (device arrays; max_p0 the largest, or more:
// the MLA decode plans its splits for it). The MLA decode splits the keys in fixed runs (kPooledSplitKeys), so a
// sequence's arithmetic does not depend on what else is in the step.
struct PooledDecode {
  int64_t B = 0;
  CachePool* pool = nullptr;
  const int32_t* slot = nullptr;    // device [B]
  const int32_t* p0 = nullptr;      // device [B]
  uint16_t* const* rows = nullptr;  // device [MLA layers][B]: each sequence's rows, room for its new one made
  int64_t max_p0 = 0;
};
inline constexpr int64_t kPooledSplitKeys = 256;

// Everything a layer needs for one forward besides its weights.
struct Run {
  const K3Config& c;
  GpuPrecision precision;
  gemm::cuda::GemmContext& gemm;
  DeviceArena& arena;
  moe::cuda::Dispatch* dispatch;  // BF16 path
  int64_t mla_ldc;                // cache row stride (elements)
  const ForwardHooks* hooks;
  bool reference;  // the specification forms: KDA recurrence, expanded MLA (CudaModel::set_reference)
  const PooledDecode* pooled = nullptr;  // segments 0..pooled->B-1 run pooled; null: none
};

// A run of rows [row0, row0 + n) of one sequence, with that sequence's device state.
struct SegmentDev {
  int64_t row0 = 0, n = 0;
  CudaSequenceCache::Impl* cache = nullptr;
};

// The launches of a per-sequence step: B consecutive sequences of n new tokens each at rows
// [row0, row0 + B n), `first` the first one's state. All segments form one group when they are
// consecutive members of one pool (index ascending by one) with the same n and, if same_length,
// the same cached length; otherwise every segment is a group of its own.
struct SeqGroup {
  int64_t row0 = 0, n = 0, B = 1;
  CudaSequenceCache::Impl* first = nullptr;
};
std::vector<SeqGroup> seq_groups(const std::vector<SegmentDev>& segs, bool same_length);

// The segments a layer runs by themselves: all of them, or those after the pooled decode's.
inline std::vector<SegmentDev> unpooled(const Run& r, const std::vector<SegmentDev>& segs) {
  const size_t skip = r.pooled ? size_t(r.pooled->B) : 0;
  return std::vector<SegmentDev>(segs.begin() + std::ptrdiff_t(skip), segs.end());
}

// y[M, W.rows] (ld_y) = x[M, W.cols] (ld_x) · Wᵀ, or y += that with accumulate (y is read). BF16 path: x bf16,
// y bf16 or fp32. F32 path: x, y fp32.
template <class T>
void linear(Run& r, void* y, DType y_type, int64_t ld_y, const T* x, int64_t ld_x, int64_t M, const DevMatrix& W,
            bool accumulate = false);
template <class T>
void linear(Run& r, T* y, const T* x, int64_t M, const DevMatrix& W) {
  linear<T>(r, y, dtype_of<T>(), W.rows, x, W.cols, M, W);
}
template <class T>
void linear_f32_out(Run& r, float* y, const T* x, int64_t M, const DevMatrix& W) {
  linear<T>(r, y, DType::F32, W.rows, x, W.cols, M, W);
}

// Whether a step of M rows is a pooled decode step of at most gemm::cuda::kLinearRowsMaxM sequences and nothing
// else: such a step runs its linears as gemm::cuda::linear_rows and its routed experts as
// moe::cuda::expert_rows_forward, both of which give a row the same bits whatever the step's row count. Any other
// step (a prefill, an append) takes cuBLAS and the grouped GEMMs, so a sequence gets the same bits alone or in a
// batch either way.
inline bool takes_linear_rows(const Run& r, int64_t M) {
  return r.pooled && r.pooled->B == M && M <= gemm::cuda::kLinearRowsMaxM;
}

// Several linears of the same rows of x: y_i [M, W_i.rows] (dense, of y_type_i). A pooled decode step of at most
// gemm::cuda::kLinearRowsMaxM sequences and nothing else (the BF16 path's) runs them as one linear_rows launch,
// anything else as one GEMM each; linear() takes linear_rows for such a step's single linears too (but the head). Only such steps: linear_rows sums in another order than cuBLAS, so a sequence
// prefilled, or appended to, alone or in a batch still takes the same GEMMs either way, and a decode step of
// up to that many sequences gives each the bits it gets alone. A null W or y skips that output.
struct LinearOut {
  const DevMatrix* W = nullptr;
  void* y = nullptr;
  DType y_type = DType::F32;
};
template <class T>
void linears_of_rows(Run& r, const T* x, int64_t M, std::initializer_list<LinearOut> outs);

// The blocks (CUDA twins of model/layers.h): x̂ [N, hidden] of the activation type in, fp32 [N, hidden] out.
template <class T>
void kda_attention_forward(Run& r, float* out, const T* x, int64_t N, const std::vector<SegmentDev>& segs,
                           int64_t layer, const KdaDev& w);
template <class T>
void mla_attention_forward(Run& r, float* out, const T* x, int64_t N, const std::vector<SegmentDev>& segs,
                           int64_t layer, const MlaDev& w);
template <class T>
void dense_ffn_forward(Run& r, float* out, const T* x, int64_t N, const GluDev& w);
template <class T>
void moe_ffn_forward(Run& r, float* out, const T* x, int64_t N, int64_t layer, const MoeDev& w);

}  // namespace k3::gpu

namespace k3 {
struct CudaSequenceCache::Impl {
  int64_t length = 0;
  std::shared_ptr<gpu::CachePool> pool;  // shared by the caches made together
  int64_t index = 0;                     // this sequence's place in the pool
  uint64_t owner = 0;                    // the id of the CudaModel that made it
  bool broken = false;                   // a forward over it failed part way: its state is undefined
};
}  // namespace k3
#endif  // K3_HAVE_CUDA
