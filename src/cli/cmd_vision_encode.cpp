// k3 vision-encode: the vision tower and projector over patchified pixels; writes what they give per item.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "io/output_file.h"
#include "io/safetensors.h"
#include "media/image_decode.h"
#include "media/vision_preprocess.h"
#include "model/engine.h"
#include "model/vision.h"
#include "multimodal/media_prompt.h"

namespace k3::cli {

void register_vision_encode(CLI::App& app) {
  struct Opts {
    std::string model, pixels, out, device = "cpu";
    std::vector<std::string> images;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = app.add_subcommand(
      "vision-encode",
      "Run the vision tower (MoonViT-V2) and projector over preprocessed images and write their outputs.\n"
      "Reads MODEL/config.json (its vision_config; a directory may hold only the tower and projector) and the\n"
      "vision_tower.* and mm_projector.* tensors of its safetensors. Runs on the CPU (fp32 activations,\n"
      "fp64-accumulated linear layers) or, with --device cuda, on the GPU in bf16 (bf16 weights and GEMM inputs,\n"
      "fp32 residual stream, norms and softmax). PIXELS holds 'pixel_patches' (F32 [L, 3, p, p]: normalised,\n"
      "patchified, each item's patches in (t, h, w) order) and 'grid_thws'\n"
      "(I64 [n, 3]: each item's frames, patch rows, patch columns). OUT (written atomically) holds, for each item\n"
      "i, 'merged.i' (F32 [tokens, 4, width]: the tower's output after the 2 x 2 merge) and 'projected.i'\n"
      "(F32 [tokens, text hidden size]: what replaces the item's media placeholder in the text).\n"
      "Or --image FILE (repeatable; PNG or JPEG): each file decoded as Pillow does and preprocessed as Moonshot's\n"
      "processor does (the release's media_proc_cfg, the model's patch size and merge), one item per image.");
  sub->add_option("--model", o->model, "model directory (config.json with a vision_config + safetensors)")->required();
  auto* pixels_opt = sub->add_option("--pixels", o->pixels, "input .safetensors: pixel_patches and grid_thws");
  auto* image_opt = sub->add_option("--image", o->images, "a PNG or JPEG file, one item each (repeatable)");
  pixels_opt->excludes(image_opt);
  image_opt->excludes(pixels_opt);
  sub->add_option("--out", o->out, "output .safetensors path (written atomically)")->required();
  sub->add_option("--device", o->device,
                  "where the tower runs: cpu, or cuda (one Hopper GPU, bf16; needs a CUDA build)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  sub->callback([o] {
    check_output_path(o->out);
    const Device device = parse_device(o->device, "--device");
    std::unique_ptr<VisionEncoder> m;
    try {
      m = load_vision_encoder(o->model, device);
    } catch (const Error& e) {
      if (device == Device::CUDA) fail("--device cuda: ", e.what());
      throw;
    }
    const VisionConfig& c = m->config();
    if (o->pixels.empty() && o->images.empty()) fail("vision-encode: give --pixels FILE or --image FILE");
    std::vector<float> pixels;
    std::vector<VisionGrid> grids;
    if (!o->images.empty()) {
      const MediaProcConfig cfg = media_proc_config(c);
      for (const std::string& f : o->images) {
        const VisionInput v = preprocess_image(read_image_file(f), cfg);
        std::fprintf(stderr, "[%.2fs] %s: %lld x %lld pixels, %lld x %lld patches\n", elapsed_seconds(), f.c_str(),
                     (long long)v.width, (long long)v.height, (long long)v.grid_h, (long long)v.grid_w);
        pixels.insert(pixels.end(), v.patches.begin(), v.patches.end());
        grids.push_back({1, v.grid_h, v.grid_w});
      }
    } else {
      const SafeTensors in = SafeTensors::open(o->pixels);
      const TensorView& pv = in.get("pixel_patches");
      if (pv.shape.size() != 4 || pv.shape[0] < 1 || pv.shape[1] != 3 || pv.shape[2] != c.patch_size ||
          pv.shape[3] != c.patch_size)
        fail(o->pixels, ": tensor 'pixel_patches' has shape ", pv.shape_str(), ", expected [L, 3, ", c.patch_size, ", ",
             c.patch_size, "] (patch_size of ", c.source, ")");
      pixels = in.read_f32("pixel_patches");
      const TensorView& gv = in.get("grid_thws");
      if (gv.shape.size() != 2 || gv.shape[1] != 3)
        fail(o->pixels, ": tensor 'grid_thws' has shape ", gv.shape_str(), ", expected [n, 3] (t, h, w per item)");
      const std::vector<int64_t> g = in.read_i64("grid_thws");
      for (size_t i = 0; i + 2 < g.size(); i += 3) grids.push_back({g[i], g[i + 1], g[i + 2]});
    }
    const int64_t L = int64_t(pixels.size()) / (3 * c.patch_size * c.patch_size);
    m->check_grids(grids, L);
    check_output_path(o->out);  // again, now that the model's and the pixels' files are known inputs
    std::fprintf(stderr, "[%.2fs] vision-encode on %s: %zu item(s), %lld patches, tower %lld x %lld blocks\n",
                 elapsed_seconds(), m->description().c_str(), grids.size(), (long long)L, (long long)c.hidden_size,
                 (long long)c.num_layers);
    const std::vector<VisionItem> items = m->encode(pixels.data(), L, grids);
    std::vector<TensorToWrite> t;
    const int64_t K = c.merge_h * c.merge_w;
    for (size_t i = 0; i < items.size(); ++i) {
      const std::string n = std::to_string(i);
      t.push_back({"merged." + n, DType::F32, {items[i].tokens, K, c.hidden_size}, items[i].merged.data()});
      t.push_back({"projected." + n, DType::F32, {items[i].tokens, c.text_hidden_size}, items[i].projected.data()});
    }
    write_safetensors(o->out, t);
    std::fprintf(stderr, "[%.2fs] wrote %s: %zu item(s)\n", elapsed_seconds(), o->out.c_str(), items.size());
  });
}

}  // namespace k3::cli
