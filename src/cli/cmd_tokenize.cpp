// k3 tokenize / k3 detokenize: text <-> token ids with a tiktoken rank file and K3's pre-tokenizer.
#include <cstdio>
#include <filesystem>
#include <memory>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "io/file.h"
#include "tokenizer/tokenizer.h"

#include <nlohmann/json.hpp>

namespace k3::cli {

namespace {

// JSON string escaping shows a token's bytes unambiguously (spaces, newlines, invalid UTF-8 as \ufffd).
std::string nlohmann_escape(const std::string& b) {
  return nlohmann::json(b).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// The rank file's tokenizer, with the special names of a tokenizer_config.json beside it when
// there is one (the layout of a model directory), else the K3 table.
Tokenizer load_beside(const std::string& ranks, const std::string& pattern) {
  const std::filesystem::path cfg = std::filesystem::path(ranks).parent_path() / "tokenizer_config.json";
  return Tokenizer::load(ranks, std::filesystem::is_regular_file(cfg) ? cfg.string() : "", pattern);
}

}  // namespace

void register_tokenize(CLI::App& app) {
  struct Opts {
    std::string ranks, pattern = "k3", text, text_file;
    bool print_ids = false, allow_special = false;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = app.add_subcommand(
      "tokenize",
      "Encode text into token ids with a tiktoken rank file (`<base64 token> <rank>` per line) and the\n"
      "K3 pre-tokenizer, splitting long runs as Kimi's tokenizer does. The 256 special tokens follow the\n"
      "ranks, named by a tokenizer_config.json beside the rank file or else by the K3 table. Prints one\n"
      "line per token (id and its bytes) and the ids; with --print-ids the last line of stdout is the ids\n"
      "separated by spaces. Special-token text is plain text unless --allow-special.");
  sub->add_option("--ranks", o->ranks, "tiktoken.model rank file")->required();
  sub->add_option("--pattern", o->pattern, "pre-tokenizer pattern")->capture_default_str();
  auto* t = sub->add_option("--text", o->text, "text to encode");
  auto* f = sub->add_option("--text-file", o->text_file, "file whose bytes are encoded");
  t->excludes(f);
  sub->add_flag("--print-ids", o->print_ids, "print only the ids");
  sub->add_flag("--allow-special", o->allow_special, "special-token text such as <|open|> becomes its id");
  sub->callback([o, t, f] {
    if (!t->count() && !f->count()) fail("tokenize: give --text or --text-file");
    const std::string text = f->count() ? read_file(o->text_file, "text file") : o->text;
    const Tokenizer tok = load_beside(o->ranks, pattern_by_name(o->pattern));
    const std::vector<int32_t> ids = tok.encode(text, o->allow_special);
    const std::string line = join_ids(ids);
    if (!o->print_ids) {
      for (int32_t id : ids) {
        const std::string b = tok.decode({id});
        std::printf("%8d  %s\n", id, nlohmann_escape(b).c_str());
      }
      std::printf("%zu tokens for %zu bytes\n", ids.size(), text.size());
    }
    std::printf("%s\n", line.c_str());
  });
}

void register_detokenize(CLI::App& app) {
  struct Opts {
    std::string ranks, ids;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = app.add_subcommand("detokenize",
                                     "Decode comma-separated token ids (special ids included) back to bytes with a "
                                     "tiktoken rank file; writes the bytes to stdout.");
  sub->add_option("--ranks", o->ranks, "tiktoken.model rank file")->required();
  sub->add_option("--ids", o->ids, "comma-separated token ids")->required();
  sub->callback([o] {
    const Tokenizer tok = load_beside(o->ranks, kK3Pattern);
    const std::string bytes = tok.decode(parse_ids(o->ids, "--ids"));
    std::fwrite(bytes.data(), 1, bytes.size(), stdout);
    std::printf("\n");
  });
}

}  // namespace k3::cli
