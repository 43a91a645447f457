// Byte-level BPE as tiktoken does it, with Kimi K3's pre-tokenizer (K3-ARCHITECTURE.md §9).
//
// A rank file (`tiktoken.model`: one `<base64 bytes> <rank>` per line) gives every mergeable byte
// string its rank, which is also its token id. Encoding: split the text with the pre-tokenizer
// regex, then merge each piece's bytes pairwise, always the lowest-ranked adjacent pair first, until
// no adjacent pair is in the table. Special tokens (e.g. `<|open|>`) have ids after the ranks and
// are recognised only when the caller allows them.
// The pre-tokenizer (and its regex translation) lives in pretokenizer.h.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/pretokenizer.h"

namespace k3 {

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
  // Replaces the special tokens (text -> id; ids must lie outside the ranks).
  void set_specials(const std::unordered_map<std::string, int32_t>& specials);

 private:
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  std::unordered_map<std::string, int32_t> ranks_;
  std::vector<std::string> id_to_bytes_;
  std::unordered_map<std::string, int32_t> specials_;
  std::unordered_map<int32_t, std::string> special_text_;
  std::vector<std::vector<std::string>> specials_by_first_byte_;  // [byte] -> texts, longest first
  std::unique_ptr<PreTokenizer> pre_;
};

}  // namespace k3
