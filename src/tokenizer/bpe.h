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
  // Merging (bpe.cpp): pieces of at most kSmallPiece bytes use tiktoken's loop over a stack array;
  // longer ones a heap (same merge order, O(n log n) instead of O(n^2)).
  static constexpr size_t kSmallPiece = 128;
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void merge_small(std::string_view piece, std::vector<int32_t>& out) const;
  void merge_large(std::string_view piece, std::vector<int32_t>& out) const;
  // The rank of a byte string, or -1 when it has none.
  int32_t rank_of(std::string_view bytes) const;
  // The lookup structures below, from id_to_bytes_; throws when two ranks have the same bytes.
  void build_rank_index(const std::string& path);

  std::vector<std::string> id_to_bytes_;
  // Rank lookup: an open-addressing table (linear probing, load <= 1/2). A slot holds a token's
  // first 8 bytes (zero-padded), its length (0: empty slot) and its rank; bytes past the first 8 are
  // compared in blob_ (all tokens' bytes in rank order, token r from blob_offset_[r]).
  struct RankSlot {
    uint64_t head = 0;
    uint32_t len = 0;
    uint32_t rank = 0;
  };
  std::vector<RankSlot> slots_;
  uint64_t slot_mask_ = 0;
  // One bit per hash bucket (other hash bits than the slot index), set for every token: most byte
  // strings that are no token are rejected here, in 256 KiB that stay in cache, before the slot
  // table (8 MiB for o200k) is read.
  std::vector<uint64_t> filter_;
  std::string blob_;
  std::vector<uint32_t> blob_offset_;
  size_t max_token_bytes_ = 0;
  std::vector<int32_t> byte_rank_;  // [byte] -> rank of that single byte
  std::vector<int32_t> pair_rank_;  // [b0 << 8 | b1] -> rank of the 2-byte string, or -1
  std::unordered_map<std::string, int32_t> specials_;
  std::unordered_map<int32_t, std::string> special_text_;
  std::vector<std::vector<std::string>> specials_by_first_byte_;  // [byte] -> texts, longest first
  std::unique_ptr<PreTokenizer> pre_;
};

}  // namespace k3
