// Image files to 8-bit pixels, as Pillow 9.4 decodes them: Moonshot's processor opens every image with
// Image.open, and what it does next (resize, alpha composite) depends on the mode Pillow gives.
//   PNG  (libpng): every colour type and depth, interlaced or not, as stored (Pillow applies no gamma and neither
//        does this), in Pillow's mode (PngImagePlugin's table):
//          grey of 8 bits L; of 2 and 4 bits L, the samples scaled to 8 bits (v 0x55, v 0x11, as Pillow's L;2 and
//          L;4 unpackers do); of 1 bit mode 1, as L of 0 and 255, marked `nearest`;
//          grey of 16 bits mode I: the samples in `grey16`, clipped to 0..255 in `pixels`;
//          grey + alpha LA (8 bits) or RGBA (16 bits: Pillow unpacks LA;16B to RGBA, grey repeated);
//          RGB and RGBA; of 16 bits the high byte of each sample (Pillow's RGB;16B, RGBA;16B, LA;16B);
//          palettes (mode P, any depth) as their colours, RGBA when a tRNS table gives alphas, marked `nearest`
//          (Pillow resizes P and 1 by NEAREST).
//        A grey tRNS key is kept in `transparent_key` as Pillow applies it after the resize: its low byte against
//        the 8-bit pixel (a 2-bit key of 1 is not scaled, a 16-bit key of 263 matches pixels clipped to 7); an RGB
//        key is dropped (the processor passes RGB images as they are).
//   JPEG (libjpeg-turbo, Pillow's settings: the islow DCT, fancy upsampling): greyscale to L, YCbCr and RGB to RGB,
//        CMYK and YCCK (Adobe transform 2, which libjpeg converts to CMYK as Pillow asks it to) to CMYK (`cmyk`; the
//        samples inverted, as Pillow reads them as Adobe's "CMYK;I").
// Refused with a k3::Error naming `what`: other formats; JPEGs of other component counts (Pillow opens 1, 3 and 4); and
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
