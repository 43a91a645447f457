// k3 tokenizer train: a byte-level BPE vocabulary from text files (tokenizer/bpe_train.h), written
// as a tokenizer directory that Tokenizer::load_dir and `k3 tokenize --ranks DIR/tiktoken.model` read.
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cli/args.h"  // defines: elapsed_seconds
#include "cli/commands.h"
#include "core/error.h"              // defines: fail
#include "tokenizer/bpe_train.h"     // defines: train_bpe, check_corpus_files, prepare_output_dir, write_tokenizer_dir
#include "tokenizer/pretokenizer.h"  // defines: pattern_by_name

namespace k3::cli {

void register_tokenizer(CLI::App& app) {
  CLI::App* tok = app.add_subcommand("tokenizer", "Tokenizer tools (subcommand: train).");
  tok->require_subcommand(1);

  struct Opts {
    std::vector<std::string> corpus;
    int64_t vocab_size = 0;
    std::string out, pattern = "k3";
    int threads = 0;
    int64_t min_pair_count = 2;
  };
  auto o = std::make_shared<Opts>();
  const unsigned hw = std::thread::hardware_concurrency();
  o->threads = hw > 0 ? int(hw) : 1;
  CLI::App* train = tok->add_subcommand(
      "train",
      "Train a byte-level BPE vocabulary on text files. Each file is cut and pre-tokenized exactly as the\n"
      "K3 tokenizer cuts text for encoding (same --pattern) and identical pieces are counted. Then the most\n"
      "frequent adjacent pair (ties: smallest (left rank, right rank)) is merged into the next rank until\n"
      "there are --vocab-size ranks; ranks 0..255 are the single bytes. A pair must occur at least\n"
      "--min-pair-count times to be merged: if the corpus runs out of such pairs first, the command fails,\n"
      "names how many ranks the corpus supports and writes nothing. Writes DIR/tiktoken.model\n"
      "(`<base64 bytes> <rank>` per line) and DIR/tokenizer_config.json (the 256 K3 special tokens at ids\n"
      "N..N+255 for N = --vocab-size), atomically, replacing existing ones. Progress goes to stderr.");
  train->add_option("--corpus", o->corpus, "text files to train on (one or more; each is one document)")
      ->required()
      ->expected(1, -1);
  train
      ->add_option("--vocab-size", o->vocab_size,
                   "N: number of mergeable ranks, 256 or more (the special tokens take ids N..N+255)")
      ->required();
  train->add_option("--out", o->out, "output directory (created if missing)")->required();
  train->add_option("--pattern", o->pattern, "pre-tokenizer pattern (the one the encoder will use)")
      ->capture_default_str();
  train
      ->add_option("--min-pair-count", o->min_pair_count,
                   "a pair is merged only if it occurs at least this often (counted over the whole corpus)")
      ->capture_default_str();
  train
      ->add_option("--threads", o->threads,
                   "threads for reading and pre-tokenizing the corpus (default: the hardware threads);\n"
                   "merging uses one")
      ->capture_default_str();
  train->callback([o] {
    if (o->vocab_size < 256 || o->vocab_size > kMaxTrainRanks)
      fail("--vocab-size must be in [256, ", kMaxTrainRanks, "] (ranks 0..255 are the single bytes), got ",
           o->vocab_size);
    if (o->threads < 1 || o->threads > 4096) fail("--threads must be in [1, 4096], got ", o->threads);
    if (o->min_pair_count < 1) fail("--min-pair-count must be at least 1, got ", o->min_pair_count);
    const std::string pattern = pattern_by_name(o->pattern);
    check_corpus_files(o->corpus);  // fail before the work (and before creating --out), not after it
    prepare_output_dir(o->out);
    BpeTrainOptions opt;
    opt.threads = o->threads;
    opt.min_pair_count = o->min_pair_count;
    opt.progress = [](const std::string& line) {
      std::fprintf(stderr, "[%7.1f s] %s\n", elapsed_seconds(), line.c_str());
    };
    elapsed_seconds();
    const BpeTrainResult r = train_bpe(o->corpus, o->vocab_size, pattern, opt);
    if (r.encoder_mismatches != 0)
      std::fprintf(stderr,
                   "warning: %lld distinct pieces encode differently from their training segmentation "
                   "(expected 0; please report)\n",
                   static_cast<long long>(r.encoder_mismatches));
    write_tokenizer_dir(o->out, r.tokens);
    std::fprintf(stderr,
                 "[%7.1f s] wrote %s/tiktoken.model (%lld ranks) and tokenizer_config.json (specials %lld..%lld)\n",
                 elapsed_seconds(), o->out.c_str(), static_cast<long long>(r.tokens.size()),
                 static_cast<long long>(r.tokens.size()), static_cast<long long>(r.tokens.size()) + 255);
  });
}

}  // namespace k3::cli
