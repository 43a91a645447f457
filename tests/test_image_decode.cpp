// Image files (media/image_decode.h) against Pillow 9.4: tests/fixtures/image-decode holds PNGs and JPEGs that
// Pillow saved (or, what it cannot save, 16-bit and 2/4-bit PNGs and YCCK JPEGs, written by the script) and the
// pixels Pillow decodes from them (tests/tools/vision_goldens/make_decode_goldens.py). Every accepted file must give
// Pillow's mode, size and every pixel (and mode I's 16-bit samples); every refused one a k3::Error that names the
// file and says why.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/file.h"
#include "io/safetensors.h"
#include "media/image_decode.h"
#include "util/compare.h"

using namespace k3;
using k3test::fixture;

namespace {

int channels_of(const std::string& mode) {
  if (mode == "L" || mode == "I") return 1;
  if (mode == "LA") return 2;
  if (mode == "RGB") return 3;
  if (mode == "RGBA" || mode == "CMYK") return 4;
  return 0;
}

// A substring of the reason each refusal must give.
std::string reason_text(const std::string& why) {
  if (why == "truncated") return "truncated";
  if (why == "format") return "not a PNG or JPEG";
  if (why == "corrupt") return "corrupt";
  return why;
}

}  // namespace

TEST(ImageDecode, PixelsEqualPillows) {
  const nlohmann::json cases = nlohmann::json::parse(read_file(fixture("image-decode/cases.json"), "cases"));
  const SafeTensors g = SafeTensors::open(fixture("image-decode/golden.safetensors"));
  int accepted = 0;
  for (const nlohmann::json& c : cases["cases"]) {
    if (c.contains("refuse")) continue;
    const std::string name = c["file"];
    SCOPED_TRACE(name);
    const Image8 im = read_image_file(fixture("image-decode/" + name));
    ASSERT_EQ(im.width, c["width"].get<int64_t>());
    ASSERT_EQ(im.height, c["height"].get<int64_t>());
    ASSERT_EQ(im.channels, channels_of(c["mode"]));
    EXPECT_EQ(im.nearest, c.value("nearest", false)) << "Pillow mode " << c.value("pillow_mode", "");
    // Pillow compares a grey key's low byte with the 8-bit pixel, unscaled.
    EXPECT_EQ(im.transparent_key, c.contains("transparency") ? (c["transparency"].get<int>() & 0xFF) : -1);
    EXPECT_EQ(im.cmyk, c["mode"] == "CMYK");
    const TensorView& want = g.get("pixels." + name);
    ASSERT_EQ(want.nbytes, im.pixels.size());
    size_t differ = 0;
    const auto* w = static_cast<const uint8_t*>(want.data);
    for (size_t k = 0; k < im.pixels.size(); ++k) differ += im.pixels[k] != w[k];
    EXPECT_EQ(differ, 0u) << "of " << im.pixels.size() << " values";
    if (c["mode"] == "I") {  // the 16-bit samples, which a resize reads
      const std::vector<int64_t> samples = g.read_i64("samples." + name);
      ASSERT_EQ(samples.size(), im.grey16.size());
      EXPECT_TRUE(std::equal(samples.begin(), samples.end(), im.grey16.begin()));
    } else {
      EXPECT_TRUE(im.grey16.empty());
    }
    ++accepted;
  }
  EXPECT_GE(accepted, 65);
}

TEST(ImageDecode, RefusesWhatItCannotDecodeAsPillowDoes) {
  const nlohmann::json cases = nlohmann::json::parse(read_file(fixture("image-decode/cases.json"), "cases"));
  int refused = 0;
  for (const nlohmann::json& c : cases["cases"]) {
    if (!c.contains("refuse")) continue;
    const std::string name = c["file"], path = fixture("image-decode/" + name);
    SCOPED_TRACE(name);
    try {
      read_image_file(path);
      ADD_FAILURE() << "decoded although it should be refused (" << c["refuse"] << ")";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr(name));
      EXPECT_THAT(e.what(), ::testing::HasSubstr(reason_text(c["refuse"])));
    }
    ++refused;
  }
  EXPECT_GE(refused, 10);
}

TEST(ImageDecode, SniffsTheFormatAndNamesAMissingFile) {
  const uint8_t png[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'}, jpg[3] = {0xFF, 0xD8, 0xFF};
  EXPECT_EQ(sniff_image_format(png, 8), ImageFormat::Png);
  EXPECT_EQ(sniff_image_format(png, 7), ImageFormat::Unknown);
  EXPECT_EQ(sniff_image_format(jpg, 3), ImageFormat::Jpeg);
  EXPECT_EQ(sniff_image_format(jpg, 2), ImageFormat::Unknown);
  EXPECT_THROW(read_image_file("/nonexistent/cat.png"), Error);
  // Every prefix of a valid file is refused cleanly, never decoded as garbage nor crashing.
  for (const char* name : {"jpeg_RGB_17x9.jpg", "png_RGBA_64x48.png", "jpeg_YCCK_151x5.jpg", "png_I16_120x30.png",
                           "png_RGBA16_151x5.png", "png_L2_151x5.png"}) {
    const std::string b = read_file(fixture(std::string("image-decode/") + name), "image");
    for (size_t n = 0; n < b.size(); n += 7)
      EXPECT_THROW(decode_image(reinterpret_cast<const uint8_t*>(b.data()), n, "prefix"), Error) << name << " " << n;
  }
}
