// A plain BPE merge loop over a tiktoken rank file: the CPU twin of the optimised encoder in
// src/tokenizer/bpe.cpp, shared by tests/test_tokenizer.cpp and fuzz/fuzz_encode.cpp.
//
// It reads the rank file itself (its own base64) and merges the way tiktoken's byte_pair_merge is
// specified, with std::string parts and a std::unordered_map: a piece that is a token is that token;
// otherwise start from single bytes and join the adjacent pair whose bytes have the lowest rank (the
// leftmost of equal ranks) until no adjacent pair is a token. O(n^2) lookups per piece, on purpose.
#pragma once
#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/pretokenizer.h"

namespace k3test {

class PlainBpe {
 public:
  explicit PlainBpe(const std::string& rank_file) {
    const std::string alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::ifstream in(rank_file);
    std::string b64;
    int32_t rank = 0;
    while (in >> b64 >> rank) {
      std::string bytes;
      uint32_t acc = 0;
      int bits = 0;
      for (char c : b64) {
        if (c == '=') break;
        acc = (acc << 6) | uint32_t(alphabet.find(c));
        bits += 6;
        if (bits >= 8) {
          bits -= 8;
          bytes.push_back(char((acc >> bits) & 0xff));
        }
      }
      ranks_.emplace(bytes, rank);
    }
  }

  size_t size() const { return ranks_.size(); }

  void encode_piece(const std::string& piece, std::vector<int32_t>& out) const {
    if (auto it = ranks_.find(piece); it != ranks_.end()) {
      out.push_back(it->second);
      return;
    }
    std::vector<std::string> parts;
    for (char c : piece) parts.emplace_back(1, c);
    for (;;) {
      size_t at = SIZE_MAX;
      int32_t best = INT32_MAX;
      for (size_t i = 0; i + 1 < parts.size(); ++i)
        if (auto it = ranks_.find(parts[i] + parts[i + 1]); it != ranks_.end() && it->second < best) {
          best = it->second;
          at = i;
        }
      if (at == SIZE_MAX) break;
      parts[at] += parts[at + 1];
      parts.erase(parts.begin() + int64_t(at) + 1);
    }
    for (const std::string& p : parts) out.push_back(ranks_.at(p));
  }

  // Pieces from the shared pre-tokenizer (the only code the twin shares with the encoder).
  std::vector<int32_t> encode(std::string_view text) const {
    static const k3::PreTokenizer pre;
    std::vector<int32_t> ids;
    pre.for_each_piece(text, [&](std::string_view piece) { encode_piece(std::string(piece), ids); });
    return ids;
  }

 private:
  std::unordered_map<std::string, int32_t> ranks_;
};

}  // namespace k3test
