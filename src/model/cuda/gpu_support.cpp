// What the GPU model can take, in every build (no CUDA needed): the precision names, and the check of
// a config against the kernels' shape contracts, so that a model the kernels cannot run is refused at
// load with the config field named, not halfway through a forward pass, and so CI can test it.
#include <vector>

#include "core/error.h"
#include "kernels/attnres/attnres_cuda.h"
#include "model/cuda/cuda_model.h"
#include "model/cuda/training/cuda_train_model.h"

namespace k3 {

const char* gpu_precision_name(GpuPrecision p) { return p == GpuPrecision::BF16 ? "bf16" : "f32"; }

GpuPrecision parse_gpu_precision(const std::string& s, const char* what) {
  if (s == "bf16") return GpuPrecision::BF16;
  if (s == "f32") return GpuPrecision::F32;
  fail(what, ": expected bf16 or f32, got '", s, "'");
}

namespace {

// The reasons a config does not fit the kernels, joined by "; " ("" when it fits).
struct Problems {
  std::vector<std::string> why;
  void need(bool ok, const std::string& what) {
    if (!ok) why.push_back(what);
  }
  std::string joined() const {
    std::string all;
    for (const auto& w : why) {
      if (!all.empty()) all += "; ";
      all += w;
    }
    return all;
  }
};

struct LayerKinds {
  bool kda = false, mla = false, moe = false;
};
LayerKinds layer_kinds(const K3Config& c) {
  LayerKinds k;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    (c.layer_kind[size_t(l)] == AttnKind::KDA ? k.kda : k.mla) = true;
    k.moe = k.moe || c.is_moe_layer(l);
  }
  return k;
}

// The contracts the inference and the training kernels share: the AttnRes source count, KDA's head
// dim and conv taps, the router's expert count.
void shared_problems(const K3Config& c, const LayerKinds& k, Problems& pr) {
  if (c.attn_res_block_size > 0) {
    const int64_t sources = (c.num_hidden_layers + c.attn_res_block_size - 1) / c.attn_res_block_size + 1;
    pr.need(sources <= attnres::cuda::kMaxSources,
            "attn_res_block_size " + std::to_string(c.attn_res_block_size) + " with " +
                std::to_string(c.num_hidden_layers) + " layers mixes " + std::to_string(sources) +
                " AttnRes sources; the fused kernel takes " + std::to_string(attnres::cuda::kMaxSources));
  }
  if (k.kda) {
    const int64_t D = c.kda_head_dim;
    pr.need(D == 32 || D == 64 || D == 128,
            "kda_head_dim " + std::to_string(D) + " (the KDA kernels take 32, 64 or 128)");
    pr.need(c.short_conv_kernel_size >= 1 && c.short_conv_kernel_size <= 8,
            "short_conv_kernel_size " + std::to_string(c.short_conv_kernel_size) + " (the conv kernel takes 1..8)");
  }
  if (k.moe)
    pr.need(c.num_experts >= 1 && c.num_experts <= 8192 && c.num_experts_per_token >= 1 &&
                c.num_experts_per_token <= c.num_experts,
            "num_experts " + std::to_string(c.num_experts) + " / num_experts_per_token " +
                std::to_string(c.num_experts_per_token) + " (the router takes up to 8192 experts, top-k <= experts)");
}

}  // namespace

std::string gpu_config_problem(const K3Config& c, GpuPrecision p) {
  Problems pr;
  const LayerKinds k = layer_kinds(c);
  shared_problems(c, k, pr);
  const bool bf16 = p == GpuPrecision::BF16;
  constexpr int64_t kRowMax = 16384;  // the row kernels (RMSNorm, AttnRes) hold a row in registers
  pr.need(c.hidden_size <= kRowMax,
          "hidden_size " + std::to_string(c.hidden_size) + " (the row kernels take up to 16384)");
  if (k.mla) {
    const int64_t dq = c.qk_nope_head_dim + c.qk_rope_head_dim, Dv = c.v_head_dim, R = c.kv_lora_rank,
                  Dr = c.qk_rope_head_dim;
    pr.need(R <= kRowMax && c.q_lora_rank <= kRowMax, "kv_lora_rank / q_lora_rank over 16384 (the MLA norms' rows)");
    if (bf16) {
      pr.need(dq % 16 == 0 && dq <= 256 && Dv % 16 == 0 && Dv <= 128,
              "qk_nope_head_dim + qk_rope_head_dim = " + std::to_string(dq) + ", v_head_dim = " + std::to_string(Dv) +
                  " (the flash prefill takes multiples of 16, qk <= 256, v <= 128)");
      pr.need(R % 16 == 0 && R <= 512 && Dr % 16 == 0 && Dr <= 64,
              "kv_lora_rank " + std::to_string(R) + ", qk_rope_head_dim " + std::to_string(Dr) +
                  " (the absorbed decode takes multiples of 16, R <= 512, rope <= 64)");
    } else {
      pr.need(Dv <= 1024 && dq <= 4096, "v_head_dim <= 1024 and qk head dim <= 4096 (the exact MLA kernel)");
    }
  }
  if (k.moe) {
    pr.need(c.routed_expert_hidden_size % 8 == 0 && c.routed_expert_hidden_size <= kRowMax,
            "routed_expert_hidden_size " + std::to_string(c.routed_expert_hidden_size) +
                " (the combine and latent norm take multiples of 8 up to 16384)");
    if (bf16)
      pr.need(c.moe_intermediate_size % 8 == 0, "moe_intermediate_size " + std::to_string(c.moe_intermediate_size) +
                                                    " (the grouped GEMM takes multiples of 8)");
  }
  return pr.joined();
}

std::string gpu_train_config_problem(const K3Config& c) {
  Problems pr;
  const LayerKinds k = layer_kinds(c);
  shared_problems(c, k, pr);
  if (k.mla)
    pr.need(c.qk_nope_head_dim + c.qk_rope_head_dim <= 256 && c.v_head_dim <= 256,
            "qk_nope_head_dim + qk_rope_head_dim = " + std::to_string(c.qk_nope_head_dim + c.qk_rope_head_dim) +
                ", v_head_dim = " + std::to_string(c.v_head_dim) + " (the training attention takes up to 256 each)");
  return pr.joined();
}

}  // namespace k3
