#include "core/json.h"

#include <string>
#include <unordered_set>
#include <vector>

#include "core/error.h"

namespace k3 {

size_t json_depth_violation(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return i;
    } else if (c == ']' || c == '}') {
      --depth;  // unbalanced text is the parser's to reject
    }
  }
  return std::string_view::npos;
}

template <class Json>
Json parse_json(std::string_view text, const std::string& where, const JsonLimits& limits) {
  if (const size_t at = json_depth_violation(text, limits.max_depth); at != std::string_view::npos)
    fail(where, ": JSON nested deeper than ", limits.max_depth, " levels (at byte ", at, ")");
  try {
    if (!limits.unique_keys) return Json::parse(text);
    // The callback parser is iterative too; it sees each key before its value.
    std::vector<std::unordered_set<std::string>> open_objects;
    return Json::parse(text, [&](int, nlohmann::json::parse_event_t ev, Json& v) {
      using E = nlohmann::json::parse_event_t;
      if (ev == E::object_start) open_objects.emplace_back();
      else if (ev == E::object_end && !open_objects.empty()) open_objects.pop_back();
      else if (ev == E::key && !open_objects.back().insert(v.template get<std::string>()).second)
        fail(where, ": key \"", v.template get<std::string>(), "\" appears twice in one object");
      return true;
    });
  } catch (const nlohmann::json::exception& e) {
    fail(where, ": not valid JSON: ", e.what());
  }
}

template <class Json>
std::optional<Json> try_parse_json(std::string_view text, int max_depth) {
  if (json_depth_violation(text, max_depth) != std::string_view::npos) return std::nullopt;
  Json v = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (v.is_discarded()) return std::nullopt;
  return v;
}

void check_json_walk_depth(int depth, const char* what) {
  if (depth > kMaxJsonDepth) fail(what, ": JSON value nested deeper than ", kMaxJsonDepth, " levels");
}

template nlohmann::json parse_json<nlohmann::json>(std::string_view, const std::string&, const JsonLimits&);
template nlohmann::ordered_json parse_json<nlohmann::ordered_json>(std::string_view, const std::string&,
                                                                   const JsonLimits&);
template std::optional<nlohmann::json> try_parse_json<nlohmann::json>(std::string_view, int);
template std::optional<nlohmann::ordered_json> try_parse_json<nlohmann::ordered_json>(std::string_view, int);

}  // namespace k3
