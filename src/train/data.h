// Training data: token shards and packed windows with document boundaries.
//
// A token shard is a flat file of uint32 token ids, memory-mapped while training: the 24-byte header
// is the magic "K3TOKS01", the token count (u64 LE) and the end-of-document id (u32 LE) + 4 reserved
// bytes; then the ids. Each document's tokens are followed by the end-of-document id, so document
// boundaries survive packing.
//
// Training reads fixed windows of consecutive tokens (packing, no padding) and cuts each window at
// document boundaries: every document piece is run as its own sequence, so the KDA state starts
// from zero and MLA attends only within the document, exactly as if the documents were separate.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace k3 {
class MappedFile;
class Tokenizer;
struct K3Config;
}  // namespace k3

namespace k3::train {

// Writes a shard atomically (temp file + rename).
void write_token_shard(const std::string& path, const std::vector<uint32_t>& tokens, uint32_t eod_id);

// Each text file is one document: its ids (specials in the text are plain text), then eod_id.
std::vector<uint32_t> tokenize_documents(const Tokenizer& tok, const std::vector<std::string>& files, uint32_t eod_id);

// Entropy (nats per token) of the unigram distribution of tokens[0..n): the loss of a model that knows
// only those tokens' own frequencies, the baseline that held-out losses are reported beside (k3 train
// --eval-data, k3 eval). Summed in id order, so the figure is reproducible to the bit. 0 for n <= 0.
double unigram_entropy(const uint32_t* tokens, int64_t n);

class TokenShard {
 public:
  static TokenShard open(const std::string& path);  // validates the header and the size
  TokenShard();
  ~TokenShard();
  TokenShard(TokenShard&&) noexcept;
  TokenShard& operator=(TokenShard&&) noexcept;
  const uint32_t* tokens() const { return tokens_; }
  int64_t size() const { return size_; }
  uint32_t eod_id() const { return eod_; }
  uint32_t max_id() const;  // the largest id in the shard (scans it)

 private:
  std::unique_ptr<MappedFile> file_;
  const uint32_t* tokens_ = nullptr;
  int64_t size_ = 0;
  uint32_t eod_ = 0;
};

// Refuses a shard that a model of config c cannot use, naming path: an id (the end-of-document id
// included) outside c's vocabulary, or no document of two tokens or more, so nothing to predict
// (a shard of end-of-document ids alone would train at loss 0).
void check_shard_for_model(const TokenShard& shard, const std::string& path, const K3Config& c);

// The `len` tokens from `pos` (wrapping around the end of the shard), cut after every
// end-of-document id into document pieces (pieces keep their end-of-document id, so the model
// learns to end documents). Pieces of a single token predict nothing and are dropped.
std::vector<std::vector<int32_t>> window_pieces(const TokenShard& shard, int64_t pos, int64_t len);

}  // namespace k3::train
