// Training through the vision tower and projector (src/model/training/vision_train.h, image_text_train.h), float64
// on the CPU:
//   - the float64 forward against Moonshot's reference (tests/fixtures/vision-tiny) and against VisionModel::encode,
//     clips and resized position tables included;
//   - each vision op's backward (kernels/vision/vision_f64.h, the GELUs) against central finite differences;
//   - the tower's and projector's backward, every tensor and the pixels, against finite differences;
//   - the text model's input rows (model_train.h: TrainInputRows): what they replace and their gradient;
//   - the whole chain, a text loss whose image tokens come from the tower, against finite differences;
//   - end to end, image-caption pairs trained with AdamW on k3-tiny-vision: the loss falls, the captions' first
//     tokens (which only the image tells apart) are learnt, every tensor moves, and a rerun is identical.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/safetensors.h"
#include "kernels/ffn/gelu.h"
#include "kernels/loss/cross_entropy.h"
#include "kernels/vision/vision.h"
#include "kernels/vision/vision_f64.h"
#include "model/config.h"
#include "model/params.h"
#include "model/tensor_table.h"
#include "model/training/image_text_train.h"
#include "model/training/model_train.h"
#include "model/training/vision_train.h"
#include "model/vision.h"
#include "model/vision_config.h"
#include "train/optimizer.h"
#include "util/compare.h"
#include "util/error_of.h"
#include "util/finite_diff.h"
#include "util/random.h"
#include "util/tiny_vision_model.h"
#include "util/vision_inputs.h"

using namespace k3;
using namespace k3::train;
using k3test::fixture;
using k3test::rel_l2;
using ::testing::HasSubstr;

namespace {

// ---- the fixture ----

const VisionConfig& fixture_config() {
  static const VisionConfig c = load_vision_config(fixture("vision-tiny"));
  return c;
}

ParamStore fixture_params() { return ParamStore::from_model_dir(fixture("vision-tiny")); }

using Pixels = k3test::VisionPixels;
constexpr auto fixture_pixels = k3test::vision_fixture_pixels;

// ---- finite differences ----

// Central difference of f at every entry of v against the analytic gradient g, at the bar of the float64 ops'
// tests (test_train_ops.cpp).
void expect_fd_all(const std::function<double()>& f, std::vector<double>& v, const std::vector<double>& g,
                   const char* what) {
  ASSERT_EQ(v.size(), g.size()) << what;
  for (size_t i = 0; i < v.size(); ++i) {
    const double num = k3test::central_difference(&v[i], f, 1e-6);
    EXPECT_NEAR(g[i], num, 1e-7 + 1e-6 * std::abs(num)) << what << "[" << i << "]";
  }
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Entries of a tensor to check: `random` drawn ones and the one of largest |gradient| (so that every tensor's
// check includes an entry its loss depends on, whatever the draws).
std::vector<int64_t> sample_entries(const double* grad, int64_t numel, int random, std::mt19937& rng) {
  std::vector<int64_t> out;
  for (int k = 0; k < random; ++k) out.push_back(int64_t(rng() % uint64_t(numel)));
  out.push_back(int64_t(
      std::max_element(grad, grad + numel, [](double a, double b) { return std::abs(a) < std::abs(b); }) - grad));
  return out;
}

}  // namespace

// The forward over the fixture's six items (the table's own grid; grids that resize it up, down and to other
// aspect ratios; clips of 2 and 3 frames) against the reference's float64 outputs. Both are float64, the goldens
// stored as F32, so what is left is that rounding (6e-8 at most, the fixture's README): the bar is 1e-6, tighter
// than the fixture's 1e-4 for a port. Against VisionModel::encode, whose activations are fp32, test_vision's bar.
TEST(TrainVision, ForwardMatchesMoonshotsReferenceAndEncode) {
  const ParamStore P = fixture_params();
  const VisionConfig& c = fixture_config();
  const Pixels px = fixture_pixels();
  ASSERT_EQ(px.grids.size(), 6u);
  const std::vector<double> pixels(px.patches.begin(), px.patches.end());
  const VisionTape t = vision_forward(P, c, pixels.data(), px.L, px.grids);
  const SafeTensors golden = SafeTensors::open(fixture("vision-tiny/golden.safetensors"));
  const std::vector<VisionItem> encoded =
      VisionModel::load(fixture("vision-tiny"))->encode(px.patches.data(), px.L, px.grids);
  ASSERT_EQ(t.items.size(), px.grids.size());
  for (size_t i = 0; i < t.items.size(); ++i) {
    const VisionItemTape& it = t.items[i];
    const std::string n = std::to_string(i);
    ASSERT_EQ(it.tokens, encoded[i].tokens) << "item " << i;
    const std::vector<float> gm = golden.read_f32("merged." + n, {it.tokens, 4, 32});
    const std::vector<float> gp = golden.read_f32("projected." + n, {it.tokens, 40});
    const double em = rel_l2(it.merged, gm), ep = rel_l2(it.projected, gp);
    std::printf("item %zu (t %lld, h %lld, w %lld): vs reference merged %.2e projected %.2e\n", i, (long long)it.grid.t,
                (long long)it.grid.h, (long long)it.grid.w, em, ep);
    EXPECT_LE(em, 1e-6) << "merged." << i;
    EXPECT_LE(ep, 1e-6) << "projected." << i;
    EXPECT_LE(rel_l2(it.merged, encoded[i].merged), 1e-5) << "item " << i;
    EXPECT_LE(rel_l2(it.projected, encoded[i].projected), 1e-5) << "item " << i;
  }
  // The tower's states the tape keeps: each block's input and the final norm's.
  const std::vector<std::pair<const char*, const std::vector<double>*>> states = {{"embed", &t.blocks[0].x},
                                                                                  {"block.0", &t.blocks[1].x},
                                                                                  {"block.1", &t.final_in}};
  for (const auto& [name, x] : states) {
    const double e = rel_l2(*x, golden.read_f32(name, {px.L, 32}));
    std::printf("%-8s vs reference %.2e\n", name, e);
    EXPECT_LE(e, 1e-6) << name;
  }
}

// ---- each op ----

TEST(TrainVisionOps, PositionTableResizeTransposeMatchesFiniteDifferences) {
  const int64_t H0 = 3, W0 = 4, D = 2;
  std::mt19937 rng(1);
  // More rows and fewer columns than the table; the table's own size (a copy); fewer of both.
  for (const auto& [h, w] : {std::pair<int64_t, int64_t>{5, 2}, {3, 4}, {2, 2}}) {
    std::vector<double> table = k3test::randn(H0 * W0 * D, 10 + h), R = k3test::randn(h * w * D, 20 + h);
    auto loss = [&] {
      std::vector<double> y(size_t(h * w * D));
      position_table_resize_f64(y.data(), table.data(), H0, W0, h, w, D);
      return dot(y, R);
    };
    std::vector<double> dtable(table.size(), 0.5);  // accumulates: starts from a value that is not 0
    position_table_resize_backward_f64(dtable.data(), R.data(), H0, W0, h, w, D);
    for (double& g : dtable) g -= 0.5;
    const std::string what = "dtable " + std::to_string(h) + "x" + std::to_string(w);
    expect_fd_all(loss, table, dtable, what.c_str());
    // The forward is the fp32 kernel's function.
    std::vector<float> tf(table.begin(), table.end()), yf(size_t(h * w * D));
    position_table_resize(yf.data(), tf.data(), H0, W0, h, w, D);
    std::vector<double> y(size_t(h * w * D));
    position_table_resize_f64(y.data(), table.data(), H0, W0, h, w, D);
    for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(yf[i], y[i], 1e-6 * (1 + std::abs(y[i]))) << what;
  }
}

TEST(TrainVisionOps, Rope2dBackwardMatchesFiniteDifferencesAndForwardMatchesKernel) {
  const int64_t n = 3, heads = 2, hd = 8, ld = heads * hd + 3;  // rows wider than the heads: strided
  const std::vector<int32_t> rows = {0, 1, 5}, cols = {2, 0, 7};
  std::vector<double> x = k3test::randn(n * ld, 2), R = k3test::randn(n * ld, 3);
  auto loss = [&] {
    std::vector<double> y = x;
    rope2d_forward_f64(y.data(), ld, n, heads, hd, rows.data(), cols.data());
    return dot(y, R);
  };
  std::vector<double> dx = R;  // columns past the heads pass through both ways, untouched
  rope2d_backward_f64(dx.data(), ld, n, heads, hd, rows.data(), cols.data());
  expect_fd_all(loss, x, dx, "dx");
  std::vector<float> xf(x.begin(), x.end());
  rope2d_forward(xf.data(), ld, n, heads, hd, rows.data(), cols.data());
  std::vector<double> y = x;
  rope2d_forward_f64(y.data(), ld, n, heads, hd, rows.data(), cols.data());
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(xf[i], y[i], 1e-6 * (1 + std::abs(y[i])));
}

TEST(TrainVisionOps, AttentionBackwardMatchesFiniteDifferencesAndForwardMatchesKernel) {
  const int64_t n = 5, heads = 2, hd = 4, Q = heads * hd, ld = 3 * Q;  // q | k | v per row, as the tower packs them
  std::vector<double> qkv = k3test::randn(n * ld, 4), R = k3test::randn(n * Q, 5);
  auto forward = [&](std::vector<double>& o, std::vector<double>& lse) {
    o.resize(size_t(n * Q));
    lse.resize(size_t(heads * n));
    attention_bidirectional_forward_f64(o.data(), lse.data(), qkv.data(), qkv.data() + Q, qkv.data() + 2 * Q, ld, n,
                                        heads, hd);
  };
  auto loss = [&] {
    std::vector<double> o, lse;
    forward(o, lse);
    return dot(o, R);
  };
  std::vector<double> o, lse, dqkv(size_t(n * ld));
  forward(o, lse);
  attention_bidirectional_backward_f64(dqkv.data(), dqkv.data() + Q, dqkv.data() + 2 * Q, ld, R.data(), qkv.data(),
                                       qkv.data() + Q, qkv.data() + 2 * Q, ld, o.data(), lse.data(), n, heads, hd);
  expect_fd_all(loss, qkv, dqkv, "dqkv");
  std::vector<float> qf(qkv.begin(), qkv.end()), of(size_t(n * Q));
  attention_bidirectional(of.data(), qf.data(), qf.data() + Q, qf.data() + 2 * Q, ld, n, heads, hd);
  for (size_t i = 0; i < o.size(); ++i) EXPECT_NEAR(of[i], o[i], 1e-6 * (1 + std::abs(o[i])));
}

TEST(TrainVisionOps, GeluBackwardsMatchFiniteDifferencesAndForwardsMatchKernels) {
  std::vector<double> x = k3test::randn(40, 6);
  for (double& v : x) v = double(float(2.5 * v));  // both tails and the middle; fp32 values, as the kernels take
  const std::vector<double> R = k3test::randn(40, 7);
  struct Form {
    const char* name;
    void (*forward)(double*, const double*, int64_t);
    void (*backward)(double*, const double*, const double*, int64_t);
    void (*forward32)(float*, int64_t);
  };
  for (const Form& f : {Form{"tanh", gelu_tanh_forward, gelu_tanh_backward, gelu_tanh_forward},
                        Form{"erf", gelu_erf_forward, gelu_erf_backward, gelu_erf_forward}}) {
    auto loss = [&] {
      std::vector<double> y(x.size());
      f.forward(y.data(), x.data(), int64_t(x.size()));
      return dot(y, R);
    };
    std::vector<double> dx(x.size());
    f.backward(dx.data(), R.data(), x.data(), int64_t(x.size()));
    expect_fd_all(loss, x, dx, f.name);
    std::vector<double> y(x.size());
    f.forward(y.data(), x.data(), int64_t(x.size()));
    std::vector<float> yf(x.begin(), x.end());
    f.forward32(yf.data(), int64_t(yf.size()));
    for (size_t i = 0; i < y.size(); ++i) EXPECT_EQ(yf[i], float(y[i])) << f.name << "[" << i << "]";
  }
}

TEST(TrainVisionOps, MergeBackwardMatchesFiniteDifferences) {
  const int64_t t = 2, h = 4, w = 6, mh = 2, mw = 3, D = 2, tokens = (h / mh) * (w / mw);
  std::vector<double> x = k3test::randn(t * h * w * D, 8), R = k3test::randn(tokens * mh * mw * D, 9);
  auto loss = [&] {
    std::vector<double> m(R.size());
    patch_merge_forward_f64(m.data(), x.data(), t, h, w, mh, mw, D);
    return dot(m, R);
  };
  std::vector<double> dx(x.size(), 7.0);  // OVERWRITTEN, every entry
  patch_merge_backward_f64(dx.data(), R.data(), t, h, w, mh, mw, D);
  expect_fd_all(loss, x, dx, "dx");
  // Token 1 (row 0, columns 3..5) slot 4 (its second row, middle column) is patch (1, 4), averaged over frames.
  std::vector<double> m(R.size());
  patch_merge_forward_f64(m.data(), x.data(), t, h, w, mh, mw, D);
  EXPECT_DOUBLE_EQ(m[size_t((1 * mh * mw + 4) * D)],
                   0.5 * (x[size_t((1 * w + 4) * D)] + x[size_t(((h + 1) * w + 4) * D)]));
}

// ---- the tower and projector ----

// loss = Σ_items <R_i, projected_i> + Σ merged_i over three items: a resized non-square grid, the table's own
// grid, and a clip of two frames on a grid with more rows and fewer columns than the table. Every vision tensor
// (three drawn entries and its largest gradient each) and the pixels against central differences.
TEST(TrainVision, EveryTensorAndThePixelsMatchFiniteDifferences) {
  ParamStore P = fixture_params();
  const VisionConfig& c = fixture_config();
  const std::vector<VisionGrid> grids = {{1, 2, 4}, {1, 4, 6}, {2, 6, 4}};
  int64_t L = 0;
  for (const VisionGrid& g : grids) L += g.patches();
  std::vector<double> pixels = k3test::randn(L * c.patch_values(), 11);
  std::vector<std::vector<double>> R;
  for (size_t i = 0; i < grids.size(); ++i)
    R.push_back(k3test::randn((grids[i].h / 2) * (grids[i].w / 2) * c.text_hidden_size, 12 + i));
  auto loss = [&] {
    const VisionTape t = vision_forward(P, c, pixels.data(), L, grids);
    double s = 0;
    for (size_t i = 0; i < t.items.size(); ++i) {
      s += dot(t.items[i].projected, R[i]);
      for (double v : t.items[i].merged) s += v;
    }
    return s;
  };
  P.zero_grads();
  const VisionTape t = vision_forward(P, c, pixels.data(), L, grids);
  std::vector<std::vector<double>> ones;
  VisionOutputGrads d;
  for (size_t i = 0; i < t.items.size(); ++i) {
    ones.emplace_back(t.items[i].merged.size(), 1.0);
    d.projected.push_back(R[i].data());
    d.merged.push_back(ones.back().data());
  }
  std::vector<double> dpixels(pixels.size());
  vision_backward(P, c, t, d, dpixels.data());

  std::mt19937 rng(13);
  // The loss sums every merged value and every projected row against R: its rounding error over 2 eps, which
  // moves with the summation order (the thread count), is what a central difference at eps = 1e-6 got wrong on
  // two threads (2.5e-7 against a bar of 1.8e-7 on one entry, right on one thread). At 1e-5 it is ten times
  // smaller, and the truncation error (eps^2 f''' / 6) stays far below the bar.
  const double eps = 1e-5;
  int checked = 0;
  for (const VisionTensorEntry& e : vision_tensor_table(c)) {
    const double* grad = P.g(e.name);
    double norm = 0;
    for (int64_t i = 0; i < e.numel(); ++i) norm += grad[i] * grad[i];
    EXPECT_GT(norm, 0.0) << e.name << " got no gradient";
    for (int64_t i : sample_entries(grad, e.numel(), 3, rng)) {
      const double num = k3test::central_difference(P.p_mut(e.name) + i, loss, eps);
      EXPECT_NEAR(grad[i], num, 1e-7 + 1e-6 * std::abs(num)) << e.name << "[" << i << "]";
      ++checked;
    }
  }
  for (int64_t i : sample_entries(dpixels.data(), int64_t(dpixels.size()), 6, rng)) {
    const double num = k3test::central_difference(&pixels[size_t(i)], loss, eps);
    EXPECT_NEAR(dpixels[size_t(i)], num, 1e-7 + 1e-6 * std::abs(num)) << "pixel_patches[" << i << "]";
    ++checked;
  }
  EXPECT_EQ(checked, int(vision_tensor_table(c).size()) * 4 + 7);
}

// The backward accumulates into the store: two backwards of one forward give twice one backward's gradients.
TEST(TrainVision, BackwardAccumulatesParameterGradients) {
  ParamStore P = fixture_params();
  const VisionConfig& c = fixture_config();
  const std::vector<VisionGrid> grids = {{2, 2, 2}};
  const std::vector<double> pixels = k3test::randn(8 * c.patch_values(), 14);
  const std::vector<double> R = k3test::randn(c.text_hidden_size, 15);
  const VisionTape t = vision_forward(P, c, pixels.data(), 8, grids);
  VisionOutputGrads d;
  d.projected = {R.data()};
  P.zero_grads();
  vision_backward(P, c, t, d);
  const std::vector<double> once = P.grads();
  vision_backward(P, c, t, d);
  // Twice, up to the rounding of adding to a sum that is not zero (a norm gain's sum over rows, the table's).
  for (size_t i = 0; i < once.size(); ++i)
    ASSERT_NEAR(P.grads()[i], 2 * once[i], 1e-14 + 1e-13 * std::abs(once[i])) << i;
  d.merged = {nullptr, nullptr};
  EXPECT_THAT(k3test::error_of([&] { vision_backward(P, c, t, d); }),
              HasSubstr("output gradients for 2 items, and the forward had 1"));
}

TEST(TrainVision, MissingOrMisshapenTensorsAndBadGridsAreNamed) {
  const VisionConfig& c = fixture_config();
  const std::vector<double> pixels(size_t(4 * c.patch_values()), 0.0);
  ParamStore empty;
  EXPECT_THAT(k3test::error_of([&] {
                vision_forward(empty, c, pixels.data(), 4, {{1, 2, 2}});
              }),
              HasSubstr("parameter 'vision_tower.patch_embed.proj.weight' is missing"));
  ParamStore P = fixture_params();
  EXPECT_THAT(k3test::error_of([&] {
                vision_forward(P, c, pixels.data(), 4, {{1, 2, 4}});
              }),
              HasSubstr("grid_thws describe 8 patches, but there are 4"));
  VisionConfig wider = c;
  wider.pos_emb_width = 7;
  EXPECT_THAT(k3test::error_of([&] {
                vision_forward(P, wider, pixels.data(), 4, {{1, 2, 2}});
              }),
              HasSubstr("'vision_tower.patch_embed.pos_emb.weight' has shape [4, 6, 32], expected [4, 7, 32]"));
}

// ---- the text model's input rows ----

namespace {

const K3Config& tiny_a() {
  static const K3Config c = load_config(fixture("k3-tiny-a/config.json"));
  return c;
}

}  // namespace

// Rows equal to the token table's rows of their ids give the ids' logits; other rows change them and get the
// gradient of the loss, which counts only the positions whose next input is a token.
TEST(TrainVision, InputRowsReplaceEmbeddingsAndGetTheirGradient) {
  ParamStore P = ParamStore::from_model_dir(fixture("k3-tiny-a"));
  const K3Config& c = tiny_a();
  const int64_t D = c.hidden_size, V = c.vocab_size;
  const std::vector<int32_t> ids = {5, 900, 17, 250, 3, 77, 640};
  const std::string embed = tensor_name(TensorNaming::Release, TensorKind::TokenEmbd);
  std::vector<double> table_rows(size_t(2 * D));
  std::copy_n(P.p(embed) + 17 * D, D, table_rows.begin());
  std::copy_n(P.p(embed) + 250 * D, D, table_rows.begin() + D);
  std::vector<double> plain, replaced;
  sequence_loss(P, c, ids, false, 0.0, &plain);
  sequence_loss(P, c, ids, {{2, 2, table_rows.data()}}, false, 0.0, &replaced);
  EXPECT_EQ(plain, replaced);

  std::vector<double> rows = k3test::randn(2 * D, 16);
  std::vector<double> drows(rows.size(), 3.0);  // OVERWRITTEN
  P.zero_grads();
  std::vector<double> logits;
  const double loss = sequence_loss(P, c, ids, {{2, 2, rows.data(), drows.data()}}, true, 0.5, &logits);
  EXPECT_NE(logits, plain);
  // The targets: positions 0, 3, 4, 5 (positions 1 and 2 come before an input row).
  EXPECT_EQ(target_count(7, {{2, 2, rows.data()}}), 4);
  std::vector<int32_t> target = {ids[1], -1, -1, ids[4], ids[5], ids[6], -1};
  EXPECT_NEAR(loss, cross_entropy(logits.data(), target.data(), 7, V, nullptr, 1.0), 1e-12 * loss);
  // Ids 17 and 250 are only at the replaced positions: their table rows get nothing.
  for (int64_t j = 0; j < D; ++j) {
    ASSERT_EQ(P.g(embed)[17 * D + j], 0.0);
    ASSERT_EQ(P.g(embed)[250 * D + j], 0.0);
  }
  std::mt19937 rng(17);
  for (int64_t i : sample_entries(drows.data(), int64_t(drows.size()), 6, rng)) {
    const double num = 0.5 * k3test::central_difference(&rows[size_t(i)], [&] {
                         return sequence_loss(P, c, ids, {{2, 2, rows.data()}}, false, 0.0);
                       });
    EXPECT_NEAR(drows[size_t(i)], num, 1e-6 + 1e-4 * std::abs(num)) << "rows[" << i << "]";
  }
  EXPECT_THAT(k3test::error_of([&] {
                sequence_loss(P, c, ids, {{5, 3, rows.data()}}, false, 0.0);
              }),
              HasSubstr("input rows [5, 8) of a sequence of 7 tokens"));
  EXPECT_THAT(k3test::error_of([&] {
                sequence_loss(P, c, ids, {{1, 2, rows.data()}, {2, 1, rows.data()}}, false, 0.0);
              }),
              HasSubstr("input rows overlap at position 2"));
}

// ---- text with images ----

namespace {

using k3test::TinyVisionModel;
using k3test::tiny_vision;
constexpr int32_t kMediaPad = k3test::kTinyVisionMediaPad;

// prompt, the image's tokens as placeholders, then the caption.
ImageTextSequence image_caption(const std::vector<int32_t>& prompt, const VisionGrid& g, std::vector<double> pixels,
                                const std::vector<int32_t>& caption) {
  ImageTextSequence s;
  s.ids = prompt;
  s.image_at = {int64_t(prompt.size())};
  s.ids.insert(s.ids.end(), size_t((g.h / 2) * (g.w / 2)), kMediaPad);
  s.ids.insert(s.ids.end(), caption.begin(), caption.end());
  s.pixel_patches = std::move(pixels);
  s.grids = {g};
  return s;
}

}  // namespace

// The text loss of a sequence whose placeholder positions take the projected rows of an image, through the whole
// text model and the tower: entries of vision tensors, of the token table and of a text layer against central
// differences.
TEST(TrainVision, TextLossGradientReachesTheTowerThroughTheImageTokens) {
  TinyVisionModel m = tiny_vision(3);
  const VisionGrid g{1, 4, 4};
  const ImageTextSequence s =
      image_caption({3840, 17, 29}, g, k3test::randn(16 * m.vc.patch_values(), 18), {55, 66, 77, 88, 99});
  m.P.zero_grads();
  const ImageTextLoss l = image_text_loss(m.P, m.c, m.vc, s, true, 1.0);
  EXPECT_EQ(l.targets, int64_t(s.ids.size()) - 1 - 4);
  const auto loss = [&] { return image_text_loss(m.P, m.c, m.vc, s, false, 0.0).loss; };
  // The placeholder's table row is never read, so it gets no gradient.
  const std::string embed = tensor_name(TensorNaming::Release, TensorKind::TokenEmbd);
  for (int64_t j = 0; j < m.c.hidden_size; ++j) ASSERT_EQ(m.P.g(embed)[kMediaPad * m.c.hidden_size + j], 0.0);

  using K = VisionTensorKind;
  std::vector<std::string> names;
  for (auto [k, b] : std::vector<std::pair<K, int64_t>>{{K::PatchEmbed, -1},
                                                        {K::PosEmb, -1},
                                                        {K::Wqkv, 0},
                                                        {K::Norm0, 1},
                                                        {K::Fc1, 1},
                                                        {K::FinalNorm, -1},
                                                        {K::Proj0, -1},
                                                        {K::Proj2, -1},
                                                        {K::PostNorm, -1}})
    names.push_back(vision_tensor_name(k, b));
  names.push_back(embed);
  names.push_back(tensor_name(TensorNaming::Release, TensorKind::InputNorm, 1));
  names.push_back(tensor_name(TensorNaming::Release, TensorKind::KdaQ, 1));
  std::mt19937 rng(19);
  for (const std::string& n : names) {
    const double* grad = m.P.g(n);
    for (int64_t i : sample_entries(grad, m.P.numel(n), 1, rng)) {
      const double num = k3test::central_difference(m.P.p_mut(n) + i, loss);
      std::printf("%-50s [%6lld] analytic %+.6e  numeric %+.6e\n", n.c_str(), (long long)i, grad[i], num);
      EXPECT_NEAR(grad[i], num, 1e-6 + 1e-4 * std::abs(num)) << n << "[" << i << "]";
    }
  }
}

namespace {

bool is_vision_tensor(const std::string& name) {
  return name.rfind("vision_tower.", 0) == 0 || name.rfind("mm_projector.", 0) == 0;
}

// One run of image-caption training: `steps` AdamW steps over all pairs (mean loss over their targets), every
// parameter but the router's selection bias trained, or with `tower_only` the vision tensors alone. Returns the
// mean loss before each step.
std::vector<double> train_pairs(ParamStore& P, const TinyVisionModel& m, const std::vector<ImageTextSequence>& pairs,
                                int steps, double lr, bool tower_only = false) {
  OptimizerConfig oc;
  oc.weight_decay = 0.0;
  const ParamGroupRule adamw = [&](const std::string& n, const std::vector<int64_t>& shape) {
    const ParamGroup g = default_param_group(n, shape);
    return g == ParamGroup::Frozen || (tower_only && !is_vision_tensor(n)) ? ParamGroup::Frozen : ParamGroup::AdamW;
  };
  Optimizer opt(P, oc, {}, adamw);
  int64_t targets = 0;
  for (const ImageTextSequence& s : pairs) targets += image_text_loss(P, m.c, m.vc, s, false, 0.0).targets;
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    P.zero_grads();
    double loss = 0;
    for (const ImageTextSequence& s : pairs) loss += image_text_loss(P, m.c, m.vc, s, true, 1.0 / targets).loss;
    losses.push_back(loss / targets);
    opt.step(P, lr);
  }
  return losses;
}

// The cross-entropy of each pair's first caption token: the prompts are equal, so only the image tells them apart.
std::vector<double> first_caption_token_losses(ParamStore& P, const TinyVisionModel& m,
                                               const std::vector<ImageTextSequence>& pairs) {
  std::vector<double> out;
  for (const ImageTextSequence& s : pairs) {
    const VisionTape t =
        vision_forward(P, m.vc, s.pixel_patches.data(), int64_t(s.pixel_patches.size()) / m.vc.patch_values(), s.grids);
    const int64_t last_image = s.image_at[0] + t.items[0].tokens - 1;
    std::vector<double> logits;
    sequence_loss(P, m.c, s.ids, {{s.image_at[0], t.items[0].tokens, t.items[0].projected.data()}}, false, 0.0,
                  &logits);
    const int32_t want = s.ids[size_t(last_image + 1)];
    out.push_back(cross_entropy(logits.data() + last_image * m.c.vocab_size, &want, 1, m.c.vocab_size, nullptr, 1.0));
  }
  return out;
}

}  // namespace

// End to end: three (image, caption) pairs with one prompt, k3-tiny-vision from `k3 init`, AdamW on every
// parameter, text and vision. The loss falls far below its start; each caption's first token, which only its image
// can tell, is learnt (its loss below ln 3 / 4: a model that ignored the image could do no better than ln 3 on
// average); every vision tensor moved; and a second run from the same start gives the same losses, bit for bit.
TEST(TrainVision, ImageCaptionPairsTrainTogetherWithTheTextModel) {
  const TinyVisionModel m = tiny_vision(1);
  const VisionGrid g{1, 4, 4};
  std::vector<ImageTextSequence> pairs;
  const std::vector<std::vector<int32_t>> captions = {{101, 202, 303, 404, 505, 606},
                                                      {707, 808, 909, 1001, 1102, 1203},
                                                      {1304, 1405, 1506, 1607, 1708, 1809}};
  for (size_t i = 0; i < captions.size(); ++i)
    pairs.push_back(image_caption({3840, 17, 29}, g, k3test::randn(16 * m.vc.patch_values(), 30 + i), captions[i]));

  ParamStore P = m.P;
  const int steps = 30;
  const std::vector<double> losses = train_pairs(P, m, pairs, steps, 3e-3);
  const std::vector<double> first = first_caption_token_losses(P, m, pairs);
  std::printf("loss %.4f -> %.4f over %d steps; first caption tokens %.4f %.4f %.4f\n", losses.front(), losses.back(),
              steps, first[0], first[1], first[2]);
  EXPECT_GT(losses.front(), 7.0);  // ~ln 4096 = 8.3: a random model
  EXPECT_LT(losses.back(), 0.1 * losses.front());
  for (size_t i = 0; i < first.size(); ++i) EXPECT_LT(first[i], std::log(3.0) / 4) << "pair " << i;
  for (const VisionTensorEntry& e : vision_tensor_table(m.vc)) {
    double moved = 0;
    for (int64_t i = 0; i < e.numel(); ++i) moved = std::max(moved, std::abs(P.p(e.name)[i] - m.P.p(e.name)[i]));
    EXPECT_GT(moved, 1e-4) << e.name << " did not train";
  }
  ParamStore again = m.P;
  EXPECT_EQ(train_pairs(again, m, pairs, steps, 3e-3), losses);

  // The gradient that reaches the tower through the image tokens trains it on its own: with the text model frozen,
  // ten steps of the tower and projector alone lower each first caption token's loss by more than a nat (1.3 to
  // 1.6 measured). They cannot take it near 0: a random text model's lm_head (entries ~0.02) bounds the logit
  // margins any input row can produce.
  ParamStore tower = m.P;
  const std::vector<double> before = first_caption_token_losses(tower, m, pairs);
  train_pairs(tower, m, pairs, 10, 1e-2, /*tower_only=*/true);
  const std::vector<double> after = first_caption_token_losses(tower, m, pairs);
  std::printf("tower alone: first caption tokens %.4f %.4f %.4f -> %.4f %.4f %.4f\n", before[0], before[1], before[2],
              after[0], after[1], after[2]);
  for (size_t i = 0; i < after.size(); ++i) EXPECT_LT(after[i], before[i] - 1.0) << "pair " << i;
  for (const std::string& n : tower.names()) {
    if (is_vision_tensor(n)) continue;
    ASSERT_TRUE(std::equal(tower.p(n), tower.p(n) + tower.numel(n), m.P.p(n))) << n << " moved";
  }
}
