// PNG and JPEG decoding (image_decode.h). libpng and libjpeg report errors by longjmp. Each library call that may
// fail runs in a small function of plain data that owns nothing (no C++ object lives across its setjmp), and the
// C++ code between those calls holds the buffers.
#include "media/image_decode.h"

#include <jpeglib.h>
#include <png.h>

#include <algorithm>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "io/file.h"

namespace k3 {

ImageFormat sniff_image_format(const uint8_t* data, size_t size) {
  static const uint8_t kPng[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (size >= 8 && std::memcmp(data, kPng, 8) == 0) return ImageFormat::Png;
  if (size >= 3 && data[0] == 0xFF && data[1] == 0xD8 && data[2] == 0xFF) return ImageFormat::Jpeg;
  return ImageFormat::Unknown;
}

namespace {

// Pillow's DecompressionBombError: twice Image.MAX_IMAGE_PIXELS (89,478,485), refused before any pixel is decoded.
constexpr uint64_t kMaxPixels = 2 * uint64_t(89478485);

void check_size(uint64_t w, uint64_t h, const std::string& what) {
  if (w == 0 || h == 0) fail(what, ": an image of ", w, " x ", h, " pixels");
  if (w * h > kMaxPixels)
    fail(what, ": ", w, " x ", h, " pixels is more than the ", kMaxPixels, " Pillow decodes (a decompression bomb)");
}

// ---- PNG ---------------------------------------------------------------------------------------------------

struct PngState {
  png_structp png = nullptr;
  png_infop info = nullptr;
  const uint8_t* data = nullptr;
  size_t size = 0, pos = 0;
  char message[256] = {0};
};

void png_error_to_jump(png_structp png, png_const_charp msg) {
  auto* s = static_cast<PngState*>(png_get_error_ptr(png));
  std::snprintf(s->message, sizeof(s->message), "%s", msg ? msg : "libpng error");
  std::longjmp(png_jmpbuf(png), 1);
}
void png_ignore_warning(png_structp, png_const_charp) {}

void png_read_memory(png_structp png, png_bytep out, png_size_t n) {
  auto* s = static_cast<PngState*>(png_get_io_ptr(png));
  if (n > s->size - s->pos) png_error(png, "the file is truncated");
  std::memcpy(out, s->data + s->pos, n);
  s->pos += n;
}

struct PngHeader {
  png_uint_32 width = 0, height = 0;
  int depth = 0, color = 0, interlace = 0;
  bool trns = false;
  int trns_grey = -1;  // a grey image's tRNS key, as stored
};

// Phase 1: the header. Returns false (message set) on a libpng error.
bool png_read_header(PngState* s, PngHeader* h) {
  if (setjmp(png_jmpbuf(s->png))) return false;
  png_set_read_fn(s->png, s, png_read_memory);
  png_read_info(s->png, s->info);
  png_get_IHDR(s->png, s->info, &h->width, &h->height, &h->depth, &h->color, &h->interlace, nullptr, nullptr);
  h->trns = png_get_valid(s->png, s->info, PNG_INFO_tRNS) != 0;
  if (h->trns && h->color == PNG_COLOR_TYPE_GRAY) {
    png_bytep alpha = nullptr;
    int n = 0;
    png_color_16p key = nullptr;
    png_get_tRNS(s->png, s->info, &alpha, &n, &key);
    if (key) h->trns_grey = key->gray;
  }
  return true;
}

// Phase 2: every row into `rows` (interlaced images assembled by libpng), then the end of the stream. A palette
// becomes its colours (and the tRNS table an alpha channel), grey of 1, 2 and 4 bits 8-bit grey by repeating the
// bits (the same values as Pillow's unpackers); 16-bit samples keep their high byte (Pillow's RGB;16B,
// RGBA;16B and LA;16B unpackers drop the low one) except grey's, which stay 16-bit, big-endian.
bool png_read_rows(PngState* s, const PngHeader& h, png_bytep* rows) {
  if (setjmp(png_jmpbuf(s->png))) return false;
  if (h.color == PNG_COLOR_TYPE_PALETTE) {
    png_set_palette_to_rgb(s->png);
    if (h.trns) png_set_tRNS_to_alpha(s->png);
  }
  if (h.color == PNG_COLOR_TYPE_GRAY && h.depth < 8) png_set_expand_gray_1_2_4_to_8(s->png);
  if (h.depth == 16 && h.color != PNG_COLOR_TYPE_GRAY) png_set_strip_16(s->png);  // (strip: the high byte)
  if (h.depth == 16 && h.color == PNG_COLOR_TYPE_GRAY_ALPHA) png_set_gray_to_rgb(s->png);
  png_set_interlace_handling(s->png);
  png_read_update_info(s->png, s->info);
  png_read_image(s->png, rows);
  png_read_end(s->png, nullptr);
  return true;
}

struct PngGuard {
  PngState& s;
  ~PngGuard() { png_destroy_read_struct(&s.png, s.info ? &s.info : nullptr, nullptr); }
};

Image8 decode_png(const uint8_t* data, size_t size, const std::string& what) {
  PngState s;
  s.data = data, s.size = size;
  s.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &s, png_error_to_jump, png_ignore_warning);
  if (!s.png) fail(what, ": out of memory starting the PNG decoder");
  PngGuard guard{s};
  s.info = png_create_info_struct(s.png);
  if (!s.info) fail(what, ": out of memory starting the PNG decoder");
  png_set_user_limits(s.png, 1u << 20, 1u << 20);
  PngHeader h;
  if (!png_read_header(&s, &h)) fail(what, ": not a readable PNG: ", s.message);
  // Pillow's modes (PngImagePlugin's table): P (any depth) and 1 (1-bit grey), resized by NEAREST; L (grey of 2,
  // 4 and 8 bits); I (16-bit grey); LA; RGBA (also 16-bit grey + alpha); RGB.
  const bool palette = h.color == PNG_COLOR_TYPE_PALETTE, one_bit = h.color == PNG_COLOR_TYPE_GRAY && h.depth == 1;
  const bool grey16 = h.color == PNG_COLOR_TYPE_GRAY && h.depth == 16;
  int channels = 0;
  switch (h.color) {
    case PNG_COLOR_TYPE_PALETTE: channels = h.trns ? 4 : 3; break;
    case PNG_COLOR_TYPE_GRAY: channels = 1; break;
    case PNG_COLOR_TYPE_GRAY_ALPHA: channels = h.depth == 16 ? 4 : 2; break;
    case PNG_COLOR_TYPE_RGB: channels = 3; break;
    case PNG_COLOR_TYPE_RGB_ALPHA: channels = 4; break;
    default: fail(what, ": PNG colour type ", h.color, " is not supported");
  }
  check_size(h.width, h.height, what);
  Image8 img(int64_t(h.width), int64_t(h.height), channels);
  std::vector<uint8_t> samples16(grey16 ? size_t(h.width) * size_t(h.height) * 2 : 0);
  std::vector<png_bytep> rows(size_t(h.height));
  for (png_uint_32 y = 0; y < h.height; ++y)
    rows[y] = grey16 ? samples16.data() + size_t(y) * h.width * 2 : img.row(int64_t(y));
  img.nearest = palette || one_bit;
  // Pillow turns a grey key into alpha after the resize (Convert.c's rgbT2rgba), comparing its low byte with the
  // 8-bit pixel, unscaled. (An RGB key is kept out: the processor passes RGB images as they are.)
  img.transparent_key = h.trns_grey >= 0 ? (h.trns_grey & 0xFF) : -1;
  if (!png_read_rows(&s, h, rows.data())) fail(what, ": a corrupt or truncated PNG: ", s.message);
  if (grey16) {  // mode I; its 8-bit view is Pillow's convert("L"), which clips
    img.grey16.resize(img.pixels.size());
    for (size_t i = 0; i < img.grey16.size(); ++i) {
      const uint16_t v = uint16_t(samples16[2 * i] << 8 | samples16[2 * i + 1]);
      img.grey16[i] = v;
      img.pixels[i] = uint8_t(std::min<uint16_t>(v, 255));
    }
  }
  return img;
}

// ---- JPEG --------------------------------------------------------------------------------------------------

struct JpegState {
  jpeg_decompress_struct cinfo;
  jpeg_error_mgr err;
  jpeg_source_mgr src;
  std::jmp_buf jump;
  const uint8_t* data = nullptr;
  size_t size = 0;
  bool truncated = false;
  char message[JMSG_LENGTH_MAX] = {0};
};

void jpeg_error_to_jump(j_common_ptr c) {
  auto* s = reinterpret_cast<JpegState*>(c->client_data);
  if (s->truncated) std::snprintf(s->message, sizeof(s->message), "the file is truncated");
  else (*c->err->format_message)(c, s->message);
  std::longjmp(s->jump, 1);
}
void jpeg_ignore_message(j_common_ptr, int) {}

// The whole file is the buffer; asking for more means it ended early (libjpeg's own memory source would insert
// an end marker and carry on, decoding grey; Pillow raises).
void jpeg_init_source(j_decompress_ptr) {}
boolean jpeg_fill_input(j_decompress_ptr c) {
  reinterpret_cast<JpegState*>(c->client_data)->truncated = true;
  (*c->err->error_exit)(reinterpret_cast<j_common_ptr>(c));
  return FALSE;
}
void jpeg_skip_input(j_decompress_ptr c, long n) {
  if (n <= 0) return;
  if (size_t(n) > c->src->bytes_in_buffer) jpeg_fill_input(c);
  c->src->next_input_byte += n;
  c->src->bytes_in_buffer -= size_t(n);
}
void jpeg_term_source(j_decompress_ptr) {}

struct JpegHeader {
  J_COLOR_SPACE space = JCS_UNKNOWN;
  int components = 0;
};

bool jpeg_start(JpegState* s, JpegHeader* h) {
  if (setjmp(s->jump)) return false;
  jpeg_create_decompress(&s->cinfo);
  s->cinfo.client_data = s;
  s->src.init_source = jpeg_init_source;
  s->src.fill_input_buffer = jpeg_fill_input;
  s->src.skip_input_data = jpeg_skip_input;
  s->src.resync_to_restart = jpeg_resync_to_restart;
  s->src.term_source = jpeg_term_source;
  s->src.next_input_byte = s->data;
  s->src.bytes_in_buffer = s->size;
  s->cinfo.src = &s->src;
  jpeg_read_header(&s->cinfo, TRUE);
  h->space = s->cinfo.jpeg_color_space;
  h->components = s->cinfo.num_components;
  return true;
}

// Pillow's settings: the islow DCT and fancy upsampling are libjpeg's defaults, and Pillow keeps them.
bool jpeg_decode_rows(JpegState* s, J_COLOR_SPACE out, uint8_t* pixels, size_t row_bytes, JDIMENSION* w,
                      JDIMENSION* h) {
  if (setjmp(s->jump)) return false;
  s->cinfo.out_color_space = out;
  s->cinfo.dct_method = JDCT_ISLOW;
  s->cinfo.do_fancy_upsampling = TRUE;
  jpeg_start_decompress(&s->cinfo);
  *w = s->cinfo.output_width, *h = s->cinfo.output_height;
  while (s->cinfo.output_scanline < s->cinfo.output_height) {
    JSAMPROW row = pixels + size_t(s->cinfo.output_scanline) * row_bytes;
    jpeg_read_scanlines(&s->cinfo, &row, 1);
  }
  jpeg_finish_decompress(&s->cinfo);
  return true;
}

Image8 decode_jpeg(const uint8_t* data, size_t size, const std::string& what) {
  JpegState s;
  std::memset(&s.cinfo, 0, sizeof(s.cinfo));
  std::memset(&s.src, 0, sizeof(s.src));
  s.data = data, s.size = size;
  s.cinfo.err = jpeg_std_error(&s.err);
  s.err.error_exit = jpeg_error_to_jump;
  s.err.emit_message = jpeg_ignore_message;
  struct Guard {
    JpegState& s;
    ~Guard() { jpeg_destroy_decompress(&s.cinfo); }
  } guard{s};
  JpegHeader h;
  if (!jpeg_start(&s, &h)) fail(what, ": not a readable JPEG: ", s.message);
  int channels = 0;
  J_COLOR_SPACE out = JCS_UNKNOWN;
  if (h.space == JCS_GRAYSCALE && h.components == 1) channels = 1, out = JCS_GRAYSCALE;
  else if ((h.space == JCS_YCbCr || h.space == JCS_RGB) && h.components == 3) channels = 3, out = JCS_RGB;
  // Pillow opens every 4-component JPEG as CMYK and asks libjpeg for CMYK, which converts YCCK itself.
  else if ((h.space == JCS_CMYK || h.space == JCS_YCCK) && h.components == 4) channels = 4, out = JCS_CMYK;
  else fail(what, ": a JPEG of ", h.components, " components in colour space ", int(h.space), " is not supported");
  const JDIMENSION w = s.cinfo.image_width, hh = s.cinfo.image_height;
  check_size(w, hh, what);
  Image8 img(int64_t(w), int64_t(hh), channels);
  JDIMENSION ow = 0, oh = 0;
  if (!jpeg_decode_rows(&s, out, img.pixels.data(), size_t(w) * size_t(channels), &ow, &oh))
    fail(what, ": a corrupt or truncated JPEG: ", s.message);
  K3_CHECK(ow == w && oh == hh, what, ": the JPEG decoder gave ", ow, " x ", oh, " pixels for ", w, " x ", hh);
  if (out == JCS_CMYK) {  // Pillow reads CMYK as "CMYK;I", Adobe's inverted samples, whatever the markers say
    img.cmyk = true;
    for (uint8_t& v : img.pixels) v = uint8_t(255 - v);
  }
  return img;
}

}  // namespace

Image8 decode_image(const uint8_t* data, size_t size, const std::string& what) {
  switch (sniff_image_format(data, size)) {
    case ImageFormat::Png: return decode_png(data, size, what);
    case ImageFormat::Jpeg: return decode_jpeg(data, size, what);
    default: break;
  }
  fail(what, ": not a PNG or JPEG file (", size, " bytes)");
}

Image8 read_image_file(const std::string& path) {
  const std::string bytes = read_file(path, "image");
  return decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), path);
}

}  // namespace k3
