#include "tokenizer/tokenizer.h"

#include <filesystem>

#include "core/error.h"

namespace k3 {

bool python_isspace(uint32_t c) {
  // Characters whose bidirectional class is WS, B or S, or whose category is Zs (CPython's
  // _PyUnicode_IsWhitespace table).
  switch (c) {
    case 0x09:
    case 0x0a:
    case 0x0b:
    case 0x0c:
    case 0x0d:
    case 0x1c:
    case 0x1d:
    case 0x1e:
    case 0x1f:
    case 0x20:
    case 0x85:
    case 0xa0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202f:
    case 0x205f:
    case 0x3000: return true;
    default: return c >= 0x2000 && c <= 0x200a;
  }
}

bool python_isspace_at(std::string_view text, size_t i, size_t& len) {
  len = utf8_sequence_length(text, i);
  if (len == 0) {
    len = 1;
    return false;
  }
  uint32_t cp = len == 1 ? uint32_t(uint8_t(text[i])) : uint32_t(uint8_t(text[i])) & (0x7fu >> len);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (uint32_t(uint8_t(text[i + k])) & 0x3f);
  return python_isspace(cp);
}

std::vector<std::pair<size_t, size_t>> kimi_encode_parts(std::string_view text, size_t max_chars, size_t max_run) {
  std::vector<std::pair<size_t, size_t>> parts;
  size_t i = 0;
  while (i < text.size()) {
    // One chunk of at most max_chars characters, then the run cuts inside it.
    size_t slice_start = i, run_len = 0, chars = 0;
    bool run_is_space = false;
    while (i < text.size() && chars < max_chars) {
      size_t n = 0;
      const bool space = python_isspace_at(text, i, n);
      if (chars == 0) run_is_space = space;  // s[0].isspace()
      if (space != run_is_space) {
        run_len = 1;
        run_is_space = space;
      } else if (++run_len > max_run) {
        parts.emplace_back(slice_start, i);
        slice_start = i;
        run_len = 1;
      }
      i += n;
      ++chars;
    }
    parts.emplace_back(slice_start, i);
  }
  return parts;
}

Tokenizer Tokenizer::load(const std::string& ranks_path, const std::string& tokenizer_config,
                          const std::string& pattern) {
  Tokenizer t;
  t.bpe_ = BpeTokenizer::load(ranks_path, {}, pattern);
  const int64_t n = t.bpe_.num_ranks();
  t.bpe_.set_specials(tokenizer_config.empty() ? k3_special_tokens(n) : load_special_tokens(tokenizer_config, n));
  // The XTML chat format renders its control tokens by name and parses them back by id (N + offset),
  // and `k3 data` ends documents with N + 2: a tokenizer_config.json that names them elsewhere, or
  // not at all, would make the chat template encode "<|end_of_msg|>" as plain text.
  if (!tokenizer_config.empty())
    for (K3Special s : {K3Special::kEndOfMsg, K3Special::kOpen, K3Special::kClose, K3Special::kSep}) {
      const std::string name = k3_special_name(s);
      const int64_t want = n + int64_t(s);
      const auto it = t.bpe_.specials().find(name);
      if (it == t.bpe_.specials().end() || it->second != want)
        fail(tokenizer_config, ": added_tokens_decoder must name ", name, " at id ", want, " (K3's layout: ranks + ",
             int64_t(s), "), ",
             it == t.bpe_.specials().end() ? "but it does not name it at all"
                                           : "but names it at id " + std::to_string(it->second),
             "; K3's chat format and end-of-document id need it");
    }
  return t;
}

bool Tokenizer::dir_has_tokenizer(const std::string& dir) {
  return std::filesystem::is_regular_file(std::filesystem::path(dir) / "tiktoken.model");
}

void Tokenizer::check_fits(int64_t model_vocab_size, const std::string& dir, const std::string& model_source) const {
  if (vocab_size() > model_vocab_size)
    fail(dir, ": the tokenizer has ", vocab_size(), " ids (", num_ranks(), " ranks + ", kNumReservedSpecialTokens,
         " specials) but the model's vocab_size is ", model_vocab_size, " (", model_source, ")");
}

Tokenizer Tokenizer::load_dir(const std::string& dir, const std::string& pattern) {
  const std::filesystem::path d(dir), ranks = d / "tiktoken.model", cfg = d / "tokenizer_config.json";
  if (!std::filesystem::is_regular_file(ranks))
    fail(dir, ": no tiktoken.model (the tokenizer's rank file) in this directory");
  return load(ranks.string(), std::filesystem::is_regular_file(cfg) ? cfg.string() : "", pattern);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool allow_special) const {
  std::vector<int32_t> out;
  for (const auto& [b, e] : kimi_encode_parts(text)) {
    const std::string_view part = text.substr(b, e - b);
    const std::vector<int32_t> ids = allow_special ? bpe_.encode_with_specials(part) : bpe_.encode_ordinary(part);
    out.insert(out.end(), ids.begin(), ids.end());
  }
  return out;
}

int32_t Tokenizer::special_id(const std::string& text) const {
  auto it = bpe_.specials().find(text);
  if (it == bpe_.specials().end()) fail("tokenizer has no special token '", text, "'");
  return it->second;
}

}  // namespace k3
