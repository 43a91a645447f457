// The vision tower and projector on the GPU (vision_cuda.h): loading, scratch, and the forward, step for step
// model/vision.cpp's encode with the GPU's kernels.
#ifdef K3_HAVE_CUDA
#include "model/cuda/vision_cuda.h"

#include <algorithm>
#include <filesystem>
#include <mutex>

#include "core/cuda.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/gemm/convert_cuda.h"
#include "kernels/gemm/linear_cuda.h"
#include "kernels/norm/norm_cuda.h"
#include "kernels/vision/vision.h"
#include "kernels/vision/vision_cuda.h"
#include "model/tensor_table.h"
#include "model/weights.h"

namespace k3 {

namespace {

namespace vc = vision::cuda;
using bf16 = uint16_t;

constexpr int64_t kBlockElems = int64_t(1) << 22;  // host staging when a weight is widened: 4M elements

// A weight matrix [rows, cols] (PyTorch [out, in]) as bf16 on the device.
struct DevMatrix {
  cuda::DeviceBuffer<bf16> buf;
  int64_t rows = 0, cols = 0;
  const bf16* data() const { return buf.data(); }
};

// W rounded to bf16 (to nearest even, core/dtype.h) row block by row block, so host memory stays bounded; a
// BF16 checkpoint tensor is copied as it is.
DevMatrix upload_bf16(const WeightRef& w) {
  DevMatrix m;
  m.rows = w.rows;
  m.cols = w.cols;
  m.buf = cuda::DeviceBuffer<bf16>(size_t(w.rows * w.cols));
  if (w.format == WeightRef::Format::BF16) {
    cuda::copy_to_device(m.buf.data(), w.data, size_t(w.rows * w.cols) * sizeof(bf16));
    return m;
  }
  const int64_t block_rows = std::max<int64_t>(1, kBlockElems / std::max<int64_t>(1, w.cols));
  std::vector<float> f32;
  std::vector<bf16> b16;
  for (int64_t r0 = 0; r0 < w.rows; r0 += block_rows) {
    const int64_t n = std::min(block_rows, w.rows - r0), len = n * w.cols;
    f32.resize(size_t(len));
    b16.resize(size_t(len));
    w.rows_to_f32(f32.data(), r0, n);
    for (int64_t i = 0; i < len; ++i) b16[size_t(i)] = f32_to_bf16(f32[size_t(i)]);
    cuda::copy_to_device(m.buf.data() + r0 * w.cols, b16.data(), size_t(len) * sizeof(bf16));
  }
  return m;
}

// A device buffer with room for at least n elements (grown, never shrunk: the largest encode's size is kept).
template <class T>
T* room(cuda::DeviceBuffer<T>& b, int64_t n) {
  if (b.size() < size_t(std::max<int64_t>(n, 1))) b = cuda::DeviceBuffer<T>(size_t(std::max<int64_t>(n, 1)));
  return b.data();
}

}  // namespace

struct CudaVisionModel::Impl {
  struct Block {
    cuda::DeviceBuffer<float> norm0, norm1;  // [width]
    DevMatrix wqkv, wo, fc0, fc1;
  };
  // Per-encode scratch; which buffers are alive together is said at each use in forward().
  struct Scratch {
    cuda::DeviceBuffer<float> pixels;     // [L, 3 p p]: encode()'s upload
    cuda::DeviceBuffer<bf16> pixels16;    // [L, 3 p p]
    cuda::DeviceBuffer<int32_t> meta;     // rows [L], cols [L], cu_seqlens [items + 1]
    cuda::DeviceBuffer<float> time;       // the clips' frame embeddings, [t, width] each
    cuda::DeviceBuffer<float> x;          // [L, width]: the residual stream
    cuda::DeviceBuffer<bf16> y;           // [L, width]: a norm's output
    cuda::DeviceBuffer<float> wide;       // [L, 3 qkv] qkv, then [L, I] fc0's output, then [T, M] W1's output
    cuda::DeviceBuffer<bf16> narrow;      // [L, I] gelu(fc0), then [T, M] gelu(W1)
    cuda::DeviceBuffer<bf16> q, k, v;     // [heads][L][packed width]
    cuda::DeviceBuffer<bf16> o;           // [L, qkv]
    cuda::DeviceBuffer<float> merged;     // [T, M]: output
    cuda::DeviceBuffer<bf16> merged16;    // [T, M]
    cuda::DeviceBuffer<float> projected;  // [T, text]: output
  };

  VisionConfig c;
  gemm::cuda::GemmContext gemm;
  DevMatrix patch_embed, proj0, proj2;
  cuda::DeviceBuffer<float> pos_table;   // [H0, W0, width]
  cuda::DeviceBuffer<float> rope;        // vc::rope_table(head dim, kMaxGridSide)
  cuda::DeviceBuffer<float> final_norm;  // [width]
  cuda::DeviceBuffer<float> post_norm;   // [text]
  std::vector<Block> blocks;
  size_t weight_bytes = 0;
  vc::AttnKernel attn = vc::AttnKernel::kAuto;
  Scratch s;
  std::mutex mu;  // encode() calls take turns

  size_t scratch_bytes() const {
    return s.pixels.size() * 4 + s.pixels16.size() * 2 + s.meta.size() * 4 + s.time.size() * 4 + s.x.size() * 4 +
           s.y.size() * 2 + s.wide.size() * 4 + s.narrow.size() * 2 + (s.q.size() + s.k.size() + s.v.size()) * 2 +
           s.o.size() * 2 + s.merged.size() * 4 + s.merged16.size() * 2 + s.projected.size() * 4;
  }

  // The tower and projector over L patches at pixels (device fp32); the outputs land in s.merged and
  // s.projected, items one after another. Returns the merged tokens of all items.
  int64_t forward(const float* pixels, int64_t L, const std::vector<VisionGrid>& grids, const VisionTrace& trace);
};

int64_t CudaVisionModel::Impl::forward(const float* pixels, int64_t L, const std::vector<VisionGrid>& grids,
                                       const VisionTrace& trace) {
  const int64_t D = c.hidden_size, Q = c.qkv_hidden_size, I = c.intermediate_size, hd = c.head_dim();
  const int64_t heads = c.num_heads, P = c.patch_values(), W = vc::packed_width(hd);
  const int64_t mh = c.merge_h, mw = c.merge_w, M = c.merged_width(), text = c.text_hidden_size;
  const int64_t items = int64_t(grids.size());

  // Every patch's row and column (the RoPE's positions), the items' row ranges, the clips' frame embeddings:
  // on the host, as model/vision.cpp computes them, then uploaded.
  std::vector<int32_t> meta(size_t(2 * L + items + 1));
  int32_t* rows = meta.data();
  int32_t* cols = rows + L;
  int32_t* cu = cols + L;
  std::vector<float> time;
  int64_t T = 0, max_len = 0, off = 0;
  for (int64_t i = 0; i < items; ++i) {
    const VisionGrid& g = grids[size_t(i)];
    cu[i] = int32_t(off);
    for (int64_t f = 0; f < g.t; ++f)
      for (int64_t p = 0; p < g.h * g.w; ++p) {
        rows[off + f * g.h * g.w + p] = int32_t(p / g.w);
        cols[off + f * g.h * g.w + p] = int32_t(p % g.w);
      }
    if (g.t > 1) {
      std::vector<float> te(size_t(g.t * D));  // zero-filled, as the CPU's
      frame_time_embedding(te.data(), g.t, D);
      time.insert(time.end(), te.begin(), te.end());
    }
    T += (g.h / mh) * (g.w / mw);
    max_len = std::max(max_len, g.patches());
    off += g.patches();
  }
  cu[items] = int32_t(off);

  // Scratch for this encode (grown before anything is queued, so no pointer moves under a kernel).
  bf16* pixels16 = room(s.pixels16, L * P);
  int32_t* d_meta = room(s.meta, int64_t(meta.size()));
  float* d_time = time.empty() ? nullptr : room(s.time, int64_t(time.size()));
  float* x = room(s.x, L * D);
  bf16* y = room(s.y, L * D);
  float* wide = room(s.wide, std::max({L * 3 * Q, L * I, T * M}));
  bf16* narrow = room(s.narrow, std::max(L * I, T * M));
  bf16* q = room(s.q, heads * L * W);
  bf16* k = room(s.k, heads * L * W);
  bf16* v = room(s.v, heads * L * W);
  bf16* o = room(s.o, L * Q);
  float* merged = room(s.merged, T * M);
  bf16* merged16 = room(s.merged16, T * M);
  float* projected = room(s.projected, T * text);
  cuda::copy_to_device(d_meta, meta.data(), meta.size() * sizeof(int32_t));
  if (d_time) cuda::copy_to_device(d_time, time.data(), time.size() * sizeof(float));
  const int32_t* d_rows = d_meta;
  const int32_t* d_cols = d_meta + L;
  const int32_t* d_cu = d_meta + 2 * L;

  auto show = [&](const std::string& name) {
    if (!trace) return;
    std::vector<float> h(size_t(L * D));
    cuda::copy_to_host(h.data(), x, h.size() * sizeof(float));
    trace(name, h.data(), L, D);
  };

  // Patch embedding (the conv as one GEMM over [L, 3 p p]), then each item's position (and time) embedding.
  gemm::cuda::convert_f32_to_bf16(pixels16, pixels, L * P);
  gemm::cuda::linear_bf16(gemm, x, pixels16, patch_embed.data(), L, D, P);  // x [L, D] fp32
  off = 0;
  const float* tp = d_time;
  for (const VisionGrid& g : grids) {
    vc::PositionParams pp;
    pp.x = x + off * D;
    pp.table = pos_table.data();
    pp.H0 = c.pos_emb_height, pp.W0 = c.pos_emb_width, pp.D = D;
    pp.t = g.t, pp.h = g.h, pp.w = g.w;
    pp.time = g.t > 1 ? tp : nullptr;
    vc::add_position_embedding(pp);
    if (g.t > 1) tp += g.t * D;
    off += g.patches();
  }
  show("embed");

  vc::RopePackParams rp;
  rp.qkv = wide, rp.ld = 3 * Q, rp.L = L, rp.heads = heads, rp.hd = hd;
  rp.rows = d_rows, rp.cols = d_cols, rp.table = rope.data(), rp.positions = VisionEncoder::kMaxGridSide;
  rp.q = q, rp.k = k, rp.v = v;
  vc::AttentionParams ap;
  ap.q = q, ap.k = k, ap.v = v, ap.L = L, ap.heads = heads, ap.hd = hd;
  ap.cu_seqlens = d_cu, ap.items = items, ap.max_len = max_len;
  ap.o = o, ap.ldo = Q, ap.kernel = attn;
  for (size_t b = 0; b < blocks.size(); ++b) {
    const Block& w = blocks[b];
    // Attention: y = bf16(norm0 x); qkv (fp32, in wide) = y Wqkvᵀ; q, k turned and packed with v (bf16);
    // o (bf16) per item; x += o Woᵀ.
    norm::cuda::rmsnorm_forward(y, x, w.norm0.data(), VisionEncoder::kTowerNormEps, L, D);
    gemm::cuda::linear_bf16(gemm, wide, y, w.wqkv.data(), L, 3 * Q, D);
    vc::rope_pack(rp);
    vc::attention(ap);
    gemm::cuda::linear_bf16(gemm, x, o, w.wo.data(), L, D, Q, /*accumulate=*/true);
    // MLP: y = bf16(norm1 x); h (fp32, in wide) = y fc0ᵀ; narrow = bf16(gelu_tanh h); x += narrow fc1ᵀ.
    norm::cuda::rmsnorm_forward(y, x, w.norm1.data(), VisionEncoder::kTowerNormEps, L, D);
    gemm::cuda::linear_bf16(gemm, wide, y, w.fc0.data(), L, I, D);
    vc::gelu_to_bf16(narrow, wide, L * I, vc::Gelu::kTanh);
    gemm::cuda::linear_bf16(gemm, x, narrow, w.fc1.data(), L, D, I, /*accumulate=*/true);
    show("block." + std::to_string(b));
  }
  norm::cuda::rmsnorm_forward(x, x, final_norm.data(), VisionEncoder::kTowerNormEps, L, D);  // fp32, in place
  show("final");

  // sd2_tpool per item into [T, M] (fp32 out, bf16 for W1), then the projector over every item's tokens at once:
  // mid (fp32, in wide) = merged W1ᵀ; narrow = bf16(gelu_erf mid); projected = RMSNorm(narrow W2ᵀ) in fp32.
  off = 0;
  int64_t tok = 0;
  for (const VisionGrid& g : grids) {
    vc::MergeParams mp;
    mp.out_f32 = merged + tok * M, mp.out_bf16 = merged16 + tok * M, mp.x = x + off * D;
    mp.t = g.t, mp.h = g.h, mp.w = g.w, mp.D = D, mp.mh = mh, mp.mw = mw;
    vc::merge_tpool(mp);
    tok += (g.h / mh) * (g.w / mw);
    off += g.patches();
  }
  gemm::cuda::linear_bf16(gemm, wide, merged16, proj0.data(), T, M, M);
  vc::gelu_to_bf16(narrow, wide, T * M, vc::Gelu::kErf);
  gemm::cuda::linear_bf16(gemm, projected, narrow, proj2.data(), T, text, M);
  norm::cuda::rmsnorm_forward(projected, projected, post_norm.data(), float(c.projector_eps), T, text);
  return T;
}

std::unique_ptr<CudaVisionModel> CudaVisionModel::load(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    fail(dir, ": not a model directory (expected config.json with a vision_config, and safetensors)");
  const VisionConfig c = load_vision_config(dir);
  const SafeTensors st = SafeTensors::open(dir);
  return std::make_unique<CudaVisionModel>(c, st);
}

CudaVisionModel::CudaVisionModel(const VisionConfig& c, const SafeTensors& st) {
  std::string why;
  if (!cuda::available(&why)) fail("the GPU vision tower cannot start: ", why);
  check_vision_biases(c, c.source);
  const std::string problem = gpu_vision_config_problem(c);
  if (!problem.empty()) fail(c.source, ": the GPU vision tower cannot run this config: ", problem);
  impl_ = std::make_unique<Impl>();
  Impl& m = *impl_;
  m.c = c;
  // Names and shapes from the vision tensor table (tensor_table.h), as VisionModel reads them.
  using K = VisionTensorKind;
  const auto matrix = [&](K kind, int64_t b = -1) {
    DevMatrix d = upload_bf16(matrix_weight(st, vision_tensor_name(kind, b), vision_tensor_shape(c, kind), c.source));
    m.weight_bytes += d.buf.size() * sizeof(bf16);
    return d;
  };
  const auto vec = [&](K kind, int64_t b = -1) {
    const std::vector<float> v = st.read_f32(vision_tensor_name(kind, b), vision_tensor_shape(c, kind));
    m.weight_bytes += v.size() * sizeof(float);
    return cuda::DeviceBuffer<float>(v.data(), v.size());
  };
  m.patch_embed = matrix(K::PatchEmbed);
  m.pos_table = vec(K::PosEmb);
  for (int64_t b = 0; b < c.num_layers; ++b) {
    Impl::Block k;
    k.norm0 = vec(K::Norm0, b);
    k.norm1 = vec(K::Norm1, b);
    k.wqkv = matrix(K::Wqkv, b);
    k.wo = matrix(K::Wo, b);
    k.fc0 = matrix(K::Fc0, b);
    k.fc1 = matrix(K::Fc1, b);
    m.blocks.push_back(std::move(k));
  }
  m.final_norm = vec(K::FinalNorm);
  m.proj0 = matrix(K::Proj0);
  m.proj2 = matrix(K::Proj2);
  m.post_norm = vec(K::PostNorm);
  const std::vector<float> rope = vc::rope_table(c.head_dim(), kMaxGridSide);
  m.rope = cuda::DeviceBuffer<float>(rope.data(), rope.size());
}

CudaVisionModel::~CudaVisionModel() = default;

const VisionConfig& CudaVisionModel::config() const { return impl_->c; }
std::string CudaVisionModel::description() const { return "cuda (bf16)"; }
size_t CudaVisionModel::weight_bytes() const { return impl_->weight_bytes; }
size_t CudaVisionModel::scratch_bytes() const {
  const std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->scratch_bytes();
}
void CudaVisionModel::set_attention_kernel(vision::cuda::AttnKernel k) {
  const std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->attn = k;
}

std::vector<VisionItem> CudaVisionModel::encode(const float* pixel_patches, int64_t L,
                                                const std::vector<VisionGrid>& grids, const VisionTrace& trace) const {
  check_grids(grids, L);
  const std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& m = *impl_;
  const VisionConfig& c = m.c;
  const int64_t P = c.patch_values(), M = c.merged_width(), text = c.text_hidden_size;
  float* pixels = room(m.s.pixels, L * P);
  cuda::copy_to_device(pixels, pixel_patches, size_t(L * P) * sizeof(float));
  m.forward(pixels, L, grids, trace);
  std::vector<VisionItem> out;
  int64_t tok = 0;
  for (const VisionGrid& g : grids) {
    VisionItem it;
    it.tokens = (g.h / c.merge_h) * (g.w / c.merge_w);
    it.merged.resize(size_t(it.tokens * M));
    it.projected.resize(size_t(it.tokens * text));
    cuda::copy_to_host(it.merged.data(), m.s.merged.data() + tok * M, it.merged.size() * sizeof(float));
    cuda::copy_to_host(it.projected.data(), m.s.projected.data() + tok * text, it.projected.size() * sizeof(float));
    tok += it.tokens;
    out.push_back(std::move(it));
  }
  return out;
}

int64_t CudaVisionModel::encode_on_device(const float* device_pixel_patches, int64_t L,
                                          const std::vector<VisionGrid>& grids) const {
  check_grids(grids, L);
  const std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->forward(device_pixel_patches, L, grids, {});
}

}  // namespace k3
#endif  // K3_HAVE_CUDA
