// The whole K3 model on the GPU (model/cuda/cuda_model.h). Truths:
//   - the golden k3-tiny-a fixture (Moonshot's float64 reference) for the F32 path: logits of every
//     input at the CPU's bar (1e-4), every layer's block outputs and routed experts, the greedy
//     continuation, teacher-forced decoding, and the MXFP4 model;
//   - full recomputation for the F32 path's cached decoding; each sequence alone for batches;
//   - for the BF16 path, its CPU twin: the CPU model with PathOptions::bf16_activations, which rounds
//     every activation to bf16 exactly where the BF16 path stores it in bf16 (model/layers.h). Block
//     by block on equal inputs, and on a router-free random model for whole sequences, prefill and
//     cached decoding.
// Skipped without a Hopper GPU or a CUDA build.
//
// How the BF16 path is judged. A random model is very sensitive to bf16 roundings of its
// activations: rounding only x̂ of the fixture's first KDA block moves that block's output by ~4e-3,
// and each later block amplifies what it inherits 1.5-3x. Those errors describe the model, not the
// kernels, and they are chaotic: moving one rounding of the twin changes them by tens of percent
// (docs/CUDA.md, "How the two paths are tested", has the figures). So a GPU block is never compared
// after inheriting noise. Instead:
//   - every block on the twin's inputs: the GPU forward continues from the twin's block outputs
//     (ForwardHooks::replace), so each GPU block differs from the twin's only by its own kernels'
//     bf16 choices and accumulation order, judged at the kernel bar (1e-2). Fed the exact model's
//     blocks the same way, the twin itself stays within 1.0e-2 of the golden per block (CpuTwin test);
//   - whole sequences on a router-free random model: the GPU departs from the exact (F32) path by no
//     more than the twin does, within 25% + 2e-3 (kTrackFactor, kTrackSlack).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "model/cuda/cuda_model.h"
#include "model/generate.h"
#include "model/init_random.h"
#include "model/model.h"
#include "model/sampler.h"
#include "util/cli.h"
#include "util/cuda_test.h"
#include "util/fixture.h"
#include "util/st_file.h"
#include "util/temp_dir.h"

using namespace k3;
using k3test::fixture;
using k3test::golden;
using k3test::golden_row;
using k3test::golden_rows;
using k3test::rel_l2;

namespace {

constexpr double kFixtureBar = 1e-4;  // fixtures README: logits and per-layer outputs of an fp32 engine
constexpr double kTwinBar = 1e-2;     // BF16 path vs its CPU twin, block by block: see the header comment
constexpr double kTrackFactor = 1.25, kTrackSlack = 2e-3;  // ditto, whole sequences of a router-free model

// The BF16 GPU path departs from the exact path (err_gpu) by no more than its CPU twin does (err_twin).
bool tracks_twin(double err_gpu, double err_twin) { return err_gpu <= kTrackFactor * err_twin + kTrackSlack; }

CudaModel& gpu_tiny(GpuPrecision p, bool mxfp4 = false) {
  static std::map<std::pair<int, bool>, std::unique_ptr<CudaModel>> models;
  auto& m = models[{int(p), mxfp4}];
  if (!m)
    m = mxfp4 ? CudaModel::load(fixture("k3-tiny-a/config-mxfp4.json"), fixture("k3-tiny-a/model-mxfp4.safetensors"), p)
              : CudaModel::load(fixture("k3-tiny-a/config.json"), fixture("k3-tiny-a/model.safetensors"), p);
  return *m;
}

// The CPU twin of the BF16 path for a checkpoint (loaded once per checkpoint).
Model& cpu_twin(const std::string& config, const std::string& weights) {
  static std::map<std::string, std::unique_ptr<Model>> twins;
  auto& m = twins[weights];
  if (!m) {
    m = Model::load(config, weights);
    m->options().bf16_activations = true;
  }
  return *m;
}
Model& tiny_twin(bool mxfp4) {
  return mxfp4 ? cpu_twin(fixture("k3-tiny-a/config-mxfp4.json"), fixture("k3-tiny-a/model-mxfp4.safetensors"))
               : cpu_twin(fixture("k3-tiny-a/config.json"), fixture("k3-tiny-a/model.safetensors"));
}

std::vector<float> forward_fresh(Model& m, const std::vector<std::vector<int32_t>>& rows, bool all = true,
                                 const ForwardHooks* hooks = nullptr) {
  std::vector<SequenceCache> caches;
  std::vector<SequenceCache*> ptrs;
  for (size_t b = 0; b < rows.size(); ++b) caches.push_back(m.new_cache());
  for (auto& c : caches) ptrs.push_back(&c);
  return m.forward(ptrs, rows, all, hooks);
}

std::vector<float> forward_fresh(CudaModel& m, const std::vector<std::vector<int32_t>>& rows, bool all = true,
                                 const ForwardHooks* hooks = nullptr) {
  std::vector<std::unique_ptr<CudaSequenceCache>> caches;
  std::vector<CudaSequenceCache*> ptrs;
  for (size_t b = 0; b < rows.size(); ++b) caches.push_back(m.new_cache());
  for (auto& c : caches) ptrs.push_back(c.get());
  return m.forward(ptrs, rows, all, hooks);
}

// Every block output and routing decision of one forward, by fixture name.
struct Trace {
  std::map<std::string, std::vector<float>> tensors;          // attn_out.L, ffn_out.L
  std::map<int64_t, std::vector<std::set<int32_t>>> experts;  // layer -> per token, the chosen set
  ForwardHooks hooks() {
    ForwardHooks h;
    h.tensor = [this](const char* name, int64_t l, const float* p, int64_t rows, int64_t cols) {
      tensors[std::string(name) + "." + std::to_string(l)] = std::vector<float>(p, p + rows * cols);
    };
    h.topk = [this](int64_t l, const int32_t* idx, int64_t rows, int64_t k) {
      auto& v = experts[l];
      v.clear();
      for (int64_t t = 0; t < rows; ++t) v.emplace_back(idx + t * k, idx + (t + 1) * k);
    };
    return h;
  }
};

template <class M>
Trace trace(M& m, const std::vector<int32_t>& ids) {
  Trace t;
  const ForwardHooks h = t.hooks();
  forward_fresh(m, {ids}, true, &h);
  return t;
}

// rel L2 of a block output against a reference, over the tokens whose expert sets agree when the block
// is a MoE FFN (got_experts/want_experts per token, nullptr for other blocks); tokens routed
// differently are left out (their outputs differ by design) and counted in *flipped.
double block_rel_l2(std::vector<float> got, std::vector<float> want, int64_t D,
                    const std::vector<std::set<int32_t>>* got_experts,
                    const std::vector<std::set<int32_t>>* want_experts, int64_t* flipped) {
  *flipped = 0;
  if (got_experts && want_experts) {
    const int64_t N = int64_t(got.size()) / D;
    int64_t kept = 0;
    for (int64_t r = 0; r < N; ++r) {
      if ((*got_experts)[size_t(r)] != (*want_experts)[size_t(r)]) {
        ++*flipped;
        continue;
      }
      std::copy_n(&got[size_t(r * D)], D, &got[size_t(kept * D)]);
      std::copy_n(&want[size_t(r * D)], D, &want[size_t(kept * D)]);
      ++kept;
    }
    got.resize(size_t(kept * D)), want.resize(size_t(kept * D));
  }
  return rel_l2(got, want);
}

// The golden fixture's expert sets of MoE layer l, per token.
std::vector<std::set<int32_t>> golden_experts(int64_t l, int64_t K) {
  const std::vector<int64_t> idx = golden().read_i64("topk_idx." + std::to_string(l));
  std::vector<std::set<int32_t>> sets;
  for (size_t t = 0; t * size_t(K) < idx.size(); ++t)
    sets.emplace_back(idx.begin() + int64_t(t) * K, idx.begin() + int64_t(t + 1) * K);
  return sets;
}

// {1, 2, 3} -> "1,2,3" (sep ',') for --ids, or "1 2 3" as --print-ids prints them.
std::string joined(const std::vector<int32_t>& ids, char sep) {
  std::string s;
  for (int32_t i : ids) {
    if (!s.empty()) s += sep;
    s += std::to_string(i);
  }
  return s;
}

int32_t argmax_row(const float* x, int64_t n) { return int32_t(std::max_element(x, x + n) - x); }

// ---------------------------------------------------------------------------------------------
// F32 path against the float64 golden fixture
// ---------------------------------------------------------------------------------------------

TEST(CudaModelF32, FixtureLogitsEveryInput) {
  K3_REQUIRE_GPU();
  CudaModel& m = gpu_tiny(GpuPrecision::F32);
  for (const char* name : {"ids_a", "ids_b", "ids_long"}) {
    const std::vector<float> got = forward_fresh(m, golden_rows(name));
    const double err = rel_l2(got, golden().read_f32(std::string("logits_") + name));
    std::printf("GPU f32 %-8s logits vs float64 golden: rel L2 %.3e\n", name, err);
    EXPECT_LE(err, kFixtureBar) << name;
  }
}

TEST(CudaModelF32, FixtureMxfp4Logits) {
  K3_REQUIRE_GPU();
  const std::vector<float> got = forward_fresh(gpu_tiny(GpuPrecision::F32, true), golden_rows("ids_a"));
  const double err = rel_l2(got, golden().read_f32("logits_mxfp4_ids_a"));
  std::printf("GPU f32 MXFP4 ids_a logits vs golden: rel L2 %.3e\n", err);
  EXPECT_LE(err, kFixtureBar);
}

TEST(CudaModelF32, FixtureEveryLayerAndRouting) {
  K3_REQUIRE_GPU();
  CudaModel& m = gpu_tiny(GpuPrecision::F32);
  Trace t = trace(m, golden_row("ids_a"));
  const int64_t L = m.config().num_hidden_layers;
  for (int64_t l = 0; l < L; ++l) {
    for (const char* kind : {"attn_out", "ffn_out"}) {
      const std::string key = std::string(kind) + "." + std::to_string(l);
      ASSERT_TRUE(t.tensors.count(key)) << key;
      const double err = rel_l2(t.tensors[key], golden().read_f32(key));
      EXPECT_LE(err, kFixtureBar) << key << ": rel L2 " << err;
    }
    if (!m.config().is_moe_layer(l)) continue;
    const std::vector<int64_t> want = golden().read_i64("topk_idx." + std::to_string(l));
    const int64_t K = m.config().num_experts_per_token;
    ASSERT_EQ(t.experts[l].size() * size_t(K), want.size()) << "layer " << l;
    for (size_t tok = 0; tok < t.experts[l].size(); ++tok) {
      const std::set<int32_t> w(want.begin() + int64_t(tok) * K, want.begin() + int64_t(tok + 1) * K);
      EXPECT_EQ(t.experts[l][tok], w) << "layer " << l << " token " << tok;
    }
  }
}

TEST(CudaModelF32, GreedyGenerateEqualsGolden) {
  K3_REQUIRE_GPU();
  CudaModel& m = gpu_tiny(GpuPrecision::F32);
  std::unique_ptr<CudaSequenceCache> cache = m.new_cache();
  const AppendFn append = [&](const std::vector<int32_t>& t) { return m.forward({cache.get()}, {t}, false); };
  Sampler greedy(SamplingParams{});
  const std::vector<int32_t> want = golden_row("greedy_cached_ids_a");
  GenerateResult r = generate(append, m.config(), golden_row("ids_a"), int64_t(want.size()), greedy);
  EXPECT_EQ(r.tokens, want);
  EXPECT_EQ(cache->length(), int64_t(golden_row("ids_a").size() + want.size() - 1));
}

// Prefill ids_a, then teacher-force the rest of ids_long one token at a time: every position's
// logits against the golden full forward (the CPU's FixtureDecode test, on the GPU).
TEST(CudaModelF32, TeacherForcedDecodeMatchesGolden) {
  K3_REQUIRE_GPU();
  CudaModel& m = gpu_tiny(GpuPrecision::F32);
  const std::vector<int32_t> ids = golden_row("ids_long");
  std::unique_ptr<CudaSequenceCache> cache = m.new_cache();
  std::vector<float> got = m.forward({cache.get()}, {std::vector<int32_t>(ids.begin(), ids.begin() + 37)}, true);
  for (size_t t = 37; t < ids.size(); ++t) {
    const std::vector<float> l = m.forward({cache.get()}, {{ids[t]}}, false);
    got.insert(got.end(), l.begin(), l.end());
  }
  const double err = rel_l2(got, golden().read_f32("logits_ids_long"));
  std::printf("GPU f32 ids_long teacher-forced decode vs golden: rel L2 %.3e\n", err);
  EXPECT_LE(err, kFixtureBar);
}

// ---------------------------------------------------------------------------------------------
// The CPU twin itself (no GPU needed): its block inputs are bf16 values, and it departs from the
// exact model by a bf16-sized amount, not more.
// ---------------------------------------------------------------------------------------------

TEST(CpuTwin, BlockInputsAreBf16ValuesAndTheFirstBlockMovesByBf16Noise) {
  Model& twin = tiny_twin(false);
  int64_t checked = 0, not_bf16 = 0;
  std::vector<float> attn0;
  ForwardHooks h;
  h.tensor = [&](const char* name, int64_t l, const float* p, int64_t rows, int64_t cols) {
    if (std::string(name) == "attn_out" && l == 0) attn0.assign(p, p + rows * cols);
    if (std::string(name) != "attn_in" && std::string(name) != "ffn_in") return;
    for (int64_t i = 0; i < rows * cols; ++i, ++checked)
      if (bf16_to_f32(f32_to_bf16(p[i])) != p[i]) ++not_bf16;
  };
  forward_fresh(twin, {golden_row("ids_a")}, true, &h);
  EXPECT_GT(checked, 0);
  EXPECT_EQ(not_bf16, 0) << "block inputs of the twin must be bf16 values";
  // The first KDA block of the fixture stores ~10 activations in bf16 (unit roundoff 2^-9 = 2e-3);
  // measured 7.1e-3 from the float64 golden. Not rounding would give ~1e-7; an O(1) error a bug.
  const double err = rel_l2(attn0, golden().read_f32("attn_out.0"));
  std::printf("CPU twin (bf16 activations) attn_out.0 vs float64 golden: rel L2 %.3e\n", err);
  EXPECT_GT(err, 1e-3);
  EXPECT_LT(err, 2e-2);
}

// ForwardHooks::replace, which the GPU block test below relies on, on the CPU model: fed its own block
// outputs the twin gives its own logits bit for bit; fed the float64 golden block outputs, each of its
// blocks departs from the golden one by a single block's bf16 noise (the first block's size), not by
// the noise it would have inherited (free, the twin is 3.5e-2 from the golden by the third layer).
TEST(CpuTwin, ReplaceHookFeedsBlockOutputsToTheForward) {
  Model& twin = tiny_twin(false);
  const std::vector<int32_t> ids = golden_row("ids_a");
  Trace free_run;
  const ForwardHooks fh = free_run.hooks();
  const std::vector<float> free_logits = forward_fresh(twin, {ids}, true, &fh);

  ForwardHooks same;
  int replaced = 0;
  same.replace = [&](const char* name, int64_t l, float* p, int64_t, int64_t) {
    const std::vector<float>& v = free_run.tensors.at(std::string(name) + "." + std::to_string(l));
    std::copy(v.begin(), v.end(), p);
    ++replaced;
    return true;
  };
  EXPECT_EQ(forward_fresh(twin, {ids}, true, &same), free_logits);
  EXPECT_EQ(replaced, 2 * twin.config().num_hidden_layers);

  Trace forced;
  ForwardHooks gh = forced.hooks();
  gh.replace = [&](const char* name, int64_t l, float* p, int64_t rows, int64_t cols) {
    const std::vector<float> v = golden().read_f32(std::string(name) + "." + std::to_string(l));
    EXPECT_EQ(v.size(), size_t(rows * cols));
    std::copy(v.begin(), v.end(), p);
    return true;
  };
  const std::vector<float> forced_logits = forward_fresh(twin, {ids}, true, &gh);
  const K3Config& c = twin.config();
  double first = 0, worst_forced = 0, worst_free = 0;
  int64_t flipped_tokens = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    for (const char* kind : {"attn_out", "ffn_out"}) {
      const std::string key = std::string(kind) + "." + std::to_string(l);
      const bool moe = std::string(kind) == "ffn_out" && c.is_moe_layer(l);
      const std::vector<std::set<int32_t>> want_experts =
          moe ? golden_experts(l, c.num_experts_per_token) : std::vector<std::set<int32_t>>{};
      int64_t flipped = 0, unused = 0;
      const double e = block_rel_l2(forced.tensors.at(key), golden().read_f32(key), c.hidden_size,
                                    moe ? &forced.experts.at(l) : nullptr, moe ? &want_experts : nullptr, &flipped);
      if (l == 0 && std::string(kind) == "attn_out") first = e;
      worst_forced = std::max(worst_forced, e);
      worst_free = std::max(worst_free, block_rel_l2(free_run.tensors.at(key), golden().read_f32(key), c.hidden_size,
                                                     nullptr, nullptr, &unused));
      flipped_tokens += flipped;
    }
  const std::vector<float> want = golden().read_f32("logits_ids_a");
  std::printf(
      "CPU twin vs float64 golden: first block %.3e; worst block free %.3e, fed the golden blocks %.3e "
      "(%lld token-layers routed differently, left out); logits %.3e vs %.3e\n",
      first, worst_free, worst_forced, (long long)flipped_tokens, rel_l2(free_logits, want),
      rel_l2(forced_logits, want));
  EXPECT_LE(worst_forced, 2 * first) << "a block's own bf16 noise is of the first block's size";
  EXPECT_GT(worst_free, 4 * first) << "the free twin must inherit noise, or this test shows nothing";
  EXPECT_LT(rel_l2(forced_logits, want), rel_l2(free_logits, want));
  EXPECT_LE(flipped_tokens * 8, int64_t(ids.size())) << "near-ties only";
}

// The switch for CLI users: `k3 logits --precision bf16` on the CPU gives the twin's logits.
TEST(CpuTwin, PrecisionFlagReachesTheCli) {
  k3test::TempDir dir("cpu-twin-cli");
  const std::string plain = (dir.path() / "plain.safetensors").string(),
                    twin = (dir.path() / "twin.safetensors").string();
  const std::string csv = joined(golden_row("ids_a"), ',');
  const std::vector<std::string> args = {"logits", "--model", fixture("k3-tiny-a"), "--ids", csv, "--out"};
  auto with = [&](const std::string& out) {
    std::vector<std::string> a = args;
    a.push_back(out);
    return a;
  };
  auto r = k3test::run_k3(with(plain));
  ASSERT_EQ(r.status, 0) << r.output;
  std::vector<std::string> twin_args = with(twin);
  twin_args.insert(twin_args.end(), {"--device", "cpu", "--precision", "bf16"});
  r = k3test::run_k3(twin_args);
  ASSERT_EQ(r.status, 0) << r.output;
  const std::vector<float> want = golden().read_f32("logits_ids_a");
  const std::vector<float> cli_twin = SafeTensors::open(twin).read_f32("logits");
  EXPECT_LE(rel_l2(SafeTensors::open(plain).read_f32("logits"), want), kFixtureBar);
  EXPECT_GT(rel_l2(cli_twin, want), 1e-3) << "the flag must round";
  // Same kernels and thread count as this process (k3_command pins OpenBLAS's): the same logits.
  EXPECT_LE(rel_l2(cli_twin, forward_fresh(tiny_twin(false), {golden_row("ids_a")})), 1e-6)
      << "the CLI's twin must be the library's twin";
}

// ---------------------------------------------------------------------------------------------
// BF16 path against its CPU twin, layer by layer up to the first routing flip
// ---------------------------------------------------------------------------------------------

// Each block of the BF16 path on the same inputs as its twin: the GPU forward continues from the
// twin's block outputs (ForwardHooks::replace), so block l sees exactly what the twin's block l saw
// and differs from it only by its own kernels. Per block: rel L2 against the twin's output at the
// kernel bar; for MoE blocks over the tokens both route to the same experts (a near-tie can flip a
// token's set on inputs that differ in a bf16 rounding of x̂; those tokens are counted, and must be
// few). Returns nothing; prints every block.
void bf16_blocks_against_twin(bool mxfp4, const std::string& input) {
  CudaModel& gpu = gpu_tiny(GpuPrecision::BF16, mxfp4);
  Model& twin = tiny_twin(mxfp4);
  const std::vector<int32_t> ids = golden_row(input);
  Trace tt;  // the twin, free
  const ForwardHooks th = tt.hooks();
  const std::vector<float> twin_logits = forward_fresh(twin, {ids}, true, &th);
  Trace tg;  // the GPU, fed the twin's block outputs
  ForwardHooks gh = tg.hooks();
  gh.replace = [&](const char* name, int64_t l, float* p, int64_t rows, int64_t cols) {
    const std::vector<float>& want = tt.tensors.at(std::string(name) + "." + std::to_string(l));
    EXPECT_EQ(want.size(), size_t(rows * cols)) << name << "." << l;
    std::copy(want.begin(), want.end(), p);
    return true;
  };
  const std::vector<float> gpu_logits = forward_fresh(gpu, {ids}, true, &gh);
  const char* label = mxfp4 ? "mxfp4" : "bf16 experts";
  const int64_t L = gpu.config().num_hidden_layers, N = int64_t(ids.size()), D = gpu.config().hidden_size;
  for (int64_t l = 0; l < L; ++l) {
    for (const char* kind : {"attn_out", "ffn_out"}) {
      const std::string key = std::string(kind) + "." + std::to_string(l);
      const bool moe = std::string(kind) == "ffn_out" && gpu.config().is_moe_layer(l);
      int64_t flipped = 0;
      const double err = block_rel_l2(tg.tensors.at(key), tt.tensors.at(key), D, moe ? &tg.experts.at(l) : nullptr,
                                      moe ? &tt.experts.at(l) : nullptr, &flipped);
      std::printf("GPU bf16 (%s, %s) %-10s on the twin's inputs: rel L2 %.3e", label, input.c_str(), key.c_str(), err);
      if (flipped) std::printf(" (%lld of %lld tokens routed differently, left out)", (long long)flipped, (long long)N);
      std::printf("\n");
      EXPECT_LE(err, kTwinBar) << key;
      EXPECT_LE(flipped * 8, N) << key << ": routing differs on " << flipped << " of " << N << " tokens";
    }
  }
  const double err = rel_l2(gpu_logits, twin_logits);
  std::printf("GPU bf16 (%s, %s) logits (final AttnRes, norm, lm_head) on the twin's inputs: rel L2 %.3e\n", label,
              input.c_str(), err);
  EXPECT_LE(err, kTwinBar);
}

TEST(CudaModelBF16, EveryBlockMatchesCpuTwinOnEqualInputs) {
  K3_REQUIRE_GPU();
  bf16_blocks_against_twin(false, "ids_a");
  bf16_blocks_against_twin(false, "ids_long");
}

TEST(CudaModelBF16, Mxfp4EveryBlockMatchesCpuTwinOnEqualInputs) {
  K3_REQUIRE_GPU();
  bf16_blocks_against_twin(true, "ids_a");
  bf16_blocks_against_twin(true, "ids_long");
}

// ---------------------------------------------------------------------------------------------
// Cached decoding = full recomputation; batches = sequences alone
// ---------------------------------------------------------------------------------------------

// Prefill `prompt`, then decode `steps` greedy tokens, comparing each step with a full forward of the
// sequence so far. A middle piece of `piece` tokens exercises multi-token appends. Returns the worst.
double cached_vs_full(CudaModel& m, const std::vector<int32_t>& prompt, int64_t piece, int steps, double tol) {
  const int64_t V = m.config().vocab_size;
  std::unique_ptr<CudaSequenceCache> cache = m.new_cache();
  std::vector<int32_t> seq = prompt;
  std::vector<float> got = m.forward({cache.get()}, {prompt}, false);
  if (piece > 0) {  // a multi-token append after the prefill
    std::vector<int32_t> more;
    for (int64_t i = 0; i < piece; ++i) more.push_back(int32_t((seq[size_t(i)] * 7 + 3) % V));
    seq.insert(seq.end(), more.begin(), more.end());
    got = m.forward({cache.get()}, {more}, false);
  }
  double worst = 0.0;
  for (int step = 0;; ++step) {
    const double err = rel_l2(got, forward_fresh(m, {seq}, false));
    worst = std::max(worst, err);
    EXPECT_LE(err, tol) << "step " << step << " (" << seq.size() << " tokens)";
    if (step == steps) break;
    seq.push_back(argmax_row(got.data(), V));
    got = m.forward({cache.get()}, {{seq.back()}}, false);
  }
  EXPECT_EQ(cache->length(), int64_t(seq.size()));
  return worst;
}

TEST(CudaModelF32, CachedDecodeEqualsFullRecomputation) {
  K3_REQUIRE_GPU();
  // Both run the same kernels (the recurrence, the exact MLA) on different row counts: the fp64 GEMMs
  // round to fp32 the same way almost always; 1e-5 is the CPU's bar for the same comparison.
  const double worst = cached_vs_full(gpu_tiny(GpuPrecision::F32), golden_row("ids_a"), 9, 24, 1e-5);
  std::printf("GPU f32 cached decode vs full recomputation (fixture, 24 steps): worst rel L2 %.3e\n", worst);
}

// A router-free random model (every layer dense): no routing decision can flip, so whole sequences
// compare. The BF16 path's prefill (KDA chunks, flash MLA) and its cached decoding (the recurrence,
// the absorbed split-K MLA, one-row GEMMs) are each held to the CPU twin taking the same path.
// hidden_size > 0 replaces the fixture's 128.
struct DenseModel {
  k3test::TempDir dir{"cuda-dense"};
  std::unique_ptr<CudaModel> bf16, f32;
  std::unique_ptr<Model> twin;
  explicit DenseModel(int64_t hidden_size = 0) {
    std::ifstream in(fixture("k3-tiny-a/config.json"));
    nlohmann::json j = nlohmann::json::parse(in);
    auto& t = j["text_config"];
    t["first_k_dense_replace"] = t["num_hidden_layers"];
    if (hidden_size > 0) t["hidden_size"] = hidden_size;
    const std::string input = (dir.path() / "input-config.json").string();
    std::ofstream(input) << j.dump(2);
    RandomInitOptions o;
    o.seed = 77;
    o.random_attnres_queries = true;
    write_random_model(input, dir.path().string(), o);
    bf16 = CudaModel::load(dir.path().string(), GpuPrecision::BF16);
    f32 = CudaModel::load(dir.path().string(), GpuPrecision::F32);
    twin = Model::load(dir.path().string());
    twin->options().bf16_activations = true;
  }
};
DenseModel& dense() {
  static DenseModel d;
  return d;
}

std::vector<int32_t> tokens(int64_t n, int64_t V, uint64_t seed) {
  std::vector<int32_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back(int32_t((i * 2654435761u + seed * 97) % uint64_t(V)));
  return t;
}

TEST(CudaModelBF16, PrefillTracksCpuTwinDenseModel) {
  K3_REQUIRE_GPU();
  const std::vector<int32_t> ids = tokens(100, dense().f32->config().vocab_size, 2);
  const std::vector<float> gpu = forward_fresh(*dense().bf16, {ids}), exact = forward_fresh(*dense().f32, {ids});
  const std::vector<float> twin = forward_fresh(*dense().twin, {ids});
  const double e_gpu = rel_l2(gpu, exact), e_twin = rel_l2(twin, exact);
  std::printf(
      "GPU bf16 logits (dense random model, 100 tokens) from exact: GPU %.3e, CPU twin %.3e; GPU vs twin %.3e\n", e_gpu,
      e_twin, rel_l2(gpu, twin));
  EXPECT_TRUE(tracks_twin(e_gpu, e_twin));
}

// The reference switch (K3_REFERENCE=1, CudaModel::set_reference) reaches the GPU's kernels: a 100-token
// prefill then runs the KDA recurrence and expanded MLA, so its logits differ from the chunked path's
// in the last bits, and still track the CPU twin as the default path does.
TEST(CudaModelBF16, ReferenceSwitchRunsTheSpecificationForms) {
  K3_REQUIRE_GPU();
  CudaModel& gpu = *dense().bf16;
  struct Restore {
    CudaModel& m;
    bool was;
    ~Restore() { m.set_reference(was); }
  } restore{gpu, gpu.reference()};
  const std::vector<int32_t> ids = tokens(100, gpu.config().vocab_size, 5);
  gpu.set_reference(false);
  const std::vector<float> chunked = forward_fresh(gpu, {ids});
  gpu.set_reference(true);
  const std::vector<float> reference = forward_fresh(gpu, {ids});
  const std::vector<float> exact = forward_fresh(*dense().f32, {ids}), twin = forward_fresh(*dense().twin, {ids});
  const double e_ref = rel_l2(reference, exact), e_twin = rel_l2(twin, exact);
  std::printf("GPU bf16 reference forms (100 tokens) from exact: %.3e (twin %.3e); from the chunked path: %.3e\n",
              e_ref, e_twin, rel_l2(reference, chunked));
  EXPECT_NE(reference, chunked) << "the switch must change the kernels that run";
  EXPECT_TRUE(tracks_twin(e_ref, e_twin));
}

// Prefill 40 tokens, append 8 (a multi-token append: recurrence + absorbed MLA with n = 8), then 24
// greedy steps, fed identically to the GPU BF16 path, the exact path and the twin: over all the
// calls' logits, the GPU's cached decoding (recurrence, absorbed split-K MLA, one-row GEMMs) departs
// from exact no more than the twin's does. (One step's logits are one row: its ratio scatters, the
// worst is printed; the 26 rows together are the measure.)
TEST(CudaModelBF16, CachedDecodeTracksCpuTwinDenseModel) {
  K3_REQUIRE_GPU();
  CudaModel& g = *dense().bf16;
  CudaModel& f = *dense().f32;
  Model& t = *dense().twin;
  const int64_t V = g.config().vocab_size;
  std::unique_ptr<CudaSequenceCache> gc = g.new_cache(), fc = f.new_cache();
  SequenceCache tc = t.new_cache();
  std::vector<float> all_g, all_f, all_t;
  double worst_ratio = 0.0;
  auto step = [&](const std::vector<int32_t>& ids) {
    const std::vector<float> a = g.forward({gc.get()}, {ids}, false), e = f.forward({fc.get()}, {ids}, false);
    const std::vector<float> b = t.forward({&tc}, {ids}, false);
    worst_ratio = std::max(worst_ratio, rel_l2(a, e) / rel_l2(b, e));
    all_g.insert(all_g.end(), a.begin(), a.end());
    all_f.insert(all_f.end(), e.begin(), e.end());
    all_t.insert(all_t.end(), b.begin(), b.end());
    return argmax_row(e.data(), V);
  };
  step(tokens(40, V, 1));
  int32_t next = step(tokens(8, V, 9));
  for (int s = 0; s < 24; ++s) next = step({next});
  EXPECT_EQ(gc->length(), tc.length);
  const double e_gpu = rel_l2(all_g, all_f), e_twin = rel_l2(all_t, all_f);
  std::printf(
      "GPU bf16 cached decode (dense random model, prefill + append + 24 steps) from exact: GPU %.3e, CPU twin "
      "%.3e (ratio %.2f; worst single step %.2f)\n",
      e_gpu, e_twin, e_gpu / e_twin, worst_ratio);
  EXPECT_TRUE(tracks_twin(e_gpu, e_twin));
}

// A hidden size that is not a multiple of 8 (nor of 4): the row kernels (RMSNorm, AttnRes, the
// embedding gather, residual adds) take their scalar paths, the GEMMs unaligned rows. The F32 path
// against the CPU model at the fixture bar, the BF16 path tracking its twin.
TEST(CudaModel, HiddenSizeNotAMultipleOfEight) {
  K3_REQUIRE_GPU();
  DenseModel m(98);
  const std::vector<int32_t> ids = tokens(50, m.f32->config().vocab_size, 6);
  std::unique_ptr<Model> cpu = Model::load(m.dir.path().string());
  const std::vector<float> want = forward_fresh(*cpu, {ids});
  const std::vector<float> f32 = forward_fresh(*m.f32, {ids}), b = forward_fresh(*m.bf16, {ids});
  const std::vector<float> twin = forward_fresh(*m.twin, {ids});
  const double e_f32 = rel_l2(f32, want), e_gpu = rel_l2(b, want), e_twin = rel_l2(twin, want);
  std::printf("hidden_size 98: GPU f32 vs CPU %.3e; bf16 from exact: GPU %.3e, CPU twin %.3e\n", e_f32, e_gpu, e_twin);
  EXPECT_LE(e_f32, kFixtureBar);
  EXPECT_TRUE(tracks_twin(e_gpu, e_twin));
}

// Input rows (ForwardHooks, an image's projected tokens) on the GPU: rows that are the fp32 table's own rows of
// other ids give the forward of those ids, to the bit, in a batch of two (F32 path, the CPU model's table rows);
// and through forward_pick, the same ids as the plain forward picks.
TEST(CudaModel, InputRowsTakeThePlaceOfTheirTokens) {
  K3_REQUIRE_GPU();
  CudaModel& m = gpu_tiny(GpuPrecision::F32);
  std::unique_ptr<Model> cpu = Model::load(fixture("k3-tiny-a"));
  const int64_t D = m.config().hidden_size;
  const std::vector<int32_t> a = {5, 6, 7, 8}, pads = {1, 2, 789, 789, 789, 3, 789, 4},
                             want = {1, 2, 40, 41, 42, 3, 43, 4};
  std::vector<float> table(size_t(4 * D));
  for (int i = 0; i < 4; ++i) cpu->weights().embed_tokens.rows_to_f32(table.data() + i * D, 40 + i, 1);
  ForwardHooks h;
  h.input_rows = {{}, {InputRows{2, 3, table.data()}, InputRows{6, 1, table.data() + 3 * D}}};
  const std::vector<float> got = forward_fresh(m, {a, pads}, true, &h), ref = forward_fresh(m, {a, want}, true);
  ASSERT_EQ(got.size(), ref.size());
  EXPECT_EQ(0, std::memcmp(got.data(), ref.data(), got.size() * sizeof(float)));
  std::unique_ptr<CudaSequenceCache> c1 = m.new_cache(), c2 = m.new_cache();
  const TokenPick greedy{true, true, 1.0f, 0.0, true};
  h.input_rows = {{InputRows{2, 3, table.data()}, InputRows{6, 1, table.data() + 3 * D}}};
  const std::vector<PickResult> p1 = m.forward_pick({c1.get()}, {pads}, {greedy}, &h);
  const std::vector<PickResult> p2 = m.forward_pick({c2.get()}, {want}, {greedy});
  EXPECT_EQ(p1[0].id, p2[0].id);
  EXPECT_EQ(p1[0].logits, p2[0].logits) << "the rows reached forward_pick's forward";
}

TEST(CudaModel, BatchEqualsSequencesAlone) {
  K3_REQUIRE_GPU();
  for (GpuPrecision p : {GpuPrecision::F32, GpuPrecision::BF16}) {
    CudaModel& m = p == GpuPrecision::F32 ? gpu_tiny(p) : *dense().bf16;
    const int64_t V = m.config().vocab_size;
    const std::vector<std::vector<int32_t>> seqs = {tokens(37, V, 3), tokens(5, V, 4), tokens(20, V, 5)};
    const std::vector<float> batched = forward_fresh(m, seqs, true);
    int64_t r0 = 0;
    for (const auto& s : seqs) {
      const std::vector<float> alone = forward_fresh(m, {s}, true);
      const std::vector<float> part(batched.begin() + r0 * V, batched.begin() + (r0 + int64_t(s.size())) * V);
      // Same kernels per sequence; only the GEMMs see other row counts. bf16 GEMMs may pick another
      // algorithm for another M (fp32 accumulation order), hence not bit equality.
      EXPECT_LE(rel_l2(part, alone), p == GpuPrecision::F32 ? 1e-6 : 1e-3) << gpu_precision_name(p);
      r0 += int64_t(s.size());
    }
  }
}

// Sequences of one cache pool run their per-sequence steps as one launch (model/cuda/cuda_model.h:
// new_caches). Equal lengths take the batched conv, KDA core, MLA append and absorbed decode; unequal
// ones fall back to one sequence at a time. Both against each sequence alone.
TEST(CudaModel, PooledBatchEqualsSequencesAlone) {
  K3_REQUIRE_GPU();
  for (GpuPrecision p : {GpuPrecision::F32, GpuPrecision::BF16}) {
    CudaModel& m = p == GpuPrecision::F32 ? gpu_tiny(p) : *dense().bf16;
    const int64_t V = m.config().vocab_size;
    const double tol = p == GpuPrecision::F32 ? 1e-6 : 1e-3;  // as BatchEqualsSequencesAlone
    for (bool equal : {true, false}) {
      // 70-token prompts: the MLA pool's first reservation holds 70 rows per sequence, so the append
      // below grows it (every sequence's rows move), and the long append of one member alone grows
      // it again under the others.
      const std::vector<std::vector<int32_t>> prompts = {tokens(70, V, 6), tokens(equal ? 70 : 23, V, 7),
                                                         tokens(70, V, 8)};
      auto pool = m.new_caches(3);
      std::vector<std::unique_ptr<CudaSequenceCache>> alone;
      for (int i = 0; i < 3; ++i) alone.push_back(m.new_cache());
      // Feeds ids[j] to pool member members[j] (one call) and to its lone twin; compares every row.
      auto check = [&](const std::vector<int>& members, const std::vector<std::vector<int32_t>>& ids, bool all,
                       const char* what) {
        std::vector<CudaSequenceCache*> bp;
        for (int i : members) bp.push_back(pool[size_t(i)].get());
        const std::vector<float> batched = m.forward(bp, ids, all);
        int64_t r0 = 0;
        for (size_t j = 0; j < ids.size(); ++j) {
          const std::vector<float> one = m.forward({alone[size_t(members[j])].get()}, {ids[j]}, all);
          const int64_t rows = int64_t(one.size()) / V;
          const std::vector<float> part(batched.begin() + r0 * V, batched.begin() + (r0 + rows) * V);
          EXPECT_LE(rel_l2(part, one), tol) << gpu_precision_name(p) << (equal ? " equal" : " unequal") << " lengths, "
                                            << what << ", pool member " << members[j];
          r0 += rows;
        }
      };
      check({0, 1, 2}, prompts, true, "prefill");
      check({0, 1, 2}, {{1, 2, 3, 4, 5, 6, 7, 8}, {9, 10, 11, 12, 13, 14, 15, 16}, {17, 18, 19, 20, 21, 22, 23, 24}},
            true, "8-token append (the pool grows)");
      for (int s = 0; s < 3; ++s)
        check({0, 1, 2}, {{int32_t(30 + s)}, {int32_t(40 + s)}, {int32_t(50 + s)}}, false, "decode step");
      check({1, 2}, {{int32_t(60)}, {int32_t(61)}}, false, "decode step of members 1 and 2");
      check({2, 0}, {{int32_t(62)}, {int32_t(63)}}, false, "decode step of members 2 and 0 (out of pool order)");
      check({0}, {tokens(80, V, 11)}, true, "80-token append of member 0 alone (the pool grows)");
      EXPECT_LT(pool[2]->bytes(), pool[0]->bytes()) << "a member's MLA rows grow alone";
      check({0, 1, 2}, {{int32_t(70)}, {int32_t(71)}, {int32_t(72)}}, false, "decode step after the growth");
      for (int i = 0; i < 3; ++i) EXPECT_EQ(pool[size_t(i)]->length(), alone[size_t(i)]->length());
    }
  }
}

// Decode graphs (CudaModel::set_graphs): a pooled decode step replayed from a CUDA graph gives the eager step's
// bits, ids and logits. Four sequences (a graph bucket, so the GEMMs see the same rows) of unequal lengths in
// out-of-pool order, greedy and sampled picks, over steps in which their MLA rows grow under the graph (new row
// tables) and the longest outgrows the graph's plan (64 rows: the graph is made again); then a batch of 3
// (padded to 4) against the same sequences run eagerly.
TEST(CudaModel, DecodeGraphEqualsEagerDecode) {
  K3_REQUIRE_GPU();
  CudaModel& m = gpu_tiny(GpuPrecision::BF16);
  const int64_t V = m.config().vocab_size;
  struct Run {
    std::vector<std::unique_ptr<CudaSequenceCache>> pool;
    std::vector<std::vector<int32_t>> ids;
    std::vector<std::vector<float>> logits;
  };
  auto run = [&](bool graphs, const std::vector<int>& order, int steps) {
    m.set_graphs(graphs);
    Run r;
    r.pool = m.new_caches(5);
    std::vector<CudaSequenceCache*> seqs;
    std::vector<std::vector<int32_t>> prompts;
    for (size_t i = 0; i < order.size(); ++i) {
      seqs.push_back(r.pool[size_t(order[i])].get());
      prompts.push_back(tokens(int64_t(5 + 7 * i), V, 20 + i));
    }
    m.forward(seqs, prompts, false);
    std::vector<std::vector<int32_t>> next(order.size());
    for (size_t i = 0; i < order.size(); ++i) next[i] = {int32_t(100 + i)};
    for (int t = 0; t < steps; ++t) {
      std::vector<k3::TokenPick> picks(order.size());
      for (size_t i = 0; i < picks.size(); ++i) {
        picks[i].pick = true, picks[i].want_logits = true, picks[i].greedy = i % 2 == 0;
        picks[i].temperature = 0.8f, picks[i].uniform = double((t * 37 + int(i) * 11) % 100) / 100.0;
      }
      const std::vector<k3::PickResult> res = m.forward_pick(seqs, next, picks);
      std::vector<int32_t> step_ids;
      for (size_t i = 0; i < res.size(); ++i) {
        step_ids.push_back(res[i].id);
        r.logits.push_back(res[i].logits);
        next[i] = {res[i].id};
      }
      r.ids.push_back(step_ids);
    }
    return r;
  };
  // 70 steps: every place's rows start at 64 (prompts of 5 to 26 tokens); the longest passes 64 at step 38.
  const Run eager = run(false, {3, 0, 4, 1}, 70);
  const Run graph = run(true, {3, 0, 4, 1}, 70);
  EXPECT_EQ(m.graphs_off_reason(), "");
  EXPECT_GE(m.graph_count(), 1);
  EXPECT_EQ(graph.ids, eager.ids);
  ASSERT_EQ(graph.logits.size(), eager.logits.size());
  for (size_t i = 0; i < eager.logits.size(); ++i)
    ASSERT_EQ(0, std::memcmp(graph.logits[i].data(), eager.logits[i].data(), size_t(V) * sizeof(float)))
        << "step " << i / 4 << ", sequence " << i % 4;
  // Three sequences: their graph has a padding row; its first step against the eager step of the same three
  // (GEMMs of 3 and 4 rows may round differently, hence the tolerance of BatchEqualsSequencesAlone).
  const Run eager3 = run(false, {2, 4, 0}, 1), graph3 = run(true, {2, 4, 0}, 1);
  ASSERT_EQ(graph3.logits.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_LE(rel_l2(graph3.logits[i], eager3.logits[i]), 1e-3) << i;
  m.set_graphs(true);
}

// ---------------------------------------------------------------------------------------------
// Errors and the CLI
// ---------------------------------------------------------------------------------------------

TEST(CudaModel, BadInputsAreErrors) {
  K3_REQUIRE_GPU();
  CudaModel& m = gpu_tiny(GpuPrecision::BF16);
  auto c = m.new_cache();
  EXPECT_THROW(m.forward({c.get()}, {{1, int32_t(m.config().vocab_size)}}, false), k3::Error);
  EXPECT_THROW(m.forward({c.get()}, std::vector<std::vector<int32_t>>{std::vector<int32_t>{}}, false), k3::Error);
  auto other = gpu_tiny(GpuPrecision::F32).new_cache();
  EXPECT_THROW(m.forward({other.get()}, {{1}}, false), k3::Error);
  EXPECT_THROW(m.forward({c.get(), c.get()}, {{1}, {2}}, false), k3::Error);
  EXPECT_EQ(c->length(), 0) << "a rejected call must not advance the cache";
  EXPECT_THROW(parse_gpu_precision("fp8", "--precision"), k3::Error);
}

TEST(CudaModelCli, LogitsAndGenerateOnTheGpu) {
  K3_REQUIRE_GPU();
  k3test::TempDir dir("cuda-cli");
  const std::string out = (dir.path() / "logits.safetensors").string();
  const std::vector<int32_t> ids = golden_row("ids_a");
  const std::string csv = joined(ids, ',');
  const std::string model = fixture("k3-tiny-a");
  auto r = k3test::run_k3(
      {"logits", "--model", model, "--ids", csv, "--out", out, "--device", "cuda", "--precision", "f32"});
  ASSERT_EQ(r.status, 0) << r.output;
  const SafeTensors st = SafeTensors::open(out);
  EXPECT_LE(rel_l2(st.read_f32("logits"), golden().read_f32("logits_ids_a")), kFixtureBar);

  r = k3test::run_k3({"generate", "--model", model, "--ids", csv, "--max-new-tokens", "24", "--print-ids", "--device",
                      "cuda", "--precision", "f32"},
                     "2>/dev/null");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string want = joined(golden_row("greedy_cached_ids_a"), ' ');
  EXPECT_NE(r.output.find(want), std::string::npos) << r.output;
}

// Without a usable GPU (CI: nvcc but no device), --device cuda fails with a message that says why, and
// nothing is written; a bad --precision is refused before anything loads.
TEST(CudaModelCli, DeviceCudaWithoutGpuIsAClearError) {
  std::string why;
  if (cuda::available(&why)) GTEST_SKIP() << "a GPU is present: LogitsAndGenerateOnTheGpu covers --device cuda";
  k3test::TempDir dir("cuda-cli-err");
  const std::string out = (dir.path() / "logits.safetensors").string();
  auto r =
      k3test::run_k3({"logits", "--model", fixture("k3-tiny-a"), "--ids", "1,2,3", "--out", out, "--device", "cuda"});
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("--device cuda"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(out));
  r = k3test::run_k3(
      {"generate", "--model", fixture("k3-tiny-a"), "--ids", "1,2,3", "--device", "cuda", "--precision", "fp8"});
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("--precision"), std::string::npos) << r.output;
}

// The kernels' shape contracts are checked at load, with the config field named (no GPU needed).
TEST(CudaModelConfig, ShapesTheKernelsCannotTakeAreNamed) {
  const K3Config ok = load_config(fixture("k3-tiny-a/config.json"));
  EXPECT_EQ(gpu_config_problem(ok, GpuPrecision::BF16), "");
  EXPECT_EQ(gpu_config_problem(ok, GpuPrecision::F32), "");
  EXPECT_EQ(gpu_config_problem(load_config(std::string(K3_SOURCE_DIR) + "/configs/kimi-k3.json"), GpuPrecision::BF16),
            "");
  K3Config c = ok;
  c.kda_head_dim = 48;
  EXPECT_NE(gpu_config_problem(c, GpuPrecision::BF16).find("kda_head_dim 48"), std::string::npos);
  c = ok;
  c.attn_res_block_size = 1;  // 8 layers -> 9 sources: fine; 20 layers -> 21: too many
  EXPECT_EQ(gpu_config_problem(c, GpuPrecision::BF16), "");
  c.num_hidden_layers = 20;
  c.layer_kind.resize(20, AttnKind::KDA);
  EXPECT_NE(gpu_config_problem(c, GpuPrecision::BF16).find("attn_res_block_size"), std::string::npos);
  c = ok;
  c.kv_lora_rank = 40;  // the absorbed decode kernel takes multiples of 16; the exact path does not care
  EXPECT_NE(gpu_config_problem(c, GpuPrecision::BF16).find("kv_lora_rank 40"), std::string::npos);
  EXPECT_EQ(gpu_config_problem(c, GpuPrecision::F32), "");
  c = ok;
  c.hidden_size = 98;  // not a multiple of 8: the row kernels' scalar paths (HiddenSizeNotAMultipleOfEight)
  EXPECT_EQ(gpu_config_problem(c, GpuPrecision::BF16), "");
  c.hidden_size = 16392;
  EXPECT_NE(gpu_config_problem(c, GpuPrecision::BF16).find("hidden_size 16392"), std::string::npos);
}

// --precision on the CPU: f32 is the default (the same logits as without the flag); only f32 and
// bf16 exist.
TEST(CudaModelCli, PrecisionOnTheCpuIsF32OrBf16) {
  const k3test::TempDir dir("precision");
  const std::vector<std::string> base = {"logits", "--model", fixture("k3-tiny-a"), "--ids", "1,2,3", "--out"};
  auto with = [&](std::vector<std::string> extra, const std::string& out) {
    std::vector<std::string> a = base;
    a.push_back(dir.file(out));
    a.insert(a.end(), extra.begin(), extra.end());
    return k3test::run_k3(a);
  };
  auto r = with({}, "plain");
  ASSERT_EQ(r.status, 0) << r.output;
  r = with({"--precision", "f32"}, "f32");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(SafeTensors::open(dir.file("plain")).read_f32("logits"),
            SafeTensors::open(dir.file("f32")).read_f32("logits"));
  r = with({"--precision", "fp8"}, "fp8");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("--precision"), std::string::npos) << r.output;
}

// Non-finite values (model/nonfinite.h): the GPU forward checks its logits and, on a fresh forward,
// runs again with every block output checked on the host, so its error names the block, the layer
// and the weight, as the CPU's does.
TEST(CudaModel, NonFiniteWeightIsNamedWithItsBlockAndLayer) {
  K3_REQUIRE_GPU();
  const k3test::TempDir dir("gpu-nonfinite");
  const std::filesystem::path m = dir.path() / "model";
  std::filesystem::create_directories(m);
  std::filesystem::copy_file(fixture("k3-tiny-a/config.json"), m / "config.json");
  std::filesystem::copy_file(fixture("k3-tiny-a/model.safetensors"), m / "model.safetensors");
  std::filesystem::permissions(m / "model.safetensors", std::filesystem::perms::owner_write,
                               std::filesystem::perm_options::add);
  const std::string kvb = "language_model.model.layers.3.self_attn.kv_b_proj.weight";
  k3test::edit_tensor(m / "model.safetensors", kvb, [](char* p, size_t) {
    p[0] = char(0xc0), p[1] = char(0x7f);  // bf16 NaN
  });
  for (GpuPrecision p : {GpuPrecision::F32, GpuPrecision::BF16}) {
    std::unique_ptr<CudaModel> gpu = CudaModel::load(m.string(), p);
    std::unique_ptr<CudaSequenceCache> cache = gpu->new_cache();
    std::string what;
    try {
      gpu->forward({cache.get()}, {{1, 2, 3}}, true);
    } catch (const Error& e) {
      what = e.what();
    }
    EXPECT_NE(what.find("layer 3's attn_out (MLA)"), std::string::npos) << gpu_precision_name(p) << ": " << what;
    EXPECT_NE(what.find(kvb), std::string::npos) << what;
    // The cache is refused from then on rather than continued from a broken state.
    EXPECT_THROW(gpu->forward({cache.get()}, {{4}}, false), Error);
  }
}

}  // namespace
