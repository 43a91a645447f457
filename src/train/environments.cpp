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
