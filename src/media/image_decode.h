// Image files to 8-bit pixels, as Pillow 9.4 decodes them: Moonshot's processor opens every image with
// Image.open, and what it does next (resize, alpha composite) depends on the mode Pillow gives.
//   PNG  (libpng): 8-bit grey, grey + alpha, RGB and RGBA, interlaced or not, as stored (Pillow applies no gamma
//        and neither does this). Palettes (Pillow's mode P, any depth) as their colours, RGBA when a tRNS table
//        gives alphas, and 1-bit grey (mode 1) as L of 0 and 255, both marked `nearest` (Pillow resizes them by
//        NEAREST); a grey tRNS key is kept in `transparent_key` (its alpha comes after the resize); an RGB key is
//        dropped (the processor passes RGB images as they are).
//   JPEG (libjpeg-turbo, Pillow's settings: the islow DCT, fancy upsampling): greyscale to L, YCbCr and RGB to RGB,
//        CMYK to CMYK (`cmyk`; the samples inverted, as Pillow reads them as Adobe's "CMYK;I").
// Refused with a k3::Error naming `what`: other formats; files whose Pillow mode the preprocessing does not yet
// follow (16-bit and 2/4-bit grey PNGs; YCCK JPEGs); and
// corrupt or truncated files (Pillow raises on a truncated file too, unless LOAD_TRUNCATED_IMAGES is set).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "media/image.h"

namespace k3 {

enum class ImageFormat { Unknown, Png, Jpeg };

// By the file's first bytes (the PNG signature; JPEG's SOI marker FF D8 FF).
ImageFormat sniff_image_format(const uint8_t* data, size_t size);

Image8 decode_image(const uint8_t* data, size_t size, const std::string& what);
Image8 read_image_file(const std::string& path);

}  // namespace k3
