#include "cli/engine.h"

#include <cstdio>
#include <cstdlib>

#include "cli/args.h"
#include "core/error.h"

namespace k3::cli {

void add_device_options(CLI::App* sub, DeviceOptions& o) {
  sub->add_option("--device", o.device, "where the model runs: cpu, or cuda (one Hopper GPU; needs a CUDA build)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  sub->add_option("--precision", o.precision,
                  "with --device cuda only: bf16 (the default; serving: bf16 weights and GEMM inputs, fp32 state and "
                  "softmax) or f32 (parity: fp32 activations, fp64-accumulated GEMMs, no TF32)")
      ->check(CLI::IsMember({"bf16", "f32"}));
}

Engine Engine::load(const std::string& model_dir, const DeviceOptions& o) {
  Engine e;
  if (o.device == "cuda") {
    const GpuPrecision p = parse_gpu_precision(o.precision.empty() ? "bf16" : o.precision, "--precision");
    if (const char* e = std::getenv("K3_BF16_ACTIVATIONS"); e && *e && std::string(e) != "0")
      std::fprintf(stderr, "note: K3_BF16_ACTIVATIONS affects the CPU engine only; --device cuda ignores it\n");
    std::fprintf(stderr, "[%.2fs] loading %s onto the GPU (%s)\n", elapsed_seconds(), model_dir.c_str(),
                 gpu_precision_name(p));
    try {
      e.gpu_ = CudaModel::load(model_dir, p);
    } catch (const Error& err) {
      fail("--device cuda: ", err.what());
    }
    std::fprintf(stderr, "[%.2fs] weights on the GPU: %.1f MiB\n", elapsed_seconds(), double(e.gpu_->weight_bytes()) / 1048576.0);
  } else {
    if (o.device != "cpu") fail("--device: expected cpu or cuda, got '", o.device, "'");
    if (!o.precision.empty())
      fail("--precision ", o.precision, " applies to --device cuda only (the CPU engine computes in fp32 with fp64 "
           "accumulation; K3_BF16_ACTIVATIONS=1 emulates the GPU's bf16 path)");
    std::fprintf(stderr, "[%.2fs] loading %s\n", elapsed_seconds(), model_dir.c_str());
    e.cpu_ = Model::load(model_dir);
  }
  return e;
}

const K3Config& Engine::config() const { return gpu_ ? gpu_->config() : cpu_->config(); }

std::string Engine::description() const {
  return gpu_ ? std::string("cuda (") + gpu_precision_name(gpu_->precision()) + ")" : "cpu";
}

std::vector<float> Engine::forward_fresh(const std::vector<std::vector<int32_t>>& rows) {
  if (gpu_) {
    std::vector<std::unique_ptr<CudaSequenceCache>> caches = gpu_->new_caches(int64_t(rows.size()));  // one pool
    std::vector<CudaSequenceCache*> ptrs;
    for (auto& c : caches) ptrs.push_back(c.get());
    return gpu_->forward(ptrs, rows, true);
  }
  std::vector<SequenceCache> caches;
  std::vector<SequenceCache*> ptrs;
  for (size_t b = 0; b < rows.size(); ++b) caches.push_back(cpu_->new_cache());
  for (auto& c : caches) ptrs.push_back(&c);
  return cpu_->forward(ptrs, rows, true);
}

AppendFn Engine::session() {
  if (gpu_) {
    std::shared_ptr<CudaSequenceCache> cache = gpu_->new_cache();
    std::shared_ptr<CudaModel> m = gpu_;
    return [m, cache](const std::vector<int32_t>& t) { return m->forward({cache.get()}, {t}, false); };
  }
  auto cache = std::make_shared<SequenceCache>(cpu_->new_cache());
  std::shared_ptr<Model> m = cpu_;
  return [m, cache](const std::vector<int32_t>& t) { return m->forward({cache.get()}, {t}, false); };
}

}  // namespace k3::cli
