// The one way k3cpp reads JSON text: configs, safetensors headers and shard indexes, chat requests,
// tokenizer configs, training state and metrics, and the JSON a model writes into tool calls.
//
// nlohmann's parser is iterative and its destructor is too, but copying, comparing and dumping a
// value recurse once per level, as do our own walks over values (python_json_dumps, deep_sorted,
// the UTF-8 repair of model output). A request nested 20,000 levels deep would overflow the stack in
// any of them. So every text is refused up front when it nests deeper than kMaxJsonDepth, and every
// recursive walk calls check_json_walk_depth, so that a value built some other way is refused too
// instead of crashing. No real config, header, tool schema or tool call comes near 256 levels
// (Python's own json module stops near 1,000: its recursion limit).
#pragma once
#include <cstddef>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace k3 {

inline constexpr int kMaxJsonDepth = 256;

struct JsonLimits {
  int max_depth = kMaxJsonDepth;
  // Refuse an object that names a key twice (nlohmann keeps the last one, other readers the first):
  // set for files whose meaning must not depend on the reader, such as safetensors headers.
  bool unique_keys = false;
};

// The byte offset of the first '[' or '{' (outside strings) that opens level max_depth + 1, or
// std::string_view::npos when the text never nests that deep. Linear, no allocation.
size_t json_depth_violation(std::string_view text, int max_depth);

// Parses text. Throws k3::Error "<where>: not valid JSON: ...", "<where>: JSON nested deeper than N
// levels (at byte B)" or "<where>: key \"K\" appears twice in one object".
template <class Json = nlohmann::json>
Json parse_json(std::string_view text, const std::string& where, const JsonLimits& limits = {});

// The value, or nullopt when text is not JSON or nests deeper than max_depth: for text that is
// allowed to be anything, such as a model's output.
template <class Json = nlohmann::json>
std::optional<Json> try_parse_json(std::string_view text, int max_depth = kMaxJsonDepth);

// Recursive walks over a JSON value call this with the depth they reached (0 at the root): throws
// k3::Error naming `what` past kMaxJsonDepth.
void check_json_walk_depth(int depth, const char* what);

}  // namespace k3
