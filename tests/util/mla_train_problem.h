// The shared harness of the training MLA attention tests (test_cuda_train_mla.cpp: the fp32 kernels,
// test_cuda_train_mla_tc.cpp: the bf16 tensor-core kernels): random fp32 problems of packed sequences,
// the float64 twins one sequence at a time, a packed GPU run with strided operands, NaN input padding
// and sentinel output padding, and the checks both tests make. Each test names the entry points
// (Kernels) and its own tolerance.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "core/cuda.h"                   // defines: cuda::DeviceBuffer, cuda::synchronize
#include "kernels/mla/mla_f64.h"         // defines: mla::attention_forward_f64, mla::attention_backward_f64, ...
#include "kernels/mla/mla_train_cuda.h"  // defines: mla::cuda::attention_forward_train, ...
#include "kernels/mla/mla_train_tc_cuda.h"  // defines: mla::cuda::attention_forward_train_bf16, ...
#include "random.h"                      // defines: randn

namespace k3test::mla_train {

constexpr float kSentinel = 12345.0f;
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// ||got - want|| / ||want||; +inf when any value is non-finite or the sizes differ.
inline double rel_err(const std::vector<float>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return INFINITY;
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]) || !std::isfinite(want[i])) return INFINITY;
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1e-300));
}

// std * N(0, 1) draws rounded to fp32 (the values both sides see).
inline std::vector<float> randf(int64_t n, uint64_t seed, double std = 1.0) {
  const std::vector<double> r = k3test::randn(n, seed);
  std::vector<float> f(r.size());
  for (size_t i = 0; i < r.size(); ++i) f[i] = float(r[i] * std);
  return f;
}
inline std::vector<double> widen(const std::vector<float>& f) { return std::vector<double>(f.begin(), f.end()); }

// One sequence's inputs and results, compact (row stride = width).
struct Seq {
  int64_t T = 0;
  std::vector<float> q, kv, kr, d_o;        // [T, H*(Dn+Dr)], [T, H*(Dn+Dv)], [T, Dr], [T, H*Dv]
  std::vector<float> o, lse, dq, dkv, dkr;  // results: [T, H*Dv], [H, T], like q, like kv, like kr
};

struct Widths {
  int64_t q, kv, r, o;
  explicit Widths(const k3::mla::Dims& d) : q(d.H * (d.Dn + d.Dr)), kv(d.H * (d.Dn + d.Dv)), r(d.Dr), o(d.H * d.Dv) {}
};

inline std::vector<Seq> make_seqs(const std::vector<int64_t>& lens, const k3::mla::Dims& d, uint64_t seed,
                                  double q_std = 1.0) {
  const Widths w(d);
  std::vector<Seq> s(lens.size());
  for (size_t b = 0; b < lens.size(); ++b) {
    const int64_t T = lens[b];
    const uint64_t sd = seed + 100 * b;
    s[b].T = T;
    s[b].q = randf(T * w.q, sd + 1, q_std);
    s[b].kv = randf(T * w.kv, sd + 2);
    s[b].kr = randf(T * w.r, sd + 3);
    s[b].d_o = randf(T * w.o, sd + 4);
  }
  return s;
}

// The float64 twins, one sequence at a time (compact layouts).
inline void reference(Seq& s, std::vector<double>& o, std::vector<double>& lse, std::vector<double>& dq,
                      std::vector<double>& dkv, std::vector<double>& dkr, const k3::mla::Dims& d, double scale) {
  const Widths w(d);
  const int64_t T = s.T;
  const std::vector<double> q = widen(s.q), kv = widen(s.kv), kr = widen(s.kr), d_o = widen(s.d_o);
  o.assign(size_t(T * w.o), 0.0);
  lse.assign(size_t(d.H * T), 0.0);
  dq.assign(size_t(T * w.q), 0.0);
  dkv.assign(size_t(T * w.kv), 0.0);
  dkr.assign(size_t(T * w.r), 0.0);
  k3::mla::attention_forward_f64(o.data(), w.o, lse.data(), q.data(), w.q, kv.data(), w.kv, kr.data(), w.r, T, d,
                                 scale);
  k3::mla::attention_backward_f64(dq.data(), w.q, dkv.data(), w.kv, dkr.data(), w.r, d_o.data(), w.o, q.data(), w.q,
                                  kv.data(), w.kv, kr.data(), w.r, lse.data(), T, d, scale);
}

// Row strides wider than the columns (+ pads), and k_rot at column kRotCol of a wider buffer.
constexpr int64_t kRotCol = 5;
struct Strides {
  int64_t q, kv, c, o, dq, dkv, dr;
  explicit Strides(const Widths& w)
      : q(w.q + 3), kv(w.kv + 5), c(kRotCol + w.r + 2), o(w.o + 7), dq(w.q + 2), dkv(w.kv + 1), dr(w.r + 4) {}
};

// dst [rows, ld] filled with `pad`, then the compact [rows, width] src copied to columns [col, col + width).
inline void pack(std::vector<float>& dst, int64_t ld, int64_t col, int64_t row0, const std::vector<float>& src,
                 int64_t width) {
  for (int64_t r = 0; r < int64_t(src.size()) / std::max<int64_t>(width, 1); ++r)
    std::copy(src.begin() + r * width, src.begin() + (r + 1) * width, dst.begin() + (row0 + r) * ld + col);
}
inline std::vector<float> unpack(const std::vector<float>& src, int64_t ld, int64_t col, int64_t row0, int64_t T,
                                 int64_t width) {
  std::vector<float> out(size_t(T * width));
  for (int64_t r = 0; r < T; ++r)
    std::copy(src.begin() + (row0 + r) * ld + col, src.begin() + (row0 + r) * ld + col + width,
              out.begin() + r * width);
  return out;
}
// The count of elements of a [rows, ld] buffer outside columns [col, col + width) that are not `pad`.
inline int64_t pad_changes(const std::vector<float>& buf, int64_t ld, int64_t col, int64_t width, float pad) {
  int64_t bad = 0;
  for (size_t i = 0; i < buf.size(); ++i) {
    const int64_t c = int64_t(i) % ld;
    if ((c < col || c >= col + width) && std::memcmp(&buf[i], &pad, sizeof(float)) != 0) ++bad;
  }
  return bad;
}

// The entry points under test: a forward (o, lse) with the size of its workspace, the size of the
// backward's workspace, and a backward that takes the forward's o and lse. The bf16 entry points have
// these signatures; fp32_forward / no_forward_workspace adapt the fp32 forward, which takes none.
struct Kernels {
  decltype(&k3::mla::cuda::attention_forward_train_bf16) forward;
  decltype(&k3::mla::cuda::attention_forward_workspace_bytes_bf16) forward_workspace_bytes;
  decltype(&k3::mla::cuda::attention_backward_workspace_bytes) workspace_bytes;
  decltype(&k3::mla::cuda::attention_backward_train) backward;
};
inline void fp32_forward(float* o, int64_t ldo, float* lse, const float* q, int64_t ldq, const float* kv, int64_t ldkv,
                         const float* k_rot, int64_t ldr, const int32_t* cu_seqlens, int B, int64_t max_len,
                         int64_t rows, const k3::mla::Dims& d, float scale, void*, bool causal) {
  k3::mla::cuda::attention_forward_train(o, ldo, lse, q, ldq, kv, ldkv, k_rot, ldr, cu_seqlens, B, max_len, rows, d,
                                         scale, causal);
}
inline size_t no_forward_workspace(int64_t, const k3::mla::Dims&) { return 0; }

// Packs `seqs` in the given order, runs the GPU forward and backward (the backward takes the forward's
// o and lse), and stores each sequence's results in it. Checks that no padding changed.
inline void run_gpu(std::vector<Seq>& seqs, const k3::mla::Dims& d, float scale, const Kernels& kernels) {
  const Widths w(d);
  const Strides ld(w);
  std::vector<int32_t> cu{0};
  int64_t max_len = 0;
  for (const Seq& s : seqs) {
    cu.push_back(cu.back() + int32_t(s.T));
    max_len = std::max(max_len, s.T);
  }
  const int64_t rows = cu.back();
  const int B = int(seqs.size());
  std::vector<float> q(size_t(rows * ld.q), kNaN), kv(size_t(rows * ld.kv), kNaN), ckv(size_t(rows * ld.c), kNaN),
      d_o(size_t(rows * ld.o), kNaN);
  for (int b = 0; b < B; ++b) {
    pack(q, ld.q, 0, cu[b], seqs[b].q, w.q);
    pack(kv, ld.kv, 0, cu[b], seqs[b].kv, w.kv);
    pack(ckv, ld.c, kRotCol, cu[b], seqs[b].kr, w.r);
    pack(d_o, ld.o, 0, cu[b], seqs[b].d_o, w.o);
  }
  k3::cuda::DeviceBuffer<float> q_d(q.data(), q.size()), kv_d(kv.data(), kv.size()), ckv_d(ckv.data(), ckv.size()),
      do_d(d_o.data(), d_o.size());
  k3::cuda::DeviceBuffer<int32_t> cu_d(cu.data(), cu.size());
  std::vector<float> o(size_t(rows * ld.o), kSentinel), lse(size_t(d.H * rows), kSentinel),
      dq(size_t(rows * ld.dq), kSentinel), dkv(size_t(rows * ld.dkv), kSentinel), dkr(size_t(rows * ld.dr), kSentinel);
  k3::cuda::DeviceBuffer<float> o_d(o.data(), o.size()), lse_d(lse.data(), lse.size()), dq_d(dq.data(), dq.size()),
      dkv_d(dkv.data(), dkv.size()), dkr_d(dkr.data(), dkr.size());
  // Workspace full of NaN bytes: a read of a part the kernels did not write would show.
  const size_t ws_bytes = kernels.workspace_bytes(rows, d);
  std::vector<unsigned char> ws_init(ws_bytes, 0xFF);
  k3::cuda::DeviceBuffer<unsigned char> ws(ws_init.data(), ws_init.size());

  const size_t fws_bytes = kernels.forward_workspace_bytes(rows, d);
  std::vector<unsigned char> fws_init(fws_bytes, 0xFF);
  k3::cuda::DeviceBuffer<unsigned char> fws(fws_init.data(), fws_init.size());
  kernels.forward(o_d.data(), ld.o, lse_d.data(), q_d.data(), ld.q, kv_d.data(), ld.kv, ckv_d.data() + kRotCol, ld.c,
                  cu_d.data(), B, max_len, rows, d, scale, fws.data(), /*causal=*/true);
  kernels.backward(dq_d.data(), ld.dq, dkv_d.data(), ld.dkv, dkr_d.data(), ld.dr, do_d.data(), ld.o, o_d.data(),
                   q_d.data(), ld.q, kv_d.data(), ld.kv, ckv_d.data() + kRotCol, ld.c, lse_d.data(), cu_d.data(), B,
                   max_len, rows, d, scale, ws.data(), /*causal=*/true);
  k3::cuda::synchronize();
  o_d.download(o.data(), o.size());
  lse_d.download(lse.data(), lse.size());
  dq_d.download(dq.data(), dq.size());
  dkv_d.download(dkv.data(), dkv.size());
  dkr_d.download(dkr.data(), dkr.size());
  EXPECT_EQ(pad_changes(o, ld.o, 0, w.o, kSentinel), 0) << "o padding written";
  EXPECT_EQ(pad_changes(dq, ld.dq, 0, w.q, kSentinel), 0) << "dq padding written";
  EXPECT_EQ(pad_changes(dkv, ld.dkv, 0, w.kv, kSentinel), 0) << "dkv padding written";
  EXPECT_EQ(pad_changes(dkr, ld.dr, 0, w.r, kSentinel), 0) << "dk_rot padding written";
  for (int b = 0; b < B; ++b) {
    Seq& s = seqs[b];
    s.o = unpack(o, ld.o, 0, cu[b], s.T, w.o);
    s.dq = unpack(dq, ld.dq, 0, cu[b], s.T, w.q);
    s.dkv = unpack(dkv, ld.dkv, 0, cu[b], s.T, w.kv);
    s.dkr = unpack(dkr, ld.dr, 0, cu[b], s.T, w.r);
    s.lse.assign(size_t(d.H * s.T), 0.0f);
    for (int64_t h = 0; h < d.H; ++h)
      std::copy(lse.begin() + h * rows + cu[b], lse.begin() + h * rows + cu[b] + s.T, s.lse.begin() + h * s.T);
  }
}

// Packed sequences of lengths {1, 7, 64, 130} against the float64 twins: o, lse, dq, dkv and dk_rot each
// within relative L2 tol.
inline void check_against_f64(const Kernels& kernels, const k3::mla::Dims& d, uint64_t seed, double q_std, double tol) {
  const float scale = float(1.0 / std::sqrt(double(d.Dn + d.Dr)));
  std::vector<Seq> seqs = make_seqs({1, 7, 64, 130}, d, seed, q_std);
  run_gpu(seqs, d, scale, kernels);
  std::vector<float> got[5];
  std::vector<double> want[5];
  for (Seq& s : seqs) {
    std::vector<double> r[5];
    reference(s, r[0], r[1], r[2], r[3], r[4], d, double(scale));
    const std::vector<float>* g[5] = {&s.o, &s.lse, &s.dq, &s.dkv, &s.dkr};
    for (int k = 0; k < 5; ++k) {
      got[k].insert(got[k].end(), g[k]->begin(), g[k]->end());
      want[k].insert(want[k].end(), r[k].begin(), r[k].end());
    }
  }
  const char* names[5] = {"o", "lse", "dq", "dkv", "dk_rot"};
  for (int k = 0; k < 5; ++k) {
    const double e = rel_err(got[k], want[k]);
    std::printf("H%lld Dn%lld Dr%lld Dv%lld %-6s rel L2 %.3g\n", (long long)d.H, (long long)d.Dn, (long long)d.Dr,
                (long long)d.Dv, names[k], e);
    EXPECT_LE(e, tol) << names[k];
  }
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// A sequence's o, lse, dq, dkv, dk_rot are bitwise the same alone, packed with others (in two
// orders, one with an empty sequence among them), and on a second run.
inline void check_packing_independent(const Kernels& kernels) {
  const k3::mla::Dims d{3, 40, 13, 24, 0};
  const float scale = float(1.0 / std::sqrt(53.0));
  std::vector<Seq> packed = make_seqs({1, 7, 64, 130}, d, 51);
  std::vector<Seq> reordered{packed[3], packed[0], make_seqs({0}, d, 52)[0], packed[2], packed[1]};  // + an empty one
  std::vector<Seq> again = packed;
  run_gpu(packed, d, scale, kernels);
  run_gpu(reordered, d, scale, kernels);
  run_gpu(again, d, scale, kernels);
  const int order[4] = {1, 4, 3, 0};  // packed[b] is reordered[order[b]]
  for (int b = 0; b < 4; ++b) {
    std::vector<Seq> alone{packed[b]};
    run_gpu(alone, d, scale, kernels);
    for (const Seq* other : {&alone[0], &reordered[order[b]], &again[b]}) {
      EXPECT_TRUE(same_bits(packed[b].o, other->o)) << "o of sequence " << b;
      EXPECT_TRUE(same_bits(packed[b].lse, other->lse)) << "lse of sequence " << b;
      EXPECT_TRUE(same_bits(packed[b].dq, other->dq)) << "dq of sequence " << b;
      EXPECT_TRUE(same_bits(packed[b].dkv, other->dkv)) << "dkv of sequence " << b;
      EXPECT_TRUE(same_bits(packed[b].dkr, other->dkr)) << "dk_rot of sequence " << b;
    }
  }
}

// One sequence of 65536 positions at K3's head dims (H = 1), peaky scores (q std 3): every output is
// finite, and sampled query rows (o, lse, dq) and keys near the end (dk_nope, dv, dk_rot, which only
// the last queries see) match a float64 evaluation of exactly those rows.
inline void check_long_sequence(const Kernels& kernels, double tol) {
  const k3::mla::Dims d{1, 128, 64, 128, 0};
  const int64_t T = 65536, dqk = 192, dkv = 256;
  const double scale = 1.0 / std::sqrt(192.0);
  std::vector<Seq> seqs = make_seqs({T}, d, 61, 3.0);
  run_gpu(seqs, d, float(scale), kernels);
  const Seq& s = seqs[0];
  for (const std::vector<float>* v : {&s.o, &s.lse, &s.dq, &s.dkv, &s.dkr})
    ASSERT_TRUE(std::all_of(v->begin(), v->end(), [](float x) { return std::isfinite(x); }));

  // Row t in float64: P_ts (s <= t), dP_ts = dO_t·v_s, lse_t, Delta_t = Σ_s P_ts dP_ts.
  auto k_at = [&](int64_t sidx, int64_t j) {
    return j < 128 ? double(s.kv[sidx * dkv + j]) : double(s.kr[sidx * 64 + j - 128]);
  };
  struct Row {
    std::vector<double> p, dp;
    double lse = 0, delta = 0;
  };
  auto row = [&](int64_t t) {
    Row r;
    r.p.resize(size_t(t + 1));
    r.dp.resize(size_t(t + 1));
    double mx = -INFINITY;
    for (int64_t si = 0; si <= t; ++si) {
      double acc = 0, a2 = 0;
      for (int64_t j = 0; j < dqk; ++j) acc += double(s.q[t * dqk + j]) * k_at(si, j);
      for (int64_t j = 0; j < 128; ++j) a2 += double(s.d_o[t * 128 + j]) * double(s.kv[si * dkv + 128 + j]);
      r.p[si] = acc * scale;
      r.dp[si] = a2;
      mx = std::max(mx, r.p[si]);
    }
    double z = 0;
    for (double& x : r.p) z += (x = std::exp(x - mx));
    for (double& x : r.p) x /= z;
    r.lse = mx + std::log(z);
    for (int64_t si = 0; si <= t; ++si) r.delta += r.p[si] * r.dp[si];
    return r;
  };
  std::vector<float> got_o, got_lse, got_dq, got_dk, got_dv;
  std::vector<double> want_o, want_lse, want_dq, want_dk, want_dv;
  for (int64_t t : {int64_t(0), int64_t(1), int64_t(63), int64_t(64), int64_t(4097), int64_t(40000), T - 1}) {
    if (t >= T) continue;
    const Row r = row(t);
    got_lse.push_back(s.lse[t]);
    want_lse.push_back(r.lse);
    for (int64_t j = 0; j < 128; ++j) {
      double acc = 0;
      for (int64_t si = 0; si <= t; ++si) acc += r.p[si] * double(s.kv[si * dkv + 128 + j]);
      got_o.push_back(s.o[t * 128 + j]);
      want_o.push_back(acc);
    }
    for (int64_t j = 0; j < dqk; ++j) {
      double acc = 0;
      for (int64_t si = 0; si <= t; ++si) acc += r.p[si] * (r.dp[si] - r.delta) * k_at(si, j);
      got_dq.push_back(s.dq[t * dqk + j]);
      want_dq.push_back(acc * scale);
    }
  }
  // Keys T-1 .. T-24: every query that sees them is among the last 24 rows.
  const int64_t kKeys = 24;
  std::vector<Row> last;
  for (int64_t t = T - kKeys; t < T; ++t) last.push_back(row(t));
  for (int64_t si = T - kKeys; si < T; ++si) {
    std::vector<double> dk(dqk, 0.0), dv(128, 0.0);
    for (int64_t t = si; t < T; ++t) {
      const Row& r = last[size_t(t - (T - kKeys))];
      const double ds = r.p[si] * (r.dp[si] - r.delta);
      for (int64_t j = 0; j < dqk; ++j) dk[j] += ds * double(s.q[t * dqk + j]);
      for (int64_t j = 0; j < 128; ++j) dv[j] += r.p[si] * double(s.d_o[t * 128 + j]);
    }
    for (int64_t j = 0; j < dqk; ++j) {
      got_dk.push_back(j < 128 ? s.dkv[si * dkv + j] : s.dkr[si * 64 + j - 128]);
      want_dk.push_back(dk[j] * scale);
    }
    for (int64_t j = 0; j < 128; ++j) {
      got_dv.push_back(s.dkv[si * dkv + 128 + j]);
      want_dv.push_back(dv[j]);
    }
  }
  const std::pair<const char*, double> errs[] = {{"o", rel_err(got_o, want_o)},
                                                 {"lse", rel_err(got_lse, want_lse)},
                                                 {"dq", rel_err(got_dq, want_dq)},
                                                 {"dk", rel_err(got_dk, want_dk)},
                                                 {"dv", rel_err(got_dv, want_dv)}};
  for (const auto& [name, e] : errs) {
    std::printf("T %lld %-4s rel L2 %.3g\n", (long long)T, name, e);
    EXPECT_LE(e, tol) << name;
  }
}

}  // namespace k3test::mla_train
