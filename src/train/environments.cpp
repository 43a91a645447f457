// The registry of built-in environments (train/environment.h).
#include <cctype>

#include "core/error.h"
#include "train/env_mcp.h"
#include "train/environment.h"

namespace k3::train {

std::unique_ptr<Environment> make_environment(const std::string& name, const nlohmann::json& options) {
  if (options.is_null()) return make_environment(name, nlohmann::json::object());
  if (!options.is_object()) fail("environment '", name, "': its options must be a JSON object");
  if (name == "calculator") return make_calculator_environment(options);
  if (name == "kb") return make_kb_environment(options);
  if (name == "retrieval") return make_retrieval_environment(options);
  if (name == "mcp") return make_mcp_environment(options);
  fail("unknown environment '", name, "' (calculator, kb, retrieval, or mcp: your tools over stdio)");
}

void check_option_names(const nlohmann::json& options, const char* env, std::initializer_list<const char*> known) {
  for (const auto& [k, v] : options.items()) {
    bool ok = false;
    std::string list;
    for (const char* n : known) ok = ok || k == n, list += (list.empty() ? "" : ", ") + std::string(n);
    if (!ok) fail(env, " environment: unknown option '", k, "' (", list, ")");
  }
}

int64_t integer_option(const nlohmann::json& options, const char* env, const char* key, int64_t fallback, int64_t lo,
                       int64_t hi) {
  if (!options.contains(key)) return fallback;
  const nlohmann::json& v = options[key];
  if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi)
    fail(env, " environment: option '", key, "' must be an integer in ", lo, "..", hi);
  return v.get<int64_t>();
}

bool last_integer(const std::string& text, std::string* out) {
  size_t end = text.size();
  while (end > 0 && !std::isdigit(static_cast<unsigned char>(text[end - 1]))) --end;
  if (end == 0) return false;
  size_t b = end;
  while (b > 0 && std::isdigit(static_cast<unsigned char>(text[b - 1]))) --b;
  if (b > 0 && text[b - 1] == '-') --b;
  *out = text.substr(b, end - b);
  return true;
}

}  // namespace k3::train
