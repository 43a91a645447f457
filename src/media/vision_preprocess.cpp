#include "media/vision_preprocess.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "media/resample_pillow.h"

namespace k3 {

ResizePlan plan_resize(int64_t width, int64_t height, const MediaProcConfig& cfg) {
  K3_CHECK(width >= 1 && height >= 1, "image: size ", width, " x ", height, " is empty");
  const int64_t p = cfg.patch_size, side = cfg.patch_limit_on_one_side;
  const double s1 = std::sqrt(double(cfg.in_patch_limit) /
                              (std::max(1.0, double(width / p)) * std::max(1.0, double(height / p))));
  const double s2 = double(side * p) / double(width), s3 = double(side * p) / double(height);
  const double scale = std::min({1.0, s1, s2, s3});
  ResizePlan r;
  r.width = std::min(std::max<int64_t>(1, int64_t(double(width) * scale)), side * p);
  r.height = std::min(std::max<int64_t>(1, int64_t(double(height) * scale)), side * p);
  const int64_t f = cfg.merge_kernel_size * p;
  r.pad_width = (f - r.width % f) % f;
  r.pad_height = (f - r.height % f) % f;
  const int64_t th = (r.height + r.pad_height) / f, tw = (r.width + r.pad_width) / f;
  K3_CHECK(th * cfg.merge_kernel_size <= side && tw * cfg.merge_kernel_size <= side, "image: ", width, " x ", height,
           " needs ", th * cfg.merge_kernel_size, " x ", tw * cfg.merge_kernel_size,
           " patches after padding, more than patch_limit_on_one_side = ", side);
  r.tokens = th * tw;
  return r;
}

namespace {

// The RGB image the reference gets from fill_transparent_bg_with: alpha composited onto the chessboard in
// float32 (each operation rounded to float32, as numpy's float32 arrays do; products and sums of these values are
// exact in double, so computing them there and rounding once is the same), truncated; L repeated. The compiler
// may turn these steps back into float operations, so k3_media is built without FMA contraction (CMakeLists.txt).
Image8 to_rgb(const Image8& im, const MediaProcConfig& cfg) {
  if (im.channels == 3) return im;
  if (im.cmyk) {  // Pillow's cmyk2rgb: (255 - k) - c (255 - k) / 255, in its integer rounding
    Image8 out(im.width, im.height, 3);
    for (size_t p = 0, q = 0; p < im.pixels.size(); p += 4, q += 3) {
      const unsigned nk = 255u - im.pixels[p + 3];
      for (int c = 0; c < 3; ++c) {
        const unsigned tmp = unsigned(im.pixels[p + size_t(c)]) * nk + 128;
        const int v = int(nk) - int(((tmp >> 8) + tmp) >> 8);
        out.pixels[q + size_t(c)] = uint8_t(std::clamp(v, 0, 255));
      }
    }
    return out;
  }
  Image8 out(im.width, im.height, 3);
  const int C = im.channels;
  for (int64_t y = 0; y < im.height; ++y)
    for (int64_t x = 0; x < im.width; ++x) {
      const uint8_t* s = im.row(y) + x * C;
      uint8_t* d = out.row(y) + x * 3;
      const uint8_t rgb[3] = {s[0], C >= 3 ? s[1] : s[0], C >= 3 ? s[2] : s[0]};
      if (!im.has_alpha()) {
        std::copy(rgb, rgb + 3, d);
        continue;
      }
      const bool white = ((y / cfg.chessboard_square + x / cfg.chessboard_square) % 2 == 1) !=
                         cfg.chessboard_white_top_left;
      const float bg = float(white ? cfg.chessboard_white : cfg.chessboard_gray);
      const float a = float(s[C - 1]) / 255.0f, na = 1.0f - a;
      for (int c = 0; c < 3; ++c) {
        const float fg = float(double(a) * double(rgb[c])), back = float(double(na) * double(bg));
        d[c] = uint8_t(float(double(fg) + double(back)));
      }
    }
  return out;
}

}  // namespace

// A grey image's tRNS key as Pillow's convert("RGBA") applies it, on the resized pixels: alpha 0 where a pixel
// equals the key, 255 elsewhere.
Image8 keyed_alpha(const Image8& grey, int key) {
  Image8 out(grey.width, grey.height, 2);
  for (size_t i = 0; i < grey.pixels.size(); ++i)
    out.pixels[2 * i] = grey.pixels[i], out.pixels[2 * i + 1] = grey.pixels[i] == key ? 0 : 255;
  return out;
}

VisionInput preprocess_image(const Image8& image, const MediaProcConfig& cfg) {
  const ResizePlan plan = plan_resize(image.width, image.height, cfg);
  Image8 resized = image.nearest ? resize_nearest_pillow(image, plan.width, plan.height)
                                 : resize_bicubic_pillow(image, plan.width, plan.height);
  if (image.transparent_key >= 0 && resized.channels == 1) resized = keyed_alpha(resized, image.transparent_key);
  const Image8 rgb = to_rgb(resized, cfg);
  const int64_t p = cfg.patch_size, H = plan.height + plan.pad_height, W = plan.width + plan.pad_width;
  VisionInput v;
  v.width = image.width;
  v.height = image.height;
  v.grid_h = H / p;
  v.grid_w = W / p;
  v.patches.assign(size_t(H * W * 3), 0.0f);
  for (int64_t y = 0; y < H; ++y)
    for (int64_t x = 0; x < W; ++x)
      for (int64_t c = 0; c < 3; ++c) {
        const uint8_t u = y < rgb.height && x < rgb.width ? rgb.row(y)[x * 3 + c] : 0;
        float f = float(double(u) / 255.0);
        f = float(double(f) - cfg.mean[c]);
        f = float(double(f) * (1.0 / cfg.std[c]));
        const int64_t patch = (y / p) * v.grid_w + x / p;
        v.patches[size_t(((patch * 3 + c) * p + y % p) * p + x % p)] = f;
      }
  return v;
}

}  // namespace k3
