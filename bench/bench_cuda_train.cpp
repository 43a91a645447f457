// Whole-model GPU training throughput: tokens/s, memory and MFU of full training steps as `k3 train
// --device cuda` runs them (train_device.h: forward, backward, clipping, Quantile Balancing, AdamW +
// Per-Head Muon, the non-finite checks) on random-initialised configs.
//
//   build/bench_cuda_train --config configs/k3-1b.json [--config configs/k3-shaped-h200.json]
//                          [--tokens 8192] [--seq-len 2048] [--precision bf16|f32] [--steps 4] [--recompute]
//                          [--run TOKENS:SEQ_LEN[:recompute][:mbN][:invariant] ...] [--micro-batch-tokens N]
//                          [--optimizer muon|adamw]
// Each --run is one measurement on the same random parameters (drawn once per config, on every host
// thread: RandomInitOptions::parallel_streams); without --run, one run of --tokens, --seq-len and
// --recompute. ":mbN" (or --micro-batch-tokens N for every run) runs each step in passes of at most N
// tokens (gradient accumulation, train_device.h): steps of many tokens, over which Muon's Newton–Schulz
// amortises as it does at the batch sizes models are trained with. ":invariant" trains in the
// batch-invariant mode (`k3 train --batch-invariant`: fixed GEMM tiles and head chunks), so its cost
// is measured beside the default mode on the same parameters.
//
// MFU = model FLOPs per second / the H200's dense BF16 peak (989.4 TFLOP/s), model FLOPs per step =
//   6 · N_active · tokens                                    (every GEMM, forward + backward)
// + 3 · Σ_MLA layers H · (d_qk + d_v) · Σ_seq T²             (causal attention: QKᵀ and PV, fwd + 2× bwd)
// + 3 · Σ_KDA layers H · tokens · (6 D² + 6 C D)             (chunked KDA, C = 16: state and intra-chunk products)
// where N_active counts the weights a token multiplies: every projection, the dense FFN, the router,
// the latent down/up projections, the shared experts, top-k routed experts and the lm_head (not the
// embedding, a gather). The first step is a warm-up (the arena and cuBLAS plans); the rest are timed
// with the GPU waited for at each step's end (the metrics read-back does that anyway).
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <random>

#include "core/cuda.h"
#include "core/error.h"
#include "model/config.h"
#include "model/params.h"
#include "train/optimizer.h"
#include "train/train_device.h"

using namespace k3;
using namespace k3::train;

namespace {

constexpr double kPeakBf16 = 989.4e12;

double active_params(const K3Config& c) {
  const double D = double(c.hidden_size);
  double n = double(c.vocab_size) * D;  // lm_head
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (c.layer_kind[size_t(l)] == AttnKind::KDA) {
      const double HD = double(c.kda_num_heads * c.kda_head_dim);
      n += 4 * HD * D + HD * D /* o */ + double(c.kda_head_dim) * (D + HD) + double(c.kda_num_heads) * D;
    } else {
      const double H = double(c.num_attention_heads), dq = double(c.qk_nope_head_dim + c.qk_rope_head_dim);
      const double dkv = double(c.qk_nope_head_dim + c.v_head_dim), R = double(c.kv_lora_rank);
      const double Qr = double(c.q_lora_rank);
      n += (Qr > 0 ? Qr * D + H * dq * Qr : H * dq * D) + (R + double(c.qk_rope_head_dim)) * D + H * dkv * R;
      n += 2 * H * double(c.v_head_dim) * D;  // g_proj, o_proj
    }
    if (c.is_moe_layer(l)) {
      const double L = double(c.routed_expert_hidden_size), I = double(c.moe_intermediate_size);
      n += double(c.num_experts) * D + 2 * L * D + double(c.num_experts_per_token) * 3 * L * I;
      n += 3 * double(c.num_shared_experts) * I * D;
    } else {
      n += 3 * double(c.intermediate_size) * D;
    }
  }
  return n;
}

double step_flops(const K3Config& c, int64_t tokens, int64_t seq_len) {
  double f = 6 * active_params(c) * double(tokens);
  const double seqs = double(tokens / seq_len), T = double(seq_len);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (c.layer_kind[size_t(l)] == AttnKind::KDA) {
      const double D = double(c.kda_head_dim);
      f += 3 * double(c.kda_num_heads) * double(tokens) * (6 * D * D + 6 * 16 * D);
    } else {
      f += 3 * double(c.num_attention_heads) *
           double(c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * seqs * T * T;
    }
  }
  return f;
}

struct Run {
  int64_t tokens, seq_len;
  bool recompute;
  int64_t micro_batch_tokens = 0;
  bool invariant = false;
};

Run parse_run(const std::string& s, int64_t micro_batch_tokens) {
  long long t = 0, l = 0;
  int used = 0;
  bool ok = std::sscanf(s.c_str(), "%lld:%lld%n", &t, &l, &used) == 2 && t > 0 && l > 0 && t % l == 0;
  Run r{t, l, false, micro_batch_tokens};
  std::string rest = ok ? s.substr(size_t(used)) : "";
  while (ok && !rest.empty()) {  // ":recompute", ":mbN" and ":invariant", in any order
    long long mb = 0;
    int n = 0;
    if (rest.rfind(":recompute", 0) == 0) r.recompute = true, rest = rest.substr(10);
    else if (rest.rfind(":invariant", 0) == 0) r.invariant = true, rest = rest.substr(10);
    else if (std::sscanf(rest.c_str(), ":mb%lld%n", &mb, &n) == 1 && mb > 0)
      r.micro_batch_tokens = mb, rest = rest.substr(size_t(n));
    else ok = false;
  }
  if (!ok)
    fail("--run '", s, "': expected TOKENS:SEQ_LEN[:recompute][:mbN][:invariant] with SEQ_LEN dividing TOKENS, N > 0");
  return r;
}

void bench_run(const K3Config& c, const std::string& config_path, ParamStore& P, const Optimizer& plan,
               const Run& run, GpuPrecision precision, int steps) {
  const int64_t tokens = run.tokens, seq_len = run.seq_len;
  const bool recompute = run.recompute;
  CudaTrainOptions options;
  options.precision = precision, options.recompute = recompute, options.micro_batch_tokens = run.micro_batch_tokens;
  options.batch_invariant = run.invariant;
  const std::unique_ptr<TrainDevice> device = make_cuda_train_device(P, c, plan, BalanceOptions{}, options);
  const std::string passes =
      (run.micro_batch_tokens > 0 ? " in passes of " + std::to_string(run.micro_batch_tokens) : std::string()) +
      (run.invariant ? ", batch-invariant" : "");

  std::mt19937_64 rng(3);
  auto batch = [&] {
    std::vector<std::vector<int32_t>> b(size_t(tokens / seq_len), std::vector<int32_t>(size_t(seq_len)));
    for (auto& s : b)
      for (auto& t : s) t = int32_t(rng() % uint64_t(c.vocab_size));
    return b;
  };
  std::printf("%s: %.3g parameters, %.3g active per token; %s; %lld tokens per step in sequences of %lld%s%s\n",
              config_path.c_str(), double(P.values().size()), active_params(c), gpu_precision_name(precision),
              (long long)tokens, (long long)seq_len, passes.c_str(), recompute ? "; recomputation" : "");
  double total = 0, loss = 0;
  for (int s = 0; s <= steps; ++s) {
    const auto b = batch();
    const auto t0 = std::chrono::steady_clock::now();
    loss = device->gradients(b, nullptr, 1.0 / double(tokens));
    std::string bad;
    device->clip(1.0, &bad);
    device->finish_balance();
    if (const std::string blown = device->update(1e-3); !bad.empty() || !blown.empty())
      fail("step ", s, ": non-finite ", bad.empty() ? "parameter " + blown : "gradient " + bad);
    cuda::synchronize();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > 0) total += secs;
    std::printf("  step %d: %.1f ms, loss %.4f%s\n", s, secs * 1e3, loss / double(tokens), s == 0 ? " (warm-up)" : "");
  }
  const double per_step = total / steps;
  size_t free_b = 0, total_b = 0;
  cuda::memory_info(&free_b, &total_b);
  const double mfu = step_flops(c, tokens, seq_len) / per_step / kPeakBf16;
  std::printf("| %s | %s%s | %lld x %lld%s | %.1f ms | %.0f tok/s | %.1f GiB | %.1f%% |\n", config_path.c_str(),
              gpu_precision_name(precision), recompute ? " recompute" : "", (long long)(tokens / seq_len),
              (long long)seq_len, passes.c_str(), per_step * 1e3, double(tokens) / per_step,
              double(total_b - free_b) / double(1 << 30), 100 * mfu);
}

void bench(const std::string& config_path, const std::vector<Run>& runs, GpuPrecision precision, int steps,
           const std::string& optimizer) {
  const K3Config c = load_config(config_path);
  const auto t0 = std::chrono::steady_clock::now();
  RandomInitOptions ri;
  ri.seed = 1;
  ri.parallel_streams = true;  // every host thread (one stream takes minutes at billions of parameters)
  ParamStore P = ParamStore::random_init(c, ri);
  std::vector<double>().swap(P.grads());  // the GPU holds the gradients; the host copy would only cost memory
  // --optimizer adamw: AdamW on every trainable tensor (what a plain PyTorch trainer runs, for
  // bench_torch_train.py beside this), instead of Per-Head Muon on the matrices.
  const ParamGroupRule rule = [&](const std::string& name, const std::vector<int64_t>& shape) {
    const ParamGroup g = default_param_group(name, shape);
    return optimizer == "adamw" && g == ParamGroup::Muon ? ParamGroup::AdamW : g;
  };
  const Optimizer plan(P, OptimizerConfig{}, optimizer == "adamw" ? std::map<std::string, int64_t>{}
                                                                  : k3_head_splits(P, c),
                       rule);
  std::printf("%s: random parameters drawn on the host in %.1f s\n", config_path.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  for (const Run& r : runs) {
    try {
      bench_run(c, config_path, P, plan, r, precision, steps);
    } catch (const Error& e) {  // e.g. out of device memory at a long sequence: report, go on
      std::printf("| %s | %s%s | %lld x %lld | failed: %s |\n", config_path.c_str(), gpu_precision_name(precision),
                  r.recompute ? " recompute" : "", (long long)(r.tokens / r.seq_len), (long long)r.seq_len, e.what());
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GPU training throughput, memory and MFU"};
  std::vector<std::string> configs;
  int64_t tokens = 8192, seq_len = 2048;
  std::string precision = "bf16", optimizer = "muon";
  int steps = 4;
  bool recompute = false;
  int64_t micro_batch_tokens = 0;
  std::vector<std::string> run_specs;
  app.add_option("--config", configs, "model config.json (repeatable)")->required();
  app.add_option("--tokens", tokens, "tokens per step")->capture_default_str();
  app.add_option("--seq-len", seq_len, "sequence length")->capture_default_str();
  app.add_option("--precision", precision, "bf16 or f32")->capture_default_str();
  app.add_option("--steps", steps, "timed steps")->capture_default_str();
  app.add_flag("--recompute", recompute, "recompute every layer's blocks in the backward");
  app.add_option("--optimizer", optimizer, "muon (Per-Head Muon on the matrices, AdamW on the rest) or adamw (AdamW on all)")
      ->check(CLI::IsMember({"muon", "adamw"}))
      ->capture_default_str();
  app.add_option("--run", run_specs,
                 "TOKENS:SEQ_LEN[:recompute][:mbN][:invariant], repeatable: several runs on one initialisation "
                 "(replaces --tokens, --seq-len and --recompute; mbN: passes of at most N tokens; invariant: the "
                 "batch-invariant mode)");
  app.add_option("--micro-batch-tokens", micro_batch_tokens,
                 "passes of at most this many tokens per step, gradients summed (0: one pass)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line as it is measured, also into a pipe
  try {
    std::vector<Run> runs;
    for (const std::string& r : run_specs) runs.push_back(parse_run(r, micro_batch_tokens));
    if (runs.empty()) {
      if (tokens <= 0 || seq_len <= 0 || tokens % seq_len != 0)
        fail("--tokens ", tokens, " and --seq-len ", seq_len, ": positive, and the length must divide the tokens");
      runs.push_back(Run{tokens, seq_len, recompute, micro_batch_tokens});
    }
    const GpuPrecision p = parse_gpu_precision(precision, "--precision");
    std::string why;
    if (!cuda::available(&why)) {
      std::printf("no GPU: %s\n", why.c_str());
      return 0;
    }
    std::printf("%s\n| config | precision | batch | step | tokens/s | device memory | MFU |\n|---|---|---|---|---|---|---|\n",
                cuda::device_summary().c_str());
    for (const std::string& c : configs) bench(c, runs, p, steps, optimizer);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
