// An 8-bit image as a decoder gives it: rows top to bottom, each pixel's channels interleaved. channels: 1 (L,
// greyscale), 2 (LA: greyscale and alpha), 3 (RGB) or 4 (RGBA, or CMYK when `cmyk`). A 16-bit grey image (Pillow's
// mode I) also keeps its samples in `grey16`.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace k3 {

struct Image8 {
  int64_t width = 0, height = 0;
  int channels = 0;
  std::vector<uint8_t> pixels;  // [height, width, channels]
  // How Pillow would treat the file's image, which the decoder gives converted: a palette (mode P, its colours,
  // RGBA with a tRNS table) or 1-bit (mode 1, as L 0/255) image is resized by NEAREST; a grey image with a tRNS
  // colour key gets its alpha from the key only after the resize (pixels equal to it transparent).
  bool nearest = false;
  int transparent_key = -1;  // (L only; -1: none)
  bool cmyk = false;         // 4 channels of C, M, Y, K (Pillow's mode CMYK), converted to RGB after the resize
  // Pillow's mode I (a 16-bit grey PNG; 1 channel): the samples, [height, width]. The resize reads these
  // (media/resample_pillow.h); `pixels` holds them clipped to 0..255, as Pillow's convert("L") and convert("RGB")
  // give them (clipped, not scaled: 256 and 65535 are both 255).
  std::vector<uint16_t> grey16;

  Image8() = default;
  Image8(int64_t w, int64_t h, int c) : width(w), height(h), channels(c), pixels(size_t(w * h * c), 0) {}
  bool has_alpha() const { return channels == 2 || (channels == 4 && !cmyk); }
  uint8_t* row(int64_t y) { return pixels.data() + y * width * channels; }
  const uint8_t* row(int64_t y) const { return pixels.data() + y * width * channels; }
};

}  // namespace k3
