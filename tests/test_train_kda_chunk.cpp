// The chunked KDA recurrence core in float64 (src/kernels/kda/kda_chunk_f64.h) against its token-by-token
// reference twin (kda_recurrent_*_f64 in src/kernels/kda/kda_f64.h), forward and backward, over awkward
// lengths, chunk sizes and gates (at the lower bound, near 0, random), and against central finite
// differences; then the whole KDA block in both forms.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/kda/kda_chunk_f64.h"
#include "kernels/kda/kda_f64.h"
#include "model/config.h"
#include "model/params.h"
#include "model/training/kda_block.h"
#include "util/finite_diff.h"
#include "util/kda_micro.h"
#include "util/random.h"

using namespace k3;
using namespace k3::train;
using namespace k3::kda;
using k3test::randn;

namespace {

enum class Gate { Random, AtBound, NearZero };
const char* gate_name(Gate g) { return g == Gate::Random ? "random" : g == Gate::AtBound ? "at-bound" : "near-zero"; }

constexpr double kLowerBound = -5.0;  // K3's gate_lower_bound

// Inputs as the block hands them to the recurrence: q, k L2-normalised per head, beta in (0, 1), g in
// [lower bound, 0].
struct Inputs {
  int64_t T, H, Dk, Dv;
  double scale;
  std::vector<double> q, k, v, g, beta;
};

Inputs make_inputs(int64_t T, int64_t H, int64_t Dk, int64_t Dv, Gate gate, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  Inputs in{T, H, Dk, Dv, 1.0 / std::sqrt(double(Dk)), {}, {}, {}, {}, {}};
  auto normalised = [&](std::vector<double>& x) {
    x.resize(size_t(T * H * Dk));
    for (double& e : x) e = nd(rng);
    for (int64_t r = 0; r < T * H; ++r) {
      double ss = 0;
      for (int64_t d = 0; d < Dk; ++d) ss += x[size_t(r * Dk + d)] * x[size_t(r * Dk + d)];
      for (int64_t d = 0; d < Dk; ++d) x[size_t(r * Dk + d)] /= std::sqrt(ss + 1e-6);
    }
  };
  normalised(in.q);
  normalised(in.k);
  in.v.resize(size_t(T * H * Dv));
  for (double& e : in.v) e = nd(rng);
  in.beta.resize(size_t(T * H));
  for (double& e : in.beta) e = 0.05 + 0.9 * ud(rng);
  in.g.resize(size_t(T * H * Dk));
  for (double& e : in.g) {
    if (gate == Gate::AtBound) e = kLowerBound;
    else if (gate == Gate::NearZero) e = -1e-3 * ud(rng);
    else e = kLowerBound * ud(rng) * ud(rng);  // mostly mild decays, some strong
  }
  return in;
}

struct Forward {
  std::vector<double> o, states;
};
Forward chunk_fwd(const Inputs& in, int64_t C) {
  Forward f{std::vector<double>(size_t(in.T * in.H * in.Dv)),
            std::vector<double>(size_t((in.T + C - 1) / C * in.H * in.Dk * in.Dv))};
  kda_chunk_forward_f64(f.o.data(), f.states.data(), in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
                        in.scale, in.T, in.H, in.Dk, in.Dv, C);
  return f;
}
Forward recurrent_fwd(const Inputs& in, int64_t every) {
  Forward f{std::vector<double>(size_t(in.T * in.H * in.Dv)),
            std::vector<double>(size_t((in.T + every - 1) / every * in.H * in.Dk * in.Dv))};
  kda_recurrent_forward_f64(f.o.data(), f.states.data(), in.q.data(), in.k.data(), in.v.data(), in.g.data(),
                            in.beta.data(), in.scale, in.T, in.H, in.Dk, in.Dv, every);
  return f;
}

struct Grads {
  std::vector<double> dq, dk, dv, dg, dbeta;
};
Grads alloc_grads(const Inputs& in) {
  const size_t nk = size_t(in.T * in.H * in.Dk), nv = size_t(in.T * in.H * in.Dv);
  // Filled with garbage: every output must be overwritten.
  return Grads{std::vector<double>(nk, 7.0), std::vector<double>(nk, 7.0), std::vector<double>(nv, 7.0),
               std::vector<double>(nk, 7.0), std::vector<double>(size_t(in.T * in.H), 7.0)};
}
Grads chunk_bwd(const Inputs& in, const Forward& f, const std::vector<double>& d_o, int64_t C) {
  Grads gr = alloc_grads(in);
  kda_chunk_backward_f64(gr.dq.data(), gr.dk.data(), gr.dv.data(), gr.dg.data(), gr.dbeta.data(), d_o.data(),
                         f.states.data(), in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), in.scale,
                         in.T, in.H, in.Dk, in.Dv, C);
  return gr;
}
Grads recurrent_bwd(const Inputs& in, const Forward& f, const std::vector<double>& d_o, int64_t every) {
  Grads gr = alloc_grads(in);
  kda_recurrent_backward_f64(gr.dq.data(), gr.dk.data(), gr.dv.data(), gr.dg.data(), gr.dbeta.data(), d_o.data(),
                             f.states.data(), in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
                             in.scale, in.T, in.H, in.Dk, in.Dv, every);
  return gr;
}

// max |a - b| / max |b| (the error relative to the tensor's scale); +inf on a non-finite value.
double rel_max(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    num = std::max(num, std::fabs(a[i] - b[i]));
    den = std::max(den, std::fabs(b[i]));
  }
  return num / (den > 0 ? den : 1e-300);
}

struct Shape {
  int64_t H, Dk, Dv;
};
const Shape kShapes[] = {{3, 8, 6}, {2, 16, 16}};  // Dk != Dv, and K3's square heads
const int64_t kLengths[] = {1, 15, 16, 17, 50, 100};
const int64_t kChunks[] = {1, 4, 16};
const Gate kGates[] = {Gate::Random, Gate::AtBound, Gate::NearZero};

// Calls f(shape, T, C, gate) for every combination of the grids above, with a trace naming the case.
template <class F>
void for_each_case(F f) {
  for (const Shape sh : kShapes)
    for (const int64_t T : kLengths)
      for (const int64_t C : kChunks)
        for (const Gate gate : kGates) {
          SCOPED_TRACE("H=" + std::to_string(sh.H) + " Dk=" + std::to_string(sh.Dk) + " Dv=" + std::to_string(sh.Dv) +
                       " T=" + std::to_string(T) + " C=" + std::to_string(C) + " gate=" + gate_name(gate));
          f(sh, T, C, gate);
        }
}

}  // namespace

// (a) The chunked forward equals the recurrence (outputs and the states entering every chunk).
TEST(TrainKdaChunk, ForwardMatchesRecurrent) {
  double worst_o = 0, worst_s = 0;
  uint64_t seed = 1;
  for_each_case([&](const Shape sh, int64_t T, int64_t C, Gate gate) {
    const Inputs in = make_inputs(T, sh.H, sh.Dk, sh.Dv, gate, ++seed);
    const Forward c = chunk_fwd(in, C), r = recurrent_fwd(in, C);
    const double eo = rel_max(c.o, r.o), es = rel_max(c.states, r.states);
    EXPECT_LE(eo, 1e-12);
    if (T > C) EXPECT_LE(es, 1e-12);  // with one chunk both hold only the zero state
    else EXPECT_EQ(c.states, r.states);
    worst_o = std::max(worst_o, eo), worst_s = std::max(worst_s, es);
    // Without chunk_states the output is the same, bit for bit.
    std::vector<double> o2(c.o.size());
    kda_chunk_forward_f64(o2.data(), nullptr, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
                          in.scale, T, sh.H, sh.Dk, sh.Dv, C);
    EXPECT_EQ(o2, c.o);
  });
  std::printf("chunked vs recurrent forward: max rel error o %.3e, chunk states %.3e\n", worst_o, worst_s);
}

// (b) The chunked backward equals the recurrent backward, for every output.
TEST(TrainKdaChunk, BackwardMatchesRecurrent) {
  double worst[5] = {0, 0, 0, 0, 0};
  const char* names[5] = {"dq", "dk", "dv", "dg", "dbeta"};
  uint64_t seed = 100;
  for_each_case([&](const Shape sh, int64_t T, int64_t C, Gate gate) {
    const Inputs in = make_inputs(T, sh.H, sh.Dk, sh.Dv, gate, ++seed);
    const std::vector<double> d_o = randn(T * sh.H * sh.Dv, ++seed);
    const Forward fc = chunk_fwd(in, C), fr = recurrent_fwd(in, C);
    const Grads c = chunk_bwd(in, fc, d_o, C);
    // The reference recomputes from states saved every C tokens too; its result does not depend on that spacing.
    const Grads r = recurrent_bwd(in, fr, d_o, C);
    const std::vector<double>* a[5] = {&c.dq, &c.dk, &c.dv, &c.dg, &c.dbeta};
    const std::vector<double>* b[5] = {&r.dq, &r.dk, &r.dv, &r.dg, &r.dbeta};
    for (int i = 0; i < 5; ++i) {
      const double e = rel_max(*a[i], *b[i]);
      EXPECT_LE(e, 1e-10) << names[i];
      worst[i] = std::max(worst[i], e);
    }
  });
  std::printf("chunked vs recurrent backward, max rel error: dq %.3e dk %.3e dv %.3e dg %.3e dbeta %.3e\n", worst[0],
              worst[1], worst[2], worst[3], worst[4]);
}

// (c) Central finite differences of loss = sum(o * R) for a spread of entries of every input. T = 37 with
// C = 16 has two full chunks and a partial one, so gradients cross chunk boundaries.
TEST(TrainKdaChunk, BackwardMatchesFiniteDifferences) {
  const int64_t T = 37, H = 2, Dk = 8, Dv = 8, C = 16;
  for (const Gate gate : kGates) {
    SCOPED_TRACE(gate_name(gate));
    Inputs in = make_inputs(T, H, Dk, Dv, gate, 4242);
    const std::vector<double> R = randn(T * H * Dv, 4243);
    const Forward f = chunk_fwd(in, C);
    const Grads gr = chunk_bwd(in, f, R, C);
    auto loss = [&] {
      std::vector<double> o(size_t(T * H * Dv));
      kda_chunk_forward_f64(o.data(), nullptr, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
                            in.scale, T, H, Dk, Dv, C);
      double L = 0;
      for (size_t i = 0; i < o.size(); ++i) L += o[i] * R[i];
      return L;
    };
    struct Var {
      const char* name;
      std::vector<double>* x;
      const std::vector<double>* grad;
    };
    double worst = 0;
    for (const Var var : {Var{"q", &in.q, &gr.dq}, Var{"k", &in.k, &gr.dk}, Var{"v", &in.v, &gr.dv},
                          Var{"g", &in.g, &gr.dg}, Var{"beta", &in.beta, &gr.dbeta}}) {
      const int64_t n = int64_t(var.x->size());
      // 12 entries spread over the tensor (first, last, and strided ones in between).
      for (int64_t j = 0; j < 12; ++j) {
        const int64_t i = j == 11 ? n - 1 : (j * 7919) % n;
        const double num = k3test::central_difference(&(*var.x)[size_t(i)], loss, 1e-6);
        const double ana = (*var.grad)[size_t(i)];
        const double ratio = std::fabs(ana - num) / (1e-8 + 1e-6 * std::fabs(num));
        worst = std::max(worst, ratio);
        EXPECT_LE(ratio, 1.0) << var.name << "[" << i << "]: analytic " << ana << " numeric " << num;
      }
    }
    std::printf("gate %s: worst |a-b|/(1e-8+1e-6|b|) = %.3e\n", gate_name(gate), worst);
  }
}

// A chunk far longer than K3's, with every gate at the bound: Gamma reaches -5 * 199 = -995 inside a chunk,
// where exp(Gamma_r) / exp(Gamma_s) would be inf / inf (e^995 overflows double). The pair decays are formed
// as products of per-token decays (kda_chunk.cpp), so everything stays finite and matches the recurrence.
TEST(TrainKdaChunk, LongChunkAtTheBoundStaysFinite) {
  const int64_t T = 300, H = 2, Dk = 8, Dv = 8, C = 200;
  const Inputs in = make_inputs(T, H, Dk, Dv, Gate::AtBound, 77);
  const std::vector<double> d_o = randn(T * H * Dv, 78);
  const Forward fc = chunk_fwd(in, C), fr = recurrent_fwd(in, C);
  EXPECT_LE(rel_max(fc.o, fr.o), 1e-12);
  const Grads c = chunk_bwd(in, fc, d_o, C), r = recurrent_bwd(in, fr, d_o, C);
  EXPECT_LE(rel_max(c.dq, r.dq), 1e-10);
  EXPECT_LE(rel_max(c.dk, r.dk), 1e-10);
  EXPECT_LE(rel_max(c.dv, r.dv), 1e-10);
  EXPECT_LE(rel_max(c.dg, r.dg), 1e-10);
  EXPECT_LE(rel_max(c.dbeta, r.dbeta), 1e-10);
}

// Bad arguments are k3::Errors naming the argument; T = 0 is a no-op.
TEST(TrainKdaChunk, BadArgumentsThrowAndEmptyIsNoop) {
  const Inputs in = make_inputs(4, 1, 4, 4, Gate::Random, 9);
  std::vector<double> o(16), st(16);
  auto fwd = [&](int64_t T, int64_t H, int64_t C) {
    kda_chunk_forward_f64(o.data(), st.data(), in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
                          in.scale, T, H, 4, 4, C);
  };
  for (auto [T, H, C, what] : {std::tuple{4, 1, 0, "chunk"}, std::tuple{4, 0, 4, "H"}, std::tuple{-1, 1, 4, "T"}}) {
    try {
      fwd(T, H, C);
      FAIL() << "no error for " << what;
    } catch (const k3::Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
  std::vector<double> untouched(16, 3.0);
  o = untouched;
  fwd(0, 1, 4);
  EXPECT_EQ(o, untouched);
  std::vector<double> dq(16, 3.0);
  kda_chunk_backward_f64(dq.data(), dq.data(), dq.data(), dq.data(), dq.data(), o.data(), nullptr, in.q.data(),
                         in.k.data(), in.v.data(), in.g.data(), in.beta.data(), in.scale, 0, 1, 4, 4, 4);
  EXPECT_EQ(dq, untouched);
  EXPECT_THROW(kda_chunk_backward_f64(dq.data(), dq.data(), dq.data(), dq.data(), dq.data(), o.data(), nullptr,
                                      in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), in.scale, 4,
                                      1, 4, 4, 4),
               k3::Error);
}

// ---- the whole block in both forms ------------------------------------------------------------------

namespace {

std::string layer_prefix(int64_t l) { return "language_model.model.layers." + std::to_string(l) + "."; }

K3Config block_config() { return k3test::kda_micro_config(12, 3, 8, {AttnKind::KDA}); }

ParamStore block_params(const K3Config& c, uint64_t seed) {
  const int64_t hid = c.hidden_size, H = c.kda_num_heads, D = c.kda_head_dim, HD = H * D, K = c.short_conv_kernel_size;
  const std::string p = layer_prefix(0) + "self_attn.";
  ParamStore P;
  for (const char* s : {"q_proj.weight", "k_proj.weight", "v_proj.weight", "g_proj.weight"}) P.add(p + s, {HD, hid});
  for (const char* s : {"q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"}) P.add(p + s, {HD, 1, K});
  P.add(p + "f_a_proj.weight", {D, hid});
  P.add(p + "f_b_proj.weight", {HD, D});
  P.add(p + "b_proj.weight", {H, hid});
  P.add(p + "o_proj.weight", {hid, HD});
  P.add(p + "A_log", {H});
  P.add(p + "dt_bias", {HD});
  P.add(p + "o_norm.weight", {D});
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (const std::string& n : P.names()) {
    double* v = P.p_mut(n);
    for (int64_t i = 0; i < P.numel(n); ++i)
      v[i] = n.find("o_norm") != std::string::npos ? 1.0 + 0.3 * nd(rng) : 0.5 * nd(rng);
  }
  return P;
}

}  // namespace

// The block with the chunked core (default) against the block with the recurrent twin: same y, dx and
// parameter gradients, at several chunk sizes and a length that is not a multiple of any of them.
TEST(TrainKdaChunk, BlockChunkedMatchesRecurrentTwin) {
  const K3Config c = block_config();
  const int64_t T = 45, hid = c.hidden_size;
  ParamStore P = block_params(c, 31);
  const std::vector<double> x = randn(T * hid, 32), dy = randn(T * hid, 33);
  std::vector<double> y_ref(size_t(T * hid)), dx_ref(y_ref.size());
  KdaBlockTape ref;
  ref.recurrent_reference = true;
  kda_block_forward(P, layer_prefix(0), c, 0, x.data(), T, y_ref.data(), &ref);
  P.zero_grads();
  kda_block_backward(P, layer_prefix(0), c, 0, ref, dy.data(), dx_ref.data());
  const std::vector<double> g_ref = P.grads();
  for (const int64_t C : {int64_t(1), int64_t(4), int64_t(16)}) {
    SCOPED_TRACE("chunk " + std::to_string(C));
    KdaBlockTape tape;
    tape.state_every = C;
    std::vector<double> y(y_ref.size()), dx(y_ref.size());
    kda_block_forward(P, layer_prefix(0), c, 0, x.data(), T, y.data(), &tape);
    P.zero_grads();
    kda_block_backward(P, layer_prefix(0), c, 0, tape, dy.data(), dx.data());
    const double ey = rel_max(y, y_ref), edx = rel_max(dx, dx_ref), eg = rel_max(P.grads(), g_ref);
    EXPECT_LE(ey, 1e-12);
    EXPECT_LE(edx, 1e-10);
    EXPECT_LE(eg, 1e-10);
    std::printf("block, chunk %lld: rel max error y %.3e dx %.3e param grads %.3e\n", (long long)C, ey, edx, eg);
  }
}
