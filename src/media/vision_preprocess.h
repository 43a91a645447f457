// Images to the vision tower's input, as Moonshot's KimiK3VisionProcessor does it (media_utils.py; K3-ARCHITECTURE.md
// §8 step 1), bit for bit:
//   1. the size: scale = min(1, sqrt(in_patch_limit / (max(1, W // p) max(1, H // p))), side p / W, side p / H)
//      (never up), new size int(W scale) x int(H scale) (at least 1, at most side p);
//   2. Pillow's bicubic resize to it (media/resample_pillow.h);
//   3. an image with alpha composited onto the chessboard (squares of `square` pixels, `white` at the top left,
//      `gray` beside), in float32 as numpy does it: a = alpha / 255, a c + (1 - a) bg, truncated to 8 bits; a
//      greyscale image repeated into RGB;
//   4. padded with zeros at the bottom and right to multiples of p * merge;
//   5. normalised: float32(x / 255), then (x - mean) / std as float64 steps each rounded to float32;
//   6. cut into p x p patches in (row, column) order, each as (C, p, p).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "media/image.h"

namespace k3 {

// media_proc_cfg of the release's preprocessor_config.json.
struct MediaProcConfig {
  int64_t patch_size = 14;
  int64_t merge_kernel_size = 2;
  int64_t in_patch_limit = 65536;
  int64_t patch_limit_on_one_side = 512;
  double mean[3] = {0.5, 0.5, 0.5};
  double std[3] = {0.5, 0.5, 0.5};
  // transparent_bg_config: the chessboard, composited after the resize.
  int64_t chessboard_square = 8;
  uint8_t chessboard_white = 255, chessboard_gray = 180;
  bool chessboard_white_top_left = true;
};

struct ResizePlan {
  int64_t width = 0, height = 0;          // after the resize
  int64_t pad_width = 0, pad_height = 0;  // zeros added at the right and the bottom
  int64_t tokens = 0;                     // the text tokens the image becomes: (padded H / (p m)) (padded W / (p m))
};
// A k3::Error when the image could never fit (a side over the limit even at one patch per token).
ResizePlan plan_resize(int64_t width, int64_t height, const MediaProcConfig& cfg);

struct VisionInput {
  int64_t width = 0, height = 0;   // the original image's size (the prompt names it)
  int64_t grid_h = 0, grid_w = 0;  // patches (t = 1)
  std::vector<float> patches;      // [grid_h grid_w, 3, p, p]
};
VisionInput preprocess_image(const Image8& image, const MediaProcConfig& cfg);

}  // namespace k3
