// The K3 tokenizer: BPE over a tiktoken.model plus the 256 special ids after its ranks, with the
// input splitting of Kimi's tokenization_kimi.py (K3-ARCHITECTURE.md §9).
//
// Kimi's wrapper does not hand a long text to tiktoken in one piece: it cuts it into chunks of
// 400,000 characters, then cuts each chunk wherever a run of consecutive whitespace (or
// non-whitespace) characters would exceed 25,000, and encodes the parts separately. "Character"
// is a Unicode code point and "whitespace" is Python's str.isspace(). The cuts change ids only for
// such long runs, but they do change them, so we reproduce them exactly.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/bpe.h"
#include "tokenizer/special_tokens.h"

namespace k3 {

constexpr size_t kKimiMaxEncodeChars = 400000;    // TIKTOKEN_MAX_ENCODE_CHARS
constexpr size_t kKimiMaxConsecutiveRun = 25000;  // MAX_NO_WHITESPACES_CHARS

// Python's str.isspace() for one code point.
bool python_isspace(uint32_t code_point);
// Python's str.isspace() for the character at text[i]; `len` receives its length in bytes. An
// invalid UTF-8 byte counts as one non-space character of length 1.
bool python_isspace_at(std::string_view text, size_t i, size_t& len);

// Kimi's cuts: the byte ranges [begin, end) of text that are encoded separately. Invalid UTF-8
// bytes count as one non-space character each.
std::vector<std::pair<size_t, size_t>> kimi_encode_parts(std::string_view text, size_t max_chars = kKimiMaxEncodeChars,
                                                         size_t max_run = kKimiMaxConsecutiveRun);

class Tokenizer {
 public:
  // A model (or tokenizer) directory: DIR/tiktoken.model, and DIR/tokenizer_config.json for the
  // special names when present (the K3 table otherwise).
  static Tokenizer load_dir(const std::string& dir, const std::string& pattern = kK3Pattern);
  // A rank file; specials from tokenizer_config (when not empty) or the K3 table.
  static Tokenizer load(const std::string& ranks_path, const std::string& tokenizer_config = "",
                        const std::string& pattern = kK3Pattern);
  // True when dir holds a tiktoken.model.
  static bool dir_has_tokenizer(const std::string& dir);

  // allow_special: special-token text becomes its id (Kimi's allowed_special="all"); otherwise
  // it is ordinary text (disallowed_special=()).
  std::vector<int32_t> encode(std::string_view text, bool allow_special) const;
  std::string decode(const std::vector<int32_t>& ids) const { return bpe_.decode(ids); }

  // The id of a special token by its text; throws naming the token when it is absent.
  int32_t special_id(const std::string& text) const;
  // The id of a K3 special by role (N + offset).
  int32_t special_id(K3Special s) const { return int32_t(bpe_.num_ranks()) + int32_t(s); }
  bool is_special(int32_t id) const { return id >= bpe_.num_ranks() && id < vocab_size(); }

  int64_t num_ranks() const { return bpe_.num_ranks(); }
  int64_t vocab_size() const { return bpe_.num_ranks() + kNumReservedSpecialTokens; }
  // A k3::Error naming `dir` (where this tokenizer came from) and `model_source` when the tokenizer has more ids
  // than a model's vocabulary of model_vocab_size: its ids would be out of range.
  void check_fits(int64_t model_vocab_size, const std::string& dir, const std::string& model_source) const;
  const BpeTokenizer& bpe() const { return bpe_; }

 private:
  BpeTokenizer bpe_;
};

}  // namespace k3
