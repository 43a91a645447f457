#include "tokenizer/bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <climits>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace k3 {

const char* const kK3Pattern =
    "[\\p{Han}]+"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|\\p{N}{1,3}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+"
    "|\\s+(?!\\S)"
    "|\\s+";

std::string translate_class_intersections(const std::string& p) {
  std::string out;
  size_t i = 0;
  while (i < p.size()) {
    if (p[i] == '\\' && i + 1 < p.size()) {  // escaped character: copy both
      out += p.substr(i, 2);
      i += 2;
      continue;
    }
    if (p[i] != '[') {
      out += p[i++];
      continue;
    }
    // A class: find its end (escapes skipped; nested classes only appear after "&&").
    size_t j = i + 1, amp = std::string::npos;
    if (j < p.size() && p[j] == '^') ++j;
    if (j < p.size() && p[j] == ']') ++j;  // a leading ']' is literal
    while (j < p.size() && p[j] != ']') {
      if (p[j] == '\\') ++j;
      else if (p[j] == '&' && j + 1 < p.size() && p[j + 1] == '&') {
        amp = j;
        break;
      }
      ++j;
    }
    if (amp == std::string::npos) {  // plain class
      out += p.substr(i, j + 1 - i);
      i = j + 1;
      continue;
    }
    // [A&&[^B]] : A = p[i+1 .. amp), nested negated class from amp+2 to its ']', then the outer ']'.
    if (amp + 3 >= p.size() || p[amp + 2] != '[' || p[amp + 3] != '^')
      fail("pre-tokenizer pattern: only intersections of the form [A&&[^B]] are supported (at offset ", i, ")");
    size_t k = amp + 4;
    while (k < p.size() && p[k] != ']') k += p[k] == '\\' ? 2 : 1;
    if (k + 1 >= p.size() || p[k + 1] != ']') fail("pre-tokenizer pattern: unterminated class intersection at offset ", i);
    const std::string a = p.substr(i + 1, amp - i - 1), b = p.substr(amp + 4, k - amp - 4);
    out += "(?:(?![" + b + "])[" + a + "])";
    i = k + 2;
  }
  return out;
}

class Regex {
 public:
  explicit Regex(const std::string& pattern) {
    int err = 0;
    PCRE2_SIZE off = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &err, &off,
                          nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      fail("pre-tokenizer pattern does not compile at offset ", off, ": ", reinterpret_cast<char*>(msg));
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  ~Regex() { pcre2_code_free(code_); }
  // Calls fn(begin, end) for each successive match in text; text must be valid UTF-8 unless
  // `valid` is false, in which case invalid sequences are matched byte by byte as fallbacks.
  template <class Fn>
  void for_each_match(std::string_view text, Fn&& fn) const {
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    size_t pos = 0;
    const auto* s = reinterpret_cast<PCRE2_SPTR>(text.data());
    while (pos < text.size()) {
      const int rc = jit_ ? pcre2_jit_match(code_, s, text.size(), pos, 0, md, nullptr)
                          : pcre2_match(code_, s, text.size(), pos, 0, md, nullptr);
      if (rc < 0) break;
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      if (ov[1] == ov[0]) {  // empty match: step over one character
        ++pos;
        continue;
      }
      fn(size_t(ov[0]), size_t(ov[1]));
      pos = size_t(ov[1]);
    }
    pcre2_match_data_free(md);
  }

 private:
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

namespace {

int b64val(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+' || c == '-') return 62;
  if (c == '/' || c == '_') return 63;
  return -1;
}

bool b64decode(const std::string& in, std::string& out) {
  out.clear();
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    const int v = b64val(c);
    if (v < 0) return false;
    acc = (acc << 6) | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(char((acc >> bits) & 0xff));
    }
  }
  return true;
}

// Is text[i..] a valid UTF-8 sequence start? Returns its length, or 0 when invalid.
size_t utf8_len(std::string_view t, size_t i) {
  const auto c = static_cast<unsigned char>(t[i]);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (n == 0 || i + n > t.size()) return 0;
  for (size_t k = 1; k < n; ++k)
    if ((static_cast<unsigned char>(t[i + k]) & 0xc0) != 0x80) return 0;
  return n;
}

}  // namespace

BpeTokenizer::BpeTokenizer() = default;
BpeTokenizer::~BpeTokenizer() = default;
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;

BpeTokenizer BpeTokenizer::load(const std::string& path, const std::unordered_map<std::string, int32_t>& specials,
                                const std::string& pattern) {
  std::ifstream in(path);
  if (!in) fail(path, ": cannot open rank file");
  BpeTokenizer t;
  std::string line, tok, bytes;
  int64_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty()) continue;
    std::istringstream ls(line);
    long long rank = -1;
    if (!(ls >> tok >> rank) || rank < 0 || rank > INT32_MAX || !b64decode(tok, bytes) || bytes.empty())
      fail(path, ":", lineno, ": expected '<base64 token> <rank>', got '", line.substr(0, 80), "'");
    if (size_t(rank) >= t.id_to_bytes_.size()) t.id_to_bytes_.resize(size_t(rank) + 1);
    if (!t.ranks_.emplace(bytes, int32_t(rank)).second) fail(path, ":", lineno, ": token bytes repeated (rank ", rank, ")");
    t.id_to_bytes_[size_t(rank)] = bytes;
  }
  if (t.ranks_.empty()) fail(path, ": no ranks");
  if (t.ranks_.size() != t.id_to_bytes_.size()) fail(path, ": ranks are not contiguous from 0");
  for (int b = 0; b < 256; ++b)
    if (!t.ranks_.count(std::string(1, char(b))))
      fail(path, ": byte 0x", std::hex, b, " has no rank (a byte-level BPE needs all 256 single bytes)");
  for (const auto& [text, id] : specials) {
    if (id < int32_t(t.id_to_bytes_.size())) fail("special token ", text, " has id ", id, ", inside the BPE ranks");
    t.specials_[text] = id;
    t.special_text_[id] = text;
  }
  t.re_ = std::make_unique<Regex>(translate_class_intersections(pattern));
  return t;
}

int64_t BpeTokenizer::vocab_size() const {
  int64_t v = num_ranks();
  for (const auto& [text, id] : specials_) v = std::max<int64_t>(v, int64_t(id) + 1);
  return v;
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (auto it = ranks_.find(std::string(piece)); it != ranks_.end()) {
    out.push_back(it->second);
    return;
  }
  // parts: boundaries of the current tokens; merge the adjacent pair whose bytes rank lowest
  // (leftmost on ties), as tiktoken's byte_pair_merge does.
  std::vector<size_t> parts(piece.size() + 1);
  for (size_t i = 0; i <= piece.size(); ++i) parts[i] = i;
  std::string key;
  while (parts.size() > 2) {
    int32_t best = INT32_MAX;
    size_t at = 0;
    for (size_t i = 0; i + 2 < parts.size(); ++i) {
      key.assign(piece.substr(parts[i], parts[i + 2] - parts[i]));
      auto it = ranks_.find(key);
      if (it != ranks_.end() && it->second < best) {
        best = it->second;
        at = i;
      }
    }
    if (best == INT32_MAX) break;
    parts.erase(parts.begin() + int64_t(at) + 1);
  }
  for (size_t i = 0; i + 1 < parts.size(); ++i) out.push_back(ranks_.at(std::string(piece.substr(parts[i], parts[i + 1] - parts[i]))));
}

std::vector<int32_t> BpeTokenizer::encode_ordinary(std::string_view text) const {
  std::vector<int32_t> out;
  // PCRE2 in UTF mode needs valid UTF-8: valid runs go through the regex; an invalid byte is a
  // piece of its own (tiktoken's Python/JS entry points only see valid strings, so any split of
  // invalid bytes is ours to choose; byte pieces keep decode(encode(x)) == x).
  size_t i = 0;
  while (i < text.size()) {
    size_t j = i;
    while (j < text.size()) {
      const size_t n = utf8_len(text, j);
      if (n == 0) break;
      j += n;
    }
    if (j > i) {
      const std::string_view run = text.substr(i, j - i);
      re_->for_each_match(run, [&](size_t b, size_t e) { encode_piece(run.substr(b, e - b), out); });
      i = j;
    } else {
      encode_piece(text.substr(i, 1), out);
      ++i;
    }
  }
  return out;
}

std::vector<int32_t> BpeTokenizer::encode_with_specials(std::string_view text) const {
  std::vector<int32_t> out;
  size_t start = 0;
  while (start < text.size()) {
    // Earliest special occurrence (longest on ties).
    size_t best = std::string_view::npos, blen = 0;
    int32_t bid = -1;
    for (const auto& [s, id] : specials_) {
      const size_t p = text.find(s, start);
      if (p != std::string_view::npos && (p < best || (p == best && s.size() > blen))) {
        best = p;
        blen = s.size();
        bid = id;
      }
    }
    const size_t end = best == std::string_view::npos ? text.size() : best;
    const std::vector<int32_t> part = encode_ordinary(text.substr(start, end - start));
    out.insert(out.end(), part.begin(), part.end());
    if (best == std::string_view::npos) break;
    out.push_back(bid);
    start = best + blen;
  }
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id >= 0 && size_t(id) < id_to_bytes_.size()) {
      out += id_to_bytes_[size_t(id)];
    } else if (auto it = special_text_.find(id); it != special_text_.end()) {
      out += it->second;
    } else {
      fail("decode: token id ", id, " is not in the vocabulary (", num_ranks(), " ranks + ", specials_.size(), " specials)");
    }
  }
  return out;
}

}  // namespace k3
