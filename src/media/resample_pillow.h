// Pillow's Image.resize(size, Resampling.BICUBIC) on an 8-bit image, bit for bit, as Moonshot's image processor
// calls it (Pillow 9.4, libImaging/Resample.c and Convert.c; newer versions compute the same).
//
//   - The filter is Keys' cubic with a = -0.5 and support 2, stretched by the scale when shrinking (so it
//     averages, an antialiasing filter). For each output pixel the taps' weights are computed in double,
//     normalised to sum 1, and rounded to fixed point with 22 fraction bits; each pass sums 8-bit values times
//     those integers, adds a half, shifts and clips to 0..255.
//   - Two passes: horizontal first (into rows the vertical pass reads, 8-bit), then vertical. A pass whose size
//     does not change is skipped; the same size in both is a copy.
//   - LA and RGBA are premultiplied by alpha before and divided by it after (Pillow's "La"/"RGBa" detour), with
//     Pillow's integer rounding: (c a + 128 + ((c a + 128) >> 8)) >> 8 on the way in, c 255 / a (truncated,
//     clipped) on the way out.
//   - A 16-bit grey image (`grey16`, Pillow's mode I, 32-bit integers) takes Pillow's 32-bit passes: the same taps
//     with the normalised weights kept in double, each output the sum of value times weight in double rounded half
//     away from zero, nothing clipped between the passes. The result comes back as 8-bit L, clipped to 0..255 as
//     Pillow's convert("L") and convert("RGB") clip mode I, which is all the processor takes from it.
#pragma once
#include <cstdint>

#include "media/image.h"

namespace k3 {

Image8 resize_bicubic_pillow(const Image8& in, int64_t width, int64_t height);

// Pillow's resize with Resampling.NEAREST, which it uses for mode P and 1 images whatever was asked
// (libImaging's ImagingScaleAffine): output column x takes input column int(x0 + s / 2 + x s) with s = in / out,
// the position accumulated in double from x0 = 0 by adding s per column as Pillow does; rows alike.
Image8 resize_nearest_pillow(const Image8& in, int64_t width, int64_t height);

}  // namespace k3
