// The shared harness of the training KDA recurrence tests (test_cuda_train_kda_chunk.cpp: the fp32 kernels,
// test_cuda_train_kda_chunk_tc.cpp: the bf16 tensor-core kernels): packed batches drawn per sequence, the float64
// twin run sequence by sequence, a GPU run into NaN-filled outputs with a NaN guard after each, and the checks both
// tests make. Each test names the entry points (KernelsOf<T>) and its own tolerance. For builds with the CUDA backend.
// The I/O type T is that of q, k, v, d_o, dq, dk, dv (float: the fp32 kernels; uint16_t, bf16 bits: the tensor-core
// kernels); g, beta, o, dg, dbeta and the states are fp32 for both. For bf16 kernels the checks round the batch's q,
// k, v and d_o to bf16 on the host first, so the float64 twin is given exactly the inputs the kernels get, and the
// bf16 outputs are widened to fp32 (exactly) for the comparisons.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "compare.h"
#include "core/cuda.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/kda/kda_chunk_f64.h"
#include "kernels/kda/kda_chunk_train_cuda.h"
#include "kernels/kda/kda_chunk_train_tc_cuda.h"

namespace k3test::kda_train {

using k3::cuda::DeviceBuffer;
using Vec = std::vector<float>;

constexpr int kC = 16;
constexpr size_t kGuard = 64;
constexpr uint32_t kSentinel = 0x7fc00001u;  // a quiet NaN (fp32 outputs)
constexpr uint16_t kSentinelBf16 = 0x7fc1u;  // a quiet NaN (bf16 outputs)

enum class Gate { Random, AtBound, NearZero };
inline const char* gate_name(Gate g) {
  return g == Gate::Random ? "random" : g == Gate::AtBound ? "at-bound" : "near-zero";
}

// One sequence's inputs, drawn from its own seed (so it is the same sequence wherever it is packed).
struct SeqSpec {
  int32_t len;
  uint64_t seed;
};

// A packed batch: q, k, v, g, d_o [rows, H*D], beta [rows, H].
struct Batch {
  int H = 0, D = 0;
  std::vector<int32_t> cu{0}, co{0};
  int64_t rows = 0, chunks = 0, max_len = 0;
  Vec q, k, v, g, beta, d_o;
  float scale = 0;
};

inline Batch make_batch(const std::vector<SeqSpec>& seqs, int H, int D, Gate gate) {
  Batch bt;
  bt.H = H;
  bt.D = D;
  bt.scale = 1.0f / std::sqrt(float(D));
  for (const SeqSpec& s : seqs) {
    std::mt19937_64 rng(s.seed);
    std::normal_distribution<double> nd(0.0, 1.0);
    std::uniform_real_distribution<double> ud(0.0, 1.0);
    const size_t n = size_t(s.len) * H * D;
    auto normalised = [&](Vec& dst) {  // rows of D, L2-normalised
      for (size_t r = 0; r < n / D; ++r) {
        std::vector<double> x(static_cast<size_t>(D));
        double ss = 0;
        for (double& e : x) e = nd(rng), ss += e * e;
        for (double e : x) dst.push_back(float(e / std::sqrt(ss)));
      }
    };
    normalised(bt.q);
    normalised(bt.k);
    for (size_t i = 0; i < n; ++i) bt.v.push_back(float(nd(rng)));
    for (size_t i = 0; i < n; ++i) {
      const double u = ud(rng);
      bt.g.push_back(gate == Gate::AtBound ? -5.0f : gate == Gate::NearZero ? float(-2e-4 * u) : float(-5.0 * u));
    }
    for (int64_t i = 0; i < int64_t(s.len) * H; ++i) bt.beta.push_back(float(0.01 + 0.98 * ud(rng)));
    for (size_t i = 0; i < n; ++i) bt.d_o.push_back(float(nd(rng)));
    bt.rows += s.len;
    bt.chunks += (s.len + kC - 1) / kC;
    bt.max_len = std::max<int64_t>(bt.max_len, s.len);
    bt.cu.push_back(int32_t(bt.rows));
    bt.co.push_back(int32_t(bt.chunks));
  }
  return bt;
}

struct Outputs {
  std::vector<double> o, states, dq, dk, dv, dg, dbeta;  // the f64 twin's
};

// The batch as bf16 kernels take it: q, k, v and d_o rounded to bf16 (kept as fp32, exactly representable), so that
// the f64 twin and any fp32 kernels run beside are given the very inputs the bf16 kernels get. g and beta stay fp32.
inline Batch as_bf16_inputs(Batch bt) {
  for (Vec* x : {&bt.q, &bt.k, &bt.v, &bt.d_o}) k3::round_to_bf16(x->data(), int64_t(x->size()));
  return bt;
}

// Whether I/O type T is bf16 (uint16_t bits; else float), and the batch the kernels of I/O type T are tested on.
template <typename T>
constexpr bool kIsBf16 = std::is_same_v<T, uint16_t>;
template <typename T>
Batch inputs_for(Batch bt) {
  static_assert(std::is_same_v<T, float> || kIsBf16<T>, "I/O type: float or uint16_t (bf16 bits)");
  if constexpr (kIsBf16<T>) return as_bf16_inputs(std::move(bt));
  else return bt;
}

// The f64 twin, sequence by sequence, on the inputs it is given (inputs_for: those the kernels get).
inline Outputs reference(const Batch& bt) {
  const int64_t H = bt.H, D = bt.D, HD = H * D, DD = D * D;
  Outputs r;
  for (auto* x : {&r.o, &r.dq, &r.dk, &r.dv, &r.dg}) x->assign(size_t(bt.rows * HD), 0.0);
  r.dbeta.assign(size_t(bt.rows * H), 0.0);
  r.states.assign(size_t(bt.chunks * H * DD), 0.0);
  auto slice = [](const Vec& x, int64_t from, int64_t n) {
    return std::vector<double>(x.begin() + from, x.begin() + from + n);
  };
  for (size_t b = 0; b + 1 < bt.cu.size(); ++b) {
    const int64_t r0 = bt.cu[b], T = bt.cu[b + 1] - r0;
    if (T == 0) continue;
    const auto q = slice(bt.q, r0 * HD, T * HD), k = slice(bt.k, r0 * HD, T * HD), v = slice(bt.v, r0 * HD, T * HD),
               g = slice(bt.g, r0 * HD, T * HD), beta = slice(bt.beta, r0 * H, T * H),
               d_o = slice(bt.d_o, r0 * HD, T * HD);
    double* states = r.states.data() + int64_t(bt.co[b]) * H * DD;
    k3::kda::kda_chunk_forward_f64(r.o.data() + r0 * HD, states, q.data(), k.data(), v.data(), g.data(), beta.data(),
                                   bt.scale, T, H, D, D, kC);
    k3::kda::kda_chunk_backward_f64(r.dq.data() + r0 * HD, r.dk.data() + r0 * HD, r.dv.data() + r0 * HD,
                                    r.dg.data() + r0 * HD, r.dbeta.data() + r0 * H, d_o.data(), states, q.data(),
                                    k.data(), v.data(), g.data(), beta.data(), bt.scale, T, H, D, D, kC);
  }
  return r;
}

struct GpuOutputs {
  Vec o, states, dq, dk, dv, dg, dbeta;  // bf16 outputs widened to fp32 (exactly: the widening keeps every bit)
};

// An output buffer of n elements of type T (float, or uint16_t bf16 bits) plus a guard, all NaN.
template <typename T>
DeviceBuffer<T> nan_buffer(size_t n) {
  using Bits = std::conditional_t<kIsBf16<T>, uint16_t, uint32_t>;
  static_assert(sizeof(Bits) == sizeof(T));
  const Bits sentinel = kIsBf16<T> ? Bits(kSentinelBf16) : Bits(kSentinel);
  std::vector<Bits> bits(n + kGuard, sentinel);
  DeviceBuffer<T> d(n + kGuard);
  k3::cuda::copy_to_device(d.data(), bits.data(), bits.size() * sizeof(Bits));
  return d;
}
// Downloads the n elements (widening bf16 to fp32); fails the test if the guard after them was written.
template <typename T>
Vec download(const DeviceBuffer<T>& d, size_t n, const char* name) {
  using Bits = std::conditional_t<kIsBf16<T>, uint16_t, uint32_t>;
  const Bits sentinel = kIsBf16<T> ? Bits(kSentinelBf16) : Bits(kSentinel);
  std::vector<T> h(n + kGuard);
  d.download(h.data(), h.size());
  for (size_t i = n; i < n + kGuard; ++i) {
    Bits bits;
    std::memcpy(&bits, &h[i], sizeof(Bits));
    if (bits != sentinel) {
      ADD_FAILURE() << name << ": written past its end at element " << i;
      break;
    }
  }
  Vec r(n);
  if constexpr (kIsBf16<T>) {
    for (size_t i = 0; i < n; ++i) r[i] = k3::bf16_to_f32(h[i]);
  } else {
    std::memcpy(r.data(), h.data(), n * sizeof(float));  // every bit, NaN payloads included
  }
  return r;
}
// An input of I/O type T on the device. For bf16 the values must already be bf16 (inputs_for): the f64 twin is
// given exactly what the kernels get, so any element the conversion would change fails the test.
template <typename T>
DeviceBuffer<T> upload_input(const Vec& x, const char* name) {
  if constexpr (kIsBf16<T>) {
    std::vector<uint16_t> b(x.size());
    bool exact = true;
    for (size_t i = 0; i < x.size(); ++i) {
      b[i] = k3::f32_to_bf16(x[i]);
      exact = exact && k3::bf16_to_f32(b[i]) == x[i];
    }
    if (!exact) ADD_FAILURE() << name << ": not rounded to bf16 before the reference (use inputs_for)";
    return DeviceBuffer<uint16_t>(b.data(), b.size());
  } else {
    return DeviceBuffer<float>(x.data(), x.size());
  }
}

// The entry points under test in one shape, for I/O type T (q, k, v, d_o, dq, dk, dv; float or uint16_t bf16
// bits): the forward's tape (the fp32 kernels' tape is their fp32 states), the workspaces (0: none), the forward,
// the backward (which reads the tape), and the tape's states as fp32 key-major [chunks, H, D, D] for the comparison.
template <typename T>
struct KernelsOf {
  using Params = k3::kda::cuda::KdaTrainParamsOf<T>;
  size_t (*saved_bytes)(const Params&);
  size_t (*forward_workspace_bytes)(const Params&);
  size_t (*backward_workspace_bytes)(const Params&);
  void (*forward)(const Params&, float* o, void* saved, void* workspace);
  void (*backward)(const Params&, const T* d_o, const void* saved, T* dq, T* dk, T* dv, float* dg, float* dbeta,
                   void* workspace);
  void (*states)(const Params&, const void* saved, float* states);
};
using Fp32Kernels = KernelsOf<float>;
using Bf16Kernels = KernelsOf<uint16_t>;

inline const Fp32Kernels kFp32Kernels{k3::kda::cuda::kda_chunk_train_states_bytes,
                                      k3::kda::cuda::kda_chunk_forward_train_workspace_bytes,
                                      k3::kda::cuda::kda_chunk_backward_train_workspace_bytes,
                                      [](const k3::kda::cuda::KdaTrainParams& p, float* o, void* saved, void* ws) {
                                        k3::kda::cuda::kda_chunk_forward_train(p, o, static_cast<float*>(saved), ws);
                                      },
                                      [](const k3::kda::cuda::KdaTrainParams& p, const float* d_o, const void* saved,
                                         float* dq, float* dk, float* dv, float* dg, float* dbeta, void* ws) {
                                        k3::kda::cuda::kda_chunk_backward_train(p, d_o,
                                                                                static_cast<const float*>(saved), dq,
                                                                                dk, dv, dg, dbeta, ws);
                                      },
                                      [](const k3::kda::cuda::KdaTrainParams& p, const void* saved, float* states) {
                                        k3::cuda::copy_on_device(states, saved,
                                                                 k3::kda::cuda::kda_chunk_train_states_bytes(p));
                                      }};

inline const Bf16Kernels kBf16Kernels{k3::kda::cuda::kda_chunk_train_bf16_saved_bytes,
                                      [](const k3::kda::cuda::KdaTrainBf16Params&) { return size_t(0); },
                                      k3::kda::cuda::kda_chunk_backward_train_bf16_workspace_bytes,
                                      [](const k3::kda::cuda::KdaTrainBf16Params& p, float* o, void* saved, void*) {
                                        k3::kda::cuda::kda_chunk_forward_train_bf16(p, o, saved);
                                      },
                                      k3::kda::cuda::kda_chunk_backward_train_bf16,
                                      k3::kda::cuda::kda_chunk_train_bf16_states};

// One forward and backward of `kernels` on bt (for bf16 kernels bt must hold bf16 values: inputs_for<T>).
template <typename T>
GpuOutputs run_gpu(const Batch& bt, const KernelsOf<T>& kernels) {
  const size_t nx = size_t(bt.rows) * bt.H * bt.D, nb = size_t(bt.rows) * bt.H;
  const size_t ns = size_t(bt.chunks) * bt.H * bt.D * bt.D;
  DeviceBuffer<T> q = upload_input<T>(bt.q, "q"), k = upload_input<T>(bt.k, "k"), v = upload_input<T>(bt.v, "v"),
                  d_o = upload_input<T>(bt.d_o, "d_o");
  DeviceBuffer<float> g(bt.g.data(), nx), beta(bt.beta.data(), nb);
  DeviceBuffer<int32_t> cu(bt.cu.data(), bt.cu.size()), co(bt.co.data(), bt.co.size());
  typename KernelsOf<T>::Params p;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.g = g.data();
  p.beta = beta.data();
  p.cu_seqlens = cu.data();
  p.chunk_offsets = co.data();
  p.B = int(bt.cu.size()) - 1;
  p.max_len = bt.max_len;
  p.rows = bt.rows;
  p.chunks = bt.chunks;
  p.H = bt.H;
  p.D = bt.D;
  p.scale = bt.scale;
  const size_t ws_bytes = std::max(kernels.forward_workspace_bytes(p), kernels.backward_workspace_bytes(p));
  DeviceBuffer<unsigned char> ws(std::max<size_t>(ws_bytes, 16)), saved(std::max<size_t>(kernels.saved_bytes(p), 16));
  DeviceBuffer<float> o = nan_buffer<float>(nx), states = nan_buffer<float>(ns);
  DeviceBuffer<T> dq = nan_buffer<T>(nx), dk = nan_buffer<T>(nx), dv = nan_buffer<T>(nx);
  DeviceBuffer<float> dg = nan_buffer<float>(nx), dbeta = nan_buffer<float>(nb);
  kernels.forward(p, o.data(), saved.data(), ws.data());
  kernels.backward(p, d_o.data(), saved.data(), dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(), ws.data());
  kernels.states(p, saved.data(), states.data());
  k3::cuda::synchronize();
  GpuOutputs r;
  r.o = download(o, nx, "o");
  r.states = download(states, ns, "states");
  r.dq = download(dq, nx, "dq");
  r.dk = download(dk, nx, "dk");
  r.dv = download(dv, nx, "dv");
  r.dg = download(dg, nx, "dg");
  r.dbeta = download(dbeta, nb, "dbeta");
  return r;
}

constexpr int kHeadDims[] = {128, 64, 32};
constexpr Gate kGates[] = {Gate::Random, Gate::AtBound, Gate::NearZero};

// Every output of `kernels` against the f64 twin (relative L2 <= tol), at every head dim and gate regime, on the
// inputs the kernels take (bf16 kernels: q, k, v, d_o rounded to bf16 for the twin too). With fp32 (the fp32 SIMT
// kernels beside a bf16 run), those run on the same (rounded) batches with fp32 inputs and must meet fp32_tol.
template <typename T>
void check_against_f64(const KernelsOf<T>& kernels, double tol, const Fp32Kernels* fp32 = nullptr,
                       double fp32_tol = 0) {
  uint64_t seed = 1;
  for (const int D : kHeadDims)
    for (const Gate gate : kGates) {
      const int H = D == 64 ? 2 : 3;
      SCOPED_TRACE("D=" + std::to_string(D) + " H=" + std::to_string(H) + " gate=" + gate_name(gate));
      std::vector<SeqSpec> seqs;
      for (const int32_t len : {1, 16, 17, 50, 300}) seqs.push_back({len, ++seed});
      const Batch bt = inputs_for<T>(make_batch(seqs, H, D, gate));
      const Outputs ref = reference(bt);
      const GpuOutputs gpu = run_gpu(bt, kernels);
      GpuOutputs f32;
      if (fp32) f32 = run_gpu(bt, *fp32);
      const char* names[] = {"o", "states", "dq", "dk", "dv", "dg", "dbeta"};
      const std::vector<double>* a[] = {&ref.o, &ref.states, &ref.dq, &ref.dk, &ref.dv, &ref.dg, &ref.dbeta};
      const Vec* b[] = {&gpu.o, &gpu.states, &gpu.dq, &gpu.dk, &gpu.dv, &gpu.dg, &gpu.dbeta};
      std::printf("D=%3d H=%d gate=%-9s rel L2:", D, H, gate_name(gate));
      for (int i = 0; i < 7; ++i) {
        ASSERT_EQ(a[i]->size(), b[i]->size()) << names[i];
        const double e = k3test::rel_l2(a[i]->data(), b[i]->data(), a[i]->size());
        EXPECT_LE(e, tol) << names[i];
        std::printf(" %s %.2e", names[i], e);
        if (fp32) {
          const Vec* c[] = {&f32.o, &f32.states, &f32.dq, &f32.dk, &f32.dv, &f32.dg, &f32.dbeta};
          // The fp32 SIMT kernels on the same batch: the bf16 kernels' error is theirs alone.
          EXPECT_LE(k3test::rel_l2(a[i]->data(), c[i]->data(), a[i]->size()), fp32_tol) << names[i] << " (fp32 SIMT)";
        }
      }
      std::printf("\n");
    }
}

// A sequence's outputs do not depend on what is packed with it, and a batch gives the same bits run to run; the
// pack (with an empty sequence in it) still matches the f64 twin's o and dg within relative L2 tol. The bitwise
// comparisons cover the bf16 outputs too (their fp32 widening keeps every bit and nothing else).
template <typename T>
void check_packing_independent(const KernelsOf<T>& kernels, double tol) {
  for (const int D : kHeadDims) {
    SCOPED_TRACE("D=" + std::to_string(D));
    const int H = 2;
    const SeqSpec x{50, 777};
    const Batch alone = inputs_for<T>(make_batch({x}, H, D, Gate::Random));
    const Batch packed = inputs_for<T>(make_batch({{300, 11}, {0, 12}, {17, 13}, x, {1, 14}}, H, D, Gate::Random));
    const GpuOutputs a = run_gpu(alone, kernels), p = run_gpu(packed, kernels), p2 = run_gpu(packed, kernels);
    // x is sequence 3 of the pack: rows from cu[3], chunks from co[3].
    const size_t HD = size_t(H) * D, r0 = size_t(packed.cu[3]), c0 = size_t(packed.co[3]);
    auto same = [](const Vec& whole, size_t from, const Vec& part, const char* name) {
      ASSERT_LE(from + part.size(), whole.size()) << name;
      EXPECT_EQ(0, std::memcmp(whole.data() + from, part.data(), part.size() * sizeof(float))) << name;
    };
    same(p.o, r0 * HD, a.o, "o");
    same(p.states, c0 * H * D * D, a.states, "states");
    same(p.dq, r0 * HD, a.dq, "dq");
    same(p.dk, r0 * HD, a.dk, "dk");
    same(p.dv, r0 * HD, a.dv, "dv");
    same(p.dg, r0 * HD, a.dg, "dg");
    same(p.dbeta, r0 * H, a.dbeta, "dbeta");
    const Vec* first[] = {&p.o, &p.states, &p.dq, &p.dk, &p.dv, &p.dg, &p.dbeta};
    const Vec* second[] = {&p2.o, &p2.states, &p2.dq, &p2.dk, &p2.dv, &p2.dg, &p2.dbeta};
    const char* names[] = {"o", "states", "dq", "dk", "dv", "dg", "dbeta"};
    for (int i = 0; i < 7; ++i) same(*first[i], 0, *second[i], names[i]);
    // The empty sequence in the pack did not disturb its neighbours: the pack still matches the f64 twin.
    const Outputs ref = reference(packed);
    EXPECT_LE(k3test::rel_l2(ref.o.data(), p.o.data(), p.o.size()), tol);
    EXPECT_LE(k3test::rel_l2(ref.dg.data(), p.dg.data(), p.dg.size()), tol);
  }
}

// Bad arguments are k3::Errors raised on the host before anything is launched (no GPU needed); rows = 0 is a
// no-op that touches nothing.
template <typename T>
void check_rejects_bad_arguments(const KernelsOf<T>& kernels) {
  using Params = typename KernelsOf<T>::Params;
  Params p;
  p.B = 1;
  p.rows = 20;
  p.chunks = 2;
  p.max_len = 20;
  p.H = 2;
  p.D = 64;
  p.scale = 0.125f;
  EXPECT_GE(kernels.saved_bytes(p), size_t(p.chunks * p.H * p.D * p.D) * 2);  // at least the states in bf16
  EXPECT_GT(kernels.backward_workspace_bytes(p), kernels.forward_workspace_bytes(p));
  float dummy[4] = {};
  alignas(16) T io[8] = {};  // q, k, v, d_o, dq, dk, dv stand-ins of the I/O type
  alignas(16) unsigned char ws[16];
  {
    Params b = p;
    b.D = 48;
    EXPECT_THROW(kernels.saved_bytes(b), k3::Error);
    EXPECT_THROW(kernels.forward(b, dummy, ws, ws), k3::Error);
  }
  {
    Params b = p;
    b.H = 0;
    EXPECT_THROW(kernels.backward_workspace_bytes(b), k3::Error);
  }
  {
    Params b = p;
    b.chunks = 1;  // 20 rows need at least 2 chunks
    EXPECT_THROW(kernels.forward(b, dummy, ws, ws), k3::Error);
  }
  // Null inputs (rows > 0) are rejected before launch.
  EXPECT_THROW(kernels.forward(p, dummy, ws, ws), k3::Error);
  EXPECT_THROW(kernels.backward(p, io, ws, io, io, io, dummy, dummy, ws), k3::Error);
  if constexpr (std::is_same_v<T, uint16_t>) {  // the bf16 backward copies g by 16-byte pieces
    alignas(16) float g[8] = {};
    const int32_t offsets[2] = {0, 2};
    Params b = p;
    b.q = b.k = b.v = io;
    b.beta = dummy;
    b.cu_seqlens = b.chunk_offsets = offsets;
    b.g = g;
    EXPECT_NO_THROW(kernels.backward_workspace_bytes(b));
    b.g = g + 1;
    try {
      kernels.backward(b, io, ws, io, io, io, dummy, dummy, ws);
      ADD_FAILURE() << "a misaligned g was accepted";
    } catch (const k3::Error& e) {
      EXPECT_NE(std::string(e.what()).find("g must be 16-byte aligned"), std::string::npos) << e.what();
    }
  }
  // rows = 0 is a no-op that touches nothing.
  Params e;
  e.H = 2;
  e.D = 32;
  EXPECT_EQ(kernels.saved_bytes(e), 0u);
  EXPECT_EQ(kernels.forward_workspace_bytes(e), 0u);
  EXPECT_NO_THROW(kernels.forward(e, nullptr, nullptr, nullptr));
  EXPECT_NO_THROW(kernels.backward(e, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr));
}

}  // namespace k3test::kda_train
