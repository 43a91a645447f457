// CPU prefill and decode throughput of a K3 model directory, with the cache's effect made visible.
//
//   build/bench_cpu_model --model models/k3-small [--model models/k3-1b] [--prefill 128,512]
//                         [--contexts 64,256,1024] [--decode-steps 16] [--gemm f64|f32]
//
// --gemm sets the linears' accumulation; without it K3_GEMM does, as for k3 (default f64).
//
// For each model it prints:
//   prefill: tokens/s of one prompt of each --prefill length (fresh cache).
//   decode:  ms per generated token after a prefix of each --contexts length, split by block kind
//            (KDA, MLA, MoE, dense FFN, lm_head with the output AttnRes and norm, other = embedding,
//            AttnRes reads, pre-norms), and as the baseline in the same run, the ms that recomputing the
//            whole prefix for that one token costs (what decoding without a cache would pay).
// KDA time per token should stay flat as the context grows (fixed-size state); MLA time grows
// linearly (it reads every cached 576-wide row); the ratio full/decode grows with the context.
// Make the models first: `build/k3 init --config configs/k3-small.json --out models/k3-small`.
#include <omp.h>
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <random>

#include "cli/args.h"
#include "core/error.h"
#include "model/model.h"

using namespace k3;
using clock_type = std::chrono::steady_clock;

static double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

static std::vector<int32_t> random_ids(int64_t n, int64_t V, uint64_t seed) {
  std::mt19937_64 r(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& t : ids) t = int32_t(r() % uint64_t(V));
  return ids;
}

static void bench_model(const std::string& dir, const std::vector<int32_t>& prefills,
                        const std::vector<int32_t>& contexts, int steps) {
  auto t0 = clock_type::now();
  auto m = Model::load(dir);
  const K3Config& c = m->config();
  const int64_t V = c.vocab_size;
  std::printf("\n== %s: %lld layers (%lld MLA), hidden %lld, %lld experts top-%lld; loaded in %.2f s\n", dir.c_str(),
              (long long)c.num_hidden_layers,
              (long long)std::count(c.layer_kind.begin(), c.layer_kind.end(), AttnKind::MLA), (long long)c.hidden_size,
              (long long)c.num_experts, (long long)c.num_experts_per_token, seconds_since(t0));
  {  // warm up: page in the weights and start the thread pool
    SequenceCache w = m->new_cache();
    m->forward({&w}, {random_ids(8, V, 99)}, false);
  }
  std::printf("%-8s %10s %12s\n", "prefill", "seconds", "tokens/s");
  for (int32_t T : prefills) {
    SequenceCache cache = m->new_cache();
    auto ids = random_ids(T, V, 1);
    t0 = clock_type::now();
    m->forward({&cache}, {ids}, false);
    const double s = seconds_since(t0);
    std::printf("%-8d %10.3f %12.1f\n", T, s, double(T) / s);
  }
  std::printf("%-8s %9s %8s | %7s %7s %7s %7s %7s %7s | %12s %8s\n", "context", "ms/token", "tok/s", "KDA", "MLA",
              "MoE", "dense", "lm_head", "other", "full-recompute", "ratio");
  m->options().profile = true;
  for (int32_t ctx : contexts) {
    auto ids = random_ids(ctx + steps, V, 2);
    SequenceCache cache = m->new_cache();
    m->forward({&cache}, {std::vector<int32_t>(ids.begin(), ids.begin() + ctx)}, false);
    m->reset_timings();
    t0 = clock_type::now();
    for (int s = 0; s < steps; ++s) m->forward({&cache}, {{ids[size_t(ctx + s)]}}, false);
    const double per = seconds_since(t0) / steps;
    const Model::Timings tm = m->timings();
    const double other = tm.total() - tm.kda - tm.mla - tm.moe - tm.dense_ffn - tm.head;
    // Baseline: the same next token computed by recomputing the whole prefix (no cache).
    SequenceCache fresh = m->new_cache();
    t0 = clock_type::now();
    m->forward({&fresh}, {std::vector<int32_t>(ids.begin(), ids.begin() + ctx + 1)}, false);
    const double full = seconds_since(t0);
    auto ms = [&](double x) { return 1e3 * x / steps; };
    std::printf("%-8d %9.2f %8.1f | %7.2f %7.2f %7.2f %7.2f %7.2f %7.2f | %12.1f ms %7.1fx\n", ctx, 1e3 * per,
                1.0 / per, ms(tm.kda), ms(tm.mla), ms(tm.moe), ms(tm.dense_ffn), ms(tm.head), ms(other), 1e3 * full,
                full / per);
  }
  m->options().profile = false;
}

int main(int argc, char** argv) {
  CLI::App app{"CPU prefill/decode benchmark for K3 model directories (see the header of bench/bench_cpu_model.cpp)"};
  std::vector<std::string> models;
  std::string prefill = "128,512", contexts = "64,256,1024", gemm;
  int steps = 16;
  app.add_option("--model", models, "model directory (repeatable)")->required();
  app.add_option("--prefill", prefill, "prompt lengths for the prefill rows")->capture_default_str();
  app.add_option("--contexts", contexts, "context lengths for the decode rows")->capture_default_str();
  app.add_option("--decode-steps", steps, "tokens decoded per context")->capture_default_str();
  app.add_option("--gemm", gemm, "accumulation precision of linear layers: f64 (default) or f32; overrides K3_GEMM");
  CLI11_PARSE(app, argc, argv);
  try {
    cli::apply_gemm_env();
    if (!gemm.empty()) set_gemm_precision(cli::parse_gemm_precision(gemm, "--gemm"));
    std::printf("k3cpp CPU benchmark: gemm accumulation %s, %d OpenMP threads\n",
                gemm_precision() == GemmPrecision::F32 ? "f32" : "f64", omp_get_max_threads());
    for (const auto& d : models)
      bench_model(d, cli::parse_ids(prefill, "--prefill"), cli::parse_ids(contexts, "--contexts"), steps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
