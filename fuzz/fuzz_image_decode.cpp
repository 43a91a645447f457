// libFuzzer target: decode_image (media/image_decode.h) on arbitrary bytes.
//
//   scripts/fuzz.sh [SECONDS]                       (builds build-fuzz with clang, runs every target)
//   build-fuzz/fuzz_image_decode build-fuzz/corpus/fuzz_image_decode -max_total_time=600
//
// Seeded with the fixture's PNGs and JPEGs (tests/fixtures/image-decode: every PNG colour type and depth, YCCK
// too). For each input it aborts when decode_image throws anything but k3::Error, or returns an image whose pixel
// buffer (or 16-bit sample buffer) does not match its size.
// ASan and UBSan (built in by K3_BUILD_FUZZ) catch memory errors and undefined behaviour in the decoders and
// around the longjmp error paths of libpng and libjpeg.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "media/image_decode.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const k3::Image8 im = k3::decode_image(data, size, "fuzz input");
    if (im.width < 1 || im.height < 1 || im.channels < 1 || im.channels > 4 ||
        im.pixels.size() != size_t(im.width * im.height * im.channels) ||
        (!im.grey16.empty() && (im.channels != 1 || im.grey16.size() != im.pixels.size()))) {
      std::fprintf(stderr, "bad image: %lld x %lld x %d, %zu bytes\n", (long long)im.width, (long long)im.height,
                   im.channels, im.pixels.size());
      std::abort();
    }
  } catch (const k3::Error&) {
  }
  return 0;
}
