#include "tokenizer/bpe.h"

#include <algorithm>
#include <climits>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace k3 {

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
  t.set_specials(specials);
  t.pre_ = std::make_unique<PreTokenizer>(pattern);
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
  out.reserve(text.size() / 3);
  pre_->for_each_piece(text, [&](std::string_view piece) { encode_piece(piece, out); });
  return out;
}

void BpeTokenizer::set_specials(const std::unordered_map<std::string, int32_t>& specials) {
  specials_.clear();
  special_text_.clear();
  specials_by_first_byte_.assign(256, {});
  for (const auto& [text, id] : specials) {
    if (text.empty()) fail("special token with id ", id, " has empty text");
    if (id >= 0 && id < num_ranks()) fail("special token ", text, " has id ", id, ", inside the BPE ranks");
    if (id < 0) fail("special token ", text, " has negative id ", id);
    if (!special_text_.emplace(id, text).second) fail("special id ", id, " is given to two tokens");
    specials_[text] = id;
    specials_by_first_byte_[uint8_t(text[0])].push_back(text);
  }
  for (auto& v : specials_by_first_byte_)
    std::sort(v.begin(), v.end(), [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
}

std::vector<int32_t> BpeTokenizer::encode_with_specials(std::string_view text) const {
  // Leftmost special occurrence first (longest on ties), as tiktoken's special-token regex finds them;
  // the text between specials is ordinary.
  std::vector<int32_t> out;
  size_t start = 0;
  for (size_t p = 0; p < text.size(); ++p) {
    if (specials_by_first_byte_.empty()) break;
    for (const std::string& s : specials_by_first_byte_[uint8_t(text[p])]) {
      if (text.compare(p, s.size(), s) != 0) continue;
      const std::vector<int32_t> part = encode_ordinary(text.substr(start, p - start));
      out.insert(out.end(), part.begin(), part.end());
      out.push_back(specials_.at(s));
      start = p + s.size();
      p = start - 1;
      break;
    }
  }
  const std::vector<int32_t> rest = encode_ordinary(text.substr(start));
  out.insert(out.end(), rest.begin(), rest.end());
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
