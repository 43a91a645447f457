// Image preprocessing (media/) against Moonshot's image processor: tests/fixtures/vision-preprocess holds synthetic
// L, LA, RGB and RGBA images and the pixel values KimiK3VisionProcessor.preprocess gives for them under the
// release's media_proc_cfg and under a small one that makes it shrink them
// (tests/tools/vision_goldens/make_preprocess_goldens.py, Pillow 9.4). Every value must be equal, bit for bit.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/file.h"
#include "io/safetensors.h"
#include "media/image_decode.h"
#include "media/resample_pillow.h"
#include "media/vision_preprocess.h"
#include "util/compare.h"

using namespace k3;
using k3test::fixture;
using ::testing::HasSubstr;

namespace {

MediaProcConfig config_of(const nlohmann::json& j) {
  MediaProcConfig c;
  c.patch_size = j["patch_size"];
  c.merge_kernel_size = j["merge_kernel_size"];
  c.in_patch_limit = j["in_patch_limit"];
  c.patch_limit_on_one_side = j["patch_limit_on_one_side"];
  for (int i = 0; i < 3; ++i) {
    c.mean[i] = j["image_mean"][i];
    c.std[i] = j["image_std"][i];
  }
  const nlohmann::json& bg = j["transparent_bg_config"];
  c.chessboard_square = bg["chessboard_square_size"];
  c.chessboard_white = uint8_t(bg["chessboard_white_value"].get<int>());
  c.chessboard_gray = uint8_t(bg["chessboard_gray_value"].get<int>());
  c.chessboard_white_top_left = bg["chessboard_square_on_top_left"];
  return c;
}

}  // namespace

TEST(VisionPreprocess, PixelValuesEqualMoonshotsProcessor) {
  const nlohmann::json cases =
      nlohmann::json::parse(read_file(fixture("vision-preprocess/cases.json"), "cases"));
  const SafeTensors g = SafeTensors::open(fixture("vision-preprocess/golden.safetensors"));
  ASSERT_EQ(cases["cases"].size(), 10u);
  for (size_t i = 0; i < cases["cases"].size(); ++i) {
    const nlohmann::json& c = cases["cases"][i];
    const std::string n = std::to_string(i);
    const TensorView& iv = g.get("image." + n);
    Image8 im(c["width"].get<int64_t>(), c["height"].get<int64_t>(), c["channels"].get<int>());
    ASSERT_EQ(iv.nbytes, im.pixels.size()) << n;
    std::memcpy(im.pixels.data(), iv.data, iv.nbytes);
    const MediaProcConfig cfg = config_of(cases["configs"][c["config"].get<std::string>()]);
    const VisionInput v = preprocess_image(im, cfg);
    const std::vector<int64_t> grid = g.read_i64("grid_thws." + n);
    EXPECT_EQ(grid, (std::vector<int64_t>{1, v.grid_h, v.grid_w})) << "case " << n;
    const std::vector<float> want = g.read_f32("pixel_values." + n);
    ASSERT_EQ(v.patches.size(), want.size()) << "case " << n;
    size_t differ = 0;
    for (size_t k = 0; k < want.size(); ++k) differ += v.patches[k] != want[k];
    std::printf("case %zu: %s %lldx%lld (%s) -> %lld x %lld patches, %zu of %zu values differ\n", i,
                c["mode"].get<std::string>().c_str(), (long long)im.width, (long long)im.height,
                c["config"].get<std::string>().c_str(), (long long)v.grid_h, (long long)v.grid_w, differ, want.size());
    EXPECT_EQ(differ, 0u) << "case " << n;
  }
}

// Files in the modes Pillow converts by its own rules (tests/fixtures/vision-preprocess-files,
// make_file_preprocess_goldens.py): palettes of 8 and 4 bits and one with a tRNS alpha table, 1-bit grey (both
// resized by NEAREST), grey with a tRNS key (alpha from it after the bicubic resize), RGB with a key (ignored), a
// CMYK JPEG and an RGBA file for comparison; and 16-bit PNGs (grey as mode I: a 32-bit resize, then clipped; with a
// key; grey + alpha as RGBA; RGB, with a key; RGBA), 2- and 4-bit grey (with keys, unscaled) and YCCK JPEGs.
// Decoded here (media/image_decode.h) and preprocessed: the processor's values, bit for bit, without a resize (the
// release's config; tiny and odd sizes) and with one (the small config).
TEST(VisionPreprocess, FilesInPillowsConvertedModesGiveTheProcessorsValues) {
  const nlohmann::json cases = nlohmann::json::parse(read_file(fixture("vision-preprocess-files/cases.json"), "cases"));
  const SafeTensors g = SafeTensors::open(fixture("vision-preprocess-files/golden.safetensors"));
  ASSERT_EQ(cases["cases"].size(), 39u);
  for (const nlohmann::json& c : cases["cases"]) {
    const std::string name = c["file"], config = c["config"], key = name + "." + config;
    const Image8 im = read_image_file(fixture("image-decode/" + name));
    const VisionInput v = preprocess_image(im, config_of(cases["configs"][config]));
    EXPECT_EQ(g.read_i64("grid_thws." + key), (std::vector<int64_t>{1, v.grid_h, v.grid_w})) << key;
    const std::vector<float> want = g.read_f32("pixel_values." + key);
    ASSERT_EQ(v.patches.size(), want.size()) << key;
    size_t differ = 0;
    for (size_t k = 0; k < want.size(); ++k) differ += v.patches[k] != want[k];
    std::printf("%s (Pillow mode %s, %s): %zu of %zu values differ\n", name.c_str(),
                c["pillow_mode"].get<std::string>().c_str(), config.c_str(), differ, want.size());
    EXPECT_EQ(differ, 0u) << key;
  }
}

// The sizes navit_resize_image gives under the release's limits, where floating point decides (100000 x 20 gives
// 7167 columns, not 7168; 10000 x 10000 gives 3585 a side).
TEST(VisionPreprocess, PlansTheReleasesSizes) {
  const nlohmann::json cases =
      nlohmann::json::parse(read_file(fixture("vision-preprocess/cases.json"), "cases"));
  const MediaProcConfig cfg;
  ASSERT_GE(cases["plans"].size(), 10u);
  for (const nlohmann::json& p : cases["plans"]) {
    const ResizePlan r = plan_resize(p["width"], p["height"], cfg);
    const std::string what = p.dump();
    EXPECT_EQ(r.width, p["new_width"].get<int64_t>()) << what;
    EXPECT_EQ(r.height, p["new_height"].get<int64_t>()) << what;
    EXPECT_EQ(r.pad_width, p["pad_width"].get<int64_t>()) << what;
    EXPECT_EQ(r.pad_height, p["pad_height"].get<int64_t>()) << what;
    EXPECT_EQ(r.tokens, p["num_tokens"].get<int64_t>()) << what;
  }
  EXPECT_THROW(plan_resize(0, 5, cfg), Error);
}

TEST(VisionPreprocess, ResizeRejectsBadImages) {
  Image8 im(4, 4, 3);
  EXPECT_THROW(resize_bicubic_pillow(im, 0, 3), Error);
  im.pixels.pop_back();
  EXPECT_THROW(resize_bicubic_pillow(im, 2, 2), Error);
  Image8 five(2, 2, 5);
  EXPECT_THROW(resize_bicubic_pillow(five, 1, 1), Error);
}
