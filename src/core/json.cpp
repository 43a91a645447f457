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

namespace {

// nlohmann's DOM builder behind a SAX filter that refuses a key repeated within one object. (The library's
// callback parser could check the same, but its end_object scans the enclosing object for discarded members,
// which makes an object of n objects O(n²): a release shard's header is an object of ~5,000 tensor objects;
// docs/BENCHMARKS.md, "Beyond one GPU".)
template <class Json>
class UniqueKeyDom {
 public:
  using number_integer_t = typename Json::number_integer_t;
  using number_unsigned_t = typename Json::number_unsigned_t;
  using number_float_t = typename Json::number_float_t;
  using string_t = typename Json::string_t;
  using binary_t = typename Json::binary_t;

  UniqueKeyDom(Json& out, const std::string& where) : dom_(out, /*allow_exceptions=*/true), where_(where) {}
  bool null() { return dom_.null(); }
  bool boolean(bool b) { return dom_.boolean(b); }
  bool number_integer(number_integer_t v) { return dom_.number_integer(v); }
  bool number_unsigned(number_unsigned_t v) { return dom_.number_unsigned(v); }
  bool number_float(number_float_t v, const string_t& s) { return dom_.number_float(v, s); }
  bool string(string_t& s) { return dom_.string(s); }
  bool binary(binary_t& b) { return dom_.binary(b); }
  bool start_object(std::size_t n) {
    keys_.emplace_back();
    return dom_.start_object(n);
  }
  bool key(string_t& k) {
    if (!keys_.back().insert(k).second) fail(where_, ": key \"", k, "\" appears twice in one object");
    return dom_.key(k);
  }
  bool end_object() {
    keys_.pop_back();
    return dom_.end_object();
  }
  bool start_array(std::size_t n) { return dom_.start_array(n); }
  bool end_array() { return dom_.end_array(); }
  bool parse_error(std::size_t at, const std::string& token, const nlohmann::detail::exception& e) {
    return dom_.parse_error(at, token, e);
  }

 private:
  nlohmann::detail::json_sax_dom_parser<Json> dom_;
  const std::string& where_;
  std::vector<std::unordered_set<std::string>> keys_;
};

}  // namespace

template <class Json>
Json parse_json(std::string_view text, const std::string& where, const JsonLimits& limits) {
  if (const size_t at = json_depth_violation(text, limits.max_depth); at != std::string_view::npos)
    fail(where, ": JSON nested deeper than ", limits.max_depth, " levels (at byte ", at, ")");
  try {
    if (!limits.unique_keys) return Json::parse(text);
    Json out;
    UniqueKeyDom<Json> sax(out, where);
    Json::sax_parse(text, &sax);
    return out;
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
