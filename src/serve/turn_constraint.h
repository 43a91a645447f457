// Constrained decoding of one K3 assistant turn for `k3 serve`: after the generation prompt, only
// tokens that keep the turn inside the grammar below may be sampled (the others' logits are set to
// -inf before sampling), so the reply parses whatever the weights are.
//
//   [think text] <|close|>think<|sep|><|open|>response<|sep|>   (when the turn starts thinking)
//   RESPONSE <|close|>response<|sep|> [TOOLS] <|close|>message<|sep|><|end_of_msg|>
//
// RESPONSE is a JSON document the schema accepts (serve/json_matcher.h; response_format json_object
// or json_schema), or free text, and there is no TOOLS block (tool_choice "none", or a response
// format). A forced call (tool_choice "required" or a named function) instead leaves RESPONSE empty
// and makes TOOLS exactly one call to one of the given tools, its arguments a JSON object that tool's
// parameter schema accepts:
//   <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|><|open|>json type="object"<|sep|>
//   ARGUMENTS<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>
// The think text is free. A mask walks the vocabulary's byte trie with a copy of the automaton and
// keeps the tokens whose every byte it accepts, plus the structural special tokens the grammar
// expects next; every other id, special or beyond the tokenizer, is masked.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "serve/json_matcher.h"
#include "tokenizer/tokenizer.h"

namespace k3::serve {

// The tokenizer's ordinary tokens (ranks) as a byte trie, and each one's bytes.
class TokenTrie {
 public:
  explicit TokenTrie(const Tokenizer& tok);
  struct Node {
    int32_t first_child = -1, next_sibling = -1;
    int32_t token = -1;  // the id whose bytes end here (-1: none)
    uint8_t byte = 0;
  };
  const std::vector<Node>& nodes() const { return nodes_; }  // node 0 is the root
  const std::string& bytes(int32_t id) const { return bytes_[size_t(id)]; }
  int64_t num_ranks() const { return int64_t(bytes_.size()); }
  int32_t next_same(int32_t id) const { return same_[size_t(id)]; }  // another id with the same bytes, or -1

 private:
  std::vector<Node> nodes_;
  std::vector<std::string> bytes_;
  std::vector<int32_t> same_;
};

// A tool a forced call may name: its name (letters, digits, '_', '-', '.') and its parameters' schema.
struct ForcedTool {
  std::string name;
  std::shared_ptr<const JsonSchema> parameters;
};

struct TurnSpec {
  bool thinking = true;                      // the generation prompt opened the think channel
  std::shared_ptr<const JsonSchema> schema;  // the response's schema; null: free text
  std::vector<ForcedTool> forced;            // non-empty: exactly one call to one of these
};

class TurnConstraint {
 public:
  TurnConstraint(const Tokenizer& tok, const TokenTrie& trie, TurnSpec spec);
  // logits[id] = -inf for every id in [0, V) that cannot come next; k3::Error if none can.
  void mask(float* logits, int64_t V) const;
  // Advances past id; false (and nothing changed) when id cannot come next.
  bool accept(int32_t id);

 private:
  struct Step {
    // kChoice: one of the forced tools' `NAME" index="1"` (the State remembers which); kJson: the
    // response's schema, or the chosen tool's parameters after a kChoice.
    enum class Kind : uint8_t { kFree, kLiteral, kSpecial, kJson, kChoice } kind;
    std::string text;     // kLiteral
    int32_t special = 0;  // kSpecial
  };
  struct State {
    size_t step = 0, pos = 0;
    int choice = -1;                  // the forced tool being called
    std::string typed;                // kChoice: the bytes so far
    std::optional<JsonMatcher> json;  // in a kJson step
  };
  static std::string choice_text(const ForcedTool& t) { return t.name + "\" index=\"1\""; }
  void enter(State& s, size_t step) const;
  bool feed_byte(State& s, uint8_t c) const;
  bool feed_special(State& s, int32_t id) const;
  void mark(int32_t node, std::vector<char>& allowed) const;
  void walk(int32_t node, const State& s, std::vector<char>& allowed) const;
  void walk_string(int32_t node, int pending, const State& s, std::vector<char>& allowed) const;

  const TokenTrie* trie_;
  TurnSpec spec_;
  std::vector<Step> steps_;
  std::vector<int32_t> structural_;  // <|open|>, <|close|>, <|sep|>, <|end_of_msg|>
  State state_;
};

}  // namespace k3::serve
