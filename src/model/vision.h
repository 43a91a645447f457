// The vision pathway on the CPU: MoonViT-V2 (the tower) and PatchMergerMLPV2 (the projector to the text width),
// K3-ARCHITECTURE.md §8, from the release's `vision_tower.*` and `mm_projector.*` tensors.
//
//   x = patches · Wpatch + pos(t, h, w)              (the 14 x 14 conv as a matrix over (C, 14, 14))
//   27 blocks: x += wo(attn(rope2d(wqkv(RMSNorm0 x)))); x += fc1(gelu_tanh(fc0(RMSNorm1 x)))
//   x = RMSNorm(x); merge 2 x 2 neighbours (mean over frames) -> [tokens, 4, width]
//   projected = RMSNorm(W2 gelu_erf(W1 merged), eps projector_ln_eps)
//
// pos: the learned table resized bilinearly to the item's grid (kernels/vision/vision.h), plus for a clip the
// fixed sin-cos embedding of each frame. Attention is bidirectional within an item (its frames together), 2D
// RoPE by each patch's row and column. The tower's three RMSNorms are built without eps in the reference, so
// torch takes the machine epsilon of the dtype the release runs them in, bf16: 2^-7 (K3-ARCHITECTURE.md §6).
//
// Precision as the text model on the CPU: fp32 activations, linear layers accumulating in fp64
// (kernels/gemm/linear.h), norms, RoPE, attention and the merge's mean in double. Weights stay where the
// checkpoint keeps them (F32, BF16 or F16), mapped.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "kernels/gemm/linear.h"
#include "model/vision_config.h"

namespace k3 {

// One image (t = 1) or clip (t frames) as a grid of patches.
struct VisionGrid {
  int64_t t = 1, h = 0, w = 0;
  int64_t patches() const { return t * h * w; }
};

struct VisionItem {
  int64_t tokens = 0;            // merged patches: (h / merge_h) (w / merge_w)
  std::vector<float> merged;     // [tokens, merge_h * merge_w, width]: the tower's output, merged
  std::vector<float> projected;  // [tokens, text_hidden_size]: what replaces the media placeholder
};

// Sees the tower's states over all patches of one encode(): "embed" (after the position embedding), "block.B"
// (after block B), "final" (after the final norm); rows = patches, cols = width.
using VisionTrace = std::function<void(const std::string& name, const float* x, int64_t rows, int64_t cols)>;

// A vision tower and projector on some device: what the CLI, the chat prompts and the server call
// (multimodal/media_prompt.h), whichever of VisionModel (the CPU) and CudaVisionModel (model/cuda/vision_cuda.h, the
// GPU in bf16) runs it. model/engine.h: load_vision_encoder picks one for a device.
class VisionEncoder {
 public:
  // The RMSNorm eps of the tower's norms (see above).
  static constexpr float kTowerNormEps = 0.0078125f;  // 2^-7
  // The reference's 2D RoPE table covers grids up to this many patches a side.
  static constexpr int64_t kMaxGridSide = 512;

  virtual ~VisionEncoder() = default;
  virtual const VisionConfig& config() const = 0;
  // "cpu", "cpu (bf16 twin)" or "cuda (bf16)", for progress lines.
  virtual std::string description() const = 0;
  // A k3::Error naming the item unless every grid is one the model takes (1 <= t <= init_pos_emb_time; h, w
  // positive multiples of the merge kernel, at most kMaxGridSide) and together they hold `patches` patches.
  void check_grids(const std::vector<VisionGrid>& grids, int64_t patches) const;
  // pixel_patches [patches, 3, p, p] (host memory): normalised, each item's patches in (t, h, w) order, items in
  // order. Checks the grids first (check_grids). Safe to call from several threads at once.
  virtual std::vector<VisionItem> encode(const float* pixel_patches, int64_t patches,
                                         const std::vector<VisionGrid>& grids, const VisionTrace& trace = {}) const = 0;
};

// A k3::Error naming the item unless every grid is one a tower of config c takes (1 <= t <= init_pos_emb_time; h, w
// positive multiples of the merge kernel, at most VisionEncoder::kMaxGridSide) and together they hold `patches`
// patches. VisionEncoder::check_grids and the training forward (model/training/vision_train.h) both ask here.
void check_vision_grids(const VisionConfig& c, const std::vector<VisionGrid>& grids, int64_t patches);

class VisionModel : public VisionEncoder {
 public:
  // dir: config.json with a vision_config, and the weights (model.safetensors, or shards with their index).
  static std::unique_ptr<VisionModel> load(const std::string& dir);
  VisionModel(const VisionConfig& c, SafeTensors st);

  const VisionConfig& config() const override { return c_; }
  std::string description() const override { return bf16_ ? "cpu (bf16 twin)" : "cpu"; }
  // The CPU twin of the GPU's bf16 path (model/cuda/vision_cuda.h), as PathOptions::bf16_activations is the text
  // model's: every activation that path stores in bf16 (the pixels, the norms' outputs that feed GEMMs, q, k and v
  // after the RoPE, the attention's output, the GELUs' outputs, the merged tokens the projector reads) is rounded
  // to bf16 at the same point, and everything else runs as usual (the weights as stored: give it a BF16
  // checkpoint to match the GPU, which rounds its weights to bf16). For the GPU path's tests; set it before
  // encoding, not during.
  void set_bf16_activations(bool on) { bf16_ = on; }
  std::vector<VisionItem> encode(const float* pixel_patches, int64_t patches, const std::vector<VisionGrid>& grids,
                                 const VisionTrace& trace = {}) const override;

 private:
  struct Block {
    std::vector<float> norm0, norm1;
    WeightRef wqkv, wo, fc0, fc1;
  };
  VisionConfig c_;
  SafeTensors st_;
  WeightRef patch_embed_;         // [width, 3 p p]
  std::vector<float> pos_table_;  // [H0, W0, width]
  std::vector<Block> blocks_;
  std::vector<float> final_norm_;  // [width]
  WeightRef proj0_, proj2_;        // [4 width, 4 width], [text, 4 width]
  std::vector<float> post_norm_;   // [text]
  bool bf16_ = false;
};

}  // namespace k3
