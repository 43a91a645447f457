// JSON-lines files written by appending one record per line (a run's metrics.jsonl).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/file.h"

namespace k3 {

struct JsonlRecord {
  int64_t line = 0;  // 1-based line number
  std::string text;  // the line as written
  nlohmann::json value;
};

struct JsonlFile {
  std::vector<JsonlRecord> records;  // blank lines skipped
  // A last line that does not parse is what a writer killed mid-line leaves behind: it is dropped
  // and reported here. Any other line that does not parse is an error naming the file and line.
  bool dropped_torn_last_line = false;
};

// Every record must be a JSON object. Errors name path:line.
JsonlFile read_jsonl(const std::string& path, const std::string& what, InputRole role = InputRole::kInput);

}  // namespace k3
