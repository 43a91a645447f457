// Gated MLA block, training forward/backward in float64 (see mla_block.h for the math).
//
// Notation: T tokens, hidden D, H heads, Dn/Dr/Dv head dims, R = kv_lora_rank, Qr = q_lora_rank,
// dq = Dn + Dr (q/k width per head), dkv = Dn + Dv (kv_b output per head), ldc = R + Dr.
// A linear layer is y = x Wᵀ with W [out, in] (the release's layout), so its backward is
// dx = dy W and dW += dyᵀ x. The ops are kernels/ ops: strided linears (gemm/linear_f64.h), RMSNorm
// with saved statistics (norm/norm.h), the attention core and output gate (mla/mla_f64.h); this file
// only composes them.
#include "model/training/mla_block.h"

#include <cmath>

#include "core/error.h"
#include "kernels/gemm/linear_f64.h"
#include "kernels/mla/mla_f64.h"
#include "kernels/norm/norm.h"
#include "model/tensor_table.h"

namespace k3::train {

namespace {

struct Dims {
  int64_t D, H, Dn, Dr, Dv, R, Qr, dq, dkv, ldc;
  bool gated;
};

Dims dims_of(const K3Config& c) {
  Dims d{};
  d.D = c.hidden_size;
  d.H = c.num_attention_heads;
  d.Dn = c.qk_nope_head_dim;
  d.Dr = c.qk_rope_head_dim;
  d.Dv = c.v_head_dim;
  d.R = c.kv_lora_rank;
  d.Qr = c.q_lora_rank;
  d.dq = d.Dn + d.Dr;
  d.dkv = d.Dn + d.Dv;
  d.ldc = d.R + d.Dr;
  d.gated = c.mla_use_output_gate;
  if (d.D <= 0 || d.H <= 0 || d.Dn < 0 || d.Dr < 0 || d.Dv <= 0 || d.R <= 0 || d.Qr < 0 || d.dq <= 0)
    fail(c.source,
         ": MLA training block needs positive hidden_size, num_attention_heads, v_head_dim, kv_lora_rank "
         "and qk head dims");
  return d;
}

// Parameter names and their expected sizes (p()/g() check the element count and name the tensor).
struct Names {
  std::string q_a, q_a_norm, q_b, q, kv_a, kv_a_norm, kv_b, g, o;
};
Names names_of(const std::string& prefix) {
  using K = TensorKind;
  auto n = [&](K kind) { return tensor_name_at(prefix, kind); };
  return {n(K::MlaQA),      n(K::MlaQANorm), n(K::MlaQB), n(K::MlaQ), n(K::MlaKvA),
          n(K::MlaKvANorm), n(K::MlaKvB),    n(K::MlaG),  n(K::MlaO)};
}

void check_layer(const K3Config& c, int64_t layer) {
  if (layer >= 0 && layer < int64_t(c.layer_kind.size()) && c.layer_kind[size_t(layer)] != AttnKind::MLA)
    fail(c.source, ": layer ", layer, " is not an MLA layer");
}

mla::Dims core_dims(const Dims& d) { return {d.H, d.Dn, d.Dr, d.Dv, d.R}; }

}  // namespace

void mla_block_forward(const ParamStore& P, const std::string& prefix, const K3Config& c, int64_t layer,
                       const double* x, int64_t T, double* y, MlaBlockTape* tape, MlaDecodeState* state) {
  check_layer(c, layer);
  K3_CHECK(!(tape && state), "mla_block_forward: a decoding forward saves no tape");
  const Dims d = dims_of(c);
  const Names n = names_of(prefix);
  if (T <= 0) fail("mla_block_forward: T must be positive, got ", T);
  const double eps = double(c.mla_norm_eps);
  const double scale = 1.0 / std::sqrt(double(d.dq));  // q_head_dim^-0.5 (§5.4 step 4)
  const size_t sT = static_cast<size_t>(T);

  MlaBlockTape local;
  MlaBlockTape& tp = tape ? *tape : local;
  tp = MlaBlockTape{};
  tp.T = T;
  tp.x.assign(x, x + T * d.D);

  // 1. q = q_b(RMSNorm(q_a x)) or q_proj x.   [T, H*dq]
  tp.q.assign(sT * size_t(d.H * d.dq), 0.0);
  if (d.Qr > 0) {
    std::vector<double> qa_raw(sT * size_t(d.Qr));
    linear_forward_strided(qa_raw.data(), d.Qr, x, d.D, P.p(n.q_a, d.Qr * d.D), T, d.D, d.Qr);
    tp.qa_hat.assign(qa_raw.size(), 0.0);
    tp.qa.assign(qa_raw.size(), 0.0);
    tp.qa_rs.assign(sT, 0.0);
    rmsnorm_forward_saved(tp.qa.data(), tp.qa_hat.data(), tp.qa_rs.data(), qa_raw.data(), d.Qr, P.p(n.q_a_norm, d.Qr),
                          eps, T, d.Qr);
    linear_forward_strided(tp.q.data(), d.H * d.dq, tp.qa.data(), d.Qr, P.p(n.q_b, d.H * d.dq * d.Qr), T, d.Qr,
                           d.H * d.dq);
  } else {
    linear_forward_strided(tp.q.data(), d.H * d.dq, x, d.D, P.p(n.q, d.H * d.dq * d.D), T, d.D, d.H * d.dq);
  }

  // 2. c = kv_a x = [c_lat | k_rot]; lat = RMSNorm(c_lat). k_rot stays raw (no norm, no rotation).
  tp.ckv.assign(sT * size_t(d.ldc), 0.0);
  linear_forward_strided(tp.ckv.data(), d.ldc, x, d.D, P.p(n.kv_a, d.ldc * d.D), T, d.D, d.ldc);
  tp.lat_hat.assign(sT * size_t(d.R), 0.0);
  tp.lat.assign(sT * size_t(d.R), 0.0);
  tp.lat_rs.assign(sT, 0.0);
  rmsnorm_forward_saved(tp.lat.data(), tp.lat_hat.data(), tp.lat_rs.data(), tp.ckv.data(), d.ldc, P.p(n.kv_a_norm, d.R),
                        eps, T, d.R);

  // 3. kv = kv_b(lat): per head [k_nope (Dn) | v (Dv)].   [T, H*dkv]
  tp.kv.assign(sT * size_t(d.H * d.dkv), 0.0);
  linear_forward_strided(tp.kv.data(), d.H * d.dkv, tp.lat.data(), d.R, P.p(n.kv_b, d.H * d.dkv * d.R), T, d.R,
                         d.H * d.dkv);

  // 4-5. Per head: causal softmax of scaled scores, o = P v (k_rot: columns R..R+Dr of ckv).
  const int64_t ldkv = d.H * d.dkv, ldo = d.H * d.Dv;
  tp.lse.assign(size_t(d.H) * sT, 0.0);
  tp.o.assign(sT * size_t(ldo), 0.0);
  if (state) {  // this forward's rows join the sequence's, and the queries attend to all of them
    K3_CHECK(int64_t(state->kv.size()) == state->length * ldkv && int64_t(state->k_rot.size()) == state->length * d.Dr,
             "mla_block_forward: layer ", layer, "'s decoding state is from another config");
    state->kv.insert(state->kv.end(), tp.kv.begin(), tp.kv.end());
    for (int64_t t = 0; t < T; ++t) {
      const double* r = &tp.ckv[size_t(t * d.ldc + d.R)];
      state->k_rot.insert(state->k_rot.end(), r, r + d.Dr);
    }
    mla::attention_forward_f64(tp.o.data(), ldo, tp.lse.data(), tp.q.data(), d.H * d.dq, state->kv.data(), ldkv,
                               state->k_rot.data(), d.Dr, T, core_dims(d), scale, state->length);
    state->length += T;
  } else {
    mla::attention_forward_f64(tp.o.data(), ldo, tp.lse.data(), tp.q.data(), d.H * d.dq, tp.kv.data(), ldkv,
                               tp.ckv.data() + d.R, d.ldc, T, core_dims(d), scale);
  }

  // Output gate: og = o ⊙ sigmoid(g_proj x) (full rank, per channel), then y = o_proj og.
  if (d.gated) {
    tp.gate.assign(sT * size_t(ldo), 0.0);
    linear_forward_strided(tp.gate.data(), ldo, x, d.D, P.p(n.g, ldo * d.D), T, d.D, ldo);
    tp.og.resize(tp.o.size());
    mla::output_gate_forward_f64(tp.og.data(), tp.gate.data(), tp.o.data(), int64_t(tp.o.size()));
  } else {
    tp.og = tp.o;
  }
  linear_forward_strided(y, d.D, tp.og.data(), ldo, P.p(n.o, d.D * ldo), T, ldo, d.D);
}

void mla_block_backward(ParamStore& P, const std::string& prefix, const K3Config& c, int64_t layer,
                        const MlaBlockTape& tp, const double* dy, double* dx) {
  check_layer(c, layer);
  const Dims d = dims_of(c);
  const Names n = names_of(prefix);
  const int64_t T = tp.T;
  if (T <= 0 || int64_t(tp.x.size()) != T * d.D || int64_t(tp.lse.size()) != d.H * T)
    fail("mla_block_backward: tape is empty or from another config");
  const double scale = 1.0 / std::sqrt(double(d.dq));
  const size_t sT = static_cast<size_t>(T);
  const int64_t ldq = d.H * d.dq, ldkv = d.H * d.dkv, ldo = d.H * d.Dv;
  const double* x = tp.x.data();

  // y = og Woᵀ:  dWo += dyᵀ og;  dog = dy Wo.
  std::vector<double> dog(sT * size_t(ldo));
  linear_backward_w_strided(P.g(n.o, d.D * ldo), dy, d.D, tp.og.data(), ldo, T, ldo, d.D);
  linear_backward_x_strided(dog.data(), ldo, dy, d.D, P.p(n.o, d.D * ldo), T, ldo, d.D, false);

  // Gate: og = o ⊙ σ(zg), zg = x Wgᵀ.  do = dog ⊙ σ;  dzg = dog ⊙ o ⊙ σ(1-σ);  dWg += dzgᵀ x; dx = dzg Wg.
  // dx is first written (overwritten) here or by the first input-gradient term below.
  std::vector<double> dO(sT * size_t(ldo));
  bool dx_written = false;
  if (d.gated) {
    std::vector<double> dz(dO.size());
    mla::output_gate_backward_f64(dO.data(), dz.data(), dog.data(), tp.o.data(), tp.gate.data(), int64_t(dO.size()));
    linear_backward_w_strided(P.g(n.g, ldo * d.D), dz.data(), ldo, x, d.D, T, d.D, ldo);
    linear_backward_x_strided(dx, d.D, dz.data(), ldo, P.p(n.g, ldo * d.D), T, d.D, ldo, false);
    dx_written = true;
  } else {
    dO = dog;
  }

  // Attention (mla/mla_f64.h): dq, dkv = [dk_nope | dv] per head, and the k_rot columns R..R+Dr of
  // dckv (summed over the heads); the RMSNorm below fills columns 0..R.
  std::vector<double> dq(sT * size_t(ldq)), dkv(sT * size_t(ldkv)), dckv(sT * size_t(d.ldc));
  mla::attention_backward_f64(dq.data(), ldq, dkv.data(), ldkv, dckv.data() + d.R, d.ldc, dO.data(), ldo, tp.q.data(),
                              ldq, tp.kv.data(), ldkv, tp.ckv.data() + d.R, d.ldc, tp.lse.data(), T, core_dims(d),
                              scale);

  // kv = lat Wkvbᵀ:  dWkvb += dkvᵀ lat;  dlat = dkv Wkvb.
  std::vector<double> dlat(sT * size_t(d.R));
  linear_backward_w_strided(P.g(n.kv_b, ldkv * d.R), dkv.data(), ldkv, tp.lat.data(), d.R, T, d.R, ldkv);
  linear_backward_x_strided(dlat.data(), d.R, dkv.data(), ldkv, P.p(n.kv_b, ldkv * d.R), T, d.R, ldkv, false);
  // lat = RMSNorm(c_lat): its input gradient fills columns 0..R of dckv (k_rot columns hold the attention term).
  rmsnorm_backward_saved(dckv.data(), d.ldc, P.g(n.kv_a_norm, d.R), dlat.data(), tp.lat_hat.data(), tp.lat_rs.data(),
                         P.p(n.kv_a_norm, d.R), T, d.R);
  // ckv = x Wkvaᵀ.
  linear_backward_w_strided(P.g(n.kv_a, d.ldc * d.D), dckv.data(), d.ldc, x, d.D, T, d.D, d.ldc);
  linear_backward_x_strided(dx, d.D, dckv.data(), d.ldc, P.p(n.kv_a, d.ldc * d.D), T, d.D, d.ldc, dx_written);

  // q path.
  if (d.Qr > 0) {
    // q = qa Wqbᵀ;  qa = RMSNorm(qa_raw);  qa_raw = x Wqaᵀ.
    std::vector<double> dqa(sT * size_t(d.Qr)), dqa_raw(sT * size_t(d.Qr));
    linear_backward_w_strided(P.g(n.q_b, ldq * d.Qr), dq.data(), ldq, tp.qa.data(), d.Qr, T, d.Qr, ldq);
    linear_backward_x_strided(dqa.data(), d.Qr, dq.data(), ldq, P.p(n.q_b, ldq * d.Qr), T, d.Qr, ldq, false);
    rmsnorm_backward_saved(dqa_raw.data(), d.Qr, P.g(n.q_a_norm, d.Qr), dqa.data(), tp.qa_hat.data(), tp.qa_rs.data(),
                           P.p(n.q_a_norm, d.Qr), T, d.Qr);
    linear_backward_w_strided(P.g(n.q_a, d.Qr * d.D), dqa_raw.data(), d.Qr, x, d.D, T, d.D, d.Qr);
    linear_backward_x_strided(dx, d.D, dqa_raw.data(), d.Qr, P.p(n.q_a, d.Qr * d.D), T, d.D, d.Qr, true);
  } else {
    linear_backward_w_strided(P.g(n.q, ldq * d.D), dq.data(), ldq, x, d.D, T, d.D, ldq);
    linear_backward_x_strided(dx, d.D, dq.data(), ldq, P.p(n.q, ldq * d.D), T, d.D, ldq, true);
  }
}

}  // namespace k3::train
