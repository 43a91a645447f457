// Training KDA recurrence core, float64: the chunked form (src/kernels/kda/kda_chunk_f64.h) against the token-by-token
// recurrence it replaced (kda_recurrent_*_f64, src/kernels/kda/kda_f64.h), forward + backward, in one process.
//
//   OMP_NUM_THREADS=1 build/bench_train_kda [--reps 5]
//
// Shapes: k3-tiny's KDA (H = 4, D = 32) at T = 256 and 1024, and k3-small's (H = 6, D = 64, from
// configs/k3-small.json) at T = 1024. Inputs are what the block feeds the core: L2-normalised q and k,
// beta in (0, 1), g in [-5, 0]. Both forms save the state every 16 tokens (the recurrence's default
// checkpoint spacing and the chunked form's chunk), so they keep the same tape. Each figure is the best of
// --reps runs (ms); "speedup" = recurrent / chunked. The last column is the largest relative difference
// between the two forms' outputs and gradients (a check that the timed code computes the same thing).
#include <omp.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/kda/kda_chunk_f64.h"
#include "kernels/kda/kda_f64.h"
#include "model/training/kda_block.h"

using namespace k3::train;
using namespace k3::kda;
using clock_type = std::chrono::steady_clock;

namespace {

struct Case {
  const char* name;
  int64_t H, D, T;
};

struct Inputs {
  int64_t T, H, D;
  std::vector<double> q, k, v, g, beta, d_o;
};

Inputs make_inputs(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  Inputs in{c.T, c.H, c.D, {}, {}, {}, {}, {}, {}};
  const size_t n = size_t(c.T * c.H * c.D);
  for (auto* x : {&in.q, &in.k}) {
    x->resize(n);
    for (double& e : *x) e = nd(rng);
    for (int64_t r = 0; r < c.T * c.H; ++r) {
      double ss = 0;
      for (int64_t d = 0; d < c.D; ++d) ss += (*x)[size_t(r * c.D + d)] * (*x)[size_t(r * c.D + d)];
      for (int64_t d = 0; d < c.D; ++d) (*x)[size_t(r * c.D + d)] /= std::sqrt(ss + 1e-6);
    }
  }
  in.v.resize(n), in.d_o.resize(n), in.g.resize(n), in.beta.resize(size_t(c.T * c.H));
  for (double& e : in.v) e = nd(rng);
  for (double& e : in.d_o) e = nd(rng);
  for (double& e : in.g) e = -5.0 * ud(rng) * ud(rng);
  for (double& e : in.beta) e = 0.05 + 0.9 * ud(rng);
  return in;
}

struct Result {
  double fwd_ms = 1e30, bwd_ms = 1e30;
  std::vector<double> o, dq, dk, dv, dg, dbeta;
};

// chunked: kda_chunk_*_f64 with chunk 16; else kda_recurrent_*_f64 with state_every 16.
Result run(const Inputs& in, bool chunked, int reps) {
  const int64_t T = in.T, H = in.H, D = in.D, every = 16;
  const double scale = 1.0 / std::sqrt(double(D));
  Result r;
  const size_t n = size_t(T * H * D);
  r.o.resize(n), r.dq.resize(n), r.dk.resize(n), r.dv.resize(n), r.dg.resize(n), r.dbeta.resize(size_t(T * H));
  std::vector<double> states(size_t((T + every - 1) / every * H * D * D));
  for (int rep = 0; rep < reps; ++rep) {
    auto t0 = clock_type::now();
    if (chunked)
      kda_chunk_forward_f64(r.o.data(), states.data(), in.q.data(), in.k.data(), in.v.data(), in.g.data(),
                            in.beta.data(), scale, T, H, D, D, every);
    else
      kda_recurrent_forward_f64(r.o.data(), states.data(), in.q.data(), in.k.data(), in.v.data(), in.g.data(),
                                in.beta.data(), scale, T, H, D, D, every);
    auto t1 = clock_type::now();
    if (chunked)
      kda_chunk_backward_f64(r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.dbeta.data(), in.d_o.data(),
                             states.data(), in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), scale,
                             T, H, D, D, every);
    else
      kda_recurrent_backward_f64(r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.dbeta.data(), in.d_o.data(),
                                 states.data(), in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
                                 scale, T, H, D, D, every);
    auto t2 = clock_type::now();
    r.fwd_ms = std::min(r.fwd_ms, std::chrono::duration<double, std::milli>(t1 - t0).count());
    r.bwd_ms = std::min(r.bwd_ms, std::chrono::duration<double, std::milli>(t2 - t1).count());
  }
  return r;
}

double rel_max(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num = std::max(num, std::fabs(a[i] - b[i]));
    den = std::max(den, std::fabs(b[i]));
  }
  return num / (den > 0 ? den : 1e-300);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 5;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "usage: %s [--reps N]\n", argv[0]);
      return 2;
    }
  }
  std::printf("KDA recurrence core, float64 forward + backward: recurrent (baseline) vs chunked (C = 16)\n");
  std::printf("%d OpenMP threads, best of %d runs, times in ms\n\n", omp_get_max_threads(), reps);
  std::printf("%-8s %2s %3s %5s | %9s %9s %9s | %9s %9s %9s | %8s %8s %8s | %9s\n", "shape", "H", "D", "T", "rec fwd",
              "rec bwd", "rec tot", "chk fwd", "chk bwd", "chk tot", "fwd x", "bwd x", "total x", "max diff");
  const Case cases[] = {{"k3-tiny", 4, 32, 256}, {"k3-tiny", 4, 32, 1024}, {"k3-small", 6, 64, 1024}};
  for (const Case& c : cases) {
    const Inputs in = make_inputs(c, 1234);
    const Result rec = run(in, false, reps), chk = run(in, true, reps);
    double diff = 0;
    diff = std::max(diff, rel_max(chk.o, rec.o));
    diff = std::max(diff, rel_max(chk.dq, rec.dq));
    diff = std::max(diff, rel_max(chk.dk, rec.dk));
    diff = std::max(diff, rel_max(chk.dv, rec.dv));
    diff = std::max(diff, rel_max(chk.dg, rec.dg));
    diff = std::max(diff, rel_max(chk.dbeta, rec.dbeta));
    const double rt = rec.fwd_ms + rec.bwd_ms, ct = chk.fwd_ms + chk.bwd_ms;
    std::printf("%-8s %2lld %3lld %5lld | %9.2f %9.2f %9.2f | %9.2f %9.2f %9.2f | %7.2fx %7.2fx %7.2fx | %9.1e\n",
                c.name, (long long)c.H, (long long)c.D, (long long)c.T, rec.fwd_ms, rec.bwd_ms, rt, chk.fwd_ms,
                chk.bwd_ms, ct, rec.fwd_ms / chk.fwd_ms, rec.bwd_ms / chk.bwd_ms, rt / ct, diff);
  }
  return 0;
}
