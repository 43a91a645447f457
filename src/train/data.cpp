#include "train/data.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "io/file.h"
#include "io/mapped_file.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "tokenizer/tokenizer.h"

namespace k3::train {

namespace {
constexpr char kMagic[8] = {'K', '3', 'T', 'O', 'K', 'S', '0', '1'};
constexpr size_t kHeader = 24;
}  // namespace

void write_token_shard(const std::string& path, const std::vector<uint32_t>& tokens, uint32_t eod_id) {
  std::string bytes(kHeader + tokens.size() * 4, '\0');
  std::memcpy(bytes.data(), kMagic, 8);
  const uint64_t n = tokens.size();
  std::memcpy(bytes.data() + 8, &n, 8);  // little-endian hosts only (x86-64, aarch64)
  std::memcpy(bytes.data() + 16, &eod_id, 4);
  if (!tokens.empty()) std::memcpy(bytes.data() + kHeader, tokens.data(), tokens.size() * 4);
  write_file_atomic(path, bytes);
}

std::vector<uint32_t> tokenize_documents(const Tokenizer& tok, const std::vector<std::string>& files, uint32_t eod_id) {
  std::vector<uint32_t> out;
  for (const std::string& f : files) {
    const std::vector<int32_t> ids = tok.encode(read_file(f, "text file"), /*allow_special=*/false);
    out.insert(out.end(), ids.begin(), ids.end());
    out.push_back(eod_id);
  }
  return out;
}

TokenShard::TokenShard() = default;
TokenShard::~TokenShard() = default;
TokenShard::TokenShard(TokenShard&&) noexcept = default;
TokenShard& TokenShard::operator=(TokenShard&&) noexcept = default;

TokenShard TokenShard::open(const std::string& path) {
  TokenShard s;
  s.file_ = std::make_unique<MappedFile>(path, "token shard");
  const MappedFile& f = *s.file_;
  if (f.size() < kHeader || std::memcmp(f.data(), kMagic, 8) != 0)
    fail(path, ": not a k3 token shard (expected the 'K3TOKS01' header; build one with `k3 data`)");
  uint64_t n = 0;
  std::memcpy(&n, f.data() + 8, 8);
  std::memcpy(&s.eod_, f.data() + 16, 4);
  if (n > (f.size() - kHeader) / 4 || f.size() != kHeader + n * 4)
    fail(path, ": header says ", n, " tokens but the file holds ", (f.size() - kHeader) / 4, " (truncated or corrupt)");
  if (n == 0) fail(path, ": the shard holds no tokens");
  s.size_ = int64_t(n);
  s.tokens_ = reinterpret_cast<const uint32_t*>(f.data() + kHeader);  // 24-byte header keeps 4-byte alignment
  return s;
}

uint32_t TokenShard::max_id() const { return *std::max_element(tokens_, tokens_ + size_); }

void check_shard_for_model(const TokenShard& shard, const std::string& path, const K3Config& c) {
  if (int64_t(shard.eod_id()) >= c.vocab_size)
    fail(path, ": the end-of-document id ", shard.eod_id(), " is outside the model's vocabulary [0, ", c.vocab_size,
         ") of ", c.source);
  if (int64_t(shard.max_id()) >= c.vocab_size)
    fail(path, ": token id ", shard.max_id(), " is outside the model's vocabulary [0, ", c.vocab_size, ") of ",
         c.source, ": the shard was made with another tokenizer");
  // A prediction needs a token that is not an end of document followed by any token (windows wrap).
  const uint32_t* t = shard.tokens();
  const int64_t n = shard.size();
  bool any = false;
  for (int64_t i = 0; i < n && !any; ++i) any = t[i] != shard.eod_id();
  if (!any)
    fail(path, ": nothing to predict: the shard holds only end-of-document ids (", n,
         " tokens), so every document is empty (were the text files empty?)");
}

std::vector<std::vector<int32_t>> window_pieces(const TokenShard& shard, int64_t pos, int64_t len) {
  if (len < 2) fail("window_pieces: a window needs at least 2 tokens, got ", len);
  std::vector<std::vector<int32_t>> pieces(1);
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t id = shard.tokens()[(pos + i) % shard.size()];
    pieces.back().push_back(int32_t(id));
    if (id == shard.eod_id() && i + 1 < len) pieces.emplace_back();
  }
  pieces.erase(std::remove_if(pieces.begin(), pieces.end(), [](const auto& p) { return p.size() < 2; }), pieces.end());
  return pieces;
}

double unigram_entropy(const uint32_t* tokens, int64_t n) {
  if (n <= 0) return 0.0;
  uint32_t max_id = 0;
  for (int64_t i = 0; i < n; ++i) max_id = std::max(max_id, tokens[i]);
  std::vector<int64_t> counts(size_t(max_id) + 1, 0);
  for (int64_t i = 0; i < n; ++i) ++counts[tokens[i]];
  double h = 0.0;
  for (int64_t c : counts)
    if (c > 0) h -= double(c) / double(n) * std::log(double(c) / double(n));
  return h;
}

}  // namespace k3::train
