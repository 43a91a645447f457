// Internals of the GPU trainer (cuda_train_model.h), shared by its .cpp files: the device mirror of the
// parameters, the packed batch, the training linear layer and the blocks' forward/backward.
//
// Precision (docs/CUDA.md, "Training on the GPU"):
//   F32   activations, gradients, master weights and every GEMM in fp32 (cuBLAS pedantic: TF32 off).
//         Checked against the CPU float64 trainer at float32's bars.
//   BF16  the same fp32 activations, gradients, master weights and optimizer state, but every GEMM
//         (projections, experts, lm_head) reads bf16 operands on tensor cores with fp32 accumulation:
//         the weights from a bf16 copy refreshed after each optimizer step, the activations rounded
//         to bf16 on the way into the GEMM. Norms, softmaxes, the router, the KDA state and AttnRes
//         stay fp32, as K3 trains.
// Everything runs on the default stream in order, so scratch taken from the arena and handed back
// (mark/rewind) needs no synchronisation.
#pragma once
#ifdef K3_HAVE_CUDA
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "kernels/gemm/linear_cuda.h"
#include "model/config.h"
#include "model/cuda/cuda_model.h"
#include "model/cuda/cuda_model_impl.h"
#include "model/params.h"
#include "model/vision.h"
#include "model/vision_config.h"

namespace k3::moe::cuda {
class TrainDispatch;
}

namespace k3::gpu {

// One parameter tensor on the device: fp32 master value and gradient (views into the flat buffers),
// and the bf16 copy in the BF16 mode. rows x cols for a matrix [out, in]; a vector has rows = numel.
struct TrainParam {
  const float* w = nullptr;
  float* g = nullptr;
  const uint16_t* w16 = nullptr;
  int64_t rows = 0, cols = 0, numel = 0;
};

// The device mirror of a ParamStore: values, gradients (fp32, the same flat layout and offsets) and,
// in the BF16 mode, a bf16 copy of the values for the GEMMs.
class DeviceParams {
 public:
  DeviceParams(const train::ParamStore& P, GpuPrecision precision);
  void upload(const train::ParamStore& P);           // values (gradients untouched)
  void download_values(train::ParamStore& P) const;  // into P.values()
  void download_grads(train::ParamStore& P) const;   // into P.grads()
  void zero_grads();
  void refresh_bf16();                           // the bf16 copy from the fp32 values (BF16 mode; after every update)
  TrainParam at(const std::string& name) const;  // throws k3::Error naming a missing tensor
  bool has(const std::string& name) const { return P_.has(name); }
  float* values() { return values_.data(); }
  float* grads() { return grads_.data(); }
  int64_t numel() const { return int64_t(values_.size()); }
  size_t bytes() const;
  const train::ParamStore& layout() const { return P_; }

 private:
  const train::ParamStore& P_;  // names, shapes and offsets (its values are not read after upload)
  GpuPrecision precision_;
  cuda::DeviceBuffer<float> values_, grads_;
  cuda::DeviceBuffer<uint16_t> values16_;
};

// The packed batch of one step: B sequences back to back, rows = their total length.
struct PackedBatch {
  int B = 0;
  int64_t rows = 0, max_len = 0, chunks = 0;  // chunks: Σ ceil(len/16), the KDA chunk count
  const int32_t* cu_seqlens = nullptr;        // device [B+1]
  const int32_t* chunk_offsets = nullptr;     // device [B+1]
  const int32_t* ids = nullptr;               // device [rows]
  const int32_t* targets = nullptr;           // device [rows]: the next id in the sequence, -1 at its last row
  const int32_t* all_rows = nullptr;          // device [2] = {0, rows}: one "expert" owning every row
  const float* row_weight = nullptr;          // device [rows] or null: each row's loss weight (TokenWeights)
};

// What a block's forward and backward share.
struct TrainCtx {
  const K3Config& c;
  GpuPrecision precision;
  gemm::cuda::GemmContext& gemm;
  DeviceArena& arena;  // the step's memory: the tape (kept to the end of the step) and scratch (rewound)
  DeviceParams& params;
  const PackedBatch& batch;
  // Batch-invariant mode (BF16 only; CudaTrainModel::set_batch_invariant): every GEMM on fixed tiles,
  // so a row's forward never depends on the other rows of the step.
  bool batch_invariant = false;

  template <class T>
  T* take(int64_t n) {
    return arena.take<T>(n);
  }
  TrainParam param(const std::string& name) const { return params.at(name); }
};

// x [M, cols] (ld) rounded to a dense bf16 copy taken from the arena (the BF16 mode's GEMM operand).
const uint16_t* to_bf16(TrainCtx& t, const float* x, int64_t ld, int64_t M, int64_t cols);
// The bf16 copy of a dense activation x [M, cols] that several GEMMs read (a block's input feeds up
// to six projections, and their weight gradients again in the backward): made once, taken from the
// arena (it lives as long as what the caller took before it), and passed to train_linear_* as x16.
// Null in the F32 mode. The products are the same bits as with a conversion per GEMM.
inline const uint16_t* bf16_operand(TrainCtx& t, const float* x, int64_t M, int64_t cols) {
  return t.precision == GpuPrecision::BF16 ? to_bf16(t, x, cols, M, cols) : nullptr;
}

// y[M, W.rows] (ld_y) (+)= x[M, W.cols] (ld_x) · Wᵀ. x16: x's dense bf16 copy (bf16_operand) or null
// (then converted here in the BF16 mode).
void train_linear_forward(TrainCtx& t, float* y, int64_t ld_y, const float* x, int64_t ld_x, int64_t M,
                          const TrainParam& W, bool accumulate = false, const uint16_t* x16 = nullptr);
// The backward of train_linear_forward: W.g += dyᵀ·x, and dx (ld_dx) = dy·W (or += with accumulate_dx;
// dx null: only the weight gradient). x16 as in the forward.
void train_linear_backward(TrainCtx& t, float* dx, int64_t ld_dx, bool accumulate_dx, const float* dy, int64_t ld_dy,
                           const float* x, int64_t ld_x, int64_t M, const TrainParam& W, const uint16_t* x16 = nullptr);
// Dense shorthands (ld = the row width).
inline void train_linear_forward(TrainCtx& t, float* y, const float* x, int64_t M, const TrainParam& W,
                                 const uint16_t* x16 = nullptr) {
  train_linear_forward(t, y, W.rows, x, W.cols, M, W, false, x16);
}
inline void train_linear_backward(TrainCtx& t, float* dx, bool accumulate_dx, const float* dy, const float* x,
                                  int64_t M, const TrainParam& W, const uint16_t* x16 = nullptr) {
  train_linear_backward(t, dx, W.cols, accumulate_dx, dy, W.rows, x, W.cols, M, W, x16);
}

// ---- the blocks: forward saves its tape (device pointers into the arena), backward consumes it ----
// x [rows, hidden] is the normed block input, kept alive by the caller until the backward; out
// [rows, hidden] OVERWRITTEN. Backward: dx [rows, hidden] OVERWRITTEN, parameter gradients accumulated.
struct KdaTrainTape {
  const float* x = nullptr;
  const uint16_t* x16 = nullptr;  // x's bf16 copy (BF16 mode): the six input projections' operand
  float *qp, *kp, *vp;   // [rows, HD] projections (conv inputs)
  float *qc, *kc, *vc;   // [rows, HD] conv outputs (SiLU inputs)
  float *qs, *ks;        // [rows, HD] SiLU outputs of q, k
  float *q_inv, *k_inv;  // [rows, H]
  float *q, *k, *v;      // [rows, HD] recurrence inputs (FP32 mode; null in BF16)
  uint16_t *q16, *k16, *v16;  // [rows, HD] the same in bf16 (BF16 mode: the tensor-core recurrence's inputs)
  float* beta;           // [rows, H]
  float* fa;             // [rows, D]
  float *z, *sg, *g;     // [rows, HD]
  float* o;              // [rows, HD]
  float* o_inv;          // [rows, H]
  float *gp, *on;        // [rows, HD]
  void* saved;           // the recurrence's tape: fp32 states [chunks, H, D, D] (FP32) or the bf16 kernels' tape
};
struct MlaTrainTape {
  const float* x = nullptr;
  const uint16_t* x16 = nullptr;                               // x's bf16 copy (BF16 mode)
  float *qa_raw = nullptr, *qa = nullptr, *qa_rstd = nullptr;  // [rows, Qr] (q_lora_rank > 0)
  float* q;                                                    // [rows, H·(Dn+Dr)]
  float* ckv;                                                  // [rows, R + Dr]: [c_lat | k_rot]
  float *lat, *lat_rstd;                                       // [rows, R], [rows]
  float* kv;                                                   // [rows, H·(Dn+Dv)]
  float *o, *lse;                                              // [rows, H·Dv], [H, rows]
  float *gate = nullptr, *og;                                  // [rows, H·Dv]
};
struct GluTrainTape {
  const float* x = nullptr;
  const uint16_t* x16 = nullptr;  // x's bf16 copy (BF16 mode)
  int64_t N = 0, I = 0;
  float *g, *u, *h;  // [N, I]
};
struct MoeTrainTape;  // moe_train.cpp
struct MoeTapeDeleter {
  void operator()(MoeTrainTape*) const;
};

void kda_train_forward(TrainCtx& t, int64_t layer, const float* x, float* out, KdaTrainTape& tape);
void kda_train_backward(TrainCtx& t, int64_t layer, const KdaTrainTape& tape, const float* dy, float* dx);
void mla_train_forward(TrainCtx& t, int64_t layer, const float* x, float* out, MlaTrainTape& tape);
void mla_train_backward(TrainCtx& t, int64_t layer, const MlaTrainTape& tape, const float* dy, float* dx);
// A GLU MLP (gate/up [I, D], down [D, I]) over N rows: the dense FFN, the shared experts.
// x16: x's bf16 copy when the caller has one (the MoE block shares its input's), else made here.
void glu_train_forward(TrainCtx& t, const TrainParam& gate, const TrainParam& up, const TrainParam& down,
                       const float* x, int64_t N, float* out, GluTrainTape& tape, const uint16_t* x16 = nullptr);
void glu_train_backward(TrainCtx& t, const TrainParam& gate, const TrainParam& up, const TrainParam& down,
                        const GluTrainTape& tape, const float* dy, float* dx);
void dense_train_forward(TrainCtx& t, int64_t layer, const float* x, float* out, GluTrainTape& tape);
void dense_train_backward(TrainCtx& t, int64_t layer, const GluTrainTape& tape, const float* dy, float* dx);
// The routed experts of one MoE layer as device arrays [E] of pointers, per linear (0 gate w1, 1 up w3,
// 2 down w2): their bf16 weights and fp32 gradients, the grouped GEMMs' operands in the BF16 mode.
// The flat parameter buffers list experts in name order (0, 1, 10, 100, ...), not stacked by index,
// hence pointers. Parameters never move: a layer's tables are built once.
struct ExpertTables {
  cuda::DeviceBuffer<const void*> w16[3];
  cuda::DeviceBuffer<float*> g[3];
};
// Null when an expert tensor is not 16-byte aligned in the flat buffers or the expert dims are not
// multiples of 8 (the per-expert path then).
std::unique_ptr<ExpertTables> make_expert_tables(const TrainCtx& t, int64_t layer);

// router_bias: [E] device fp32 (selection only) or null. forced: null, or router replay's experts [rows, K]
// (device) used instead of the router's selection. The tape's router scores [rows, E] (device):
// moe_router_scores, for Quantile Balancing.
// `dispatch` (reused across steps) must hold rows·K slots; the tape keeps a pointer to it and to
// `experts` (BF16 mode: the layer's tables, the experts run as grouped GEMMs unless the pass has
// 1,024 or more rows per expert on average, where one bf16 cuBLAS call per expert is faster; F32
// mode: null, one pedantic fp32 cuBLAS call per expert).
std::unique_ptr<MoeTrainTape, MoeTapeDeleter> moe_train_forward(TrainCtx& t, int64_t layer, const float* x, float* out,
                                                                const float* router_bias, const int32_t* forced,
                                                                moe::cuda::TrainDispatch& dispatch,
                                                                const ExpertTables* experts);
const float* moe_router_scores(const MoeTrainTape& tape);
void moe_train_backward(TrainCtx& t, int64_t layer, const MoeTrainTape& tape, const float* dy, float* dx);

// ---- the vision tower and projector (vision_train.cpp): the CUDA twin of model/training/vision_train.h ----
// One packed pass over a step's images: pixels [L, 3 p p] (device fp32; every item's patches in (t, h, w)
// order, items in order), grids one per item. The forward writes the projected tokens of every item, items in
// order, to *projected (device [Σ tokens, text_hidden_size], from the arena) and keeps its tape in the arena; the
// backward takes their gradient and ACCUMULATES every vision tensor's gradient (the pixels get none). The tower
// reads nothing of t.batch. A k3::Error names a grid the tower cannot take or a vision tensor the parameters lack
// or hold in another shape.
struct VisionTrainTape;
struct VisionTapeDeleter {
  void operator()(VisionTrainTape*) const;
};
std::unique_ptr<VisionTrainTape, VisionTapeDeleter> vision_train_forward(TrainCtx& t, const VisionConfig& c,
                                                                         const float* pixels, int64_t L,
                                                                         const std::vector<VisionGrid>& grids,
                                                                         float** projected);
void vision_train_backward(TrainCtx& t, const VisionConfig& c, const VisionTrainTape& tape, const float* dprojected);

}  // namespace k3::gpu
#endif  // K3_HAVE_CUDA
