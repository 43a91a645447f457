#include "tokenizer/special_tokens.h"

#include <map>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"
#include "io/file.h"

namespace k3 {

namespace {

const std::map<int32_t, const char*>& k3_named() {
  static const std::map<int32_t, const char*> names = {
      {0, "[BOS]"},
      {1, "[EOS]"},
      {2, "<|end_of_msg|>"},
      {3, "<|open|>"},
      {4, "<|close|>"},
      {5, "<|sep|>"},
      {6, "[start_header_id]"},
      {7, "[end_header_id]"},
      {9, "[EOT]"},
      {18, "<|media_begin|>"},
      {19, "<|media_content|>"},
      {20, "<|media_end|>"},
      {21, "<|media_pad|>"},
      {65, "<osagent_mode>"},
      {254, "[UNK]"},
      {255, "[PAD]"},
  };
  return names;
}

std::string reserved_name(int64_t id) { return "<|reserved_token_" + std::to_string(id) + "|>"; }

// id -> name for the 256 specials after num_ranks, with `named` (by absolute id) overriding.
std::unordered_map<std::string, int32_t> table(int64_t num_ranks, const std::map<int64_t, std::string>& named,
                                               const std::string& source) {
  if (num_ranks < 1 || num_ranks + kNumReservedSpecialTokens > INT32_MAX)
    fail(source, ": ", num_ranks, " ranks leave no room for 256 special ids in int32");
  std::unordered_map<std::string, int32_t> out;
  for (int64_t id = num_ranks; id < num_ranks + kNumReservedSpecialTokens; ++id) {
    auto it = named.find(id);
    const std::string name = it != named.end() ? it->second : reserved_name(id);
    if (!out.emplace(name, int32_t(id)).second) fail(source, ": special token '", name, "' names two ids");
  }
  return out;
}

}  // namespace

const char* k3_special_name(K3Special s) { return k3_named().at(int32_t(s)); }

std::unordered_map<std::string, int32_t> k3_special_tokens(int64_t num_ranks) {
  std::map<int64_t, std::string> named;
  for (const auto& [off, name] : k3_named()) named[num_ranks + off] = name;
  return table(num_ranks, named, "K3 special tokens");
}

std::unordered_map<std::string, int32_t> load_special_tokens(const std::string& path, int64_t num_ranks) {
  const nlohmann::json j = parse_json(read_file(path, "tokenizer config"), path);
  if (!j.is_object()) fail(path, ": expected a JSON object");
  std::map<int64_t, std::string> named;
  if (j.contains("added_tokens_decoder")) {
    const auto& d = j["added_tokens_decoder"];
    if (!d.is_object()) fail(path, ": added_tokens_decoder must be an object of id -> {content}");
    for (const auto& [key, entry] : d.items()) {
      int64_t id = -1;
      size_t used = 0;
      try {
        id = std::stoll(key, &used);
      } catch (...) {
        used = 0;
      }
      if (used != key.size() || key.empty()) fail(path, ": added_tokens_decoder key '", key, "' is not an integer id");
      if (!entry.is_object() || !entry.contains("content") || !entry["content"].is_string() ||
          entry["content"].get<std::string>().empty())
        fail(path, ": added_tokens_decoder[\"", key, "\"] needs a non-empty string 'content'");
      if (id < num_ranks || id >= num_ranks + kNumReservedSpecialTokens)
        fail(path, ": added_tokens_decoder id ", id, " is outside the special range [", num_ranks, ", ",
             num_ranks + kNumReservedSpecialTokens, ") that follows the ", num_ranks, " ranks");
      named[id] = entry["content"].get<std::string>();
    }
  }
  return table(num_ranks, named, path);
}

std::string k3_tokenizer_config_json(int64_t num_ranks) {
  nlohmann::ordered_json decoder = nlohmann::ordered_json::object();
  for (const auto& [off, name] : k3_named())
    decoder[std::to_string(num_ranks + off)] = {{"content", name}, {"lstrip", false},      {"normalized", false},
                                                {"rstrip", false}, {"single_word", false}, {"special", true}};
  nlohmann::ordered_json j = {{"tokenizer_class", "TikTokenTokenizer"},
                              {"bos_token", "[BOS]"},
                              {"eos_token", "[EOS]"},
                              {"unk_token", "[UNK]"},
                              {"pad_token", "[PAD]"},
                              {"added_tokens_decoder", decoder}};
  return j.dump(2) + "\n";
}

}  // namespace k3
