#include "cli/args.h"

#include <cerrno>
#include <chrono>
#include <cstdlib>

#include "core/error.h"

namespace k3::cli {

std::vector<int32_t> parse_ids(const std::string& text, const std::string& flag) {
  std::vector<int32_t> out;
  size_t i = 0;
  while (i <= text.size()) {
    size_t j = text.find(',', i);
    if (j == std::string::npos) j = text.size();
    const std::string item = text.substr(i, j - i);
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || errno != 0 || v < 0 || v > INT32_MAX)
      fail(flag, ": expected comma-separated non-negative token ids, got '", item, "' in '", text, "'");
    out.push_back(int32_t(v));
    i = j + 1;
  }
  return out;
}

void check_ids_in_vocab(const std::vector<std::vector<int32_t>>& rows, int64_t vocab_size, const std::string& flag,
                        const std::string& source) {
  for (size_t b = 0; b < rows.size(); ++b)
    for (size_t i = 0; i < rows[b].size(); ++i)
      if (rows[b][i] >= vocab_size)
        fail(flag, ": token id ", rows[b][i], rows.size() > 1 ? " (row " + std::to_string(b) + ", " : " (",
             "position ", i, ") is outside the vocabulary [0, ", vocab_size, ") of ", source);
}

std::string join_ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) {
    if (!s.empty()) s += ' ';
    s += std::to_string(id);
  }
  return s;
}

double elapsed_seconds() {
  static const auto t0 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace k3::cli
