// The pre-tokenizer: splits text into the pieces BPE merges within (K3-ARCHITECTURE.md §9).
//
// Kimi K3's pattern uses character-class intersection (`[\p{Lu}...&&[^\p{Han}]]`), which PCRE2
// lacks; translate_class_intersections() rewrites each `[A&&[^B]]` as `(?:(?![B])[A])`, the same
// set. PCRE2 runs with UTF + UCP (Unicode properties for \s, \p{..}) and JIT.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace k3 {

// Kimi K3's pre-tokenizer, verbatim (with `&&` intersections).
extern const char* const kK3Pattern;

// `[A&&[^B]]` -> `(?:(?![B])[A])` for every intersection in a pattern; other text is unchanged.
std::string translate_class_intersections(const std::string& pattern);

// Pattern by CLI name ("k3"); throws k3::Error naming the known ones otherwise.
std::string pattern_by_name(const std::string& name);

class PreTokenizer {
 public:
  explicit PreTokenizer(const std::string& pattern = kK3Pattern);  // tiktoken-style pattern
  ~PreTokenizer();
  PreTokenizer(PreTokenizer&&) noexcept;
  PreTokenizer& operator=(PreTokenizer&&) noexcept;

  // Calls fn(piece) for each piece of text, in order; the pieces concatenate to text. Valid UTF-8
  // runs go through the regex; each byte of an invalid sequence is a piece of its own (tiktoken's
  // entry points only ever see valid strings, so this split is ours to choose, and byte pieces keep
  // decode(encode(x)) == x). Thread-safe: each call uses its own match data.
  void for_each_piece(std::string_view text, const std::function<void(std::string_view)>& fn) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Length of the valid UTF-8 sequence starting at t[i], or 0 when it is invalid (overlong forms,
// surrogates and code points above U+10FFFF are invalid, as PCRE2 requires).
size_t utf8_sequence_length(std::string_view t, size_t i);

// text with each maximal invalid UTF-8 subpart replaced by U+FFFD, as Python's
// bytes.decode("utf-8", "replace") does (generated token ids may cut a character in two).
std::string to_valid_utf8(std::string_view text);

}  // namespace k3
