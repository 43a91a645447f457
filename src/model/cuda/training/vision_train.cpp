// The vision tower (MoonViT-V2) and projector (PatchMergerMLPV2) for GPU training: the CUDA twin of
// model/training/vision_train.cpp, op for op, over the trainer's device parameters (train_context.h). Every item
// of a step runs in one packed pass: the linears and norms over all L patches, the attention per item
// (cu_seqlens), the merge per item, the projector over all merged tokens.
//
//   x = patches · Wpatchᵀ + resize(pos table) (+ each frame's time embedding, for a clip)
//   per block: x += wo(attn(rope2d(wqkv(RMSNorm0 x)))); x += fc1(gelu_tanh(fc0(RMSNorm1 x)))
//   x = RMSNorm(x); merged = sd2_tpool(x); projected = RMSNorm(proj.2 gelu_erf(proj.0 merged))
//
// Precision as the text trainer's: fp32 activations, gradients and master weights; in the BF16 mode the GEMMs
// read bf16 operands (train_linear_*) and the attention runs on the bf16 tensor-core kernels. The attention is the
// text trainer's (kernels/mla/mla_train_cuda.h) with causal = false and Dn = Dv = head dim, Dr = 0; the RoPE
// writes its q and [k | v] layout (kernels/vision/vision_train_cuda.h). Tower norms take eps 2^-7
// (VisionModel::kTowerNormEps), the projector's post-norm projector_ln_eps, as on the CPU.
#ifdef K3_HAVE_CUDA
#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "kernels/common/elementwise_cuda.h"
#include "kernels/mla/mla_train_cuda.h"
#include "kernels/mla/mla_train_tc_cuda.h"
#include "kernels/norm/norm_train_cuda.h"
#include "kernels/vision/vision.h"
#include "kernels/vision/vision_cuda.h"
#include "kernels/vision/vision_train_cuda.h"
#include "model/cuda/training/train_context.h"
#include "model/tensor_table.h"
#include "model/training/vision_train.h"

namespace k3::gpu {

namespace vc = vision::cuda;
using K = VisionTensorKind;

namespace {

// Vision tensor k (of block b), after checking that the parameters hold it in the table's shape.
TrainParam vision_param(const TrainCtx& t, const VisionConfig& c, K k, int64_t b = -1) {
  return t.params.at(train::checked_vision_name(t.params.layout(), c, k, b));
}

template <class T>
T* upload(TrainCtx& t, const std::vector<T>& v) {
  T* d = t.take<T>(int64_t(std::max<size_t>(v.size(), 1)));
  if (!v.empty()) cuda::copy_to_device(d, v.data(), v.size() * sizeof(T));
  return d;
}

void rmsnorm_backward(TrainCtx& t, float* dx, float* dw, const float* dy, const float* x, const float* rstd,
                      const float* w, int64_t N, int64_t D) {
  const DeviceArena::Mark m = t.arena.mark();
  void* ws = t.arena.take_bytes(norm::cuda::rmsnorm_backward_workspace_bytes(N, D));
  norm::cuda::rmsnorm_backward_train(dx, D, dw, dy, D, x, D, rstd, w, N, D, ws);
  t.arena.rewind(m);
}

}  // namespace

struct VisionBlockTrainTape {
  const float* x = nullptr;  // [L, D]  the block's input: norm0's
  float *y0, *rstd0;         // [L, D], [L]
  float *q, *kv;             // [L, Q], [L, 2Q]: the attention's inputs, turned
  float *o, *lse;            // [L, Q], [heads, L]
  float* x_mid;              // [L, D]  x + wo o: norm1's input
  float *y1, *rstd1;         // [L, D], [L]
  float *f, *g;              // [L, I]  fc0 y1 and gelu_tanh(f)
};

struct VisionItemPlace {
  VisionGrid grid;
  int64_t first_patch = 0, first_token = 0, tokens = 0;
};

struct VisionTrainTape {
  int64_t L = 0, T = 0;  // patches, merged tokens
  int64_t max_len = 0;
  std::vector<VisionItemPlace> items;
  const float* pixels = nullptr;  // [L, V]
  const int32_t *rows = nullptr, *cols = nullptr, *cu = nullptr;
  const float* rope = nullptr;  // rope_table(hd, positions)
  int64_t positions = 0;
  std::vector<VisionBlockTrainTape> blocks;
  float *final_in = nullptr, *final_out = nullptr, *rstd_final = nullptr;  // [L, D], [L, D], [L]
  float *merged = nullptr, *mid = nullptr, *act = nullptr;                 // [T, M]
  float *z = nullptr, *rstd_post = nullptr;                                // [T, H], [T]
};

void VisionTapeDeleter::operator()(VisionTrainTape* p) const { delete p; }

namespace {

void attention_forward(TrainCtx& t, const VisionConfig& c, const VisionTrainTape& tp, VisionBlockTrainTape& k) {
  const int64_t L = tp.L, Q = c.qkv_hidden_size, hd = c.head_dim();
  const mla::Dims d{c.num_heads, hd, 0, hd, 0};
  const float scale = float(1.0 / std::sqrt(double(hd)));
  const int B = int(tp.items.size());
  if (t.precision == GpuPrecision::BF16) {
    const DeviceArena::Mark m = t.arena.mark();
    void* ws = t.arena.take_bytes(mla::cuda::attention_forward_workspace_bytes_bf16(L, d));
    mla::cuda::attention_forward_train_bf16(k.o, Q, k.lse, k.q, Q, k.kv, 2 * Q, nullptr, 0, tp.cu, B, tp.max_len, L, d,
                                            scale, ws, /*causal=*/false);
    t.arena.rewind(m);
  } else {
    mla::cuda::attention_forward_train(k.o, Q, k.lse, k.q, Q, k.kv, 2 * Q, nullptr, 0, tp.cu, B, tp.max_len, L, d,
                                       scale, /*causal=*/false);
  }
}

void attention_backward(TrainCtx& t, const VisionConfig& c, const VisionTrainTape& tp, const VisionBlockTrainTape& k,
                        const float* d_o, float* dq, float* dkv) {
  const int64_t L = tp.L, Q = c.qkv_hidden_size, hd = c.head_dim();
  const mla::Dims d{c.num_heads, hd, 0, hd, 0};
  const float scale = float(1.0 / std::sqrt(double(hd)));
  const int B = int(tp.items.size());
  const bool bf = t.precision == GpuPrecision::BF16;
  const DeviceArena::Mark m = t.arena.mark();
  void* ws = t.arena.take_bytes(bf ? mla::cuda::attention_backward_workspace_bytes_bf16(L, d)
                                   : mla::cuda::attention_backward_workspace_bytes(L, d));
  const auto backward = bf ? mla::cuda::attention_backward_train_bf16 : mla::cuda::attention_backward_train;
  backward(dq, Q, dkv, 2 * Q, nullptr, 0, d_o, Q, k.o, k.q, Q, k.kv, 2 * Q, nullptr, 0, k.lse, tp.cu, B, tp.max_len, L,
           d, scale, ws, /*causal=*/false);
  t.arena.rewind(m);
}

// One block: x (its input, kept by the caller) to *out (a new buffer); the tape keeps what the backward needs.
float* block_forward(TrainCtx& t, const VisionConfig& c, int64_t b, const VisionTrainTape& tp, const float* x,
                     VisionBlockTrainTape& k) {
  const int64_t L = tp.L, D = c.hidden_size, Q = c.qkv_hidden_size, I = c.intermediate_size;
  const float eps = VisionModel::kTowerNormEps;
  const TrainParam norm0 = vision_param(t, c, K::Norm0, b), norm1 = vision_param(t, c, K::Norm1, b),
                   wqkv = vision_param(t, c, K::Wqkv, b), wo = vision_param(t, c, K::Wo, b),
                   fc0 = vision_param(t, c, K::Fc0, b), fc1 = vision_param(t, c, K::Fc1, b);
  k.x = x;
  k.y0 = t.take<float>(L * D), k.rstd0 = t.take<float>(L);
  norm::cuda::rmsnorm_forward_train(k.y0, D, k.rstd0, x, D, norm0.w, eps, L, D);
  k.q = t.take<float>(L * Q), k.kv = t.take<float>(L * 2 * Q);
  {
    const DeviceArena::Mark m = t.arena.mark();
    float* qkv = t.take<float>(L * 3 * Q);
    train_linear_forward(t, qkv, k.y0, L, wqkv);
    vc::RopeSplitParams r;
    r.qkv = qkv, r.ld = 3 * Q, r.L = L, r.heads = c.num_heads, r.hd = c.head_dim();
    r.rows = tp.rows, r.cols = tp.cols, r.table = tp.rope, r.positions = tp.positions, r.q = k.q, r.kv = k.kv;
    vc::rope_split(r);
    t.arena.rewind(m);
  }
  k.o = t.take<float>(L * Q), k.lse = t.take<float>(c.num_heads * L);
  attention_forward(t, c, tp, k);
  k.x_mid = t.take<float>(L * D);
  cuda::copy_on_device(k.x_mid, x, size_t(L * D) * sizeof(float));
  train_linear_forward(t, k.x_mid, D, k.o, Q, L, wo, /*accumulate=*/true);
  k.y1 = t.take<float>(L * D), k.rstd1 = t.take<float>(L);
  norm::cuda::rmsnorm_forward_train(k.y1, D, k.rstd1, k.x_mid, D, norm1.w, eps, L, D);
  k.f = t.take<float>(L * I), k.g = t.take<float>(L * I);
  train_linear_forward(t, k.f, k.y1, L, fc0);
  vc::gelu_forward_train(k.g, k.f, L * I, vc::Gelu::kTanh);
  float* out = t.take<float>(L * D);
  cuda::copy_on_device(out, k.x_mid, size_t(L * D) * sizeof(float));
  train_linear_forward(t, out, D, k.g, I, L, fc1, /*accumulate=*/true);
  return out;
}

// dx: the gradient of the block's output on entry, of its input on return (in place).
void block_backward(TrainCtx& t, const VisionConfig& c, int64_t b, const VisionTrainTape& tp,
                    const VisionBlockTrainTape& k, float* dx) {
  const int64_t L = tp.L, D = c.hidden_size, Q = c.qkv_hidden_size, I = c.intermediate_size;
  const TrainParam norm0 = vision_param(t, c, K::Norm0, b), norm1 = vision_param(t, c, K::Norm1, b),
                   wqkv = vision_param(t, c, K::Wqkv, b), wo = vision_param(t, c, K::Wo, b),
                   fc0 = vision_param(t, c, K::Fc0, b), fc1 = vision_param(t, c, K::Fc1, b);
  const DeviceArena::Mark m = t.arena.mark();
  float *dnorm = t.take<float>(L * D), *dres = t.take<float>(L * D);
  // x_out = x_mid + fc1(gelu_tanh(fc0(norm1(x_mid))))
  float* dg = t.take<float>(L * I);
  train_linear_backward(t, dg, I, false, dx, D, k.g, I, L, fc1);
  vc::gelu_backward_train(dg, dg, k.f, L * I, vc::Gelu::kTanh);  // now d f
  train_linear_backward(t, dnorm, false, dg, k.y1, L, fc0);
  rmsnorm_backward(t, dres, norm1.g, dnorm, k.x_mid, k.rstd1, norm1.w, L, D);
  elementwise::cuda::add_inplace(dx, dres, L * D);  // now d x_mid
  // x_mid = x + wo(attn(rope2d(wqkv(norm0(x)))))
  float *d_o = t.take<float>(L * Q), *dq = t.take<float>(L * Q), *dkv = t.take<float>(L * 2 * Q),
        *dqkv = t.take<float>(L * 3 * Q);
  train_linear_backward(t, d_o, Q, false, dx, D, k.o, Q, L, wo);
  attention_backward(t, c, tp, k, d_o, dq, dkv);
  vc::RopeSplitParams r;
  r.qkv = dqkv, r.ld = 3 * Q, r.L = L, r.heads = c.num_heads, r.hd = c.head_dim();
  r.rows = tp.rows, r.cols = tp.cols, r.table = tp.rope, r.positions = tp.positions, r.q = dq, r.kv = dkv;
  vc::rope_split_backward(r);
  train_linear_backward(t, dnorm, false, dqkv, k.y0, L, wqkv);
  rmsnorm_backward(t, dres, norm0.g, dnorm, k.x, k.rstd0, norm0.w, L, D);
  elementwise::cuda::add_inplace(dx, dres, L * D);  // now d x
  t.arena.rewind(m);
}

}  // namespace

std::unique_ptr<VisionTrainTape, VisionTapeDeleter> vision_train_forward(TrainCtx& t, const VisionConfig& c,
                                                                         const float* pixels, int64_t L,
                                                                         const std::vector<VisionGrid>& grids,
                                                                         float** projected) {
  check_vision_grids(c, grids, L);
  K3_CHECK(projected, "GPU vision training: no place for the projected tokens");
  const int64_t D = c.hidden_size, M = c.merged_width(), H = c.text_hidden_size, hd = c.head_dim();
  std::unique_ptr<VisionTrainTape, VisionTapeDeleter> tape(new VisionTrainTape);
  VisionTrainTape& tp = *tape;
  tp.L = L;
  tp.pixels = pixels;
  // Where each item lies, each patch's row and column (the RoPE's angles), the attention's cu_seqlens.
  std::vector<int32_t> rows(static_cast<size_t>(L)), cols(static_cast<size_t>(L)), cu{0};
  int64_t first = 0;
  for (const VisionGrid& g : grids) {
    VisionItemPlace it{g, first, tp.T, c.merged_tokens(g.h, g.w)};
    for (int64_t p = 0; p < g.patches(); ++p) {
      rows[size_t(first + p)] = int32_t((p % (g.h * g.w)) / g.w);
      cols[size_t(first + p)] = int32_t(p % g.w);
    }
    first += g.patches();
    tp.T += it.tokens;
    tp.max_len = std::max(tp.max_len, g.patches());
    tp.positions = std::max({tp.positions, g.h, g.w});
    cu.push_back(int32_t(first));
    tp.items.push_back(it);
  }
  tp.rows = upload(t, rows), tp.cols = upload(t, cols), tp.cu = upload(t, cu);
  tp.rope = upload(t, vc::rope_table(hd, tp.positions));

  // The embedding: patches · Wpatchᵀ, then each item's resized table (and a clip's time embedding).
  const TrainParam patch = vision_param(t, c, K::PatchEmbed), pos = vision_param(t, c, K::PosEmb);
  float* x = t.take<float>(L * D);
  train_linear_forward(t, x, D, pixels, c.patch_values(), L, patch);
  for (const VisionItemPlace& it : tp.items) {
    const DeviceArena::Mark m = t.arena.mark();
    vc::PositionParams p;
    p.x = x + it.first_patch * D, p.table = pos.w, p.H0 = c.pos_emb_height, p.W0 = c.pos_emb_width, p.D = D;
    p.t = it.grid.t, p.h = it.grid.h, p.w = it.grid.w;
    if (it.grid.t > 1) {  // the CPU adds the time embedding for clips only
      std::vector<float> time(size_t(it.grid.t * D));
      frame_time_embedding(time.data(), it.grid.t, D);
      p.time = upload(t, time);
    }
    if (const std::string why = vc::can_run(p); !why.empty()) fail("GPU vision training: ", why);
    vc::add_position_embedding(p);
    t.arena.rewind(m);
  }
  tp.blocks.resize(size_t(c.num_layers));
  for (int64_t b = 0; b < c.num_layers; ++b) x = block_forward(t, c, b, tp, x, tp.blocks[size_t(b)]);

  // The final norm, the merge per item, the projector over every merged token.
  tp.final_in = x;
  tp.final_out = t.take<float>(L * D), tp.rstd_final = t.take<float>(L);
  norm::cuda::rmsnorm_forward_train(tp.final_out, D, tp.rstd_final, x, D, vision_param(t, c, K::FinalNorm).w,
                                    VisionModel::kTowerNormEps, L, D);
  tp.merged = t.take<float>(tp.T * M), tp.mid = t.take<float>(tp.T * M), tp.act = t.take<float>(tp.T * M);
  for (const VisionItemPlace& it : tp.items) {
    vc::MergeParams p;
    p.out_f32 = tp.merged + it.first_token * M, p.x = tp.final_out + it.first_patch * D;
    p.t = it.grid.t, p.h = it.grid.h, p.w = it.grid.w, p.D = D, p.mh = c.merge_h, p.mw = c.merge_w;
    vc::merge_tpool(p);
  }
  train_linear_forward(t, tp.mid, tp.merged, tp.T, vision_param(t, c, K::Proj0));
  vc::gelu_forward_train(tp.act, tp.mid, tp.T * M, vc::Gelu::kErf);
  tp.z = t.take<float>(tp.T * H), tp.rstd_post = t.take<float>(tp.T);
  train_linear_forward(t, tp.z, tp.act, tp.T, vision_param(t, c, K::Proj2));
  *projected = t.take<float>(tp.T * H);
  norm::cuda::rmsnorm_forward_train(*projected, H, tp.rstd_post, tp.z, H, vision_param(t, c, K::PostNorm).w,
                                    float(c.projector_eps), tp.T, H);
  return tape;
}

void vision_train_backward(TrainCtx& t, const VisionConfig& c, const VisionTrainTape& tp, const float* dprojected) {
  K3_CHECK(int64_t(tp.blocks.size()) == c.num_layers, "GPU vision training: a tape of ", tp.blocks.size(),
           " blocks for a tower of ", c.num_layers);
  const int64_t L = tp.L, T = tp.T, D = c.hidden_size, M = c.merged_width(), H = c.text_hidden_size;
  const DeviceArena::Mark m = t.arena.mark();
  // The projector, over every merged token.
  const TrainParam post = vision_param(t, c, K::PostNorm), w2 = vision_param(t, c, K::Proj2),
                   w0 = vision_param(t, c, K::Proj0);
  float *dz = t.take<float>(T * H), *dact = t.take<float>(T * M), *dmerged = t.take<float>(T * M);
  rmsnorm_backward(t, dz, post.g, dprojected, tp.z, tp.rstd_post, post.w, T, H);
  train_linear_backward(t, dact, false, dz, tp.act, T, w2);
  vc::gelu_backward_train(dact, dact, tp.mid, T * M, vc::Gelu::kErf);  // now d mid
  train_linear_backward(t, dmerged, false, dact, tp.merged, T, w0);
  // The merge per item, then the final norm.
  float* dfinal = t.take<float>(L * D);
  for (const VisionItemPlace& it : tp.items)
    vc::merge_tpool_backward(dfinal + it.first_patch * D, dmerged + it.first_token * M, it.grid.t, it.grid.h, it.grid.w,
                             D, c.merge_h, c.merge_w);
  const TrainParam final_norm = vision_param(t, c, K::FinalNorm);
  float* dx = t.take<float>(L * D);
  rmsnorm_backward(t, dx, final_norm.g, dfinal, tp.final_in, tp.rstd_final, final_norm.w, L, D);
  for (int64_t b = c.num_layers - 1; b >= 0; --b) block_backward(t, c, b, tp, tp.blocks[size_t(b)], dx);
  // The embedding: the patch matrix, and the position table through the resize's transpose per item.
  train_linear_backward(t, nullptr, false, dx, tp.pixels, L, vision_param(t, c, K::PatchEmbed));
  const TrainParam pos = vision_param(t, c, K::PosEmb);
  for (const VisionItemPlace& it : tp.items) {
    const DeviceArena::Mark mi = t.arena.mark();
    const vc::TransposedTaps tr = vc::transposed_taps(it.grid.h, c.pos_emb_height),
                             tc = vc::transposed_taps(it.grid.w, c.pos_emb_width);
    vc::PositionBackwardParams p;
    p.dtable = pos.g, p.dx = dx + it.first_patch * D;
    p.H0 = c.pos_emb_height, p.W0 = c.pos_emb_width, p.D = D, p.t = it.grid.t, p.h = it.grid.h, p.w = it.grid.w;
    p.row_start = upload(t, tr.start), p.row_index = upload(t, tr.index), p.row_weight = upload(t, tr.weight);
    p.col_start = upload(t, tc.start), p.col_index = upload(t, tc.index), p.col_weight = upload(t, tc.weight);
    vc::position_embedding_backward(p);
    t.arena.rewind(mi);
  }
  t.arena.rewind(m);
}

}  // namespace k3::gpu
#endif  // K3_HAVE_CUDA
