#include "cli/engine.h"

#include <cstdio>

#include "cli/args.h"
#include "core/error.h"

namespace k3::cli {

void add_device_options(CLI::App* sub, DeviceOptions& o) {
  sub->add_option("--device", o.device, "where the model runs: cpu, or cuda (one Hopper GPU; needs a CUDA build)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  sub->add_option("--precision", o.precision,
                  "f32, bf16 or f64. cuda: bf16 (the default; bf16 weights and GEMM inputs, fp32 state and softmax) "
                  "or f32 (parity: fp32 activations, fp64-accumulated GEMMs, no TF32). cpu: f32 (the default; fp32 "
                  "activations, fp64 accumulation), bf16 (the CPU twin of the GPU's bf16 path: activations "
                  "rounded to bf16 where the GPU stores them) or f64 (the float64 engine: the trainer's forward, "
                  "several times slower; for small models)")
      ->check(CLI::IsMember({"bf16", "f32", "f64"}));
}

EngineOptions engine_options(const DeviceOptions& o) {
  EngineOptions e;
  e.device = parse_device(o.device, "--device");
  e.precision = o.precision.empty() ? (e.device == Device::CUDA ? Precision::BF16 : Precision::F32)
                                    : parse_precision(o.precision, "--precision");
  return e;
}

std::unique_ptr<Engine> load_engine(const std::string& model_dir, const DeviceOptions& o) {
  const EngineOptions eo = engine_options(o);
  const bool gpu = eo.device == Device::CUDA;
  std::fprintf(stderr, "[%.2fs] loading %s%s (%s)\n", elapsed_seconds(), model_dir.c_str(), gpu ? " onto the GPU" : "",
               precision_name(eo.precision));
  std::unique_ptr<Engine> e;
  try {
    e = Engine::load(model_dir, eo);
  } catch (const Error& err) {
    if (gpu) fail("--device cuda: ", err.what());
    throw;
  }
  if (gpu)
    std::fprintf(stderr, "[%.2fs] weights on the GPU: %.1f MiB\n", elapsed_seconds(),
                 double(e->weight_bytes()) / 1048576.0);
  return e;
}

Tokenizer load_tokenizer(const std::string& model_dir, const std::string& tokenizer_dir, const K3Config& cfg) {
  const std::string dir = tokenizer_dir.empty() ? model_dir : tokenizer_dir;
  if (!Tokenizer::dir_has_tokenizer(dir))
    fail(dir,
         ": no tiktoken.model, so text cannot be tokenised; give --ids, or --tokenizer DIR (e.g. one written by "
         "`k3 tokenizer train`)");
  Tokenizer tok = Tokenizer::load_dir(dir);
  tok.check_fits(cfg.vocab_size, dir, cfg.source);
  return tok;
}

}  // namespace k3::cli
