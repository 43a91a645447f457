// What the GPU model can take, in every build (no CUDA needed): the precision names, and the check of
// a config against the kernels' shape contracts, so that a model the kernels cannot run is refused at
// load with the config field named, not halfway through a forward pass, and so CI can test it.
#include <vector>

#include "core/error.h"
#include "kernels/attnres/attnres_cuda.h"
#include "model/cuda/cuda_model.h"

namespace k3 {

const char* gpu_precision_name(GpuPrecision p) { return p == GpuPrecision::BF16 ? "bf16" : "f32"; }

GpuPrecision parse_gpu_precision(const std::string& s, const char* what) {
  if (s == "bf16") return GpuPrecision::BF16;
  if (s == "f32") return GpuPrecision::F32;
  fail(what, ": expected bf16 or f32, got '", s, "'");
}

std::string gpu_config_problem(const K3Config& c, GpuPrecision p) {
  std::vector<std::string> why;
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) why.push_back(what);
  };
  const bool bf16 = p == GpuPrecision::BF16;
  bool any_kda = false, any_mla = false, any_moe = false;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    (c.layer_kind[size_t(l)] == AttnKind::KDA ? any_kda : any_mla) = true;
    any_moe = any_moe || c.is_moe_layer(l);
  }
  constexpr int64_t kRowMax = 16384;  // the row kernels (RMSNorm, AttnRes) hold a row in registers
  need(c.hidden_size <= kRowMax,
       "hidden_size " + std::to_string(c.hidden_size) + " (the row kernels take up to 16384)");
  if (c.attn_res_block_size > 0) {
    const int64_t sources = (c.num_hidden_layers + c.attn_res_block_size - 1) / c.attn_res_block_size + 1;
    need(sources <= attnres::cuda::kMaxSources,
         "attn_res_block_size " + std::to_string(c.attn_res_block_size) + " with " +
             std::to_string(c.num_hidden_layers) + " layers mixes " + std::to_string(sources) +
             " AttnRes sources; the fused kernel takes " + std::to_string(attnres::cuda::kMaxSources));
  }
  if (any_kda) {
    const int64_t D = c.kda_head_dim;
    need(D == 32 || D == 64 || D == 128, "kda_head_dim " + std::to_string(D) + " (the KDA kernels take 32, 64 or 128)");
    need(c.short_conv_kernel_size >= 1 && c.short_conv_kernel_size <= 8,
         "short_conv_kernel_size " + std::to_string(c.short_conv_kernel_size) + " (the conv kernel takes 1..8)");
  }
  if (any_mla) {
    const int64_t dq = c.qk_nope_head_dim + c.qk_rope_head_dim, Dv = c.v_head_dim, R = c.kv_lora_rank,
                  Dr = c.qk_rope_head_dim;
    need(R <= kRowMax && c.q_lora_rank <= kRowMax, "kv_lora_rank / q_lora_rank over 16384 (the MLA norms' rows)");
    if (bf16) {
      need(dq % 16 == 0 && dq <= 256 && Dv % 16 == 0 && Dv <= 128,
           "qk_nope_head_dim + qk_rope_head_dim = " + std::to_string(dq) + ", v_head_dim = " + std::to_string(Dv) +
               " (the flash prefill takes multiples of 16, qk <= 256, v <= 128)");
      need(R % 16 == 0 && R <= 512 && Dr % 16 == 0 && Dr <= 64,
           "kv_lora_rank " + std::to_string(R) + ", qk_rope_head_dim " + std::to_string(Dr) +
               " (the absorbed decode takes multiples of 16, R <= 512, rope <= 64)");
    } else {
      need(Dv <= 1024 && dq <= 4096, "v_head_dim <= 1024 and qk head dim <= 4096 (the exact MLA kernel)");
    }
  }
  if (any_moe) {
    need(c.num_experts >= 1 && c.num_experts <= 8192 && c.num_experts_per_token >= 1 &&
             c.num_experts_per_token <= c.num_experts,
         "num_experts " + std::to_string(c.num_experts) + " / num_experts_per_token " +
             std::to_string(c.num_experts_per_token) + " (the router takes up to 8192 experts, top-k <= experts)");
    need(c.routed_expert_hidden_size % 8 == 0 && c.routed_expert_hidden_size <= kRowMax,
         "routed_expert_hidden_size " + std::to_string(c.routed_expert_hidden_size) +
             " (the combine and latent norm take multiples of 8 up to 16384)");
    if (bf16)
      need(c.moe_intermediate_size % 8 == 0, "moe_intermediate_size " + std::to_string(c.moe_intermediate_size) +
                                                 " (the grouped GEMM takes multiples of 8)");
  }
  std::string all;
  for (const auto& w : why) {
    if (!all.empty()) all += "; ";
    all += w;
  }
  return all;
}

}  // namespace k3
