// Kimi K3's special tokens (K3-ARCHITECTURE.md §9).
//
// A K3 vocabulary is N mergeable ranks (ids 0..N-1) followed by 256 reserved special ids
// (N..N+255); for the released tokenizer N = 163,584. Some specials have names ([BOS], <|open|>,
// ...); every other one is called `<|reserved_token_{id}|>`, as Kimi's tokenization_kimi.py names
// them. The names come from the model directory's tokenizer_config.json (`added_tokens_decoder`)
// when it has one, and from the K3 table below otherwise.
#pragma once
#include <cstdint>
#include <string>
#include <unordered_map>

namespace k3 {

constexpr int32_t kNumReservedSpecialTokens = 256;

// Offsets (id - N) of the named K3 specials.
enum class K3Special : int32_t {
  kBos = 0,          // [BOS]
  kEos = 1,          // [EOS]
  kEndOfMsg = 2,     // <|end_of_msg|>: ends every XTML message; the generation stop (eos_token_id)
  kOpen = 3,         // <|open|>
  kClose = 4,        // <|close|>
  kSep = 5,          // <|sep|>
  kStartHeader = 6,  // [start_header_id]
  kEndHeader = 7,    // [end_header_id]
  kEot = 9,          // [EOT]
  kMediaBegin = 18,  // <|media_begin|>
  kMediaContent = 19,
  kMediaEnd = 20,
  kMediaPad = 21,
  kOsAgentMode = 65,  // <osagent_mode>
  kUnk = 254,         // [UNK]
  kPad = 255,         // [PAD]
};

// The name the K3 table gives a special ("<|end_of_msg|>").
const char* k3_special_name(K3Special s);

// text -> id for all 256 specials after num_ranks, named by the K3 table.
std::unordered_map<std::string, int32_t> k3_special_tokens(int64_t num_ranks);

// text -> id for all 256 specials after num_ranks, named by a tokenizer_config.json's
// `added_tokens_decoder` ({"163584": {"content": "[BOS]", ...}, ...}); ids it does not name get
// `<|reserved_token_{id}|>`. Errors name the file and the entry.
std::unordered_map<std::string, int32_t> load_special_tokens(const std::string& tokenizer_config_path,
                                                             int64_t num_ranks);

// tokenizer_config.json text naming the K3 specials after num_ranks (what `k3 tokenizer train`
// writes beside its tiktoken.model).
std::string k3_tokenizer_config_json(int64_t num_ranks);

}  // namespace k3
