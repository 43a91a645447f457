#include "model/init_random.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <list>
#include <map>
#include <nlohmann/json.hpp>
#include <tuple>

#include "core/error.h"
#include "core/json.h"
#include "core/memory.h"
#include "core/validate.h"
#include "io/file.h"
#include "io/safetensors.h"
#include "kernels/gemm/mxfp4.h"
#include "model/param_count.h"
#include "model/release_layout.h"
#include "model/tensor_init.h"
#include "model/tensor_table.h"
#include "model/vision_config.h"

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

// The buffers of a model being written: every tensor stays in memory until the one write at the end.
class Buffers {
 public:
  template <class T>
  std::vector<T>& make(int64_t n) {
    auto& list = std::get<std::list<std::vector<T>>>(lists_);
    list.emplace_back(size_t(n));
    return list.back();
  }
  void add(const std::string& name, DType t, std::vector<int64_t> shape, const void* p) {
    out_.push_back({name, t, std::move(shape), p});
  }
  const std::vector<TensorToWrite>& tensors() const { return out_; }

 private:
  // std::list: buffers never move once handed out.
  std::tuple<std::list<std::vector<uint16_t>>, std::list<std::vector<float>>, std::list<std::vector<uint8_t>>> lists_;
  std::vector<TensorToWrite> out_;
};

// Draws the tensor `name` of `shape` (init.begin done for it) and adds it stored as `dtype`.
void draw(TensorInitializer& init, DType dtype, const std::vector<int64_t>& shape, const std::string& name,
          Buffers& b) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  switch (dtype) {
    case DType::F32: {
      std::vector<float>& v = b.make<float>(n);
      init.fill(v.data(), n);
      b.add(name, DType::F32, shape, v.data());
      return;
    }
    case DType::BF16: {
      std::vector<uint16_t>& v = b.make<uint16_t>(n);
      std::vector<float> chunk(size_t(std::min<int64_t>(n, int64_t(1) << 20)));
      for (int64_t i = 0; i < n; i += int64_t(chunk.size())) {
        const int64_t len = std::min<int64_t>(int64_t(chunk.size()), n - i);
        init.fill(chunk.data(), len);
        for (int64_t j = 0; j < len; ++j) v[size_t(i + j)] = f32_to_bf16(chunk[size_t(j)]);
      }
      b.add(name, DType::BF16, shape, v.data());
      return;
    }
    case DType::U8: {  // a routed expert as MXFP4, quantised row by row
      const int64_t rows = shape[0], cols = shape[1];
      std::vector<uint8_t>& packed = b.make<uint8_t>(rows * cols / 2);
      std::vector<uint8_t>& scales = b.make<uint8_t>(rows * cols / 32);
      std::vector<float> row(static_cast<size_t>(cols));
      for (int64_t r = 0; r < rows; ++r) {
        init.fill(row.data(), cols);
        mxfp4_encode_row(&packed[size_t(r * cols / 2)], &scales[size_t(r * cols / 32)], row.data(), cols);
      }
      b.add(mxfp4_packed_name(name), DType::U8, {rows, cols / 2}, packed.data());
      b.add(mxfp4_scale_name(name), DType::U8, {rows, cols / 32}, scales.data());
      return;
    }
    default: break;
  }
  K3_ASSERT(false);
}

}  // namespace

void write_random_model(const std::string& config_path, const std::string& out_dir, const RandomInitOptions& opt) {
  namespace fs = std::filesystem;
  const K3Config c = load_config(config_path);
  require_number("--router-bias-std", opt.router_bias_std, 0, 1e3);
  // Both outputs are checked before either is written (the config given may be OUT/config.json itself,
  // an input the writer will not replace): a refusal leaves the directory as it was.
  if (std::filesystem::is_directory(out_dir))
    for (const char* f : {"model.safetensors", "config.json"})
      check_output_path((std::filesystem::path(out_dir) / f).string());
  if (opt.mxfp4_experts && c.num_experts > 0 &&
      (c.routed_expert_hidden_size % 32 != 0 || c.moe_intermediate_size % 32 != 0))
    fail(config_path, ": MXFP4 experts need routed_expert_hidden_size and moe_intermediate_size divisible by 32");
  const TensorTable table(c);
  // The vision tower and projector, when the config has a vision_config: written after the text model, from the
  // same random stream (so the text tensors are those of the same config without it). The projector writes the
  // text model's width: a vision_config.text_hidden_size that disagrees is refused (parse_vision_config names it),
  // and a missing one is filled in below.
  std::vector<VisionTensorEntry> vision;
  if (c.has_vision_config) {
    VisionConfig v;
    const bool found = parse_vision_config(read_file(config_path, "config"), config_path, &v, c.hidden_size);
    K3_ASSERT(found && v.text_hidden_size == c.hidden_size);
    check_vision_biases(v, config_path);
    vision = vision_tensor_table(v);
  }
  {
    // The whole model is built in memory before it is written: refuse up front what cannot fit
    // (configs/kimi-k3.json is 2.78T parameters) instead of allocating until the OOM killer comes.
    double bytes = 0;
    int64_t params = 0;
    for (const TensorEntry& e : table.entries()) {
      params += e.params;
      bytes +=
          double(e.params) * (opt.mxfp4_experts && e.info().store == TensorStore::ExpertMatrix ? 17.0 / 32.0 : 2.0);
    }
    for (const VisionTensorEntry& e : vision) {
      params += e.numel();
      bytes += double(e.numel()) * double(dtype_size(e.dtype));
    }
    const uint64_t need = saturated_bytes(bytes);
    const std::string what = "k3 init: the model of " + config_path + " (" + format_count(params) + " parameters)";
    require_memory(need, what);
    require_disk_space(out_dir, need, what);
  }
  TensorInitializer init(c, opt);
  Buffers buffers;
  for (const TensorEntry& e : table.entries()) {
    init.begin(e);
    draw(init, init.stored_dtype(e), e.shape, table.name(e), buffers);
  }
  for (const VisionTensorEntry& e : vision) {
    init.begin(e.init, e.numel());
    draw(init, e.dtype, e.shape, e.name, buffers);
  }

  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) fail(out_dir, ": cannot create directory: ", ec.message());
  // config.json: the input, plus the quantisation block for MXFP4 experts.
  nlohmann::json j = parse_json(read_file(config_path, "config"), config_path);
  nlohmann::json& tj = j.contains("text_config") ? j["text_config"] : j;
  // The projector's width, stated where VisionModel::load reads it first.
  if (!vision.empty() && !j["vision_config"].contains("text_hidden_size"))
    j["vision_config"]["text_hidden_size"] = c.hidden_size;
  if (opt.mxfp4_experts) {
    tj["quantization_config"] = {{"quant_method", "compressed-tensors"},
                                 {"format", "mxfp4-pack-quantized"},
                                 {"quantization_status", "compressed"},
                                 {"config_groups",
                                  {{"group_0",
                                    {{"targets", {"Linear"}},
                                     {"weights",
                                      {{"num_bits", 4},
                                       {"type", "float"},
                                       {"group_size", 32},
                                       {"strategy", "group"},
                                       {"symmetric", true},
                                       {"scale_dtype", "torch.uint8"},
                                       {"dynamic", false}}},
                                     {"input_activations", nullptr}}}}},
                                 {"ignore",
                                  {".*self_attn.*", ".*shared_experts.*", ".*mlp\\.(gate|up|gate_up|down)_proj.*",
                                   ".*lm_head.*", ".*gate$", ".*routed_expert_.*"}}};
  } else {
    tj.erase("quantization_config");
  }
  const std::map<std::string, std::string> meta = {{"format", "pt"},
                                                   {"k3cpp", "random init, seed " + std::to_string(opt.seed)}};
  if (opt.release_shards) {
    write_release_shards(out_dir, buffers.tensors(), c.num_hidden_layers, meta);
  } else {
    write_safetensors((fs::path(out_dir) / "model.safetensors").string(), buffers.tensors(), meta);
    remove_model_weights(out_dir, {"model.safetensors"});
  }
  write_file_atomic((fs::path(out_dir) / "config.json").string(), j.dump(2) + "\n");
}

void write_random_vision_model(const std::string& config_path, const std::string& out_dir,
                               const RandomInitOptions& opt) {
  namespace fs = std::filesystem;
  const VisionConfig v = load_vision_config(config_path);
  check_vision_biases(v, config_path);
  const nlohmann::json j = parse_json(read_file(config_path, "config"), config_path);
  K3Config c;  // only its initializer_range is read (TensorInitializer)
  for (const nlohmann::json* t : {&j, j.contains("text_config") ? &j["text_config"] : &j})
    if (t->is_object() && t->contains("initializer_range") && (*t)["initializer_range"].is_number())
      c.initializer_range = (*t)["initializer_range"].get<float>();
  require_number("initializer_range", c.initializer_range, 0, 1e3);
  if (fs::is_directory(out_dir))
    for (const char* f : {"model.safetensors", "config.json"}) check_output_path((fs::path(out_dir) / f).string());
  const std::vector<VisionTensorEntry> table = vision_tensor_table(v);
  {
    double bytes = 0;
    int64_t params = 0;
    for (const VisionTensorEntry& e : table) {
      params += e.numel();
      bytes += double(e.numel()) * double(dtype_size(e.dtype));
    }
    const std::string what = "the vision tower of " + config_path + " (" + format_count(params) + " parameters)";
    require_memory(saturated_bytes(bytes), what);
    require_disk_space(out_dir, saturated_bytes(bytes), what);
  }
  TensorInitializer init(c, opt);
  Buffers buffers;
  for (const VisionTensorEntry& e : table) {
    init.begin(e.init, e.numel());
    draw(init, e.dtype, e.shape, e.name, buffers);
  }
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) fail(out_dir, ": cannot create directory: ", ec.message());
  write_safetensors((fs::path(out_dir) / "model.safetensors").string(), buffers.tensors(),
                    {{"format", "pt"}, {"k3cpp", "random vision tower, seed " + std::to_string(opt.seed)}});
  write_file_atomic((fs::path(out_dir) / "config.json").string(), j.dump(2) + "\n");
}

}  // namespace k3
