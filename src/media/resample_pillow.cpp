#include "media/resample_pillow.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"

namespace k3 {

namespace {

constexpr int kPrecisionBits = 32 - 8 - 2;

double bicubic(double x) {  // Keys' cubic, a = -0.5
  constexpr double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

// One axis: for each output index, the first input index, the number of taps and their weights, normalised in
// double (what Pillow's 32-bit passes use) and in fixed point (its 8-bit ones).
struct Axis {
  int ksize = 0;
  std::vector<int> first, count;
  std::vector<double> normalised;  // [out, ksize]
  std::vector<int32_t> weights;    // [out, ksize]
};

Axis coefficients(int in_size, int out_size) {
  Axis a;
  const double scale = double(float(in_size) - 0.0f) / out_size;
  const double filterscale = scale < 1.0 ? 1.0 : scale;
  const double support = 2.0 * filterscale;
  a.ksize = int(std::ceil(support)) * 2 + 1;
  a.first.resize(size_t(out_size));
  a.count.resize(size_t(out_size));
  a.normalised.assign(size_t(out_size) * size_t(a.ksize), 0.0);
  a.weights.assign(size_t(out_size) * size_t(a.ksize), 0);
  std::vector<double> k(size_t(a.ksize));
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = (xx + 0.5) * scale, ss = 1.0 / filterscale;
    int xmin = int(center - support + 0.5), xmax = int(center + support + 0.5);
    if (xmin < 0) xmin = 0;
    if (xmax > in_size) xmax = in_size;
    xmax -= xmin;
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) ww += (k[size_t(x)] = bicubic((x + xmin - center + 0.5) * ss));
    for (int x = 0; x < xmax; ++x) {
      const double w = ww != 0.0 ? k[size_t(x)] / ww : k[size_t(x)];
      a.normalised[size_t(xx) * size_t(a.ksize) + size_t(x)] = w;
      a.weights[size_t(xx) * size_t(a.ksize) + size_t(x)] =
          int32_t(w < 0 ? -0.5 + w * (1 << kPrecisionBits) : 0.5 + w * (1 << kPrecisionBits));
    }
    a.first[size_t(xx)] = xmin;
    a.count[size_t(xx)] = xmax;
  }
  return a;
}

uint8_t clip8(int v) {
  const int s = v >> kPrecisionBits;  // arithmetic shift: floor
  return uint8_t(s < 0 ? 0 : s > 255 ? 255 : s);
}

// One pass along x (horizontal) or y over every channel of an interleaved 8-bit image.
Image8 pass(const Image8& in, const Axis& a, bool horizontal, int64_t out_size) {
  Image8 out(horizontal ? out_size : in.width, horizontal ? in.height : out_size, in.channels);
  const int C = in.channels;
  for (int64_t y = 0; y < out.height; ++y)
    for (int64_t x = 0; x < out.width; ++x) {
      const int64_t o = horizontal ? x : y;
      const int first = a.first[size_t(o)], n = a.count[size_t(o)];
      const int32_t* k = a.weights.data() + o * a.ksize;
      for (int c = 0; c < C; ++c) {
        int ss = 1 << (kPrecisionBits - 1);
        for (int t = 0; t < n; ++t) {
          const int64_t sx = horizontal ? first + t : x, sy = horizontal ? y : first + t;
          ss += int(in.pixels[size_t((sy * in.width + sx) * C + c)]) * k[t];
        }
        out.pixels[size_t((y * out.width + x) * C + c)] = clip8(ss);
      }
    }
  return out;
}

// Pillow's ROUND_UP (Resample.c): half away from zero, by truncating v +- 0.5.
int32_t round_up(double v) { return int32_t(v >= 0.0 ? v + 0.5 : v - 0.5); }

// One pass of Pillow's 32-bit resampler over a mode I image [h, w]: each output the sum, in double from the first
// tap, of value times normalised weight, rounded; nothing is clipped (a bicubic lobe may leave 0..65535).
std::vector<int32_t> pass_i32(const std::vector<int32_t>& in, int64_t w, int64_t h, const Axis& a, bool horizontal,
                              int64_t out_size) {
  const int64_t ow = horizontal ? out_size : w, oh = horizontal ? h : out_size;
  std::vector<int32_t> out(size_t(ow * oh));
  for (int64_t y = 0; y < oh; ++y)
    for (int64_t x = 0; x < ow; ++x) {
      const int64_t o = horizontal ? x : y;
      const int first = a.first[size_t(o)], n = a.count[size_t(o)];
      const double* k = a.normalised.data() + o * a.ksize;
      double ss = 0.0;
      for (int t = 0; t < n; ++t) {
        const int64_t sx = horizontal ? first + t : x, sy = horizontal ? y : first + t;
        ss += double(in[size_t(sy * w + sx)]) * k[t];
      }
      out[size_t(y * ow + x)] = round_up(ss);
    }
  return out;
}

// Pillow's RGBA -> RGBa (and LA -> La): colour times alpha / 255, rounded its way.
void premultiply(Image8& im) {
  const int C = im.channels;
  for (size_t p = 0; p < im.pixels.size(); p += size_t(C)) {
    const unsigned alpha = im.pixels[p + size_t(C) - 1];
    for (int c = 0; c + 1 < C; ++c) {
      const unsigned tmp = unsigned(im.pixels[p + size_t(c)]) * alpha + 128;
      im.pixels[p + size_t(c)] = uint8_t(((tmp >> 8) + tmp) >> 8);
    }
  }
}

// Pillow's RGBa -> RGBA (and La -> LA): colour * 255 / alpha, truncated and clipped; alpha 0 or 255 unchanged.
void unpremultiply(Image8& im) {
  const int C = im.channels;
  for (size_t p = 0; p < im.pixels.size(); p += size_t(C)) {
    const unsigned alpha = im.pixels[p + size_t(C) - 1];
    if (alpha == 255 || alpha == 0) continue;
    for (int c = 0; c + 1 < C; ++c) {
      const unsigned v = 255u * im.pixels[p + size_t(c)] / alpha;
      im.pixels[p + size_t(c)] = uint8_t(v > 255 ? 255 : v);
    }
  }
}

}  // namespace

namespace {

void check_resize(const Image8& in, int64_t width, int64_t height) {
  K3_CHECK(in.channels >= 1 && in.channels <= 4, "resize: images have 1 to 4 channels, got ", in.channels);
  K3_CHECK(in.width >= 1 && in.height >= 1 && int64_t(in.pixels.size()) == in.width * in.height * in.channels,
           "resize: a ", in.width, " x ", in.height, " x ", in.channels, " image holds ", in.pixels.size(), " bytes");
  K3_CHECK(width >= 1 && height >= 1 && width <= (1 << 24) && height <= (1 << 24), "resize: target size ", width,
           " x ", height, " is out of range");
}

// Input positions of the output's columns (or rows): Pillow's pretabulation in ImagingScaleAffine.
std::vector<int64_t> nearest_taps(int64_t in, int64_t out) {
  const double a = double(in) / double(out);
  std::vector<int64_t> taps(static_cast<size_t>(out));
  double pos = a * 0.5;
  for (int64_t x = 0; x < out; ++x) {
    taps[size_t(x)] = std::min<int64_t>(pos < 0.0 ? 0 : int64_t(pos), in - 1);
    pos += a;
  }
  return taps;
}

}  // namespace

Image8 resize_nearest_pillow(const Image8& in, int64_t width, int64_t height) {
  check_resize(in, width, height);
  if (width == in.width && height == in.height) return in;
  Image8 out(width, height, in.channels);
  out.nearest = in.nearest, out.transparent_key = in.transparent_key;
  const std::vector<int64_t> xs = nearest_taps(in.width, width), ys = nearest_taps(in.height, height);
  const int C = in.channels;
  for (int64_t y = 0; y < height; ++y)
    for (int64_t x = 0; x < width; ++x) std::copy_n(in.row(ys[size_t(y)]) + xs[size_t(x)] * C, C, out.row(y) + x * C);
  return out;
}

namespace {

// Mode I: the 32-bit passes on the 16-bit samples, then Pillow's I -> L clip (Convert.c's i2l, as i2rgb).
Image8 resize_grey16(const Image8& in, int64_t width, int64_t height) {
  K3_CHECK(in.channels == 1 && in.grey16.size() == in.pixels.size(), "resize: a 16-bit grey image of ", in.channels,
           " channels holds ", in.grey16.size(), " samples for ", in.pixels.size(), " pixels");
  std::vector<int32_t> v(in.grey16.begin(), in.grey16.end());
  int64_t w = in.width, h = in.height;
  if (width != w) v = pass_i32(v, w, h, coefficients(int(w), int(width)), /*horizontal=*/true, width), w = width;
  if (height != h) v = pass_i32(v, w, h, coefficients(int(h), int(height)), /*horizontal=*/false, height), h = height;
  Image8 out(width, height, 1);
  for (size_t i = 0; i < v.size(); ++i) out.pixels[i] = uint8_t(std::clamp<int32_t>(v[i], 0, 255));
  out.transparent_key = in.transparent_key;
  return out;
}

}  // namespace

Image8 resize_bicubic_pillow(const Image8& in, int64_t width, int64_t height) {
  check_resize(in, width, height);
  if (width == in.width && height == in.height) return in;
  if (!in.grey16.empty()) return resize_grey16(in, width, height);
  Image8 im = in;
  const bool alpha = in.has_alpha();  // (CMYK's fourth channel is K: no premultiplying)
  if (alpha) premultiply(im);
  if (width != im.width) im = pass(im, coefficients(int(im.width), int(width)), /*horizontal=*/true, width);
  if (height != im.height) im = pass(im, coefficients(int(im.height), int(height)), /*horizontal=*/false, height);
  if (alpha) unpremultiply(im);
  im.nearest = in.nearest, im.transparent_key = in.transparent_key, im.cmyk = in.cmyk;
  return im;
}

}  // namespace k3
