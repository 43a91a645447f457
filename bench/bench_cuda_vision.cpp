// The vision tower and projector on the GPU (model/cuda/vision_cuda.h): images/s at a real-size random tower.
//
//   build/bench_cuda_vision [--model DIR] [--rows 32x32:1,...] [--attn auto|mma|wgmma] [--reps N]
//
// The tower is K3-ARCHITECTURE.md §2.3's: 27 blocks 1024 wide, 12 heads of 128 (qkv 1536), MLP 4096, patch 14, a
// 64 x 64 position table, 2 x 2 merge, the projector 4096 -> 4096 -> 7168; random (write_random_vision_model: the
// project's init, BF16) in DIR (default models/vision-k3-random), written there on first use and kept.
// Rows (--rows H x W : images per call): 448² px is a 32 x 32 patch grid, 1036² px (1024² rounded up to the 28-px
// merge grid) 74 x 74, 3584² px (the processor's limit, 65,536 patches) 256 x 256. A row times one
// encode_on_device call on that many images of that grid (pixels already on the device, outputs left there: tower
// + merge + projector, no host copies), the median of --reps CUDA-event timings after two warm-up calls.
// FLOPs per image of n patches and T = n/4 merged tokens (multiply-adds x 2; norms, RoPE, softmax and GELU not
// counted): patch embedding 2 n (3 p²) D; per block 2 n (D 3Q + Q D + 2 D I) + attention 4 n² Q (QKᵀ and PV, the
// whole square: bidirectional); projector 2 T (M M + M text).
// Then each attention kernel alone on one image's q, k, v (packed bf16, random), the share of the tower's time
// that is attention follows from it. tests/tools/vision_goldens/bench_reference_vision.py prints the same rows for
// Moonshot's PyTorch code in bf16. Without a Hopper GPU it prints why and exits 0.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "core/dtype.h"
#include "core/error.h"
#include "gpu_bench.h"
#include "kernels/vision/vision_cuda.h"
#include "model/cuda/vision_cuda.h"
#include "model/init_random.h"
#include "model/vision_config.h"

using namespace k3;
namespace vc = k3::vision::cuda;

namespace {

struct Row {
  int64_t h = 0, w = 0, images = 1;
};

std::vector<Row> parse_rows(const std::string& text) {
  std::vector<Row> rows;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t end = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, end - at);
    Row r;
    char x = 0, colon = 0;
    long long h = 0, w = 0, n = 1;
    const int got = std::sscanf(item.c_str(), "%lld%c%lld%c%lld", &h, &x, &w, &colon, &n);
    if (!((got == 3 && x == 'x') || (got == 5 && x == 'x' && colon == ':')) || h <= 0 || w <= 0 || n <= 0)
      fail("--rows: expected H x W[:IMAGES] items like 32x32:16, got '", item, "'");
    r.h = h, r.w = w, r.images = n;
    rows.push_back(r);
    at = end + 1;
  }
  return rows;
}

// The release's vision_config (K3-ARCHITECTURE.md §2.3) with `layers` blocks.
void write_real_tower(const std::string& dir, int64_t layers) {
  const nlohmann::json j = {{"vision_config",
                             {{"patch_size", 14},
                              {"vt_hidden_size", 1024},
                              {"vt_intermediate_size", 4096},
                              {"vt_num_attention_heads", 12},
                              {"vt_num_hidden_layers", layers},
                              {"qkv_hidden_size", 1536},
                              {"init_pos_emb_height", 64},
                              {"init_pos_emb_width", 64},
                              {"init_pos_emb_time", 4},
                              {"merge_kernel_size", {2, 2}},
                              {"mm_hidden_size", 1024},
                              {"projector_ln_eps", 1e-5},
                              {"text_hidden_size", 7168}}}};
  std::filesystem::create_directories(dir);
  const std::string cfg = (std::filesystem::path(dir) / "in-config.json").string();
  std::ofstream(cfg) << j.dump(2);
  std::printf("writing a random %lld-block tower to %s (once)\n", (long long)layers, dir.c_str());
  RandomInitOptions o;
  o.seed = 1;
  write_random_vision_model(cfg, dir, o);
  std::filesystem::remove(cfg);
}

void fill_device(float* dev, int64_t n, uint64_t seed) {
  const int64_t block = std::min<int64_t>(n, int64_t(1) << 22);
  std::vector<float> h(static_cast<size_t>(block));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);  // normalised pixels
  for (float& v : h) v = u(rng);
  for (int64_t off = 0; off < n; off += block)
    cuda::copy_to_device(dev + off, h.data(), size_t(std::min(block, n - off)) * sizeof(float));
}

void bench_tower(const CudaVisionModel& m, const std::vector<Row>& rows, int reps) {
  const VisionConfig& c = m.config();
  const double D = double(c.hidden_size), Q = double(c.qkv_hidden_size), I = double(c.intermediate_size);
  const double P = double(c.patch_values()), M = double(c.merged_width()), text = double(c.text_hidden_size);
  std::printf("\ntower + projector (%lld blocks, width %lld, %lld heads x %lld, MLP %lld, projector -> %lld), bf16\n",
              (long long)c.num_layers, (long long)c.hidden_size, (long long)c.num_heads, (long long)c.head_dim(),
              (long long)c.intermediate_size, (long long)c.text_hidden_size);
  std::printf("| %-9s | %6s | %8s | %10s | %10s | %9s | %8s |\n", "grid", "images", "patches", "ms/call", "ms/image",
              "images/s", "TFLOP/s");
  for (const Row& r : rows) {
    const int64_t n = r.h * r.w, L = n * r.images;
    std::vector<VisionGrid> grids(size_t(r.images), VisionGrid{1, r.h, r.w});
    cuda::DeviceBuffer<float> px(size_t(L * c.patch_values()));
    fill_device(px.data(), L * c.patch_values(), 7);
    const int row_reps = n >= 256 * 256 ? std::max(3, reps / 4) : reps;
    const double ms = cuda::median_ms([&](int) { m.encode_on_device(px.data(), L, grids); }, row_reps, 2);
    const double T = double(n) / double(c.merge_h * c.merge_w);
    const double flops_image =
        2.0 * double(n) * P * D +
        double(c.num_layers) * (2.0 * double(n) * (D * 3 * Q + Q * D + 2 * D * I) + 4.0 * double(n) * double(n) * Q) +
        2.0 * T * (M * M + M * text);
    const double per_image = ms / double(r.images);
    std::printf("| %4lldx%-4lld | %6lld | %8lld | %10.3f | %10.3f | %9.2f | %8.1f |\n", (long long)r.h, (long long)r.w,
                (long long)r.images, (long long)L, ms, per_image, 1e3 / per_image,
                flops_image * double(r.images) / (ms * 1e-3) / 1e12);
    std::printf("vision_tower grid=%lldx%lld images=%lld ms=%.4f ms_per_image=%.4f images_per_s=%.3f tflops=%.2f\n",
                (long long)r.h, (long long)r.w, (long long)r.images, ms, per_image, 1e3 / per_image,
                flops_image * double(r.images) / (ms * 1e-3) / 1e12);
  }
  std::printf("scratch on the device after the largest row: %.1f MiB; weights %.1f MiB\n",
              double(m.scratch_bytes()) / 1048576.0, double(m.weight_bytes()) / 1048576.0);
}

// One image's attention (all heads) per kernel: ms, TFLOP/s (4 n² Q), and x blocks = the tower's attention time.
void bench_attention(const VisionConfig& c, const std::vector<Row>& rows, int reps) {
  const int64_t heads = c.num_heads, hd = c.head_dim(), W = vc::packed_width(hd);
  std::printf("\nattention alone, one image (%lld heads x %lld, bidirectional, bf16 q/k/v/o)\n", (long long)heads,
              (long long)hd);
  std::printf("| %-9s | %-6s | %10s | %8s | %16s |\n", "grid", "kernel", "ms", "TFLOP/s", "x blocks (ms)");
  std::vector<Row> seen;
  for (const Row& r : rows) {
    if (std::any_of(seen.begin(), seen.end(), [&](const Row& s) { return s.h == r.h && s.w == r.w; })) continue;
    seen.push_back(r);
    const int64_t n = r.h * r.w;
    cuda::DeviceBuffer<uint16_t> q(size_t(heads * n * W)), k(q.size()), v(q.size()), o(size_t(n * heads * hd));
    {  // N(0, 1) bf16 values: a 4 Mi-element random block copied over each operand, offset per operand
      const size_t block = std::min<size_t>(q.size(), size_t(1) << 22);
      std::vector<uint16_t> h(block + 2);
      std::mt19937_64 rng(3);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      for (auto& x : h) x = f32_to_bf16(nd(rng));
      int shift = 0;
      for (auto* b : {&q, &k, &v}) {
        for (size_t off = 0; off < b->size(); off += block)
          cuda::copy_to_device(b->data() + off, h.data() + shift, std::min(block, b->size() - off) * sizeof(uint16_t));
        ++shift;
      }
    }
    const std::vector<int32_t> cu{0, int32_t(n)};
    cuda::DeviceBuffer<int32_t> dcu(cu.data(), cu.size());
    for (const vc::AttnKernel kind : {vc::AttnKernel::kMmaSync, vc::AttnKernel::kWgmma}) {
      vc::AttentionParams p;
      p.q = q.data(), p.k = k.data(), p.v = v.data(), p.L = n, p.heads = heads, p.hd = hd;
      p.cu_seqlens = dcu.data(), p.items = 1, p.max_len = n, p.o = o.data(), p.ldo = heads * hd, p.kernel = kind;
      if (!vc::can_run(p).empty()) continue;
      const double ms = cuda::median_ms([&](int) { vc::attention(p); }, n >= 256 * 256 ? std::max(3, reps / 4) : reps);
      const double flops = 4.0 * double(n) * double(n) * double(heads * hd);
      std::printf("| %4lldx%-4lld | %-6s | %10.4f | %8.1f | %16.2f |\n", (long long)r.h, (long long)r.w,
                  vc::attn_kernel_name(kind), ms, flops / (ms * 1e-3) / 1e12, ms * double(c.num_layers));
      std::printf("vision_attention grid=%lldx%lld kernel=%s ms=%.4f tflops=%.2f\n", (long long)r.h, (long long)r.w,
                  vc::attn_kernel_name(kind), ms, flops / (ms * 1e-3) / 1e12);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CLI::App app{"GPU vision tower + projector benchmark (see the header of bench/bench_cuda_vision.cpp)"};
  std::string model = "models/vision-k3-random", rows_text = "32x32:1,32x32:16,74x74:1,74x74:4,256x256:1",
              attn = "auto";
  int reps = 10, layers = 27;
  app.add_option("--model", model, "tower directory (a random real-size tower is written there when it has none)")
      ->capture_default_str();
  app.add_option("--rows", rows_text, "H x W patch grids : images per call")->capture_default_str();
  app.add_option("--attn", attn, "attention kernel: auto, mma or wgmma")->capture_default_str();
  app.add_option("--layers", layers, "blocks of the tower written when --model has none")->capture_default_str();
  app.add_option("--reps", reps, "timed calls per row (a quarter, at least 3, at 256 x 256)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  return k3bench::run_gpu_bench("bench_cuda_vision", reps, [&] {
    const std::vector<Row> rows = parse_rows(rows_text);
    const vc::AttnKernel kernel = vc::parse_attn_kernel(attn, "--attn");
    if (!std::filesystem::exists(std::filesystem::path(model) / "config.json")) write_real_tower(model, layers);
    const std::unique_ptr<CudaVisionModel> m = CudaVisionModel::load(model);
    m->set_attention_kernel(kernel);
    std::printf("model %s, attention kernel %s\n", model.c_str(), vc::attn_kernel_name(kernel));
    bench_tower(*m, rows, reps);
    bench_attention(m->config(), rows, reps);
  });
}
