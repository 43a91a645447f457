// Byte-level BPE vocabulary training (`k3 tokenizer train`): corpus files -> a tiktoken.model whose
// ranks BpeTokenizer / Tokenizer encode with. Not a tokenizer itself (see bpe.h, tokenizer.h).
//
// What is trained. Ranks 0..255 are the 256 single bytes (rank b = byte b). Each later rank r is
// one merge: the concatenation of two existing tokens. The result is N ranks; the K3 specials
// then sit at N..N+255 (special_tokens.h).
//
// The algorithm, step by step, and why:
//  1. Pieces. Every file is cut exactly as Tokenizer::encode cuts a text (kimi_encode_parts:
//     400k-character chunks, 25k-character runs), then each part is split by the PreTokenizer
//     with the same pattern the encoder uses. Why: BPE merges only inside a piece, so the
//     training pieces must be exactly the pieces the encoder will merge within. A file is one
//     document: no piece crosses a file boundary. Special-token text is ordinary text here.
//  2. Counting. Identical pieces are counted once with their frequency (a "word"). The parts are
//     spread over `threads` workers, each with its own table, merged at the end; the result does
//     not depend on the thread count.
//  3. Merging (classic byte-level BPE). Each word starts as its bytes. A pair's count is
//     sum over words of (word frequency x number of adjacent positions holding the pair);
//     overlapping occurrences ("aaa" holds (a,a) twice) both count, as in HF tokenizers and
//     minbpe. Repeatedly the most frequent pair (A,B) becomes the next rank, and in every word
//     its occurrences are replaced left to right ("aaa" -> "aa","a").
//  4. Ties: among pairs with the same count the smallest (rank of A, rank of B) wins. Why: a
//     fixed total order makes the output a function of the corpus alone (not of hash order or
//     thread count), and it is cheap to reproduce in a naive reference.
//  5. Stop. A merge needs a pair that occurs at least min_pair_count (default 2) times: a pair
//     seen once only memorises one spot of the corpus. When no such pair is left before N ranks,
//     train_bpe throws k3::Error naming how many ranks the corpus supports, and writes nothing.
//     Why an error and not a smaller vocabulary: the special ids are N..N+255, so a silently
//     smaller N would move them; the caller asked for N and must choose.
//
// Why the encoder reproduces training, and how that is checked. tiktoken's encoder merges, inside
// each piece, the adjacent pair whose concatenation has the lowest rank, until no concatenation is
// a token. Ranks are given in merge order, so on a training piece the encoder meets the training
// merges in training order and ends in the training segmentation. This is what tiktoken-style
// vocabularies rely on, but it is not proven here for every corpus: it would break if another split
// (C,D) of a token's bytes ever stood adjacent in a piece, or if a merge produced bytes that are
// already a token. So it is checked, not assumed: a repeated token is an internal error, and after
// training every distinct piece is re-encoded with the encoder's rule and compared with its training
// segmentation; the number of differences is returned (encoder_mismatches; `k3 tokenizer train`
// warns when it is not 0). docs/TOKENIZER.md ("Vocabulary training") lists the corpora it has been
// checked on.
//
// Speed (docs/BENCHMARKS.md has figures): merging is incremental, never a recount. Kept up to
// date: each pair's count, an index from each pair to the words that hold it (entries may be
// stale; a word is checked when visited), and a max-heap of (count, tie key) with lazy
// invalidation (an entry whose count is out of date is re-pushed with the current count when it
// surfaces). A merge visits only the words holding its pair; each visit shrinks the word, so the
// total work is bounded by the corpus's distinct bytes, not by N x corpus.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace k3 {

struct BpeTrainOptions {
  int threads = 0;                                   // pre-tokenise/count workers; 0 = hardware concurrency
  int64_t min_pair_count = 2;                        // a merge needs a pair occurring at least this often
  bool keep_segmentations = false;                   // fill BpeTrainResult::segmentations (for tests)
  std::function<void(const std::string&)> progress;  // progress lines (no trailing newline); null = silent
};

// Distinct pieces of a corpus with their frequencies, sorted by bytes.
struct PieceCounts {
  std::vector<std::pair<std::string, int64_t>> pieces;
  int64_t corpus_bytes = 0;
  int64_t num_pieces = 0;  // with repetitions
};

struct BpeTrainResult {
  std::vector<std::string> tokens;    // rank -> bytes; tokens[b] == std::string(1, char(b)) for b < 256
  std::vector<int64_t> merge_counts;  // [r - 256]: the pair's count when rank r was made
  int64_t corpus_bytes = 0, num_pieces = 0, num_distinct_pieces = 0;
  int64_t num_tokens = 0;          // tokens the corpus encodes to with the trained ranks
  int64_t encoder_mismatches = 0;  // distinct pieces whose encoding differs from training (see above)
  // With keep_segmentations: each distinct piece (sorted by bytes) and its final token ids.
  std::vector<std::pair<std::string, std::vector<int32_t>>> segmentations;
};

// Largest num_ranks train_bpe accepts: the specials (256 ids after the ranks) must fit in int32.
constexpr int64_t kMaxTrainRanks = int64_t(INT32_MAX) - 256 + 1;

// Throws k3::Error naming the first path that is missing, a directory or unreadable.
void check_corpus_files(const std::vector<std::string>& corpus_paths);

// Steps 1-2: reads and pre-tokenises the files. Throws k3::Error naming a missing, unreadable or
// directory path before any work, and when the files hold no bytes at all.
PieceCounts count_corpus_pieces(const std::vector<std::string>& corpus_paths, const std::string& pattern,
                                const BpeTrainOptions& options);

// Steps 3-5 on counted pieces. num_ranks in [256, kMaxTrainRanks].
BpeTrainResult train_bpe_on_pieces(const PieceCounts& counts, int64_t num_ranks, const BpeTrainOptions& options);

// Both: the ranked token byte strings for num_ranks ranks.
BpeTrainResult train_bpe(const std::vector<std::string>& corpus_paths, int64_t num_ranks, const std::string& pattern,
                         const BpeTrainOptions& options);

// tiktoken.model text: one `<standard base64 of the bytes> <rank>` line per token, ranks ascending.
std::string tiktoken_model_text(const std::vector<std::string>& tokens);

// Writes tiktoken.model (atomically) to path.
void write_tiktoken_model(const std::string& path, const std::vector<std::string>& tokens);

// Creates dir if missing and checks that a file can be created in it (throws k3::Error naming it).
void prepare_output_dir(const std::string& dir);

// dir/tiktoken.model and dir/tokenizer_config.json (K3 specials at tokens.size()..+255), atomically.
void write_tokenizer_dir(const std::string& dir, const std::vector<std::string>& tokens);

}  // namespace k3
