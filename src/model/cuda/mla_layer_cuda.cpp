// Gated MLA block on the GPU: the CUDA twin of model/mla_layer.cpp. New rows' [latent | k_rot] are
// appended to each sequence's device cache (its own rows buffer); attention then reads the cache in one of two
// forms:
//   expanded (prefill, and every call of the F32 path): kv_b applied to all cached latents, then the
//            flash prefill kernel (BF16) or the fp64 exact kernel (F32);
//   absorbed (BF16 decode, when the new tokens are under a quarter of the cache): q_lat = W_kbᵀ q_nope
//            per head (one batched GEMM), the split-K latent decode kernel, then W_vb per head.
#ifdef K3_HAVE_CUDA
#include <algorithm>

#include "core/error.h"
#include "kernels/common/elementwise_cuda.h"
#include "kernels/gemm/convert_cuda.h"
#include "kernels/mla/mla_cuda.h"
#include "kernels/norm/norm_cuda.h"
#include "model/cuda/cuda_model_impl.h"

namespace k3::gpu {

void reserve_rows(MlaPoolDev& mp, int64_t place, int64_t need, int64_t ldc, size_t esize) {
  const size_t at = size_t(place);
  K3_CHECK(at < mp.rows.size(), "reserve_rows: place ", place, " of ", mp.rows.size());
  const int64_t old = mp.capacity[at];
  if (need <= old) return;
  const int64_t cap = std::max<int64_t>({need, 2 * old, 64});
  cuda::DeviceBuffer<uint8_t> grown(size_t(cap * ldc) * esize);
  if (old > 0) cuda::copy_on_device(grown.data(), mp.rows[at].data(), size_t(old * ldc) * esize);
  mp.rows[at] = std::move(grown);
  mp.capacity[at] = cap;
}

int64_t mla_ordinal(const K3Config& c, int64_t layer) {
  int64_t n = 0;
  for (int64_t l = 0; l < layer; ++l) n += c.layer_kind[size_t(l)] == AttnKind::MLA;
  return n;
}

namespace {

// The BF16 path's batched per-head product of the absorbed form: y_h[n, N] = x_h[n, K] · op(W_h) for
// every head h; W_h is head h's slice of kv_b (its rows times R elements from the base, stride_w apart).
void per_head_linear(Run& r, bf16* y, int64_t ld_y, int64_t stride_y, const bf16* x, int64_t ld_x, int64_t stride_x,
                     int64_t n, int64_t K, int64_t Nout, const bf16* w, int64_t ld_w, int64_t stride_w, bool w_in_out,
                     int64_t heads) {
  gemm::cuda::LinearParams p;
  p.y = y, p.y_type = DType::BF16, p.ld_y = ld_y, p.stride_y = stride_y;
  p.x = x, p.ld_x = ld_x, p.stride_x = stride_x;
  p.w = w, p.ld_w = ld_w, p.stride_w = stride_w, p.w_in_out = w_in_out;
  p.in_type = DType::BF16, p.M = n, p.N = Nout, p.K = K, p.batch = heads;
  gemm::cuda::linear_forward(r.gemm, p);
}

}  // namespace

template <class T>
void mla_attention_forward(Run& r, float* out, const T* x, int64_t N, const std::vector<SegmentDev>& segs,
                           int64_t layer, const MlaDev& w) {
  const K3Config& c = r.c;
  const mla::Dims d{c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank};
  const int64_t H = d.H, dq = d.Dn + d.Dr, dkv = d.Dn + d.Dv, lrow = d.R + d.Dr, ldc = r.mla_ldc;
  constexpr DType act = dtype_of<T>();

  // Every projection of x̂ at once (one launch for a decode step of a few sequences): q's low-rank input (or q),
  // the latent and k_rot, the output gate's pre-activation.
  T* q = r.arena.take<T>(N * H * dq);          // [N, H, Dn + Dr]
  float* ckv = r.arena.take<float>(N * lrow);  // [N, R + Dr]: the latent normalised in place, k_rot as is
  T* qa = w.q_a_proj.empty() ? nullptr : r.arena.take<T>(N * c.q_lora_rank);
  T* gate = w.g_proj.empty() ? nullptr : r.arena.take<T>(N * H * d.Dv);
  linears_of_rows<T>(r, x, N,
                     {{qa ? &w.q_a_proj : &w.q_proj, qa ? qa : q, act},
                      {&w.kv_a_proj_with_mqa, ckv, DType::F32},
                      {&w.g_proj, gate, act}});
  if (qa) {
    norm::cuda::RmsNormParams np;
    np.y = qa, np.y_type = act, np.x = qa, np.x_type = act, np.weight = w.q_a_layernorm.data();
    np.eps = float(c.mla_norm_eps), np.N = N, np.D = c.q_lora_rank;
    norm::cuda::rmsnorm_forward(np);
    linear<T>(r, q, qa, N, w.q_b_proj);
  }
  {
    norm::cuda::RmsNormParams np;
    np.y = ckv, np.y_type = DType::F32, np.ld_y = lrow, np.x = ckv, np.x_type = DType::F32, np.ld_x = lrow;
    np.weight = w.kv_a_layernorm.data(), np.eps = float(c.mla_norm_eps), np.N = N, np.D = d.R;
    norm::cuda::rmsnorm_forward(np);
  }

  T* o = r.arena.take<T>(N * H * d.Dv);  // [N, H, Dv]
  // The absorbed form over rows [row0, row0 + rows_n) (query tokens of one or more sequences), given how the
  // decode kernel finds each sequence's cache rows.
  auto absorbed = [&](int64_t row0, int64_t rows_n, mla::cuda::DecodeParams dp) {
    if constexpr (std::is_same_v<T, float>) {
      fail("GPU MLA: the absorbed form is the BF16 path's");
    } else {
      const bf16* qs = q + row0 * H * dq;
      const bf16* kvb = w.kv_b_proj.as<bf16>();
      bf16* q_lat = r.arena.take<bf16>(rows_n * H * d.R);  // [rows, H, R]
      per_head_linear(r, q_lat, H * d.R, d.R, qs, H * dq, dq, rows_n, d.Dn, d.R, kvb, d.R, dkv * d.R, true, H);
      bf16* q_rot = r.arena.take<bf16>(rows_n * H * d.Dr);
      elementwise::cuda::copy_rows(q_rot, act, d.Dr, qs + d.Dn, act, dq, rows_n * H, d.Dr);
      float* o_lat = r.arena.take<float>(rows_n * H * d.R);
      dp.q_lat = q_lat, dp.q_rot = q_rot, dp.q_type = mla::cuda::Dtype::BF16;
      dp.ldc = ldc, dp.o_lat = o_lat, dp.d = d;
      dp.workspace_bytes = mla::cuda::decode_workspace_bytes(dp);
      dp.workspace = dp.workspace_bytes ? r.arena.take_bytes(dp.workspace_bytes) : nullptr;
      mla::cuda::decode(dp);
      bf16* o_lat16 = r.arena.take<bf16>(rows_n * H * d.R);
      gemm::cuda::convert_f32_to_bf16(o_lat16, o_lat, rows_n * H * d.R);
      per_head_linear(r, o + row0 * H * d.Dv, H * d.Dv, d.Dv, o_lat16, H * d.R, d.R, rows_n, d.R, d.Dv,
                      kvb + d.Dn * d.R, d.R, dkv * d.R, false, H);
    }
  };
  if (const PooledDecode* pd = r.pooled) {  // rows 0..B-1: one token of each pooled sequence (room made by the caller)
    if constexpr (std::is_same_v<T, float>) {
      fail("GPU MLA: the pooled decode is the BF16 path's");
    } else {
      uint16_t* const* rows = pd->rows + mla_ordinal(c, layer) * pd->B;
      mla::cuda::append_rows(rows, ldc, pd->p0, ckv, lrow, pd->B);
      mla::cuda::DecodeParams dp;
      dp.B = pd->B, dp.n = 1, dp.p0 = pd->max_p0;
      dp.seq_cache = rows, dp.seq_p0 = pd->p0, dp.split_keys = kPooledSplitKeys;
      absorbed(0, pd->B, dp);
    }
  }
  for (const SeqGroup& g : seq_groups(unpooled(r, segs), /*same_length=*/true)) {
    MlaPoolDev& mp = g.first->pool->mla[size_t(layer)];
    const int64_t p0 = g.first->length, Tc = p0 + g.n;
    auto rows_of = [&](int64_t b) { return reinterpret_cast<T*>(mp.rows[size_t(g.first->index + b)].data()); };
    // Append the new rows: sequence b's n rows go to its rows p0 .. p0+n-1.
    for (int64_t b = 0; b < g.B; ++b) {
      reserve_rows(mp, g.first->index + b, Tc, ldc, sizeof(T));
      elementwise::cuda::copy_rows(rows_of(b) + p0 * ldc, act, ldc, ckv + (g.row0 + b * g.n) * lrow, DType::F32, lrow,
                                   g.n, lrow);
    }

    if constexpr (std::is_same_v<T, float>) {  // the F32 path: expanded, in fp64, a sequence at a time
      double* kvh = r.arena.take<double>(Tc * H * dkv);
      for (int64_t b = 0; b < g.B; ++b) {
        const float* rows = rows_of(b);
        const int64_t r0 = g.row0 + b * g.n;
        gemm::cuda::linear_exact_f64(r.gemm, kvh, H * dkv, rows, ldc, w.kv_b_proj.as<double>(), Tc, H * dkv, d.R);
        mla::cuda::ExactParams ep;
        ep.o = o + r0 * H * d.Dv, ep.q = q + r0 * H * dq, ep.kvh = kvh, ep.cache = rows, ep.ldc = ldc, ep.d = d;
        ep.n = g.n, ep.p0 = p0;
        mla::cuda::attention_expanded_exact(ep);
      }
    } else if (r.reference || g.n * 4 >= Tc) {  // BF16 expanded (prefill): keys and values of every cached position
      bf16* kvh = r.arena.take<bf16>(Tc * H * dkv);
      bf16* kk = r.arena.take<bf16>(Tc * H * dq);  // [Tc, H, Dn + Dr]
      bf16* vv = r.arena.take<bf16>(Tc * H * d.Dv);
      for (int64_t b = 0; b < g.B; ++b) {
        const bf16* rows = rows_of(b);
        const int64_t r0 = g.row0 + b * g.n;
        linear<T>(r, kvh, DType::BF16, H * dkv, rows, ldc, Tc, w.kv_b_proj);
        elementwise::cuda::copy_rows(kk, act, dq, kvh, act, dkv, Tc * H, d.Dn);
        elementwise::cuda::copy_rows(vv, act, d.Dv, kvh + d.Dn, act, dkv, Tc * H, d.Dv);
        for (int64_t h = 0; h < H; ++h)  // k_rot is shared by the heads
          elementwise::cuda::copy_rows(kk + h * dq + d.Dn, act, H * dq, rows + d.R, act, ldc, Tc, d.Dr);
        mla::cuda::PrefillParams pp;
        pp.q = q + r0 * H * dq, pp.k = kk, pp.v = vv, pp.o = o + r0 * H * d.Dv, pp.o_type = mla::cuda::Dtype::BF16;
        pp.d = d, pp.B = 1, pp.n = g.n, pp.p0 = p0;
        mla::cuda::prefill(pp);
      }
    } else {  // BF16 absorbed (a short append to a long cache), a sequence at a time
      for (int64_t b = 0; b < g.B; ++b) {
        mla::cuda::DecodeParams dp;
        dp.cache = rows_of(b), dp.B = 1, dp.n = g.n, dp.p0 = p0;
        absorbed(g.row0 + b * g.n, g.n, dp);
      }
    }
  }
  if (gate) elementwise::cuda::mul_sigmoid(o, gate, N * H * d.Dv);
  linear_f32_out<T>(r, out, o, N, w.o_proj);
}

template void mla_attention_forward<float>(Run&, float*, const float*, int64_t, const std::vector<SegmentDev>&, int64_t,
                                           const MlaDev&);
template void mla_attention_forward<bf16>(Run&, float*, const bf16*, int64_t, const std::vector<SegmentDev>&, int64_t,
                                          const MlaDev&);

}  // namespace k3::gpu
#endif  // K3_HAVE_CUDA
