#include "io/jsonl.h"

#include "core/error.h"
#include "core/json.h"

namespace k3 {

JsonlFile read_jsonl(const std::string& path, const std::string& what, InputRole role) {
  const std::string text = read_file(path, what, role);
  JsonlFile out;
  int64_t lineno = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t nl = text.find('\n', pos);
    const bool last = nl == std::string::npos || text.find_first_not_of(" \t\r\n", nl) == std::string::npos;
    if (nl == std::string::npos) nl = text.size();
    const std::string line = text.substr(pos, nl - pos);
    pos = nl + 1;
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::optional<nlohmann::json> v = try_parse_json(line);
    if (!v && last) {
      out.dropped_torn_last_line = true;
      break;
    }
    if (!v) fail(path, ":", lineno, ": not a JSON record (", what, ")");
    if (!v->is_object()) fail(path, ":", lineno, ": a record must be a JSON object (", what, ")");
    out.records.push_back({lineno, line, std::move(*v)});
  }
  return out;
}

}  // namespace k3
