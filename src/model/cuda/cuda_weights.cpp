// Uploading a bound checkpoint (model/weights.h) to the device (cuda_model_impl.h: upload_weights),
// tensor by tensor of the config's table (model/tensor_table.h).
// Matrices are widened row-block by row-block from wherever the checkpoint keeps them (mmap'ed
// BF16/F32/F16, or MXFP4) and narrowed to the path's type, so host memory stays bounded by one
// block; a BF16 matrix bound for the BF16 path is copied as is.
#ifdef K3_HAVE_CUDA
#include <algorithm>

#include "core/error.h"
#include "model/cuda/cuda_model_impl.h"
#include "model/tensor_table.h"

namespace k3::gpu {

namespace {

constexpr int64_t kBlockElems = int64_t(1) << 22;  // host staging: 4M elements per upload

// The device element type of a matrix: bf16 (BF16 path), fp64 (the F32 path's GEMM operands) or
// fp32 (the F32 path's embedding table, read by a gather, not a GEMM).
enum class Store { BF16, F32, F64 };
size_t store_size(Store t) { return t == Store::BF16 ? 2 : t == Store::F32 ? 4 : 8; }
Store matrix_store(GpuPrecision p) { return p == GpuPrecision::F32 ? Store::F64 : Store::BF16; }

// Writes W's rows, converted to `store`, at dst (device) contiguously.
void upload_rows(uint8_t* dst, const WeightRef& w, Store store) {
  const size_t esize = store_size(store);
  if (store == Store::BF16 && w.format == WeightRef::Format::BF16) {
    cuda::copy_to_device(dst, w.data, size_t(w.rows * w.cols) * esize);
    return;
  }
  const int64_t block_rows = std::max<int64_t>(1, kBlockElems / std::max<int64_t>(1, w.cols));
  std::vector<float> f32;
  std::vector<double> f64;
  std::vector<bf16> b16;
  for (int64_t r0 = 0; r0 < w.rows; r0 += block_rows) {
    const int64_t n = std::min(block_rows, w.rows - r0), len = n * w.cols;
    f32.resize(size_t(len));
    w.rows_to_f32(f32.data(), r0, n);
    const void* src = f32.data();
    if (store == Store::F64) {
      f64.assign(f32.begin(), f32.end());
      src = f64.data();
    } else if (store == Store::BF16) {
      b16.resize(size_t(len));
      for (int64_t i = 0; i < len; ++i) b16[size_t(i)] = f32_to_bf16(f32[size_t(i)]);
      src = b16.data();
    }
    cuda::copy_to_device(dst + size_t(r0 * w.cols) * esize, src, size_t(len) * esize);
  }
}

size_t matrix_bytes(const WeightRef& w, GpuPrecision p) {
  return size_t(w.rows * w.cols) * store_size(matrix_store(p));
}

class Uploader {
 public:
  explicit Uploader(GpuPrecision p) : p_(p) {}
  size_t bytes = 0;

  DevMatrix matrix(const WeightRef& w) {
    DevMatrix m;
    if (w.empty()) return m;
    m.rows = w.rows;
    m.cols = w.cols;
    m.buf = cuda::DeviceBuffer<uint8_t>(matrix_bytes(w, p_));
    upload_rows(m.buf.data(), w, matrix_store(p_));
    bytes += m.buf.size();
    return m;
  }

  DevVector vec(const std::vector<float>& v) {
    DevVector d(v.data(), v.size());
    bytes += v.size() * sizeof(float);
    return d;
  }

  // Stacks one Linear of every expert: pick(e) is expert e's weight.
  template <class Pick>
  DevExperts experts(int64_t E, Pick pick) {
    DevExperts x;
    const WeightRef& w0 = pick(0);
    x.rows = w0.rows;
    x.cols = w0.cols;
    x.mxfp4 = p_ == GpuPrecision::BF16 && w0.format == WeightRef::Format::MXFP4;
    if (x.mxfp4) {
      const size_t pb = size_t(w0.rows * w0.cols / 2), sb = size_t(w0.rows * w0.cols / 32);
      x.data = cuda::DeviceBuffer<uint8_t>(pb * size_t(E));
      x.scales = cuda::DeviceBuffer<uint8_t>(sb * size_t(E));
      for (int64_t e = 0; e < E; ++e) {
        const WeightRef& w = pick(e);
        K3_CHECK(w.format == WeightRef::Format::MXFP4, "GPU upload: expert ", e, " is not MXFP4 while expert 0 is");
        cuda::copy_to_device(x.data.data() + pb * size_t(e), w.data, pb);
        cuda::copy_to_device(x.scales.data() + sb * size_t(e), w.scales, sb);
      }
      const std::string why = moe::cuda::gemm_can_run(x.linear());
      K3_CHECK(why.empty(), "GPU upload: routed experts: ", why);
    } else {
      const size_t one = matrix_bytes(w0, p_);
      x.data = cuda::DeviceBuffer<uint8_t>(one * size_t(E));
      for (int64_t e = 0; e < E; ++e) upload_rows(x.data.data() + one * size_t(e), pick(e), matrix_store(p_));
      if (p_ == GpuPrecision::BF16) {
        const std::string why = moe::cuda::gemm_can_run(x.linear());
        K3_CHECK(why.empty(), "GPU upload: routed experts: ", why);
      }
    }
    bytes += x.data.size() + x.scales.size();
    return x;
  }

 private:
  GpuPrecision p_;
};

}  // namespace

moe::cuda::ExpertLinear DevExperts::linear() const {
  return mxfp4 ? moe::cuda::ExpertLinear::mxfp4_stacked(data.data(), scales.data(), rows, cols)
               : moe::cuda::ExpertLinear::bf16_stacked(reinterpret_cast<const bf16*>(data.data()), rows, cols);
}

const double* DevExperts::expert_f64(int64_t e) const {
  return reinterpret_cast<const double*>(data.data()) + e * rows * cols;
}

WeightsDev upload_weights(const K3Config& c, const ModelWeights& w, GpuPrecision p) {
  Uploader up(p);
  WeightsDev d;
  {  // the embedding table: the gather reads bf16 (BF16 path) or fp32 rows
    const WeightRef& e = w.embed_tokens;
    const Store store = p == GpuPrecision::F32 ? Store::F32 : Store::BF16;
    d.embed = cuda::DeviceBuffer<uint8_t>(size_t(e.rows * e.cols) * store_size(store));
    upload_rows(d.embed.data(), e, store);
    up.bytes += d.embed.size();
  }
  d.lm_head = up.matrix(w.lm_head);
  d.norm = up.vec(w.norm);
  d.output_res_query = up.vec(w.output_res_query);
  // Every layer tensor of the table goes to the device field of its kind (weights.h: layer_matrix and
  // layer_vector name the fields of both structs); an AttnRes pair is uploaded once, as the query its
  // projection's field holds. The routed experts are stacked per layer below.
  d.layers.resize(size_t(c.num_hidden_layers));
  const TensorTable table(c);
  for (const TensorEntry& e : table.entries()) {
    if (e.layer < 0 || e.expert >= 0 || e.kind == TensorKind::AttnResNorm || e.kind == TensorKind::MlpResNorm) continue;
    const LayerWeights& L = w.layers[size_t(e.layer)];
    LayerDev& D = d.layers[size_t(e.layer)];
    if (const WeightRef* m = layer_matrix(L, e.kind)) {
      *layer_matrix(D, e.kind) = up.matrix(*m);
    } else {
      const std::vector<float>* v = layer_vector(L, e.kind);
      K3_ASSERT(v != nullptr);
      *layer_vector(D, e.kind) = up.vec(*v);
    }
  }
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (!w.layers[size_t(l)].is_moe) continue;
    const std::vector<ExpertWeights>& x = w.layers[size_t(l)].moe.experts;
    MoeDev& D = d.layers[size_t(l)].moe;
    D.w1 = up.experts(c.num_experts, [&](int64_t e) -> const WeightRef& { return x[size_t(e)].w1; });
    D.w3 = up.experts(c.num_experts, [&](int64_t e) -> const WeightRef& { return x[size_t(e)].w3; });
    D.w2 = up.experts(c.num_experts, [&](int64_t e) -> const WeightRef& { return x[size_t(e)].w2; });
  }
  d.bytes = up.bytes;
  return d;
}

}  // namespace k3::gpu
#endif  // K3_HAVE_CUDA
