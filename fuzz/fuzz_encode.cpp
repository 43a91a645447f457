// libFuzzer target: BpeTokenizer encode on arbitrary bytes (any UTF-8, invalid or not).
//
//   scripts/fuzz.sh [SECONDS]                       (builds build-fuzz with clang, runs every target)
//   build-fuzz/fuzz_encode build-fuzz/corpus/fuzz_encode -dict=fuzz/fuzz_encode.dict -max_total_time=600
//
// Loads the o200k fixture ranks once, with K3's pattern and a few specials (two of them prefixes of
// others, so the longest-match rule is exercised). For each input it aborts when:
//   - encode_ordinary or encode_with_specials throws, or returns an id outside the vocabulary;
//   - decode(encode_ordinary(x)) != x or decode(encode_with_specials(x)) != x (lossless for any bytes);
//   - encode_ordinary returns a special id (typed special text must stay text);
//   - for inputs of at most kTwinMaxBytes, encode_ordinary differs from a plain merge loop (tiktoken's
//     byte_pair_merge written simply, over a hash map of its own), the optimised merge's CPU twin.
// ASan and UBSan (built in by K3_BUILD_FUZZ) catch memory errors and undefined behaviour on the way.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "../tests/util/plain_bpe.h"  // k3test::PlainBpe, the twin
#include "tokenizer/bpe.h"            // BpeTokenizer

namespace {

constexpr size_t kTwinMaxBytes = 300;  // the twin costs O(n^2) hashed lookups per piece; > 128 reaches the heap path

const std::string kRanks = std::string(K3_SOURCE_DIR) + "/tests/fixtures/tokenizer/o200k.tiktoken";

const k3::BpeTokenizer& tokenizer() {
  static const k3::BpeTokenizer t = k3::BpeTokenizer::load(
      kRanks,
      {{"<|open|>", 200100}, {"<|sep|>", 200101}, {"<|close|>", 200102}, {"<|op", 200103}, {"<|open|><|", 200104}});
  return t;
}

const k3test::PlainBpe& twin() {
  static const k3test::PlainBpe t(kRanks);
  return t;
}

[[noreturn]] void die(const char* what, std::string_view text, const std::vector<int32_t>& ids) {
  std::fprintf(stderr, "fuzz_encode: %s (input %zu bytes, %zu ids)\n", what, text.size(), ids.size());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const k3::BpeTokenizer& t = tokenizer();
  std::vector<int32_t> ids, sids;
  try {
    ids = t.encode_ordinary(text);
    sids = t.encode_with_specials(text);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_encode: encode threw: %s\n", e.what());
    std::abort();
  }
  for (int32_t id : ids)
    if (id < 0 || id >= t.num_ranks()) die("encode_ordinary returned an id outside the ranks", text, ids);
  for (int32_t id : sids)
    if (id < 0 || id >= t.vocab_size()) die("encode_with_specials returned an id outside the vocabulary", text, sids);
  if (t.decode(ids) != text) die("decode(encode_ordinary(x)) != x", text, ids);
  if (t.decode(sids) != text) die("decode(encode_with_specials(x)) != x", text, sids);
  if (size <= kTwinMaxBytes) {
    if (ids != twin().encode(text)) die("encode_ordinary differs from the plain merge loop", text, ids);
  }
  return 0;
}
