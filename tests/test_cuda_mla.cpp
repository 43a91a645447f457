// The CUDA MLA kernels (kernels/mla/mla_cuda.h) against their CPU twin (kernels/mla/mla.h) on random
// inputs of awkward sizes: prefill vs attention_head_expanded, absorbed decode vs
// attention_head_latent, and decode through the absorbed weights vs the last rows of prefill.
// Inputs are rounded to bf16 once and the CPU twin gets the same rounded values, so the tolerance
// (relative L2 <= 1e-2) only has to cover the kernels' own roundings: bf16 probabilities in P·V
// (2^-9 relative), a bf16 output (2^-9) and, for an fp32 q_lat, its bf16 rounding inside the
// decode kernel. Outputs sit between sentinels that must survive. Skips without a Hopper GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/cuda.h"             // defines: cuda::DeviceBuffer, cuda::synchronize
#include "core/dtype.h"            // defines: f32_to_bf16, bf16_to_f32
#include "core/error.h"            // defines: k3::Error
#include "kernels/mla/mla.h"       // defines: mla::attention_head_expanded, mla::attention_head_latent
#include "kernels/mla/mla_cuda.h"  // defines: mla::cuda::prefill, mla::cuda::decode
#include "util/compare.h"          // defines: rel_l2
#include "util/cuda_test.h"        // defines: K3_REQUIRE_GPU
#include "util/random.h"           // defines: randn

using namespace k3;
namespace mc = k3::mla::cuda;

namespace {

constexpr double kTol = 1e-2;
constexpr size_t kPad = 64;  // sentinel elements before and after each output (keeps 16-byte alignment)

// bf16 bits of std * N(0,1) draws, and the same values widened back to f32 (what the CPU twin sees).
struct Bf16Data {
  std::vector<uint16_t> bits;
  std::vector<float> f;
};
Bf16Data random_bf16(int64_t n, uint64_t seed, double std = 1.0) {
  const std::vector<double> r = k3test::randn(n, seed);
  Bf16Data d;
  d.bits.resize(size_t(n));
  d.f.resize(size_t(n));
  for (size_t i = 0; i < size_t(n); ++i) {
    d.bits[i] = f32_to_bf16(float(r[i] * std));
    d.f[i] = bf16_to_f32(d.bits[i]);
  }
  return d;
}
Bf16Data to_bf16(const std::vector<double>& x) {
  Bf16Data d;
  d.bits.resize(x.size());
  d.f.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    d.bits[i] = f32_to_bf16(float(x[i]));
    d.f[i] = bf16_to_f32(d.bits[i]);
  }
  return d;
}

// A device output of n elements of T between kPad sentinels on each side.
template <class T>
struct GuardedOut {
  std::vector<T> host;
  cuda::DeviceBuffer<T> dev;
  T sentinel;
  size_t n;
  GuardedOut(size_t n_, T s) : host(n_ + 2 * kPad, s), dev(n_ + 2 * kPad), sentinel(s), n(n_) {
    dev.upload(host.data(), host.size());
  }
  T* out() { return dev.data() + kPad; }
  // Downloads; returns the count of sentinel elements that changed.
  size_t fetch() {
    dev.download(host.data(), host.size());
    size_t bad = 0;
    for (size_t i = 0; i < kPad; ++i) {
      bad += std::memcmp(&host[i], &sentinel, sizeof(T)) != 0;
      bad += std::memcmp(&host[kPad + n + i], &sentinel, sizeof(T)) != 0;
    }
    return bad;
  }
  const T* data() const { return host.data() + kPad; }
};

// ---------------------------------------------------------------------------------------------
// Prefill

struct PrefillCase {
  int64_t B, n, p0, H, Dn, Dr, Dv;
  bool o_bf16;
};
std::string describe(const PrefillCase& c) {
  return "B=" + std::to_string(c.B) + " n=" + std::to_string(c.n) + " p0=" + std::to_string(c.p0) +
         " H=" + std::to_string(c.H) + " Dn=" + std::to_string(c.Dn) + " Dr=" + std::to_string(c.Dr) +
         " Dv=" + std::to_string(c.Dv) + (c.o_bf16 ? " o=bf16" : " o=f32");
}

// Runs one prefill case on the GPU and the CPU twin and checks the relative L2 error.
void check_prefill(const PrefillCase& c, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  const int64_t T = c.p0 + c.n, H = c.H, dq = c.Dn + c.Dr;
  // Per head k_nope and v, one k_rot per position shared by all heads (the MLA structure).
  const Bf16Data q = random_bf16(c.B * c.n * H * dq, seed, 1.5);
  const Bf16Data knope = random_bf16(c.B * T * H * c.Dn, seed + 1);
  const Bf16Data krot = random_bf16(c.B * T * c.Dr, seed + 2);
  const Bf16Data v = random_bf16(c.B * T * H * c.Dv, seed + 3);
  std::vector<uint16_t> k(size_t(c.B * T * H * dq));
  for (int64_t bt = 0; bt < c.B * T; ++bt)
    for (int64_t h = 0; h < H; ++h) {
      uint16_t* kr = &k[size_t((bt * H + h) * dq)];
      for (int64_t j = 0; j < c.Dn; ++j) kr[j] = knope.bits[size_t((bt * H + h) * c.Dn + j)];
      for (int64_t j = 0; j < c.Dr; ++j) kr[c.Dn + j] = krot.bits[size_t(bt * c.Dr + j)];
    }

  // CPU twin, head by head: kvh = [k_nope | v], the "cache" holds k_rot at column R = 0.
  const size_t no = size_t(c.B * c.n * H * c.Dv);
  std::vector<float> ref(no);
  const mla::Dims dcpu{H, c.Dn, c.Dr, c.Dv, 0};
  const double scale = 1.0 / std::sqrt(double(dq));
  std::vector<double> kvh(size_t(T * (c.Dn + c.Dv)));
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t s = 0; s < T; ++s) {
        const int64_t bsh = (b * T + s) * H + h;
        for (int64_t j = 0; j < c.Dn; ++j) kvh[size_t(s * (c.Dn + c.Dv) + j)] = knope.f[size_t(bsh * c.Dn + j)];
        for (int64_t j = 0; j < c.Dv; ++j) kvh[size_t(s * (c.Dn + c.Dv) + c.Dn + j)] = v.f[size_t(bsh * c.Dv + j)];
      }
      mla::attention_head_expanded(&ref[size_t((b * c.n * H + h) * c.Dv)], H * c.Dv,
                                   &q.f[size_t((b * c.n * H + h) * dq)], H * dq, kvh.data(),
                                   krot.f.data() + b * T * c.Dr, c.Dr, c.n, c.p0, dcpu, scale);
    }

  cuda::DeviceBuffer<uint16_t> dq_(q.bits.data(), q.bits.size()), dk(k.data(), k.size()),
      dv(v.bits.data(), v.bits.size());
  mc::PrefillParams p;
  p.q = dq_.data();
  p.k = dk.data();
  p.v = dv.data();
  p.d = mla::Dims{H, c.Dn, c.Dr, c.Dv, 0};
  p.B = c.B;
  p.n = c.n;
  p.p0 = c.p0;
  EXPECT_NE(mc::can_run(p).find("o is null"), std::string::npos) << "o is still null: can_run must say so";
  std::vector<float> got(no);
  if (c.o_bf16) {
    GuardedOut<uint16_t> o(no, uint16_t(0x7fc1));  // a NaN pattern no kernel output has
    p.o = o.out();
    p.o_type = mc::Dtype::BF16;
    mc::prefill(p);
    cuda::synchronize();
    EXPECT_EQ(o.fetch(), 0u) << "prefill wrote outside o";
    for (size_t i = 0; i < no; ++i) got[i] = bf16_to_f32(o.data()[i]);
  } else {
    GuardedOut<float> o(no, -12345.5f);
    p.o = o.out();
    p.o_type = mc::Dtype::F32;
    mc::prefill(p);
    cuda::synchronize();
    EXPECT_EQ(o.fetch(), 0u) << "prefill wrote outside o";
    std::memcpy(got.data(), o.data(), no * sizeof(float));
  }
  const double err = k3test::rel_l2(got, ref);
  EXPECT_LE(err, kTol);
  // Where the worst element is, for a failure message.
  size_t worst = 0;
  double wd = -1;
  for (size_t i = 0; i < no; ++i)
    if (std::abs(double(got[i]) - ref[i]) > wd) wd = std::abs(double(got[i]) - ref[i]), worst = i;
  const int64_t col = int64_t(worst) % c.Dv, hh = int64_t(worst) / c.Dv % H, row = int64_t(worst) / c.Dv / H;
  std::printf("  prefill %-52s rel_l2 %.2e  max|diff| %.2e at (b*n+i=%lld, h=%lld, j=%lld)\n", describe(c).c_str(), err,
              wd, (long long)row, (long long)hh, (long long)col);
}

// ---------------------------------------------------------------------------------------------
// Decode

struct DecodeCase {
  int64_t B, n, p0, H, Dn, Dr, R, ldc_extra;
  bool q_bf16;
  int splits;  // 0 = auto
};
std::string describe(const DecodeCase& c) {
  return "B=" + std::to_string(c.B) + " n=" + std::to_string(c.n) + " p0=" + std::to_string(c.p0) +
         " H=" + std::to_string(c.H) + " Dn=" + std::to_string(c.Dn) + " Dr=" + std::to_string(c.Dr) +
         " R=" + std::to_string(c.R) + " ldc=R+Dr+" + std::to_string(c.ldc_extra) + (c.q_bf16 ? " q=bf16" : " q=f32") +
         " splits=" + (c.splits ? std::to_string(c.splits) : std::string("auto"));
}

// The decode of one case; `ref` gets the CPU twin, the return value the GPU output [B, n, H, R].
struct DecodeRun {
  std::vector<float> got, ref;
  int splits = 0;
};
DecodeRun run_decode(const DecodeCase& c, const std::vector<uint16_t>& cache_bits, const std::vector<float>& cache_f,
                     const std::vector<double>& q_lat, const std::vector<float>& q_rot) {
  const int64_t T = c.p0 + c.n, H = c.H, ldc = c.R + c.Dr + c.ldc_extra, rows = c.B * c.n * H;
  DecodeRun out;
  // CPU twin, head by head.
  out.ref.resize(size_t(rows * c.R));
  const mla::Dims dcpu{H, 0, c.Dr, 0, c.R};  // Dn = 0: q below is [q_rot] only
  const double scale = 1.0 / std::sqrt(double(c.Dn + c.Dr));
  std::vector<double> ql(size_t(c.n * c.R)), ol(size_t(c.n * c.R));
  std::vector<float> qr(size_t(c.n * std::max<int64_t>(c.Dr, 1)));
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < c.n; ++i) {
        const int64_t row = (b * c.n + i) * H + h;
        for (int64_t j = 0; j < c.R; ++j) ql[size_t(i * c.R + j)] = q_lat[size_t(row * c.R + j)];
        for (int64_t j = 0; j < c.Dr; ++j) qr[size_t(i * c.Dr + j)] = q_rot[size_t(row * c.Dr + j)];
      }
      mla::attention_head_latent(ol.data(), ql.data(), qr.data(), c.Dr, &cache_f[size_t(b * T * ldc)], ldc, c.n, c.p0,
                                 dcpu, scale);
      for (int64_t i = 0; i < c.n; ++i)
        for (int64_t j = 0; j < c.R; ++j)
          out.ref[size_t(((b * c.n + i) * H + h) * c.R + j)] = float(ol[size_t(i * c.R + j)]);
    }

  // GPU.
  cuda::DeviceBuffer<uint16_t> dcache(cache_bits.data(), cache_bits.size());
  std::vector<float> qlf(q_lat.begin(), q_lat.end());
  std::vector<uint16_t> qlb(q_lat.size()), qrb(q_rot.size());
  for (size_t i = 0; i < q_lat.size(); ++i) qlb[i] = f32_to_bf16(float(q_lat[i]));
  for (size_t i = 0; i < q_rot.size(); ++i) qrb[i] = f32_to_bf16(q_rot[i]);
  cuda::DeviceBuffer<float> dqlf(qlf.data(), qlf.size()), dqrf(q_rot.data(), q_rot.size());
  cuda::DeviceBuffer<uint16_t> dqlb(qlb.data(), qlb.size()), dqrb(qrb.data(), qrb.size());
  GuardedOut<float> o(size_t(rows * c.R), -12345.5f);
  mc::DecodeParams p;
  p.q_type = c.q_bf16 ? mc::Dtype::BF16 : mc::Dtype::F32;
  p.q_lat = c.q_bf16 ? static_cast<const void*>(dqlb.data()) : dqlf.data();
  p.q_rot = c.q_bf16 ? static_cast<const void*>(dqrb.data()) : dqrf.data();
  p.cache = dcache.data();
  p.ldc = ldc;
  p.o_lat = o.out();
  p.d = mla::Dims{H, c.Dn, c.Dr, 0, c.R};
  p.B = c.B;
  p.n = c.n;
  p.p0 = c.p0;
  p.num_splits = c.splits;
  out.splits = mc::decode_splits(p);
  const size_t wsb = mc::decode_workspace_bytes(p);
  EXPECT_EQ(wsb == 0, out.splits == 1);
  cuda::DeviceBuffer<unsigned char> ws(wsb);
  p.workspace = ws.data();
  p.workspace_bytes = wsb;
  mc::decode(p);
  cuda::synchronize();
  EXPECT_EQ(o.fetch(), 0u) << "decode wrote outside o_lat";
  out.got.assign(o.data(), o.data() + rows * c.R);
  return out;
}

void check_decode(const DecodeCase& c, uint64_t seed, int min_splits = 1) {
  SCOPED_TRACE(describe(c));
  const int64_t T = c.p0 + c.n, H = c.H, ldc = c.R + c.Dr + c.ldc_extra, rows = c.B * c.n * H;
  // Cache rows [latent | k_rot | pad]; the pad holds values the kernel must not read into scores.
  Bf16Data cache = random_bf16(c.B * T * ldc, seed);
  const std::vector<double> ql = k3test::randn(rows * c.R, seed + 1);
  const std::vector<double> qr = k3test::randn(rows * c.Dr, seed + 2);
  std::vector<double> q_lat(ql.size());
  std::vector<float> q_rot(qr.size());
  for (size_t i = 0; i < ql.size(); ++i) q_lat[i] = c.q_bf16 ? bf16_to_f32(f32_to_bf16(float(ql[i]))) : float(ql[i]);
  for (size_t i = 0; i < qr.size(); ++i) q_rot[i] = c.q_bf16 ? bf16_to_f32(f32_to_bf16(float(qr[i]))) : float(qr[i]);
  const DecodeRun r = run_decode(c, cache.bits, cache.f, q_lat, q_rot);
  EXPECT_GE(r.splits, min_splits);
  const double err = k3test::rel_l2(r.got, r.ref);
  EXPECT_LE(err, kTol);
  std::printf("  decode  %-72s splits %3d  rel_l2 %.2e\n", describe(c).c_str(), r.splits, err);
}

}  // namespace

TEST(CudaMla, PrefillSmallDims) {
  K3_REQUIRE_GPU();
  // k3-tiny's dims (qk 48, v 32: the (64, 64) bucket with guards).
  check_prefill({1, 1, 0, 4, 32, 16, 32, false}, 11);     // T = 1
  check_prefill({2, 77, 0, 4, 32, 16, 32, false}, 12);    // T not a multiple of the 64 tile
  check_prefill({2, 37, 113, 4, 32, 16, 32, false}, 13);  // n new queries over a cache: p0 offset
  check_prefill({1, 130, 0, 3, 32, 16, 32, true}, 14);    // bf16 output
  check_prefill({3, 1, 64, 4, 32, 16, 32, false}, 15);    // one query on a tile boundary
}

TEST(CudaMla, PrefillOtherBuckets) {
  K3_REQUIRE_GPU();
  check_prefill({1, 130, 0, 8, 64, 32, 64, false}, 21);  // k3-1b / k3-small: qk 96 in the (128, 128) bucket
  check_prefill({2, 65, 31, 2, 160, 64, 96, true}, 22);  // qk 224, v 96: the (256, 128) bucket
  check_prefill({1, 200, 0, 2, 16, 16, 16, false}, 23);  // the smallest dims
  check_prefill({1, 90, 40, 2, 64, 0, 128, false}, 24);  // Dr = 0
}

TEST(CudaMla, PrefillK3Dims) {
  K3_REQUIRE_GPU();
  // K3: qk 192 (128 + 64), v 128, the exact instantiation.
  check_prefill({1, 1, 0, 64, 128, 64, 128, false}, 31);
  check_prefill({1, 193, 0, 16, 128, 64, 128, false}, 32);
  check_prefill({2, 70, 123, 8, 128, 64, 128, true}, 33);
  check_prefill({1, 300, 0, 64, 128, 64, 128, true}, 34);
}

TEST(CudaMla, DecodeSmallDims) {
  K3_REQUIRE_GPU();
  check_decode({1, 1, 0, 4, 32, 16, 32, 0, false, 0}, 41);      // T = 1
  check_decode({2, 1, 99, 4, 32, 16, 32, 0, false, 1}, 42);     // one split, 100 rows
  check_decode({2, 1, 99, 4, 32, 16, 32, 0, false, 3}, 42, 2);  // the same, split (combine pass)
  check_decode({2, 3, 97, 4, 32, 16, 32, 16, true, 4}, 43, 2);  // 3 new tokens (causal among them), padded rows
  check_decode({1, 2, 500, 6, 64, 32, 32, 0, false, 0}, 44);    // k3-small dims, auto splits
}

TEST(CudaMla, DecodeK3Dims) {
  K3_REQUIRE_GPU();
  check_decode({1, 1, 299, 64, 128, 64, 512, 0, false, 0}, 51, 2);  // auto: several splits
  check_decode({1, 1, 299, 64, 128, 64, 512, 0, false, 1}, 51);     // the same on one split
  check_decode({2, 2, 250, 64, 128, 64, 512, 0, true, 5}, 52,
               4);  // 2 tokens = 2 row tiles, bf16 q (5 asked: 4 of 64 keys)
  check_decode({1, 1, 4999, 16, 128, 64, 512, 64, false, 3}, 53, 3);  // long splits, padded cache rows
  check_decode({1, 1, 128, 8, 64, 32, 256, 0, false, 0}, 54);         // R = 256: the generic (512, 64) bucket
}

// Decode through the absorbed weights equals prefill through the expanded ones: with
// k_nope = W_kb latent and v = W_vb latent, the last n rows of a full prefill and a decode of those
// n tokens over the cache (q_lat = W_kbᵀ q_nope, o = W_vb o_lat) are the same attention.
TEST(CudaMla, DecodeMatchesLastRowsOfPrefill) {
  K3_REQUIRE_GPU();
  for (const int64_t nd : {int64_t(1), int64_t(4)}) {
    const int64_t H = 8, Dn = 128, Dr = 64, Dv = 128, R = 512, T = 257, dq = Dn + Dr, ldc = R + Dr;
    SCOPED_TRACE("decode of the last " + std::to_string(nd) + " tokens, T=" + std::to_string(T));
    const Bf16Data cache = random_bf16(T * ldc, 61);  // [latent | k_rot]
    std::vector<double> wkb = k3test::randn(H * Dn * R, 62), wvb = k3test::randn(H * Dv * R, 63);
    for (double& x : wkb) x /= std::sqrt(double(R));
    for (double& x : wvb) x /= std::sqrt(double(R));
    const std::vector<double> q = k3test::randn(T * H * dq, 64);

    // Expanded inputs: k = [W_kb_h latent | k_rot], v = W_vb_h latent, in bf16.
    std::vector<double> kx(size_t(T * H * dq)), vx(size_t(T * H * Dv));
    for (int64_t s = 0; s < T; ++s)
      for (int64_t h = 0; h < H; ++h) {
        const float* lat = &cache.f[size_t(s * ldc)];
        for (int64_t j = 0; j < Dn; ++j) {
          double acc = 0;
          for (int64_t r = 0; r < R; ++r) acc += wkb[size_t((h * Dn + j) * R + r)] * lat[r];
          kx[size_t((s * H + h) * dq + j)] = acc;
        }
        for (int64_t j = 0; j < Dr; ++j) kx[size_t((s * H + h) * dq + Dn + j)] = lat[R + j];
        for (int64_t j = 0; j < Dv; ++j) {
          double acc = 0;
          for (int64_t r = 0; r < R; ++r) acc += wvb[size_t((h * Dv + j) * R + r)] * lat[r];
          vx[size_t((s * H + h) * Dv + j)] = acc;
        }
      }
    const Bf16Data qb = to_bf16(q), kb = to_bf16(kx), vb = to_bf16(vx);
    cuda::DeviceBuffer<uint16_t> dq_(qb.bits.data(), qb.bits.size()), dk(kb.bits.data(), kb.bits.size()),
        dv(vb.bits.data(), vb.bits.size());
    cuda::DeviceBuffer<float> dout(size_t(T * H * Dv));
    mc::PrefillParams pp;
    pp.q = dq_.data();
    pp.k = dk.data();
    pp.v = dv.data();
    pp.o = dout.data();
    pp.o_type = mc::Dtype::F32;
    pp.d = mla::Dims{H, Dn, Dr, Dv, R};
    pp.n = T;
    mc::prefill(pp);
    std::vector<float> full(size_t(T * H * Dv));
    dout.download(full.data(), full.size());

    // Absorbed: q_lat = W_kb_hᵀ q_nope (from the same bf16 q the prefill saw), q_rot.
    const DecodeCase c{1, nd, T - nd, H, Dn, Dr, R, 0, false, 0};
    std::vector<double> q_lat(size_t(nd * H * R));
    std::vector<float> q_rot(size_t(nd * H * Dr));
    for (int64_t i = 0; i < nd; ++i)
      for (int64_t h = 0; h < H; ++h) {
        const float* qi = &qb.f[size_t(((T - nd + i) * H + h) * dq)];
        for (int64_t r = 0; r < R; ++r) {
          double acc = 0;
          for (int64_t j = 0; j < Dn; ++j) acc += wkb[size_t((h * Dn + j) * R + r)] * qi[j];
          q_lat[size_t((i * H + h) * R + r)] = float(acc);  // the kernel takes f32
        }
        for (int64_t j = 0; j < Dr; ++j) q_rot[size_t((i * H + h) * Dr + j)] = qi[Dn + j];
      }
    const DecodeRun r = run_decode(c, cache.bits, cache.f, q_lat, q_rot);
    EXPECT_LE(k3test::rel_l2(r.got, r.ref), kTol) << "decode vs attention_head_latent";

    // o = W_vb_h o_lat against the prefill's last nd rows.
    std::vector<float> expanded(size_t(nd * H * Dv)), last(size_t(nd * H * Dv));
    for (int64_t i = 0; i < nd; ++i)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t j = 0; j < Dv; ++j) {
          double acc = 0;
          for (int64_t rr = 0; rr < R; ++rr)
            acc += wvb[size_t((h * Dv + j) * R + rr)] * r.got[size_t((i * H + h) * R + rr)];
          expanded[size_t((i * H + h) * Dv + j)] = float(acc);
          last[size_t((i * H + h) * Dv + j)] = full[size_t(((T - nd + i) * H + h) * Dv + j)];
        }
    const double err = k3test::rel_l2(expanded, last);
    EXPECT_LE(err, kTol) << "W_vb · decode vs the last rows of prefill";
    std::printf("  decode of the last %lld token(s) through W_vb vs prefill rows: rel_l2 %.2e (splits %d)\n",
                (long long)nd, err, r.splits);
  }
}

// Shapes the kernels do not take are k3::Errors that name the argument.
TEST(CudaMla, RejectsUnsupportedShapesByName) {
  K3_REQUIRE_GPU();
  cuda::DeviceBuffer<uint16_t> buf(4096);
  cuda::DeviceBuffer<float> fbuf(4096);
  auto prefill_error = [&](int64_t Dn, int64_t Dr, int64_t Dv) -> std::string {
    mc::PrefillParams p;
    p.q = p.k = p.v = buf.data();
    p.o = fbuf.data();
    p.d = mla::Dims{2, Dn, Dr, Dv, 0};
    p.n = 4;
    try {
      mc::prefill(p);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(prefill_error(24, 16, 32).find("Dn = 24"), std::string::npos) << prefill_error(24, 16, 32);
  EXPECT_NE(prefill_error(32, 8, 32).find("Dr = 8"), std::string::npos) << prefill_error(32, 8, 32);
  EXPECT_NE(prefill_error(32, 16, 40).find("Dv = 40"), std::string::npos) << prefill_error(32, 16, 40);
  EXPECT_NE(prefill_error(32, 16, 256).find("Dv = 256"), std::string::npos) << prefill_error(32, 16, 256);
  EXPECT_NE(prefill_error(256, 64, 128).find("Dn + Dr = 320"), std::string::npos) << prefill_error(256, 64, 128);
  EXPECT_EQ(prefill_error(32, 16, 32), "");

  auto decode_error = [&](int64_t R, int64_t Dr, int64_t ldc) -> std::string {
    mc::DecodeParams p;
    p.q_lat = p.q_rot = fbuf.data();
    p.cache = buf.data();
    p.o_lat = fbuf.data();
    p.ldc = ldc;
    p.d = mla::Dims{2, 16, Dr, 0, R};
    p.n = 1;
    p.p0 = 3;
    p.num_splits = 1;
    try {
      mc::decode(p);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(decode_error(40, 16, 56).find("R = 40"), std::string::npos) << decode_error(40, 16, 56);
  EXPECT_NE(decode_error(1024, 16, 1040).find("R = 1024"), std::string::npos);
  EXPECT_NE(decode_error(32, 8, 40).find("Dr = 8"), std::string::npos) << decode_error(32, 8, 40);
  EXPECT_NE(decode_error(32, 16, 44).find("ldc = 44"), std::string::npos) << decode_error(32, 16, 44);
  EXPECT_EQ(decode_error(32, 16, 48), "");
  cuda::synchronize();

  // A split decode without its workspace says how much it needs.
  mc::DecodeParams p;
  p.q_lat = p.q_rot = fbuf.data();
  p.cache = buf.data();
  p.o_lat = fbuf.data();
  p.ldc = 48;
  p.d = mla::Dims{2, 16, 16, 0, 32};
  p.n = 1;
  p.p0 = 80;
  p.num_splits = 2;
  ASSERT_GT(mc::decode_workspace_bytes(p), 0u);
  try {
    mc::decode(p);
    FAIL() << "a split decode ran without a workspace";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("workspace"), std::string::npos) << e.what();
  }
}
