// End-to-end GPU prefill and decode throughput of K3 model directories (model/cuda/cuda_model.h),
// with the CPU engine on the same machine as the baseline in the same run.
//
//   build/bench_cuda_model --model models/k3-small [--model models/k3-1b] [--prefill 512,2048,8192]
//                          [--contexts 128,1024,8192] [--batch 1,16] [--decode-steps 32]
//                          [--precision bf16|f32] [--cpu-tokens 128]
//
// For each model:
//   prefill: seconds and tokens/s of one prompt of each length (fresh cache, logits of the last token
//            copied to the host: what serving pays before the first sampled token).
//   decode:  ms per step and tokens/s after a prefix of each --contexts length, for each --batch size
//            (B sequences of one cache pool stepped together, one token each), and the cost of
//            recomputing the prefix for one token as the no-cache baseline; then the same steps
//            profiled (the GPU waited for after every block) split by block kind: KDA, MLA, MoE, dense
//            FFN, head (output AttnRes, norm, lm_head, logits to the host), other (embedding, AttnRes).
//   cpu:     the CPU engine (all cores) on a --cpu-tokens prompt and 8 decode steps after it, and the
//            GPU's ratio at the same length (0 skips it); its linears accumulate as K3_GEMM says (f64
//            unless K3_GEMM=f32, as for k3).
// pick/graph: the same decode steps through forward_pick (greedy ids chosen on the device, no logits copied),
// eager and as a CUDA graph (CudaModel::set_graphs), with their ratio.
// Times are wall clock around forward() (which ends by copying logits to the host), medians of 3
// for prefill, means over the steps for decode. Make the models first, e.g.
// `build/k3 init --config configs/k3-1b.json --out models/k3-1b`.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include "cli/args.h"
#include "core/cuda.h"
#include "core/error.h"
#include "model/cuda/cuda_model.h"
#include "model/model.h"

using namespace k3;
using clock_type = std::chrono::steady_clock;

namespace {

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

std::vector<int32_t> random_ids(int64_t n, int64_t V, uint64_t seed) {
  std::mt19937_64 r(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& t : ids) t = int32_t(r() % uint64_t(V));
  return ids;
}

double gpu_prefill_seconds(CudaModel& m, const std::vector<int32_t>& ids) {
  std::vector<double> t;
  for (int rep = 0; rep < 3; ++rep) {
    auto c = m.new_cache();
    const auto t0 = clock_type::now();
    m.forward({c.get()}, {ids}, false);
    t.push_back(seconds_since(t0));
  }
  std::sort(t.begin(), t.end());
  return t[1];
}

// B sequences of one pool after a prefix of ctx random tokens each, and one next token for each.
struct DecodeSetup {
  std::vector<std::unique_ptr<CudaSequenceCache>> caches;  // one pool: batched launches
  std::vector<CudaSequenceCache*> ptrs;
  std::vector<std::vector<int32_t>> step;
};
DecodeSetup prefilled(CudaModel& m, int64_t ctx, int64_t B, uint64_t seed) {
  const int64_t V = m.config().vocab_size;
  DecodeSetup d;
  d.caches = m.new_caches(B);
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t b = 0; b < B; ++b) {
    d.ptrs.push_back(d.caches[size_t(b)].get());
    prompts.push_back(random_ids(ctx, V, seed + uint64_t(b)));
  }
  m.forward(d.ptrs, prompts, false);
  d.step.assign(size_t(B), std::vector<int32_t>(1));
  for (int64_t b = 0; b < B; ++b) d.step[size_t(b)][0] = int32_t((b * 31 + 7) % V);
  return d;
}

// Mean seconds per decode step of B sequences after a prefix of ctx tokens each.
double gpu_decode_seconds(CudaModel& m, int64_t ctx, int64_t B, int steps, uint64_t seed,
                          BlockTimings* breakdown = nullptr) {
  DecodeSetup d = prefilled(m, ctx, B, seed);
  m.forward(d.ptrs, d.step, false);  // warm-up step (first decode-shaped GEMM plans)
  const auto t0 = clock_type::now();
  for (int s = 0; s < steps; ++s) m.forward(d.ptrs, d.step, false);
  const double per = seconds_since(t0) / steps;
  if (breakdown) {  // the same steps again, profiled (a wait after every block)
    m.reset_timings();
    m.set_profile(true);
    for (int s = 0; s < steps; ++s) m.forward(d.ptrs, d.step, false);
    m.set_profile(false);
    *breakdown = m.timings();
  }
  return per;
}

// Mean seconds per decode step as a server takes it (CudaModel::forward_pick: greedy ids chosen on the device,
// no logits to the host), eagerly or replayed from a decode graph.
double gpu_pick_seconds(CudaModel& m, int64_t ctx, int64_t B, int steps, uint64_t seed, bool graphs) {
  m.set_graphs(graphs);
  DecodeSetup d = prefilled(m, ctx, B, seed);
  TokenPick greedy;
  greedy.pick = true;
  const std::vector<TokenPick> picks(size_t(B), greedy);
  for (int w = 0; w < 2; ++w) m.forward_pick(d.ptrs, d.step, picks);  // warm-up (plans; the graph's capture)
  const auto t0 = clock_type::now();
  for (int s = 0; s < steps; ++s) m.forward_pick(d.ptrs, d.step, picks);
  const double per = seconds_since(t0) / steps;
  m.set_graphs(true);
  return per;
}

void bench_model(const std::string& dir, GpuPrecision prec, const std::vector<int32_t>& prefills,
                 const std::vector<int32_t>& contexts, const std::vector<int32_t>& batches, int steps, int cpu_tokens) {
  auto t0 = clock_type::now();
  auto m = CudaModel::load(dir, prec);
  const K3Config& c = m->config();
  const int64_t V = c.vocab_size;
  std::printf(
      "\n== %s (%s): %lld layers (%lld MLA), hidden %lld, %lld experts top-%lld; %.0f MiB of weights on the "
      "GPU, loaded in %.2f s\n",
      dir.c_str(), gpu_precision_name(prec), (long long)c.num_hidden_layers,
      (long long)std::count(c.layer_kind.begin(), c.layer_kind.end(), AttnKind::MLA), (long long)c.hidden_size,
      (long long)c.num_experts, (long long)c.num_experts_per_token, double(m->weight_bytes()) / 1048576.0,
      seconds_since(t0));
  gpu_prefill_seconds(*m, random_ids(64, V, 98));  // warm-up: cuBLAS handles, plans, the arena
  std::printf("%-10s %10s %12s\n", "prefill", "ms", "tokens/s");
  for (int32_t T : prefills) {
    if (T > c.max_position_embeddings) continue;
    const double s = gpu_prefill_seconds(*m, random_ids(T, V, 1));
    std::printf("%-10d %10.2f %12.0f\n", T, 1e3 * s, double(T) / s);
  }
  std::printf("%-10s %6s %10s %12s | %16s %8s | %6s %6s %6s %6s %6s %6s | %9s %9s %12s %6s\n", "context", "batch",
              "ms/step", "tokens/s", "full-recompute ms", "ratio", "KDA", "MLA", "MoE", "dense", "head", "other",
              "pick ms", "graph ms", "graph tok/s", "gain");
  std::printf("%-10s %6s %10s %12s | %16s %8s | %41s | %s\n", "", "", "(logits", "to host)", "", "",
              "(profiled ms/step)", "(ids chosen on the GPU: eager, then graph)");
  for (int32_t ctx : contexts) {
    if (ctx + steps + 2 > c.max_position_embeddings) continue;
    const double full = gpu_prefill_seconds(*m, random_ids(ctx + 1, V, 3));
    for (int32_t B : batches) {
      BlockTimings bt;
      const double per = gpu_decode_seconds(*m, ctx, B, steps, 11, &bt);
      auto ms = [&](double x) { return 1e3 * x / steps; };
      const double pick = gpu_pick_seconds(*m, ctx, B, steps, 11, false);
      const double graph = gpu_pick_seconds(*m, ctx, B, steps, 11, true);
      std::printf(
          "%-10d %6d %10.3f %12.0f | %16.2f %7.1fx | %6.2f %6.2f %6.2f %6.2f %6.2f %6.2f | %9.3f %9.3f %12.0f %5.2fx\n",
          ctx, B, 1e3 * per, double(B) / per, 1e3 * full, full / per, ms(bt.kda), ms(bt.mla), ms(bt.moe),
          ms(bt.dense_ffn), ms(bt.head), ms(bt.embed + bt.attnres_norm), 1e3 * pick, 1e3 * graph, double(B) / graph,
          pick / graph);
      if (!m->graphs_off_reason().empty()) std::printf("  decode graphs off: %s\n", m->graphs_off_reason().c_str());
    }
  }
  if (cpu_tokens > 0) {
    auto cpu = Model::load(dir);
    const auto ids = random_ids(cpu_tokens + 9, V, 5);
    const std::vector<int32_t> prompt(ids.begin(), ids.begin() + cpu_tokens);
    SequenceCache cc = cpu->new_cache();
    t0 = clock_type::now();
    cpu->forward({&cc}, {prompt}, false);
    const double cpu_pre = seconds_since(t0);
    t0 = clock_type::now();
    for (int s = 0; s < 8; ++s) cpu->forward({&cc}, {{ids[size_t(cpu_tokens + s)]}}, false);
    const double cpu_dec = seconds_since(t0) / 8;
    const double gpu_pre = gpu_prefill_seconds(*m, prompt);
    const double gpu_dec = gpu_decode_seconds(*m, cpu_tokens, 1, steps, 5);
    std::printf(
        "cpu baseline at %d tokens: prefill %.1f tok/s (GPU %.0f, %.0fx), decode %.1f tok/s (GPU %.0f, %.0fx)\n",
        cpu_tokens, cpu_tokens / cpu_pre, cpu_tokens / gpu_pre, cpu_pre / gpu_pre, 1.0 / cpu_dec, 1.0 / gpu_dec,
        cpu_dec / gpu_dec);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line as it is measured, also into a pipe
  CLI::App app{"GPU end-to-end prefill/decode benchmark (see the header of bench/bench_cuda_model.cpp)"};
  std::vector<std::string> models;
  std::string prefill = "512,2048,8192", contexts = "128,1024,8192", batches = "1,16", precision = "bf16";
  int steps = 32, cpu_tokens = 128;
  app.add_option("--model", models, "model directory (repeatable)")->required();
  app.add_option("--prefill", prefill, "prompt lengths for the prefill rows")->capture_default_str();
  app.add_option("--contexts", contexts, "context lengths for the decode rows")->capture_default_str();
  app.add_option("--batch", batches, "sequences decoded together, for each decode row")->capture_default_str();
  app.add_option("--decode-steps", steps, "decode steps timed per row")->capture_default_str();
  app.add_option("--precision", precision, "bf16 or f32")->capture_default_str();
  app.add_option("--cpu-tokens", cpu_tokens, "prompt length of the CPU baseline (0: skip it)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    cli::apply_gemm_env();  // K3_GEMM=f32|f64: the CPU baseline's linears, as for k3
    std::string why;
    if (!cuda::available(&why)) {
      std::printf("no GPU: %s\n", why.c_str());
      return 0;
    }
    std::printf("k3cpp GPU model benchmark on %s\n", cuda::device_summary().c_str());
    for (const auto& d : models)
      bench_model(d, parse_gpu_precision(precision, "--precision"), cli::parse_ids(prefill, "--prefill"),
                  cli::parse_ids(contexts, "--contexts"), cli::parse_ids(batches, "--batch"), steps, cpu_tokens);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
