#include "model/init_random.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <list>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "core/error.h"
#include "core/json.h"
#include "core/memory.h"
#include "core/validate.h"
#include "io/file.h"
#include "io/safetensors.h"
#include "model/param_count.h"
#include "kernels/gemm/mxfp4.h"

namespace k3 {

void mxfp4_encode_row(uint8_t* packed, uint8_t* scales, const float* row, int64_t cols) {
  K3_CHECK(cols % 32 == 0, "MXFP4 needs a multiple of 32 columns, got ", cols);
  for (int64_t g = 0; g < cols / 32; ++g) {
    const float* x = row + g * 32;
    float mx = 0.0f;
    for (int i = 0; i < 32; ++i) mx = std::max(mx, std::fabs(x[i]));
    // E2M1's largest magnitude is 6 = 1.5 * 2^2: pick e with mx / 2^e in [4, 8) -> clamps at 6.
    int e = mx > 0 ? std::ilogb(mx) - 2 : -127;  // ilogb is exact; floor(log2f) rounds up just below 2^n
    e = std::clamp(e, -127, 127);
    scales[g] = uint8_t(e + 127);
    const float s = std::ldexp(1.0f, e);
    uint8_t nib[32];
    for (int i = 0; i < 32; ++i) {
      const float v = x[i] / s;
      int best = 0;
      for (int c = 1; c < 16; ++c)
        if (std::fabs(kE2M1[c] - v) < std::fabs(kE2M1[best] - v)) best = c;
      nib[i] = uint8_t(best);
    }
    for (int j = 0; j < 16; ++j) packed[g * 16 + j] = uint8_t(nib[2 * j] | (nib[2 * j + 1] << 4));
  }
}

namespace {

class Writer {
 public:
  Writer(const K3Config& c, const RandomInitOptions& o) : c_(c), o_(o), rng_(o.seed) {}

  void normal(const std::string& name, std::vector<int64_t> shape, float std) {
    auto& buf = new_u16(numel(shape));
    std::normal_distribution<float> d(0.0f, std);
    for (auto& v : buf) v = f32_to_bf16(d(rng_));
    add(name, DType::BF16, shape, buf.data());
  }
  void constant_bf16(const std::string& name, std::vector<int64_t> shape, float value) {
    auto& buf = new_u16(numel(shape));
    for (auto& v : buf) v = f32_to_bf16(value);
    add(name, DType::BF16, shape, buf.data());
  }
  template <class Fn>
  void f32(const std::string& name, std::vector<int64_t> shape, Fn&& gen) {
    f32s_.emplace_back(size_t(numel(shape)));
    for (auto& v : f32s_.back()) v = gen(rng_);
    add(name, DType::F32, shape, f32s_.back().data());
  }
  // A routed-expert Linear [rows, cols]: BF16 `.weight`, or MXFP4 `.weight_packed` + `.weight_scale`.
  void expert(const std::string& n, int64_t rows, int64_t cols, float std) {
    if (!o_.mxfp4_experts) return normal(n + ".weight", {rows, cols}, std);
    std::normal_distribution<float> d(0.0f, std);
    std::vector<float> row(static_cast<size_t>(cols));
    u8s_.emplace_back(size_t(rows * cols / 2));
    auto& packed = u8s_.back();
    u8s_.emplace_back(size_t(rows * cols / 32));
    auto& scales = u8s_.back();
    for (int64_t r = 0; r < rows; ++r) {
      for (auto& v : row) v = d(rng_);
      mxfp4_encode_row(&packed[size_t(r * cols / 2)], &scales[size_t(r * cols / 32)], row.data(), cols);
    }
    add(n + ".weight_packed", DType::U8, {rows, cols / 2}, packed.data());
    add(n + ".weight_scale", DType::U8, {rows, cols / 32}, scales.data());
  }
  const std::vector<TensorToWrite>& tensors() const { return out_; }
  std::mt19937_64& rng() { return rng_; }

 private:
  static int64_t numel(const std::vector<int64_t>& s) {
    int64_t n = 1;
    for (auto d : s) n *= d;
    return n;
  }
  std::vector<uint16_t>& new_u16(int64_t n) {
    u16s_.emplace_back(size_t(n));
    return u16s_.back();
  }
  void add(const std::string& name, DType t, std::vector<int64_t> shape, const void* p) {
    out_.push_back({name, t, std::move(shape), p});
  }
  const K3Config& c_;
  RandomInitOptions o_;
  std::mt19937_64 rng_;
  std::list<std::vector<uint16_t>> u16s_;  // std::list: buffers never move once handed out
  std::list<std::vector<float>> f32s_;
  std::list<std::vector<uint8_t>> u8s_;
  std::vector<TensorToWrite> out_;
};

}  // namespace

void write_random_model(const std::string& config_path, const std::string& out_dir, const RandomInitOptions& opt) {
  namespace fs = std::filesystem;
  const K3Config c = load_config(config_path);
  require_number("--router-bias-std", opt.router_bias_std, 0, 1e3);
  // Both outputs are checked before either is written (the config given may be OUT/config.json itself,
  // an input the writer will not replace): a refusal leaves the directory as it was.
  if (std::filesystem::is_directory(out_dir))
    for (const char* f : {"model.safetensors", "config.json"}) check_output_path((std::filesystem::path(out_dir) / f).string());
  if (opt.mxfp4_experts && c.num_experts > 0 &&
      (c.routed_expert_hidden_size % 32 != 0 || c.moe_intermediate_size % 32 != 0))
    fail(config_path, ": MXFP4 experts need routed_expert_hidden_size and moe_intermediate_size divisible by 32");
  {
    // The whole model is built in memory before it is written: refuse up front what cannot fit
    // (configs/kimi-k3.json is 2.78T parameters) instead of allocating until the OOM killer comes.
    double bytes = 0;
    int64_t params = 0;
    for (const ParamGroup& g : count_parameters(c)) {
      params += g.total;
      bytes += double(g.total) * (g.name == "routed experts" && opt.mxfp4_experts ? 17.0 / 32.0 : 2.0);
    }
    const uint64_t need = saturated_bytes(bytes);
    const std::string what = "k3 init: the model of " + config_path + " (" + format_count(params) + " parameters)";
    require_memory(need, what);
    require_disk_space(out_dir, need, what);
  }
  Writer w(c, opt);
  const float s = c.initializer_range;
  const int64_t hid = c.hidden_size;
  const std::string P = "language_model.model.";
  auto uni = [](float lo, float hi) { return [=](std::mt19937_64& r) { return std::uniform_real_distribution<float>(lo, hi)(r); }; };
  auto res_query = [&](const std::string& n) {
    w.constant_bf16(n + "_norm.weight", {hid}, 1.0f);
    if (opt.random_attnres_queries) w.normal(n + "_proj.weight", {1, hid}, s);
    else w.constant_bf16(n + "_proj.weight", {1, hid}, 0.0f);
  };
  w.normal(P + "embed_tokens.weight", {c.vocab_size, hid}, s);
  if (!c.tie_word_embeddings) w.normal("language_model.lm_head.weight", {c.vocab_size, hid}, s);
  w.constant_bf16(P + "norm.weight", {hid}, 1.0f);
  res_query(P + "output_attn_res");
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = P + "layers." + std::to_string(l) + ".";
    w.constant_bf16(p + "input_layernorm.weight", {hid}, 1.0f);
    w.constant_bf16(p + "post_attention_layernorm.weight", {hid}, 1.0f);
    res_query(p + "self_attention_res");
    res_query(p + "mlp_res");
    const std::string a = p + "self_attn.";
    if (c.layer_kind[size_t(l)] == AttnKind::KDA) {
      const int64_t H = c.kda_num_heads, D = c.kda_head_dim, HD = H * D, K = c.short_conv_kernel_size;
      for (const char* n : {"q_proj", "k_proj", "v_proj", "g_proj"}) w.normal(a + n + ".weight", {HD, hid}, s);
      const float cb = 1.0f / std::sqrt(float(K));
      for (const char* n : {"q_conv1d", "k_conv1d", "v_conv1d"}) w.f32(a + n + ".weight", {HD, 1, K}, uni(-cb, cb));
      w.normal(a + "f_a_proj.weight", {D, hid}, s);
      w.normal(a + "f_b_proj.weight", {HD, D}, s);
      w.normal(a + "b_proj.weight", {H, hid}, s);
      w.f32(a + "A_log", {H}, [](std::mt19937_64& r) { return std::log(std::uniform_real_distribution<float>(1.0f, 16.0f)(r)); });
      w.f32(a + "dt_bias", {HD}, uni(-0.5f, 0.5f));
      w.f32(a + "o_norm.weight", {D}, [](std::mt19937_64&) { return 1.0f; });
      w.normal(a + "o_proj.weight", {hid, HD}, s);
    } else {
      const int64_t H = c.num_attention_heads;
      if (c.q_lora_rank > 0) {
        w.normal(a + "q_a_proj.weight", {c.q_lora_rank, hid}, s);
        w.constant_bf16(a + "q_a_layernorm.weight", {c.q_lora_rank}, 1.0f);
        w.normal(a + "q_b_proj.weight", {H * c.q_head_dim(), c.q_lora_rank}, s);
      } else {
        w.normal(a + "q_proj.weight", {H * c.q_head_dim(), hid}, s);
      }
      w.normal(a + "kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, hid}, s);
      w.constant_bf16(a + "kv_a_layernorm.weight", {c.kv_lora_rank}, 1.0f);
      w.normal(a + "kv_b_proj.weight", {H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}, s);
      if (c.mla_use_output_gate) w.normal(a + "g_proj.weight", {H * c.v_head_dim, hid}, s);
      w.normal(a + "o_proj.weight", {hid, H * c.v_head_dim}, s);
    }
    if (c.is_moe_layer(l)) {
      const std::string m = p + "block_sparse_moe.";
      const int64_t E = c.num_experts, lat = c.routed_expert_hidden_size, I = c.moe_intermediate_size;
      w.normal(m + "gate.weight", {E, hid}, s);
      const float bs = opt.router_bias_std;
      w.f32(m + "gate.e_score_correction_bias", {E},
            [bs](std::mt19937_64& r) { return bs > 0 ? std::normal_distribution<float>(0.0f, bs)(r) : 0.0f; });
      w.normal(m + "routed_expert_down_proj.weight", {lat, hid}, s);
      w.normal(m + "routed_expert_up_proj.weight", {hid, lat}, s);
      w.constant_bf16(m + "routed_expert_norm.weight", {lat}, 1.0f);
      for (int64_t e = 0; e < E; ++e) {
        const std::string ep = m + "experts." + std::to_string(e) + ".";
        w.expert(ep + "w1", I, lat, s);
        w.expert(ep + "w2", lat, I, s);
        w.expert(ep + "w3", I, lat, s);
      }
      if (c.num_shared_experts > 0) {
        const int64_t SI = c.shared_intermediate();
        w.normal(m + "shared_experts.gate_proj.weight", {SI, hid}, s);
        w.normal(m + "shared_experts.up_proj.weight", {SI, hid}, s);
        w.normal(m + "shared_experts.down_proj.weight", {hid, SI}, s);
      }
    } else {
      w.normal(p + "mlp.gate_proj.weight", {c.intermediate_size, hid}, s);
      w.normal(p + "mlp.up_proj.weight", {c.intermediate_size, hid}, s);
      w.normal(p + "mlp.down_proj.weight", {hid, c.intermediate_size}, s);
    }
  }

  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) fail(out_dir, ": cannot create directory: ", ec.message());
  // config.json: the input, plus the quantisation block for MXFP4 experts.
  nlohmann::json j = parse_json(read_file(config_path, "config"), config_path);
  nlohmann::json& tj = j.contains("text_config") ? j["text_config"] : j;
  if (opt.mxfp4_experts) {
    tj["quantization_config"] = {
        {"quant_method", "compressed-tensors"},
        {"format", "mxfp4-pack-quantized"},
        {"quantization_status", "compressed"},
        {"config_groups",
         {{"group_0",
           {{"targets", {"Linear"}},
            {"weights", {{"num_bits", 4}, {"type", "float"}, {"group_size", 32}, {"strategy", "group"}, {"symmetric", true},
                         {"scale_dtype", "torch.uint8"}, {"dynamic", false}}},
            {"input_activations", nullptr}}}}},
        {"ignore", {".*self_attn.*", ".*shared_experts.*", ".*mlp\\.(gate|up|gate_up|down)_proj.*", ".*lm_head.*", ".*gate$",
                    ".*routed_expert_.*"}}};
  } else {
    tj.erase("quantization_config");
  }
  write_safetensors((fs::path(out_dir) / "model.safetensors").string(), w.tensors(),
                    {{"format", "pt"}, {"k3cpp", "random init, seed " + std::to_string(opt.seed)}});
  write_file_atomic((fs::path(out_dir) / "config.json").string(), j.dump(2) + "\n");
}

}  // namespace k3
