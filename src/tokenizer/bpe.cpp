#include "tokenizer/bpe.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <fstream>
#include <queue>
#include <sstream>

#include "core/base64.h"
#include "core/error.h"
#include "io/file.h"

namespace k3 {

namespace {

constexpr uint32_t kNoRank = UINT32_MAX;  // a pair that is not a token

uint64_t load64(const char* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}

uint32_t load32(const char* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// The first min(n, 8) bytes of p as a little-endian word, zero-padded. Short strings are read
// without a byte loop: two overlapping 4-byte words, or the first, middle and last byte.
uint64_t head_bytes(const char* p, size_t n) {
  if (n >= 8) return load64(p);
  if (n >= 4) return uint64_t(load32(p)) | (uint64_t(load32(p + n - 4)) << (8 * (n - 4)));
  if (n == 0) return 0;
  return uint64_t(uint8_t(p[0])) | (uint64_t(uint8_t(p[n / 2])) << (8 * (n / 2))) |
         (uint64_t(uint8_t(p[n - 1])) << (8 * (n - 1)));
}

uint64_t fmix64(uint64_t h) {  // murmur3's finaliser
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  return h ^ (h >> 33);
}

// Hash of a byte string given its head word: bytes past the first 8 are mixed in as whole words
// (the last one overlapping). Equal hashes are resolved by comparing bytes, so only the spread matters.
uint64_t hash_bytes(uint64_t head, const char* p, size_t n) {
  uint64_t h = head ^ (uint64_t(n) * 0x9e3779b97f4a7c15ull);
  if (n > 8) {
    for (size_t i = 8; i + 8 < n; i += 8) h = (h ^ load64(p + i)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ load64(p + n - 8)) * 0xbf58476d1ce4e5b9ull;
  }
  return fmix64(h);
}

// The token filter: 2^21 bits (256 KiB), about 10% set for o200k's 200k tokens. Its bit is taken
// from hash bits 32..52, which the slot index (the low bits) does not use for tables below 2^32 slots.
constexpr size_t kFilterWords = size_t(1) << 15;
size_t filter_word(uint64_t h) { return size_t(h >> 32) & (kFilterWords - 1); }
uint64_t filter_bit(uint64_t h) { return uint64_t(1) << ((h >> 47) & 63); }

}  // namespace

BpeTokenizer::BpeTokenizer() = default;
BpeTokenizer::~BpeTokenizer() = default;
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;

BpeTokenizer BpeTokenizer::load(const std::string& path, const std::unordered_map<std::string, int32_t>& specials,
                                const std::string& pattern) {
  const std::string text = read_file(path, "rank file");
  // Ranks are 0..N-1 for a file of N entries: counting the lines first bounds every allocation by the
  // file's own size, so one line claiming rank 300000000 is an error, not 10 GB of empty slots.
  int64_t entries = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    if (nl > pos) ++entries;
    pos = nl + 1;
  }
  BpeTokenizer t;
  t.id_to_bytes_.resize(size_t(entries));
  std::vector<char> seen(size_t(entries), 0);  // [rank] -> given by a line
  std::istringstream in(text);
  std::string line, tok, bytes;
  int64_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty()) continue;
    std::istringstream ls(line);
    long long rank = -1;
    if (!(ls >> tok >> rank) || rank < 0 || rank > INT32_MAX || !base64_decode(tok, bytes) || bytes.empty())
      fail(path, ":", lineno, ": expected '<base64 token> <rank>', got '", line.substr(0, 80), "'");
    if (rank >= entries)
      fail(path, ":", lineno, ": rank ", rank, " is out of range: a file of ", entries, " ranks holds ranks 0..",
           entries - 1);
    if (seen[size_t(rank)]) fail(path, ":", lineno, ": rank ", rank, " given twice");
    seen[size_t(rank)] = 1;
    t.id_to_bytes_[size_t(rank)] = bytes;
  }
  if (t.id_to_bytes_.empty()) fail(path, ": no ranks");
  if (std::find(seen.begin(), seen.end(), 0) != seen.end()) fail(path, ": ranks are not contiguous from 0");
  t.build_rank_index(path);
  for (int b = 0; b < 256; ++b)
    if (t.byte_rank_[size_t(b)] < 0)
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

void BpeTokenizer::build_rank_index(const std::string& path) {
  const size_t n = id_to_bytes_.size();
  blob_.clear();
  blob_offset_.assign(1, 0);
  max_token_bytes_ = 0;
  for (const std::string& b : id_to_bytes_) {
    blob_ += b;
    if (blob_.size() > UINT32_MAX) fail(path, ": token bytes exceed 4 GiB in all");
    blob_offset_.push_back(uint32_t(blob_.size()));
    max_token_bytes_ = std::max(max_token_bytes_, b.size());
  }
  size_t cap = 16;
  while (cap < 2 * n) cap *= 2;
  slots_.assign(cap, RankSlot{});
  slot_mask_ = cap - 1;
  filter_.assign(kFilterWords, ~uint64_t(0));  // all set while the table fills (rank_of checks repeats)
  std::vector<uint64_t> filter(kFilterWords, 0);
  for (size_t r = 0; r < n; ++r) {
    const std::string& b = id_to_bytes_[r];
    if (const int32_t other = rank_of(b); other >= 0)
      fail(path, ": token bytes repeated (ranks ", other, " and ", r, ")");
    const uint64_t head = head_bytes(b.data(), b.size());
    const uint64_t h = hash_bytes(head, b.data(), b.size());
    filter[filter_word(h)] |= filter_bit(h);
    uint64_t i = h & slot_mask_;
    while (slots_[i].len != 0) i = (i + 1) & slot_mask_;
    slots_[i] = RankSlot{head, uint32_t(b.size()), uint32_t(r)};
  }
  filter_ = std::move(filter);
  byte_rank_.assign(256, -1);
  pair_rank_.assign(65536, -1);
  for (size_t r = 0; r < n; ++r) {
    const std::string& b = id_to_bytes_[r];
    if (b.size() == 1) byte_rank_[uint8_t(b[0])] = int32_t(r);
    if (b.size() == 2) pair_rank_[size_t(uint8_t(b[0])) << 8 | uint8_t(b[1])] = int32_t(r);
  }
}

int32_t BpeTokenizer::rank_of(std::string_view s) const {
  const size_t n = s.size();
  if (n == 0 || n > max_token_bytes_) return -1;
  const uint64_t head = head_bytes(s.data(), n);
  const uint64_t h = hash_bytes(head, s.data(), n);
  if (!(filter_[filter_word(h)] & filter_bit(h))) return -1;
  for (uint64_t i = h & slot_mask_;; i = (i + 1) & slot_mask_) {
    const RankSlot& e = slots_[i];
    if (e.len == 0) return -1;
    if (e.len == n && e.head == head &&
        (n <= 8 || std::memcmp(blob_.data() + blob_offset_[e.rank] + 8, s.data() + 8, n - 8) == 0))
      return int32_t(e.rank);
  }
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() == 1) {
    out.push_back(byte_rank_[uint8_t(piece[0])]);
    return;
  }
  if (const int32_t r = rank_of(piece); r >= 0) {  // most pieces of ordinary text are one token
    out.push_back(r);
    return;
  }
  if (piece.size() <= kSmallPiece) merge_small(piece, out);
  else merge_large(piece, out);
}

// tiktoken's byte_pair_merge. Parts 0..m-1 are the current tokens: part i is
// piece[start[i], start[i + 1]) with id[i]; pair[i] is the rank of part i joined with part i + 1
// (kNoRank when that is no token, or for the last part). Each round merges the lowest-ranked pair,
// leftmost on ties, until no pair is a token; each part is always a token.
void BpeTokenizer::merge_small(std::string_view piece, std::vector<int32_t>& out) const {
  const size_t n = piece.size();  // 2 <= n <= kSmallPiece
  const char* p = piece.data();
  uint32_t start[kSmallPiece + 1], pair[kSmallPiece];
  int32_t id[kSmallPiece];
  for (size_t i = 0; i < n; ++i) {
    start[i] = uint32_t(i);
    id[i] = byte_rank_[uint8_t(p[i])];
    // pair_rank_'s -1 (no token) becomes kNoRank.
    pair[i] = i + 1 < n ? uint32_t(pair_rank_[size_t(uint8_t(p[i])) << 8 | uint8_t(p[i + 1])]) : kNoRank;
  }
  start[n] = uint32_t(n);
  const auto rank_span = [&](size_t a, size_t b) {  // rank of parts a..b-1 joined
    const int32_t r = rank_of(std::string_view(p + start[a], start[b] - start[a]));
    return r < 0 ? kNoRank : uint32_t(r);
  };
  size_t m = n;
  while (m > 1) {
    uint32_t best = kNoRank;
    size_t at = 0;
    for (size_t i = 0; i + 1 < m; ++i)
      if (pair[i] < best) {
        best = pair[i];
        at = i;
      }
    if (best == kNoRank) break;
    // Part at absorbs part at + 1.
    id[at] = int32_t(best);
    for (size_t i = at + 1; i + 1 < m; ++i) {
      start[i] = start[i + 1];
      id[i] = id[i + 1];
      pair[i] = pair[i + 1];
    }
    start[m - 1] = start[m];
    --m;
    pair[at] = at + 1 < m ? rank_span(at, at + 2) : kNoRank;
    if (at > 0) pair[at - 1] = rank_span(at - 1, at + 1);
  }
  out.insert(out.end(), id, id + m);
}

// The same merge order as merge_small with a min-heap of (pair rank, part start). A part is named
// by its first byte (which never changes); next/prev link the live parts. A heap entry is stale when
// pair[start] no longer equals its rank: a pair's bytes only grow, so its rank never comes back.
void BpeTokenizer::merge_large(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() >= UINT32_MAX)
    fail("encode: a pre-tokenizer piece of ", piece.size(), " bytes (the limit is 4 GiB)");
  const uint32_t n = uint32_t(piece.size());
  const char* p = piece.data();
  std::vector<uint32_t> next(n), prev(n), pair(n);
  std::vector<int32_t> id(n);
  std::vector<uint64_t> heap_items;
  heap_items.reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    next[i] = i + 1;
    prev[i] = i - 1;  // unused for part 0
    id[i] = byte_rank_[uint8_t(p[i])];
    pair[i] = i + 1 < n ? uint32_t(pair_rank_[size_t(uint8_t(p[i])) << 8 | uint8_t(p[i + 1])]) : kNoRank;
    if (pair[i] != kNoRank) heap_items.push_back(uint64_t(pair[i]) << 32 | i);
  }
  std::priority_queue<uint64_t, std::vector<uint64_t>, std::greater<>> heap(std::greater<>(), std::move(heap_items));
  const auto rank_span = [&](uint32_t a, uint32_t b) {  // rank of piece[a, b)
    const int32_t r = rank_of(std::string_view(p + a, b - a));
    return r < 0 ? kNoRank : uint32_t(r);
  };
  while (!heap.empty()) {
    const uint64_t top = heap.top();
    heap.pop();
    const uint32_t rank = uint32_t(top >> 32), a = uint32_t(top);
    if (pair[a] != rank) continue;  // stale
    const uint32_t b = next[a];     // part a absorbs part b
    id[a] = int32_t(rank);
    next[a] = next[b];
    if (next[b] < n) prev[next[b]] = a;
    pair[b] = kNoRank;
    pair[a] = next[a] < n ? rank_span(a, next[next[a]]) : kNoRank;
    if (pair[a] != kNoRank) heap.push(uint64_t(pair[a]) << 32 | a);
    if (a > 0) {
      const uint32_t z = prev[a];
      pair[z] = rank_span(z, next[a]);
      if (pair[z] != kNoRank) heap.push(uint64_t(pair[z]) << 32 | z);
    }
  }
  for (uint32_t i = 0; i < n; i = next[i]) out.push_back(id[i]);
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
      fail("decode: token id ", id, " is not in the vocabulary (", num_ranks(), " ranks + ", specials_.size(),
           " specials)");
    }
  }
  return out;
}

}  // namespace k3
