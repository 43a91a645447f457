#include "model/vision.h"

#include <filesystem>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/ffn/gelu.h"
#include "kernels/norm/norm.h"
#include "kernels/vision/vision.h"
#include "model/tensor_table.h"
#include "model/weights.h"

namespace k3 {

std::unique_ptr<VisionModel> VisionModel::load(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    fail(dir, ": not a model directory (expected config.json with a vision_config, and safetensors)");
  const VisionConfig c = load_vision_config(dir);
  return std::make_unique<VisionModel>(c, SafeTensors::open(dir));
}

VisionModel::VisionModel(const VisionConfig& c, SafeTensors st) : c_(c), st_(std::move(st)) {
  check_vision_biases(c_, c_.source);
  // Names and shapes from the vision tensor table (tensor_table.h), which k3 init writes from too.
  using K = VisionTensorKind;
  const std::string& src = c_.source;
  const auto matrix = [&](K k, int64_t b = -1) {
    return matrix_weight(st_, vision_tensor_name(k, b), vision_tensor_shape(c_, k), src);
  };
  const auto vec = [&](K k, int64_t b = -1) {
    return st_.read_f32(vision_tensor_name(k, b), vision_tensor_shape(c_, k));
  };
  patch_embed_ = matrix(K::PatchEmbed);
  pos_table_ = vec(K::PosEmb);
  for (int64_t b = 0; b < c_.num_layers; ++b) {
    Block k;
    k.norm0 = vec(K::Norm0, b);
    k.norm1 = vec(K::Norm1, b);
    k.wqkv = matrix(K::Wqkv, b);
    k.wo = matrix(K::Wo, b);
    k.fc0 = matrix(K::Fc0, b);
    k.fc1 = matrix(K::Fc1, b);
    blocks_.push_back(std::move(k));
  }
  final_norm_ = vec(K::FinalNorm);
  proj0_ = matrix(K::Proj0);
  proj2_ = matrix(K::Proj2);
  post_norm_ = vec(K::PostNorm);
}

void check_vision_grids(const VisionConfig& c, const std::vector<VisionGrid>& grids, int64_t patches) {
  K3_CHECK(!grids.empty(), "vision: no items (grid_thws is empty)");
  int64_t total = 0;
  for (size_t i = 0; i < grids.size(); ++i) {
    const VisionGrid& g = grids[i];
    K3_CHECK(g.t >= 1 && g.t <= c.pos_emb_time, "vision: item ", i, " has t = ", g.t, " frames; the tower takes 1..",
             c.pos_emb_time, " (init_pos_emb_time)");
    for (auto [side, n, m] : {std::tuple{"h", g.h, c.merge_h}, std::tuple{"w", g.w, c.merge_w}})
      K3_CHECK(n >= m && n <= VisionEncoder::kMaxGridSide && n % m == 0, "vision: item ", i, " has ", side, " = ", n,
               " patches; it must be a multiple of the merge kernel's ", m, " in [", m, ", ", VisionEncoder::kMaxGridSide,
               "]");
    total += g.patches();
  }
  K3_CHECK(total == patches, "vision: grid_thws describe ", total, " patches, but there are ", patches);
}

void VisionEncoder::check_grids(const std::vector<VisionGrid>& grids, int64_t patches) const {
  check_vision_grids(config(), grids, patches);
}

std::vector<VisionItem> VisionModel::encode(const float* pixel_patches, int64_t L, const std::vector<VisionGrid>& grids,
                                            const VisionTrace& trace) const {
  check_grids(grids, L);
  const int64_t D = c_.hidden_size, Q = c_.qkv_hidden_size, I = c_.intermediate_size, hd = c_.head_dim();
  const int64_t heads = c_.num_heads;
  const auto bf16 = [this](std::vector<float>& v) {  // the bf16 twin's roundings (set_bf16_activations)
    if (bf16_) round_to_bf16(v.data(), int64_t(v.size()));
  };
  std::vector<float> pixels16;  // the twin's bf16 pixels
  if (bf16_) {
    pixels16.assign(pixel_patches, pixel_patches + L * c_.patch_values());
    bf16(pixels16);
    pixel_patches = pixels16.data();
  }

  // Patch embedding, position embedding (and each frame's time embedding), and every patch's row and column.
  std::vector<float> x(size_t(L * D));
  linear_forward(x.data(), pixel_patches, L, patch_embed_);
  std::vector<int32_t> rows(static_cast<size_t>(L)), cols(static_cast<size_t>(L));
  {
    int64_t off = 0;
    for (const VisionGrid& g : grids) {
      std::vector<float> pos(size_t(g.h * g.w * D)), time(size_t(g.t * D));
      position_table_resize(pos.data(), pos_table_.data(), c_.pos_emb_height, c_.pos_emb_width, g.h, g.w, D);
      if (g.t > 1) frame_time_embedding(time.data(), g.t, D);
      for (int64_t f = 0; f < g.t; ++f)
        for (int64_t p = 0; p < g.h * g.w; ++p) {
          const int64_t r = off + f * g.h * g.w + p;
          float* xr = x.data() + r * D;
          for (int64_t d = 0; d < D; ++d)
            xr[d] = float(double(xr[d]) + double(pos[size_t(p * D + d)]) +
                          (g.t > 1 ? double(time[size_t(f * D + d)]) : 0.0));
          rows[size_t(r)] = int32_t(p / g.w);
          cols[size_t(r)] = int32_t(p % g.w);
        }
      off += g.patches();
    }
  }
  if (trace) trace("embed", x.data(), L, D);

  std::vector<float> y(size_t(L * D)), qkv(size_t(L * 3 * Q)), o(size_t(L * Q)), h(size_t(L * I));
  for (size_t b = 0; b < blocks_.size(); ++b) {
    const Block& k = blocks_[b];
    rmsnorm_forward(y.data(), x.data(), k.norm0.data(), kTowerNormEps, L, D);
    bf16(y);
    linear_forward(qkv.data(), y.data(), L, k.wqkv);
    rope2d_forward(qkv.data(), 3 * Q, L, heads, hd, rows.data(), cols.data());      // q
    rope2d_forward(qkv.data() + Q, 3 * Q, L, heads, hd, rows.data(), cols.data());  // k
    bf16(qkv);
    int64_t off = 0;
    for (const VisionGrid& g : grids) {
      const float* base = qkv.data() + off * 3 * Q;
      attention_bidirectional(o.data() + off * Q, base, base + Q, base + 2 * Q, 3 * Q, g.patches(), heads, hd);
      off += g.patches();
    }
    bf16(o);
    linear_forward(x.data(), D, o.data(), Q, L, k.wo, /*accumulate=*/true);
    rmsnorm_forward(y.data(), x.data(), k.norm1.data(), kTowerNormEps, L, D);
    bf16(y);
    linear_forward(h.data(), y.data(), L, k.fc0);
    gelu_tanh_forward(h.data(), L * I);
    bf16(h);
    linear_forward(x.data(), D, h.data(), I, L, k.fc1, /*accumulate=*/true);
    if (trace) trace("block." + std::to_string(b), x.data(), L, D);
  }
  rmsnorm_forward(x.data(), x.data(), final_norm_.data(), kTowerNormEps, L, D);
  if (trace) trace("final", x.data(), L, D);

  // sd2_tpool: each merge_h x merge_w neighbourhood's patches side by side (row-major within it), averaged over
  // the frames; then the projector.
  std::vector<VisionItem> out;
  const int64_t K = c_.merge_h * c_.merge_w, M = c_.merged_width(), H = c_.text_hidden_size;
  int64_t off = 0;
  for (const VisionGrid& g : grids) {
    VisionItem it;
    const int64_t th = g.h / c_.merge_h, tw = g.w / c_.merge_w;
    it.tokens = th * tw;
    it.merged.assign(size_t(it.tokens * M), 0.0f);
    for (int64_t tok = 0; tok < it.tokens; ++tok)
      for (int64_t kk = 0; kk < K; ++kk) {
        const int64_t r = (tok / tw) * c_.merge_h + kk / c_.merge_w, cc = (tok % tw) * c_.merge_w + kk % c_.merge_w;
        float* dst = it.merged.data() + (tok * K + kk) * D;
        for (int64_t d = 0; d < D; ++d) {
          double s = 0.0;
          for (int64_t f = 0; f < g.t; ++f) s += x[size_t((off + (f * g.h + r) * g.w + cc) * D + d)];
          dst[d] = float(s / double(g.t));
        }
      }
    std::vector<float> mid(size_t(it.tokens * M));
    std::vector<float> merged16;  // the twin's bf16 copy of the projector's input
    if (bf16_) {
      merged16 = it.merged;
      bf16(merged16);
    }
    linear_forward(mid.data(), bf16_ ? merged16.data() : it.merged.data(), it.tokens, proj0_);
    gelu_erf_forward(mid.data(), it.tokens * M);
    bf16(mid);
    it.projected.assign(size_t(it.tokens * H), 0.0f);
    linear_forward(it.projected.data(), mid.data(), it.tokens, proj2_);
    rmsnorm_forward(it.projected.data(), it.projected.data(), post_norm_.data(), float(c_.projector_eps), it.tokens, H);
    out.push_back(std::move(it));
    off += g.patches();
  }
  return out;
}

}  // namespace k3
