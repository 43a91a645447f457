// Training through the vision tower on the GPU (model/cuda/training/vision_train.cpp, CudaTrainModel's input rows
// and image_text_loss) against the CPU's float64 truths:
//   - the training attention with causal = false (kernels/mla/mla_train_cuda.h, both kernels) against
//     attention_bidirectional_*_f64 (kernels/vision/vision_f64.h) on packed items of lengths {1, 7, 64, 130}:
//     the fp32 kernel at the causal kernels' bar (1e-5 relative L2), the bf16 tensor-core kernel at theirs (1e-2);
//   - the RoPE split and its backward, both GELUs' forwards and backwards, the merge's backward and the position
//     table's transposed resize against their float64 twins (kernels/vision/vision_f64.h, kernels/ffn/gelu.h);
//   - the resize's transposed taps (no GPU needed) against the transpose of the forward taps, dense;
//   - image-text sequences (three images: the table's grid, a non-square grid that needs interpolation, a 2-frame
//     clip; two sequences, one holding two images) on k3-tiny-vision from `k3 init`: the loss, the target count
//     and every tensor's gradient, text and vision, against train::image_text_loss in float64. F32: the loss at
//     1e-5 relative, each vision tensor and the whole vision gradient at 1e-4 relative L2, the whole text gradient
//     at the text trainer's packed-batch bar (1e-3: its routed experts see a token or two each, and
//     docs/NUMERICS.md measures some at 1.5e-4 alone). BF16: the loss at the text trainer's 1e-2 relative; the
//     whole gradient, vision and text apart, within 2x what bf16's rounding of the weights alone moves the float64
//     gradient of these sequences (the largest of four draws of a random relative perturbation of up to 2^-9 on
//     every weight). The text trainer's fixed 5e-2 does not carry over: on this model and batch one such draw moves
//     the float64 gradient by 1.8-6.3% (six draws), and bf16 compute rounds every GEMM's activations as well.
// GPU tests skip without a Hopper GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "kernels/ffn/gelu.h"
#include "kernels/mla/mla_train_cuda.h"
#include "kernels/mla/mla_train_tc_cuda.h"
#include "kernels/vision/bilinear_taps.h"
#include "kernels/vision/vision_cuda.h"
#include "kernels/vision/vision_f64.h"
#include "kernels/vision/vision_train_cuda.h"
#include "model/config.h"
#include "model/cuda/training/cuda_train_model.h"
#include "model/params.h"
#include "model/training/image_text_train.h"
#include "model/vision_config.h"
#include "util/compare.h"
#include "util/cuda_test.h"
#include "util/random.h"
#include "util/tiny_vision_model.h"

using namespace k3;
using k3test::rel_l2;

namespace {

// ---- the bidirectional training attention ----

struct AttnResult {
  std::vector<double> o, lse, dq, dk, dv;  // [L, Q], [heads, L] (items concatenated), [L, Q] x 3
};

// The float64 truth, item by item: q, k, v [L, Q] dense.
AttnResult attention_f64(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                         const std::vector<double>& dO, const std::vector<int32_t>& cu, int64_t heads, int64_t hd) {
  const int64_t Q = heads * hd, L = cu.back();
  AttnResult r;
  r.o.assign(size_t(L * Q), 0.0), r.lse.assign(size_t(heads * L), 0.0);
  r.dq = r.dk = r.dv = r.o;
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    const int64_t r0 = cu[i], n = cu[i + 1] - cu[i];
    std::vector<double> lse(size_t(heads * n));
    attention_bidirectional_forward_f64(r.o.data() + r0 * Q, lse.data(), q.data() + r0 * Q, k.data() + r0 * Q,
                                        v.data() + r0 * Q, Q, n, heads, hd);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < n; ++j) r.lse[size_t(h * L + r0 + j)] = lse[size_t(h * n + j)];
    attention_bidirectional_backward_f64(r.dq.data() + r0 * Q, r.dk.data() + r0 * Q, r.dv.data() + r0 * Q, Q,
                                         dO.data() + r0 * Q, q.data() + r0 * Q, k.data() + r0 * Q, v.data() + r0 * Q, Q,
                                         r.o.data() + r0 * Q, lse.data(), n, heads, hd);
  }
  return r;
}

// The GPU kernels in the vision trainer's layout: q [L, Q], kv [L, 2Q] ([k | v] per head).
AttnResult attention_gpu(bool bf16, const std::vector<double>& q, const std::vector<double>& k,
                         const std::vector<double>& v, const std::vector<double>& dO, const std::vector<int32_t>& cu,
                         int64_t heads, int64_t hd) {
  const int64_t Q = heads * hd, L = cu.back();
  int64_t max_len = 0;
  for (size_t i = 0; i + 1 < cu.size(); ++i) max_len = std::max<int64_t>(max_len, cu[i + 1] - cu[i]);
  std::vector<float> qf(size_t(L * Q)), kvf(size_t(L * 2 * Q)), dof(size_t(L * Q));
  for (int64_t r = 0; r < L; ++r)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < hd; ++j) {
        const size_t s = size_t(r * Q + h * hd + j);
        qf[s] = float(q[s]), dof[s] = float(dO[s]);
        kvf[size_t(r * 2 * Q + h * 2 * hd + j)] = float(k[s]);
        kvf[size_t(r * 2 * Q + h * 2 * hd + hd + j)] = float(v[s]);
      }
  const mla::Dims d{heads, hd, 0, hd, 0};
  const float scale = float(1.0 / std::sqrt(double(hd)));
  cuda::DeviceBuffer<float> q_d(qf.data(), qf.size()), kv_d(kvf.data(), kvf.size()), do_d(dof.data(), dof.size());
  cuda::DeviceBuffer<float> o_d(size_t(L * Q)), lse_d(size_t(heads * L)), dq_d(size_t(L * Q)), dkv_d(size_t(L * 2 * Q));
  cuda::DeviceBuffer<int32_t> cu_d(cu.data(), cu.size());
  const int B = int(cu.size()) - 1;
  if (bf16) {
    cuda::DeviceBuffer<uint8_t> ws(std::max(mla::cuda::attention_forward_workspace_bytes_bf16(L, d),
                                            mla::cuda::attention_backward_workspace_bytes_bf16(L, d)));
    mla::cuda::attention_forward_train_bf16(o_d.data(), Q, lse_d.data(), q_d.data(), Q, kv_d.data(), 2 * Q, nullptr, 0,
                                            cu_d.data(), B, max_len, L, d, scale, ws.data(), false);
    mla::cuda::attention_backward_train_bf16(dq_d.data(), Q, dkv_d.data(), 2 * Q, nullptr, 0, do_d.data(), Q,
                                             o_d.data(), q_d.data(), Q, kv_d.data(), 2 * Q, nullptr, 0, lse_d.data(),
                                             cu_d.data(), B, max_len, L, d, scale, ws.data(), false);
  } else {
    cuda::DeviceBuffer<uint8_t> ws(mla::cuda::attention_backward_workspace_bytes(L, d));
    mla::cuda::attention_forward_train(o_d.data(), Q, lse_d.data(), q_d.data(), Q, kv_d.data(), 2 * Q, nullptr, 0,
                                       cu_d.data(), B, max_len, L, d, scale, false);
    mla::cuda::attention_backward_train(dq_d.data(), Q, dkv_d.data(), 2 * Q, nullptr, 0, do_d.data(), Q, o_d.data(),
                                        q_d.data(), Q, kv_d.data(), 2 * Q, nullptr, 0, lse_d.data(), cu_d.data(), B,
                                        max_len, L, d, scale, ws.data(), false);
  }
  std::vector<float> o(size_t(L * Q)), lse(size_t(heads * L)), dq(size_t(L * Q)), dkv(size_t(L * 2 * Q));
  o_d.download(o.data(), o.size()), lse_d.download(lse.data(), lse.size());
  dq_d.download(dq.data(), dq.size()), dkv_d.download(dkv.data(), dkv.size());
  AttnResult r;
  r.o.assign(o.begin(), o.end()), r.lse.assign(lse.begin(), lse.end()), r.dq.assign(dq.begin(), dq.end());
  r.dk.resize(size_t(L * Q)), r.dv.resize(size_t(L * Q));
  for (int64_t row = 0; row < L; ++row)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < hd; ++j) {
        r.dk[size_t(row * Q + h * hd + j)] = dkv[size_t(row * 2 * Q + h * 2 * hd + j)];
        r.dv[size_t(row * Q + h * hd + j)] = dkv[size_t(row * 2 * Q + h * 2 * hd + hd + j)];
      }
  return r;
}

void check_bidirectional(bool bf16, int64_t heads, int64_t hd, double bar) {
  const std::vector<int32_t> cu{0, 1, 8, 72, 202};  // items of 1, 7, 64 and 130 patches
  const int64_t n = int64_t(cu.back()) * heads * hd;
  const std::vector<double> q = k3test::randn(n, 11), k = k3test::randn(n, 12), v = k3test::randn(n, 13),
                            dO = k3test::randn(n, 14);
  const AttnResult want = attention_f64(q, k, v, dO, cu, heads, hd),
                   got = attention_gpu(bf16, q, k, v, dO, cu, heads, hd);
  const char* kernel = bf16 ? "bf16" : "fp32";
  const std::vector<std::pair<const char*, std::pair<const std::vector<double>*, const std::vector<double>*>>> parts{
      {"o", {&want.o, &got.o}},
      {"lse", {&want.lse, &got.lse}},
      {"dq", {&want.dq, &got.dq}},
      {"dk", {&want.dk, &got.dk}},
      {"dv", {&want.dv, &got.dv}}};
  for (const auto& [name, pair] : parts) {
    const double e = rel_l2(pair.second->data(), pair.first->data(), pair.first->size());  // got against want
    std::printf("%s heads %lld hd %lld  %-3s rel L2 %.3e\n", kernel, (long long)heads, (long long)hd, name, e);
    EXPECT_LE(e, bar) << kernel << " " << name << " (heads " << heads << ", hd " << hd << ")";
  }
}

TEST(CudaVisionTrain, BidirectionalAttentionFp32MatchesFloat64) {
  K3_REQUIRE_GPU();
  check_bidirectional(false, 2, 24, 1e-5);  // k3-tiny-vision's heads
  check_bidirectional(false, 3, 64, 1e-5);  // the release's head dim
}

TEST(CudaVisionTrain, BidirectionalAttentionBf16MatchesFloat64) {
  K3_REQUIRE_GPU();
  check_bidirectional(true, 2, 24, 1e-2);
  check_bidirectional(true, 3, 64, 1e-2);
}

// ---- the elementwise training ops against their float64 twins ----

std::vector<double> widen(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }
std::vector<float> narrow(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }
template <class T>
std::vector<T> download(const cuda::DeviceBuffer<T>& b) {
  std::vector<T> h(b.size());
  b.download(h.data(), h.size());
  return h;
}

// rope_split and its backward against rope2d_forward_f64 / rope2d_backward_f64, at fp32's bar (the table's cos and
// sin are fp32 roundings of the double angles).
TEST(CudaVisionTrain, RopeSplitAndItsBackwardMatchFloat64) {
  K3_REQUIRE_GPU();
  const int64_t L = 35, heads = 2, hd = 24, Q = heads * hd, positions = 7;
  std::vector<int32_t> rows(L), cols(L);
  for (int64_t r = 0; r < L; ++r) rows[size_t(r)] = int32_t(r / 7 % 5), cols[size_t(r)] = int32_t(r % 7);
  const std::vector<float> qkv = narrow(k3test::randn(L * 3 * Q, 21));
  std::vector<double> want = widen(qkv);
  rope2d_forward_f64(want.data(), 3 * Q, L, heads, hd, rows.data(), cols.data());
  rope2d_forward_f64(want.data() + Q, 3 * Q, L, heads, hd, rows.data(), cols.data());
  const std::vector<float> table = vision::cuda::rope_table(hd, positions);
  cuda::DeviceBuffer<float> qkv_d(qkv.data(), qkv.size()), table_d(table.data(), table.size()), q_d(size_t(L * Q)),
      kv_d(size_t(L * 2 * Q)), dqkv_d(size_t(L * 3 * Q));
  cuda::DeviceBuffer<int32_t> rows_d(rows.data(), rows.size()), cols_d(cols.data(), cols.size());
  vision::cuda::RopeSplitParams p;
  p.qkv = qkv_d.data(), p.ld = 3 * Q, p.L = L, p.heads = heads, p.hd = hd, p.rows = rows_d.data();
  p.cols = cols_d.data(), p.table = table_d.data(), p.positions = positions, p.q = q_d.data(), p.kv = kv_d.data();
  vision::cuda::rope_split(p);
  const std::vector<float> q = download(q_d), kv = download(kv_d);
  std::vector<double> got(size_t(L * 3 * Q));  // back in the [q | k | v] layout
  for (int64_t r = 0; r < L; ++r)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < hd; ++j) {
        got[size_t(r * 3 * Q + h * hd + j)] = q[size_t(r * Q + h * hd + j)];
        got[size_t(r * 3 * Q + Q + h * hd + j)] = kv[size_t(r * 2 * Q + h * 2 * hd + j)];
        got[size_t(r * 3 * Q + 2 * Q + h * hd + j)] = kv[size_t(r * 2 * Q + h * 2 * hd + hd + j)];
      }
  EXPECT_LE(rel_l2(got.data(), want.data(), want.size()), 1e-6);

  // The backward from gradients in the split layouts.
  const std::vector<float> dq = narrow(k3test::randn(L * Q, 22)), dkv = narrow(k3test::randn(L * 2 * Q, 23));
  std::vector<double> dwant(size_t(L * 3 * Q));
  for (int64_t r = 0; r < L; ++r)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < hd; ++j) {
        dwant[size_t(r * 3 * Q + h * hd + j)] = dq[size_t(r * Q + h * hd + j)];
        dwant[size_t(r * 3 * Q + Q + h * hd + j)] = dkv[size_t(r * 2 * Q + h * 2 * hd + j)];
        dwant[size_t(r * 3 * Q + 2 * Q + h * hd + j)] = dkv[size_t(r * 2 * Q + h * 2 * hd + hd + j)];
      }
  rope2d_backward_f64(dwant.data(), 3 * Q, L, heads, hd, rows.data(), cols.data());
  rope2d_backward_f64(dwant.data() + Q, 3 * Q, L, heads, hd, rows.data(), cols.data());
  cuda::DeviceBuffer<float> dq_d(dq.data(), dq.size()), dkv_d(dkv.data(), dkv.size());
  vision::cuda::RopeSplitParams b = p;  // the same geometry, the gradients in the split layouts
  b.qkv = dqkv_d.data(), b.q = dq_d.data(), b.kv = dkv_d.data();
  vision::cuda::rope_split_backward(b);
  const std::vector<float> dgot = download(dqkv_d);
  EXPECT_LE(rel_l2(dgot.data(), dwant.data(), dwant.size()), 1e-6);
}

// Both GELUs' fp32 forwards and backwards against the float64 ones, saturated inputs included.
TEST(CudaVisionTrain, GeluForwardsAndBackwardsMatchFloat64) {
  K3_REQUIRE_GPU();
  std::vector<double> x = k3test::randn(4096, 31);
  for (double& v : x) v *= 3.0;
  for (double v : {-40.0, -12.0, -5.0, 0.0, 5.0, 12.0, 40.0}) x.push_back(v);
  const std::vector<float> xf = narrow(x), dy = narrow(k3test::randn(int64_t(x.size()), 32));
  const std::vector<double> xd = widen(xf), dyd = widen(dy);
  const int64_t n = int64_t(x.size());
  cuda::DeviceBuffer<float> x_d(xf.data(), xf.size()), dy_d(dy.data(), dy.size()), y_d(xf.size()), dx_d(xf.size());
  for (const vision::cuda::Gelu form : {vision::cuda::Gelu::kTanh, vision::cuda::Gelu::kErf}) {
    const bool tanh_form = form == vision::cuda::Gelu::kTanh;
    std::vector<double> y(static_cast<size_t>(n)), dx(static_cast<size_t>(n));
    if (tanh_form) {
      gelu_tanh_forward(y.data(), xd.data(), n);
      gelu_tanh_backward(dx.data(), dyd.data(), xd.data(), n);
    } else {
      gelu_erf_forward(y.data(), xd.data(), n);
      gelu_erf_backward(dx.data(), dyd.data(), xd.data(), n);
    }
    vision::cuda::gelu_forward_train(y_d.data(), x_d.data(), n, form);
    vision::cuda::gelu_backward_train(dx_d.data(), dy_d.data(), x_d.data(), n, form);
    const std::vector<float> yg = download(y_d), dxg = download(dx_d);
    EXPECT_LE(rel_l2(yg.data(), y.data(), y.size()), 1e-6) << (tanh_form ? "tanh" : "erf");
    EXPECT_LE(rel_l2(dxg.data(), dx.data(), dx.size()), 1e-6) << (tanh_form ? "tanh" : "erf");
  }
}

// The merge's backward and the position table's transposed resize (a table that ACCUMULATES, frames summed)
// against patch_merge_backward_f64 and position_table_resize_backward_f64: a 2-frame clip resized from a 4 x 6
// table to 8 x 10, and a grid equal to the table.
TEST(CudaVisionTrain, MergeAndPositionBackwardsMatchFloat64) {
  K3_REQUIRE_GPU();
  const int64_t H0 = 4, W0 = 6, D = 8;
  for (const VisionGrid& g : {VisionGrid{2, 8, 10}, VisionGrid{1, 4, 6}}) {
    const int64_t n = g.patches() * D;
    const std::vector<float> dm = narrow(k3test::randn(n / g.t, 41));  // [(h/2)(w/2), 4, D]
    std::vector<double> dx_want(static_cast<size_t>(n));
    patch_merge_backward_f64(dx_want.data(), widen(dm).data(), g.t, g.h, g.w, 2, 2, D);
    cuda::DeviceBuffer<float> dm_d(dm.data(), dm.size()), dx_d(static_cast<size_t>(n));
    vision::cuda::merge_tpool_backward(dx_d.data(), dm_d.data(), g.t, g.h, g.w, D, 2, 2);
    const std::vector<float> dx_got = download(dx_d);
    EXPECT_LE(rel_l2(dx_got.data(), dx_want.data(), dx_want.size()), 1e-7) << "merge, t " << g.t;

    const std::vector<float> dx = narrow(k3test::randn(n, 42)), table0 = narrow(k3test::randn(H0 * W0 * D, 43));
    std::vector<double> dpos(size_t(g.h * g.w * D), 0.0), table_want = widen(table0);
    for (int64_t f = 0; f < g.t; ++f)
      for (int64_t i = 0; i < g.h * g.w * D; ++i) dpos[size_t(i)] += dx[size_t(f * g.h * g.w * D + i)];
    position_table_resize_backward_f64(table_want.data(), dpos.data(), H0, W0, g.h, g.w, D);
    const vision::cuda::TransposedTaps tr = vision::cuda::transposed_taps(g.h, H0), tc = vision::cuda::transposed_taps(g.w, W0);
    cuda::DeviceBuffer<float> dx2_d(dx.data(), dx.size()), table_d(table0.data(), table0.size());
    cuda::DeviceBuffer<int32_t> rs(tr.start.data(), tr.start.size()), ri(tr.index.data(), tr.index.size()),
        cs(tc.start.data(), tc.start.size()), ci(tc.index.data(), tc.index.size());
    cuda::DeviceBuffer<double> rw(tr.weight.data(), tr.weight.size()), cw(tc.weight.data(), tc.weight.size());
    vision::cuda::PositionBackwardParams p;
    p.dtable = table_d.data(), p.dx = dx2_d.data(), p.H0 = H0, p.W0 = W0, p.D = D, p.t = g.t, p.h = g.h, p.w = g.w;
    p.row_start = rs.data(), p.row_index = ri.data(), p.row_weight = rw.data();
    p.col_start = cs.data(), p.col_index = ci.data(), p.col_weight = cw.data();
    vision::cuda::position_embedding_backward(p);
    const std::vector<float> table_got = download(table_d);
    EXPECT_LE(rel_l2(table_got.data(), table_want.data(), table_want.size()), 1e-6) << "position, t " << g.t;
  }
}

// ---- the resize's transposed taps (host) ----

TEST(CudaVisionTrain, TransposedTapsAreTheForwardTapsTransposed) {
  for (const auto& [n_out, n_in] :
       std::vector<std::pair<int64_t, int64_t>>{{4, 4}, {7, 4}, {3, 8}, {1, 5}, {9, 1}, {64, 6}}) {
    std::vector<double> dense(size_t(n_out * n_in), 0.0);  // forward: out i = Σ_s R[i][s] in s
    const std::vector<vision_detail::BilinearTap> taps = vision_detail::bilinear_taps(n_out, n_in);
    for (int64_t i = 0; i < n_out; ++i) {
      const vision_detail::BilinearTap& t = taps[size_t(i)];
      dense[size_t(i * n_in + t.i0)] += 1.0 - t.frac;
      dense[size_t(i * n_in + t.i1)] += t.frac;
    }
    const vision::cuda::TransposedTaps tt = vision::cuda::transposed_taps(n_out, n_in);
    ASSERT_EQ(tt.start.size(), size_t(n_in + 1));
    std::vector<double> back(size_t(n_out * n_in), 0.0);
    for (int64_t s = 0; s < n_in; ++s)
      for (int32_t j = tt.start[size_t(s)]; j < tt.start[size_t(s + 1)]; ++j) {
        if (j > tt.start[size_t(s)]) {
          EXPECT_LT(tt.index[size_t(j - 1)], tt.index[size_t(j)]);  // ascending
        }
        back[size_t(tt.index[size_t(j)] * n_in + s)] += tt.weight[size_t(j)];
      }
    for (size_t i = 0; i < dense.size(); ++i)
      EXPECT_NEAR(back[i], dense[i], 1e-15) << n_out << " from " << n_in << " at " << i;
  }
}

// ---- image-text sequences through the GPU trainer ----

using k3test::TinyVisionModel;
using k3test::tiny_vision;
constexpr int32_t kMediaPad = k3test::kTinyVisionMediaPad;

// ids: `text` with each image's tokens (placeholders) spliced in after position `at` of the text.
train::ImageTextSequence sequence(const VisionConfig& vc, const std::vector<int32_t>& text,
                                  const std::vector<std::pair<int64_t, VisionGrid>>& images, uint64_t seed) {
  train::ImageTextSequence s;
  size_t next = 0;
  for (const auto& [at, g] : images) {
    while (int64_t(next) < at) s.ids.push_back(text[next++]);
    s.image_at.push_back(int64_t(s.ids.size()));
    s.ids.insert(s.ids.end(), size_t((g.h / vc.merge_h) * (g.w / vc.merge_w)), kMediaPad);
    s.grids.push_back(g);
    const std::vector<double> px = k3test::randn(g.patches() * vc.patch_values(), seed++);
    for (double x : px) s.pixel_patches.push_back(std::tanh(x));
  }
  while (next < text.size()) s.ids.push_back(text[next++]);
  return s;
}

bool is_vision_tensor(const std::string& name) {
  return name.rfind("vision_tower.", 0) == 0 || name.rfind("mm_projector.", 0) == 0;
}

std::vector<train::ImageTextSequence> image_text_batch(const VisionConfig& vc) {
  return {sequence(vc, {3840, 17, 29, 55, 66, 77, 88, 99, 101}, {{2, VisionGrid{1, 4, 6}}}, 100),
          sequence(vc, {3840, 12, 13, 14, 15, 16, 2000, 300, 40, 41},
                   {{1, VisionGrid{1, 6, 4}}, {5, VisionGrid{2, 4, 4}}}, 200)};
}

// m.P's float64 gradient of `seqs` (summed losses) into m.P.grads(); returns the loss, counts the targets.
double float64_step(TinyVisionModel& m, const std::vector<train::ImageTextSequence>& seqs, int64_t* targets) {
  m.P.zero_grads();
  double loss = 0;
  for (const train::ImageTextSequence& s : seqs) {
    const train::ImageTextLoss l = train::image_text_loss(m.P, m.c, m.vc, s, true, 1.0);
    loss += l.loss, *targets += l.targets;
  }
  return loss;
}

// A whole gradient laid out as P's grads(), its vision and text tensors apart.
struct SplitGradient {
  std::vector<double> vision, text;
};
SplitGradient split(const train::ParamStore& P, const std::vector<double>& grads) {
  SplitGradient s;
  for (const std::string& n : P.names()) {
    std::vector<double>& to = is_vision_tensor(n) ? s.vision : s.text;
    const auto at = grads.begin() + P.offset(n);
    to.insert(to.end(), at, at + P.numel(n));
  }
  return s;
}

// Relative L2 of `got` from `want`, vision and text apart.
std::pair<double, double> split_error(const SplitGradient& got, const SplitGradient& want) {
  return {rel_l2(got.vision.data(), want.vision.data(), want.vision.size()),
          rel_l2(got.text.data(), want.text.data(), want.text.size())};
}

// How far bf16's rounding of the weights alone moves the float64 gradient of `seqs` from `want` (vision and text
// apart): the largest of `draws` draws of a uniform random relative perturbation of up to 2^-9 on every weight.
// m.P's values are restored after.
std::pair<double, double> bf16_weight_rounding_shift(TinyVisionModel& m,
                                                     const std::vector<train::ImageTextSequence>& seqs,
                                                     const SplitGradient& want, int draws) {
  const std::vector<double> w0 = m.P.values();
  std::pair<double, double> most{0.0, 0.0};
  for (int d = 0; d < draws; ++d) {
    std::mt19937_64 rng(1000 + uint64_t(d));
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    std::vector<double>& w = m.P.values();
    for (size_t i = 0; i < w.size(); ++i) w[i] = w0[i] * (1.0 + std::ldexp(u(rng), -9));
    int64_t targets = 0;
    float64_step(m, seqs, &targets);
    const auto [v, t] = split_error(split(m.P, m.P.grads()), want);
    std::printf("weights perturbed by 2^-9, draw %d: gradient moves vision %.3e, text %.3e\n", d, v, t);
    most = {std::max(most.first, v), std::max(most.second, t)};
  }
  m.P.values() = w0;
  return most;
}

// The GPU step against the float64 one. A whole-gradient bar <= 0 means "2x bf16_weight_rounding_shift".
void check_image_text(GpuPrecision precision, double loss_bar, double vision_tensor_bar, double vision_bar,
                      double text_bar) {
  TinyVisionModel m = tiny_vision(7);
  const std::vector<train::ImageTextSequence> seqs = image_text_batch(m.vc);
  int64_t want_targets = 0;
  const double want_loss = float64_step(m, seqs, &want_targets);
  const train::ParamStore want = m.P;  // the float64 gradient

  auto model = CudaTrainModel::create(m.c, m.P, precision);
  model->zero_grads();
  int64_t targets = 0;
  const double loss = model->image_text_loss(seqs, m.vc, true, 1.0, nullptr, &targets);
  EXPECT_EQ(targets, want_targets);
  std::printf("loss %.10f (float64 %.10f)\n", loss, want_loss);
  EXPECT_LE(std::abs(loss - want_loss), loss_bar * std::abs(want_loss));
  train::ParamStore G = m.P;
  model->download_grads(G);

  int64_t vision_tensors = 0;
  for (const std::string& n : want.names()) {
    const double e = rel_l2(G.g(n), want.g(n), size_t(want.numel(n)));  // GPU against float64
    const bool vision = is_vision_tensor(n);
    vision_tensors += vision;
    std::printf("%-60s rel L2 %.3e\n", n.c_str(), e);
    if (vision && vision_tensor_bar > 0) {
      EXPECT_LE(e, vision_tensor_bar) << n;
    }
  }
  EXPECT_GT(vision_tensors, 10);
  const SplitGradient want_split = split(want, want.grads());
  const auto [ev, et] = split_error(split(G, G.grads()), want_split);
  std::printf("whole gradient: vision %.3e, text %.3e\n", ev, et);
  if (vision_bar <= 0 || text_bar <= 0) {
    const auto [sv, st] = bf16_weight_rounding_shift(m, seqs, want_split, 4);
    if (vision_bar <= 0) vision_bar = 2 * sv;
    if (text_bar <= 0) text_bar = 2 * st;
  }
  EXPECT_LE(ev, vision_bar);
  EXPECT_LE(et, text_bar);
}

TEST(CudaVisionTrain, ImageTextGradientsF32MatchFloat64) {
  K3_REQUIRE_GPU();
  check_image_text(GpuPrecision::F32, 1e-5, 1e-4, 1e-4, 1e-3);
}

TEST(CudaVisionTrain, ImageTextGradientsBf16MatchFloat64) {
  K3_REQUIRE_GPU();
  check_image_text(GpuPrecision::BF16, 1e-2, 0.0, 0.0, 0.0);
}

// Input rows that do not fit their piece, or overlap, are refused by name before anything runs.
TEST(CudaVisionTrain, BadInputRowsAreNamed) {
  K3_REQUIRE_GPU();
  TinyVisionModel m = tiny_vision(8);
  auto model = CudaTrainModel::create(m.c, m.P, GpuPrecision::F32);
  cuda::DeviceBuffer<float> rows(size_t(4 * m.c.hidden_size));
  const std::vector<std::vector<int32_t>> pieces{{1, 2, 3, 4, 5}};
  const auto message = [&](const std::vector<GpuInputRows>& r) {
    try {
      model->loss(pieces, false, 0.0, nullptr, nullptr, &r);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({{0, 3, 4, rows.data(), nullptr}}).find("do not fit"), std::string::npos);
  EXPECT_NE(message({{1, 0, 1, rows.data(), nullptr}}).find("piece 1"), std::string::npos);
  EXPECT_NE(message({{0, 0, 2, rows.data(), nullptr}, {0, 1, 2, rows.data(), nullptr}}).find("overlap at position 1"),
            std::string::npos);
}

}  // namespace
