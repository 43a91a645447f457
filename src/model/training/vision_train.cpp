// Float64 forward and backward of the vision tower and projector (see vision_train.h). Linear layers follow the
// checkpoint convention W [out, in], y = x Wᵀ, so dW += dyᵀ x and dx = dy W (kernels/gemm/linear_f64.h).
#include "model/training/vision_train.h"

#include <algorithm>
#include <string>

#include "core/error.h"
#include "kernels/ffn/gelu.h"
#include "kernels/gemm/linear_f64.h"
#include "kernels/norm/norm.h"
#include "kernels/vision/vision_f64.h"
#include "model/tensor_table.h"

namespace k3::train {

namespace {

using K = VisionTensorKind;
constexpr double kTowerEps = double(VisionModel::kTowerNormEps);

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

std::string checked_vision_name(const ParamStore& P, const VisionConfig& c, VisionTensorKind k, int64_t b) {
  std::string n = vision_tensor_name(k, b);
  if (!P.has(n)) fail("vision training: parameter '", n, "' is missing (the store holds no vision tower?)");
  const std::vector<int64_t> want = vision_tensor_shape(c, k);
  if (P.shape(n) != want)
    fail("vision training: parameter '", n, "' has shape ", shape_text(P.shape(n)), ", expected ", shape_text(want),
         " (", c.source, ")");
  return n;
}

namespace {

// The names of one tower block's tensors.
struct BlockNames {
  std::string norm0, norm1, wqkv, wo, fc0, fc1;
};
BlockNames block_names(const ParamStore& P, const VisionConfig& c, int64_t b) {
  return {checked_vision_name(P, c, K::Norm0, b), checked_vision_name(P, c, K::Norm1, b), checked_vision_name(P, c, K::Wqkv, b),
          checked_vision_name(P, c, K::Wo, b),    checked_vision_name(P, c, K::Fc0, b),   checked_vision_name(P, c, K::Fc1, b)};
}

void add_into(double* y, const double* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

// ---- forward ----

// x [L, D] = pixels · Wpatchᵀ + each item's resized position table (+ its frames' time embedding); the RoPE's
// rows and columns.
void embed_forward(const ParamStore& P, const VisionConfig& c, VisionTape& t, std::vector<double>& x) {
  const int64_t L = t.patches, D = c.hidden_size;
  x.assign(size_t(L * D), 0.0);
  linear_forward(x.data(), t.pixels.data(), P.p(checked_vision_name(P, c, K::PatchEmbed)), L, c.patch_values(), D);
  const double* table = P.p(checked_vision_name(P, c, K::PosEmb));
  t.rows.resize(size_t(L));
  t.cols.resize(size_t(L));
  for (const VisionItemTape& it : t.items) {
    const VisionGrid& g = it.grid;
    std::vector<double> pos(size_t(g.h * g.w * D)), time(size_t(g.t * D), 0.0);
    position_table_resize_f64(pos.data(), table, c.pos_emb_height, c.pos_emb_width, g.h, g.w, D);
    if (g.t > 1) frame_time_embedding_f64(time.data(), g.t, D);
    for (int64_t f = 0; f < g.t; ++f)
      for (int64_t p = 0; p < g.h * g.w; ++p) {
        const int64_t r = it.first_patch + f * g.h * g.w + p;
        for (int64_t d = 0; d < D; ++d) x[size_t(r * D + d)] += pos[size_t(p * D + d)] + time[size_t(f * D + d)];
        t.rows[size_t(r)] = int32_t(p / g.w);
        t.cols[size_t(r)] = int32_t(p % g.w);
      }
  }
}

// One block: x (its input, [L, D]) becomes its output; the tape keeps what the backward needs.
void block_forward(const ParamStore& P, const VisionConfig& c, int64_t b, const VisionTape& t, std::vector<double>& x,
                   VisionBlockTape& k) {
  const BlockNames n = block_names(P, c, b);
  const int64_t L = t.patches, D = c.hidden_size, Q = c.qkv_hidden_size, I = c.intermediate_size;
  const int64_t heads = c.num_heads, hd = c.head_dim();
  k.x = x;
  k.y0.resize(size_t(L * D));
  rmsnorm_forward(k.y0.data(), k.x.data(), P.p(n.norm0), kTowerEps, L, D);
  k.qkv.resize(size_t(L * 3 * Q));
  linear_forward(k.qkv.data(), k.y0.data(), P.p(n.wqkv), L, D, 3 * Q);
  rope2d_forward_f64(k.qkv.data(), 3 * Q, L, heads, hd, t.rows.data(), t.cols.data());      // q
  rope2d_forward_f64(k.qkv.data() + Q, 3 * Q, L, heads, hd, t.rows.data(), t.cols.data());  // k
  k.o.resize(size_t(L * Q));
  k.lse.resize(size_t(heads * L));
  for (const VisionItemTape& it : t.items) {
    const double* base = k.qkv.data() + it.first_patch * 3 * Q;
    attention_bidirectional_forward_f64(k.o.data() + it.first_patch * Q, k.lse.data() + heads * it.first_patch, base,
                                        base + Q, base + 2 * Q, 3 * Q, it.grid.patches(), heads, hd);
  }
  std::vector<double> branch(size_t(L * D));  // a residual branch's output
  linear_forward(branch.data(), k.o.data(), P.p(n.wo), L, Q, D);
  k.x_mid = k.x;
  add_into(k.x_mid.data(), branch.data(), L * D);
  k.y1.resize(size_t(L * D));
  rmsnorm_forward(k.y1.data(), k.x_mid.data(), P.p(n.norm1), kTowerEps, L, D);
  k.f.resize(size_t(L * I));
  linear_forward(k.f.data(), k.y1.data(), P.p(n.fc0), L, D, I);
  k.g.resize(size_t(L * I));
  gelu_tanh_forward(k.g.data(), k.f.data(), L * I);
  linear_forward(branch.data(), k.g.data(), P.p(n.fc1), L, I, D);
  x = k.x_mid;
  add_into(x.data(), branch.data(), L * D);
}

// One item's projector, from its merged tokens.
void projector_forward(const ParamStore& P, const VisionConfig& c, VisionItemTape& it) {
  const int64_t M = c.merged_width(), H = c.text_hidden_size, N = it.tokens;
  it.mid.resize(size_t(N * M));
  linear_forward(it.mid.data(), it.merged.data(), P.p(checked_vision_name(P, c, K::Proj0)), N, M, M);
  it.act.resize(size_t(N * M));
  gelu_erf_forward(it.act.data(), it.mid.data(), N * M);
  it.z.resize(size_t(N * H));
  linear_forward(it.z.data(), it.act.data(), P.p(checked_vision_name(P, c, K::Proj2)), N, M, H);
  it.projected.resize(size_t(N * H));
  rmsnorm_forward(it.projected.data(), it.z.data(), P.p(checked_vision_name(P, c, K::PostNorm)), c.projector_eps, N, H);
}

// ---- backward ----

// dx: the gradient of the block's output on entry, of its input on return.
void block_backward(ParamStore& P, const VisionConfig& c, int64_t b, const VisionTape& t, const VisionBlockTape& k,
                    std::vector<double>& dx) {
  const BlockNames n = block_names(P, c, b);
  const int64_t L = t.patches, D = c.hidden_size, Q = c.qkv_hidden_size, I = c.intermediate_size;
  const int64_t heads = c.num_heads, hd = c.head_dim();
  std::vector<double> dnorm(size_t(L * D)), dres(size_t(L * D));  // a norm's output and input gradients
  // x_out = x_mid + fc1(gelu_tanh(fc0(norm1(x_mid))))
  std::vector<double> dg(size_t(L * I));
  linear_backward(dg.data(), P.g(n.fc1), dx.data(), k.g.data(), P.p(n.fc1), L, I, D);
  gelu_tanh_backward(dg.data(), dg.data(), k.f.data(), L * I);  // now d f
  linear_backward(dnorm.data(), P.g(n.fc0), dg.data(), k.y1.data(), P.p(n.fc0), L, D, I);
  rmsnorm_backward(dres.data(), P.g(n.norm1), dnorm.data(), k.x_mid.data(), P.p(n.norm1), kTowerEps, L, D);
  add_into(dx.data(), dres.data(), L * D);  // now d x_mid
  // x_mid = x + wo(attn(rope2d(wqkv(norm0(x)))))
  std::vector<double> d_o(size_t(L * Q)), dqkv(size_t(L * 3 * Q));
  linear_backward(d_o.data(), P.g(n.wo), dx.data(), k.o.data(), P.p(n.wo), L, Q, D);
  for (const VisionItemTape& it : t.items) {
    const int64_t r0 = it.first_patch;
    const double* base = k.qkv.data() + r0 * 3 * Q;
    double* dbase = dqkv.data() + r0 * 3 * Q;
    attention_bidirectional_backward_f64(dbase, dbase + Q, dbase + 2 * Q, 3 * Q, d_o.data() + r0 * Q, base, base + Q,
                                         base + 2 * Q, 3 * Q, k.o.data() + r0 * Q, k.lse.data() + heads * r0,
                                         it.grid.patches(), heads, hd);
  }
  rope2d_backward_f64(dqkv.data(), 3 * Q, L, heads, hd, t.rows.data(), t.cols.data());      // q
  rope2d_backward_f64(dqkv.data() + Q, 3 * Q, L, heads, hd, t.rows.data(), t.cols.data());  // k
  linear_backward(dnorm.data(), P.g(n.wqkv), dqkv.data(), k.y0.data(), P.p(n.wqkv), L, D, 3 * Q);
  rmsnorm_backward(dres.data(), P.g(n.norm0), dnorm.data(), k.x.data(), P.p(n.norm0), kTowerEps, L, D);
  add_into(dx.data(), dres.data(), L * D);  // now d x
}

// From the item's output gradients (either may be null) to the gradient of the tower's final output at its
// patches, dfinal [its patches, D] (OVERWRITTEN).
void projector_backward(ParamStore& P, const VisionConfig& c, const VisionItemTape& it, const double* dprojected,
                        const double* dmerged_out, double* dfinal) {
  const int64_t M = c.merged_width(), H = c.text_hidden_size, N = it.tokens;
  std::vector<double> dmerged(size_t(N * M), 0.0);
  if (dprojected) {
    const std::string post = checked_vision_name(P, c, K::PostNorm), w2 = checked_vision_name(P, c, K::Proj2),
                      w0 = checked_vision_name(P, c, K::Proj0);
    std::vector<double> dz(size_t(N * H)), dact(size_t(N * M));
    rmsnorm_backward(dz.data(), P.g(post), dprojected, it.z.data(), P.p(post), c.projector_eps, N, H);
    linear_backward(dact.data(), P.g(w2), dz.data(), it.act.data(), P.p(w2), N, M, H);
    gelu_erf_backward(dact.data(), dact.data(), it.mid.data(), N * M);  // now d mid
    linear_backward(dmerged.data(), P.g(w0), dact.data(), it.merged.data(), P.p(w0), N, M, M);
  }
  if (dmerged_out) add_into(dmerged.data(), dmerged_out, N * M);
  patch_merge_backward_f64(dfinal, dmerged.data(), it.grid.t, it.grid.h, it.grid.w, c.merge_h, c.merge_w,
                           c.hidden_size);
}

// dx: the gradient of the embedding's output [L, D]; into the patch embedding, the position table (through the
// resize's transpose, summed over a clip's frames) and, when wanted, the pixels.
void embed_backward(ParamStore& P, const VisionConfig& c, const VisionTape& t, const std::vector<double>& dx,
                    double* d_pixels) {
  const int64_t L = t.patches, D = c.hidden_size;
  const std::string pe = checked_vision_name(P, c, K::PatchEmbed), pos = checked_vision_name(P, c, K::PosEmb);
  linear_backward(d_pixels, P.g(pe), dx.data(), t.pixels.data(), P.p(pe), L, c.patch_values(), D);
  for (const VisionItemTape& it : t.items) {
    const VisionGrid& g = it.grid;
    std::vector<double> dpos(size_t(g.h * g.w * D), 0.0);
    for (int64_t f = 0; f < g.t; ++f)
      add_into(dpos.data(), dx.data() + (it.first_patch + f * g.h * g.w) * D, g.h * g.w * D);
    position_table_resize_backward_f64(P.g(pos), dpos.data(), c.pos_emb_height, c.pos_emb_width, g.h, g.w, D);
  }
}

}  // namespace

VisionTape vision_forward(const ParamStore& P, const VisionConfig& c, const double* pixel_patches, int64_t patches,
                          const std::vector<VisionGrid>& grids) {
  check_vision_grids(c, grids, patches);
  const int64_t D = c.hidden_size;
  VisionTape t;
  t.patches = patches;
  t.pixels.assign(pixel_patches, pixel_patches + patches * c.patch_values());
  int64_t first = 0;
  for (const VisionGrid& g : grids) {
    VisionItemTape it;
    it.grid = g;
    it.first_patch = first;
    it.tokens = c.merged_tokens(g.h, g.w);
    t.items.push_back(std::move(it));
    first += g.patches();
  }
  std::vector<double> x;
  embed_forward(P, c, t, x);
  t.blocks.resize(size_t(c.num_layers));
  for (int64_t b = 0; b < c.num_layers; ++b) block_forward(P, c, b, t, x, t.blocks[size_t(b)]);
  t.final_in = x;
  rmsnorm_forward(x.data(), t.final_in.data(), P.p(checked_vision_name(P, c, K::FinalNorm)), kTowerEps, patches, D);
  for (VisionItemTape& it : t.items) {
    it.merged.resize(size_t(it.tokens * c.merged_width()));
    patch_merge_forward_f64(it.merged.data(), x.data() + it.first_patch * D, it.grid.t, it.grid.h, it.grid.w, c.merge_h,
                            c.merge_w, D);
    projector_forward(P, c, it);
  }
  return t;
}

void vision_backward(ParamStore& P, const VisionConfig& c, const VisionTape& tape, const VisionOutputGrads& d,
                     double* d_pixel_patches) {
  const size_t items = tape.items.size();
  K3_CHECK(int64_t(tape.blocks.size()) == c.num_layers, "vision training: a tape of ", tape.blocks.size(),
           " blocks for a tower of ", c.num_layers);
  for (const auto* list : {&d.projected, &d.merged})
    if (!list->empty() && list->size() != items)
      fail("vision training: output gradients for ", list->size(), " items, and the forward had ", items);
  const int64_t L = tape.patches, D = c.hidden_size;
  std::vector<double> dfinal(size_t(L * D));
  for (size_t i = 0; i < items; ++i) {
    const VisionItemTape& it = tape.items[i];
    projector_backward(P, c, it, d.projected.empty() ? nullptr : d.projected[i],
                       d.merged.empty() ? nullptr : d.merged[i], dfinal.data() + it.first_patch * D);
  }
  std::vector<double> dx(size_t(L * D));
  const std::string final_norm = checked_vision_name(P, c, K::FinalNorm);
  rmsnorm_backward(dx.data(), P.g(final_norm), dfinal.data(), tape.final_in.data(), P.p(final_norm), kTowerEps, L, D);
  for (int64_t b = c.num_layers - 1; b >= 0; --b) block_backward(P, c, b, tape, tape.blocks[size_t(b)], dx);
  embed_backward(P, c, tape, dx, d_pixel_patches);
}

}  // namespace k3::train
