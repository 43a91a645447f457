// Byte-level BPE as tiktoken does it, with Kimi K3's pre-tokenizer (K3-ARCHITECTURE.md §9).
//
// A rank file (`tiktoken.model`: one `<base64 bytes> <rank>` per line) gives every mergeable byte
// string its rank, which is also its token id. Encoding: split the text with the pre-tokenizer
// regex, then merge each piece's bytes pairwise, always the lowest-ranked adjacent pair first, until
// no adjacent pair is in the table. Special tokens (e.g. `<|open|>`) have ids after the ranks and
// are recognised only when the caller allows them.
//
// The K3 pattern uses character-class intersection (`[\p{Lu}...&&[^\p{Han}]]`), which PCRE2 lacks;
// translate_class_intersections() rewrites each `[A&&[^B]]` as `(?:(?![B])[A])`, the same set.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace k3 {

// Kimi K3's pre-tokenizer, verbatim (with `&&` intersections).
extern const char* const kK3Pattern;

// `[A&&[^B]]` -> `(?:(?![B])[A])` for every intersection in a pattern; other text is unchanged.
std::string translate_class_intersections(const std::string& pattern);

class Regex;  // PCRE2, compiled once, JIT when available

class BpeTokenizer {
 public:
  // ranks_path: tiktoken.model. pattern: tiktoken-style pattern (kK3Pattern by default).
  // specials: special token text -> id (ids must not collide with ranks).
  static BpeTokenizer load(const std::string& ranks_path, const std::unordered_map<std::string, int32_t>& specials = {},
                           const std::string& pattern = kK3Pattern);
  BpeTokenizer();
  ~BpeTokenizer();
  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;

  // Ordinary text: special-token text is encoded as plain bytes.
  std::vector<int32_t> encode_ordinary(std::string_view text) const;
  // Special tokens in the text become their ids; everything between them is ordinary text.
  std::vector<int32_t> encode_with_specials(std::string_view text) const;
  // Bytes of the ids concatenated (may be invalid UTF-8 when a multi-byte character is split).
  std::string decode(const std::vector<int32_t>& ids) const;

  int64_t num_ranks() const { return int64_t(id_to_bytes_.size()); }
  int64_t vocab_size() const;  // ranks + specials (max id + 1)
  const std::unordered_map<std::string, int32_t>& specials() const { return specials_; }

 private:
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  std::unordered_map<std::string, int32_t> ranks_;
  std::vector<std::string> id_to_bytes_;
  std::unordered_map<std::string, int32_t> specials_;
  std::unordered_map<int32_t, std::string> special_text_;
  std::unique_ptr<Regex> re_;
};

}  // namespace k3
