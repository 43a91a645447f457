// The training KDA recurrence core on the GPU: the fp32 SIMT kernels (kda_chunk_train_cuda.h) and the bf16
// tensor-core kernels (kda_chunk_train_tc_cuda.h), timed at ANCHORS.md's five KDA shapes (D = 128).
//
//   build/bench_cuda_train_kda [--reps 10] [--warmup 2] [--shapes BxTxH,...] [--no-f32]
//
// Each time is the median of --reps runs (after --warmup), CUDA events around the calls: "fwd" is one
// forward (prep + sequential kernel, saving every chunk's entering state), "fwd+bwd" a forward and a backward
// (the bf16 kernels' backward reads the forward's chunk items from its tape; the fp32 kernels' backward runs
// prep again). B sequences of T tokens each, packed (cu_seqlens). The fp32 kernels take fp32 q, k, v, g, beta,
// d_o and give fp32 gradients; the bf16 kernels take q, k, v, d_o as bf16 and give dq, dk, dv as bf16 (g, beta,
// o, dg, dbeta fp32), as the training path holds them: the bf16 copies are made once at setup, outside the timing.
// "x fla" = fla chunk_kda's published time at the shape (ANCHORS.md: bf16 inputs, K3 gate, in-kernel q/k
// L2 norm and beta sigmoid, which these kernels do not do) divided by ours: > 1 means faster than fla.
// Memory: the fp32 kernels save chunks * H * D * D fp32 states (4.3 GB at B1 T32768 H32); the bf16 kernels' tape
// holds them in bf16 beside the chunk items (0.72x that), and their backward workspace is the states' size in
// bf16 again plus rows * H * D bf16. --no-f32 skips the fp32 SIMT kernels. Exits 0 with a message when there is
// no GPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "core/dtype.h"
#include "core/splitmix.h"
#include "kernels/kda/kda_chunk_train_cuda.h"
#include "kernels/kda/kda_chunk_train_tc_cuda.h"

namespace kc = k3::kda::cuda;
using k3::cuda::DeviceBuffer;

namespace {

constexpr int D = 128;

struct Shape {
  int64_t B, T, H;
  double fla_fwd, fla_fwdbwd;  // ms, ANCHORS.md (0: not published)
};
// ANCHORS.md, "flash-linear-attention chunk_kda", H200.
const Shape kAnchors[] = {{1, 8192, 64, 1.76, 8.44},
                          {1, 8192, 96, 2.60, 12.98},
                          {4, 4096, 32, 1.69, 8.27},
                          {1, 32768, 32, 4.15, 18.55},
                          {1, 65536, 16, 4.43, 19.26}};

using Rng = k3::SplitMixUniform;  // splitmix64 -> uniform [0, 1)

float median_ms(const std::function<void()>& f, int warmup, int reps) {
  return k3::cuda::median_ms([&](int) { f(); }, reps, warmup);
}

void run_shape(const Shape& s, int warmup, int reps, bool with_f32) {
  const int64_t rows = s.B * s.T, n = rows * s.H * D, nb = rows * s.H;
  const int64_t cpb = (s.T + 15) / 16, chunks = s.B * cpb;
  // Inputs: q, k entries of an L2-normalised vector's size, v and d_o O(1), g in (-5, 0), beta in (0, 1).
  const size_t nx = size_t(n), nbx = size_t(nb);
  std::vector<float> x(nx), gg(nx), bb(nbx);
  Rng rng{uint64_t(s.T * 131 + s.H)};
  for (auto& e : x) e = float(rng.next() * 2 - 1) * 0.15f;
  for (auto& e : gg) e = float(-5.0 * rng.next());
  for (auto& e : bb) e = float(0.01 + 0.98 * rng.next());
  std::vector<int32_t> cu(size_t(s.B + 1)), co(size_t(s.B + 1));
  for (int64_t b = 0; b <= s.B; ++b) {
    cu[size_t(b)] = int32_t(b * s.T);
    co[size_t(b)] = int32_t(b * cpb);
  }
  // q, k, v, d_o hold the same values in four buffers: the kernels' memory traffic is that of distinct tensors.
  DeviceBuffer<float> q(x.data(), nx), k(x.data(), nx), v(x.data(), nx), dob(x.data(), nx), g(gg.data(), nx),
      beta(bb.data(), nbx);
  DeviceBuffer<int32_t> dcu(cu.data(), cu.size()), dco(co.data(), co.size());
  kc::KdaTrainParams p;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.g = g.data();
  p.beta = beta.data();
  p.cu_seqlens = dcu.data();
  p.chunks = chunks;
  p.chunk_offsets = dco.data();
  p.B = int(s.B);
  p.max_len = s.T;
  p.rows = rows;
  p.H = int(s.H);
  p.D = D;
  p.scale = 1.0f / std::sqrt(float(D));
  const size_t ns = size_t(chunks * s.H * D * D);
  DeviceBuffer<float> o(nx), states(ns);
  DeviceBuffer<float> dq(nx), dk(nx), dv(nx), dg(nx), dbeta(nbx);
  const float* d_o = dob.data();

  auto row = [&](const char* name, float fwd, float fb) {
    std::printf("B%-2lld T%-6lld H%-3lld %-10s fwd %8.3f ms", (long long)s.B, (long long)s.T, (long long)s.H, name,
                fwd);
    if (s.fla_fwd > 0) std::printf(" (%.2fx fla)", s.fla_fwd / fwd);
    std::printf("   fwd+bwd %8.3f ms", fb);
    if (s.fla_fwdbwd > 0) std::printf(" (%.2fx fla)", s.fla_fwdbwd / fb);
    std::printf("\n");
  };
  {
    // bf16 q, k, v, d_o (converted once, here) and bf16 dq, dk, dv: the bf16 kernels' I/O.
    std::vector<uint16_t> xb(nx);
    for (size_t i = 0; i < nx; ++i) xb[i] = k3::f32_to_bf16(x[i]);
    DeviceBuffer<uint16_t> qb(xb.data(), nx), kb(xb.data(), nx), vb(xb.data(), nx), dob16(xb.data(), nx);
    DeviceBuffer<uint16_t> dqb(nx), dkb(nx), dvb(nx);
    kc::KdaTrainBf16Params pb;
    pb.q = qb.data();
    pb.k = kb.data();
    pb.v = vb.data();
    pb.g = p.g;
    pb.beta = p.beta;
    pb.cu_seqlens = p.cu_seqlens;
    pb.chunk_offsets = p.chunk_offsets;
    pb.B = p.B;
    pb.max_len = p.max_len;
    pb.rows = p.rows;
    pb.chunks = p.chunks;
    pb.H = p.H;
    pb.D = p.D;
    pb.scale = p.scale;
    DeviceBuffer<unsigned char> ws(kc::kda_chunk_backward_train_bf16_workspace_bytes(pb)),
        saved(kc::kda_chunk_train_bf16_saved_bytes(pb));
    auto fwd = [&] { kc::kda_chunk_forward_train_bf16(pb, o.data(), saved.data()); };
    auto fb = [&] {
      fwd();
      kc::kda_chunk_backward_train_bf16(pb, dob16.data(), saved.data(), dqb.data(), dkb.data(), dvb.data(), dg.data(),
                                        dbeta.data(), ws.data());
    };
    row("bf16 tc", median_ms(fwd, warmup, reps), median_ms(fb, warmup, reps));
  }
  if (with_f32) {
    const size_t wsb =
        std::max(kc::kda_chunk_forward_train_workspace_bytes(p), kc::kda_chunk_backward_train_workspace_bytes(p));
    DeviceBuffer<unsigned char> ws(wsb);
    auto fwd = [&] { kc::kda_chunk_forward_train(p, o.data(), states.data(), ws.data()); };
    auto fb = [&] {
      fwd();
      kc::kda_chunk_backward_train(p, d_o, states.data(), dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(),
                                   ws.data());
    };
    row("fp32 simt", median_ms(fwd, warmup, reps), median_ms(fb, warmup, reps));
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line as it is measured, also into a pipe
  int reps = 10, warmup = 2;
  bool with_f32 = true;
  std::vector<Shape> shapes(std::begin(kAnchors), std::end(kAnchors));
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--warmup" && i + 1 < argc) warmup = std::max(0, std::atoi(argv[++i]));
    else if (a == "--no-f32") with_f32 = false;
    else if (a == "--shapes" && i + 1 < argc) {
      shapes.clear();
      const std::string list = argv[++i];
      size_t pos = 0;
      while (pos <= list.size()) {
        size_t end = list.find(',', pos);
        if (end == std::string::npos) end = list.size();
        long long B = 0, T = 0, H = 0;
        if (std::sscanf(list.substr(pos, end - pos).c_str(), "%lldx%lldx%lld", &B, &T, &H) == 3 && B > 0 && T > 0 &&
            H > 0) {
          Shape s{B, T, H, 0, 0};
          for (const Shape& k : kAnchors)
            if (k.B == B && k.T == T && k.H == H) s = k;
          shapes.push_back(s);
        } else {
          std::fprintf(stderr, "bench_cuda_train_kda: bad shape in --shapes: %s\n", list.c_str());
          return 2;
        }
        pos = end + 1;
      }
    } else {
      std::fprintf(stderr, "usage: bench_cuda_train_kda [--reps N] [--warmup N] [--shapes BxTxH,...] [--no-f32]\n");
      return 2;
    }
  }
  std::string why;
  if (!k3::cuda::available(&why)) {
    std::printf("bench_cuda_train_kda: no usable GPU (%s); nothing to measure.\n", why.c_str());
    return 0;
  }
  std::printf("%s\n", k3::cuda::device_summary().c_str());
  std::printf(
      "KDA training chunk core (C = 16, D = %d), fp32 in/out (bf16 tc: bf16 q, k, v, d_o, dq, dk, dv); median of %d "
      "after %d warm-up\n",
      D, reps, warmup);
  for (const Shape& s : shapes) run_shape(s, warmup, reps, with_f32);
  return 0;
}
