#include "cli/args.h"

#include <cerrno>
#include <chrono>
#include <cmath>
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
        fail(flag, ": token id ", rows[b][i], rows.size() > 1 ? " (row " + std::to_string(b) + ", " : " (", "position ",
             i, ") is outside the vocabulary [0, ", vocab_size, ") of ", source);
}

GemmPrecision parse_gemm_precision(const std::string& text, const std::string& what) {
  if (text == "f32") return GemmPrecision::F32;
  if (text == "f64") return GemmPrecision::F64Accumulate;
  fail(what, " must be f32 or f64, got '", text, "'");
}

void apply_gemm_env() {
  const char* e = std::getenv("K3_GEMM");
  if (e && *e) set_gemm_precision(parse_gemm_precision(e, "K3_GEMM"));
}

std::string join_ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) {
    if (!s.empty()) s += ' ';
    s += std::to_string(id);
  }
  return s;
}

namespace {

// The check of one option's value; `kind` is CLI11's type name. May rewrite the text (leading zeros
// of an integer) so that CLI11's own conversion, which uses base 0, reads it as decimal.
std::string strict_number(std::string& text, const std::string& kind) {
  const char* s = text.c_str();
  char* end = nullptr;
  errno = 0;
  if (kind == "FLOAT") {
    const double v = std::strtod(s, &end);
    if (text.empty() || *end != '\0') return "expected a number, got '" + text + "'";
    if (!std::isfinite(v)) return "expected a finite number, got '" + text + "'";
    return "";
  }
  size_t i = 0;
  const bool negative = !text.empty() && text[0] == '-';
  if (!text.empty() && (text[0] == '-' || text[0] == '+')) i = 1;
  if (i == text.size() || text.find_first_not_of("0123456789", i) != std::string::npos)
    return "expected a whole decimal number, got '" + text + "'";
  if (kind == "UINT" && negative && text.find_first_not_of('0', 1) != std::string::npos)
    return "expected a non-negative whole number, got '" + text + "'";
  if (kind == "UINT") (void)std::strtoull(s, &end, 10);
  else (void)std::strtoll(s, &end, 10);
  if (errno == ERANGE) return "'" + text + "' is out of range (at most 64 bits)";
  const size_t first = text.find_first_not_of('0', i);
  text = (negative ? "-" : "") + (first == std::string::npos ? std::string("0") : text.substr(first));
  return "";
}

}  // namespace

void add_strict_number_checks(CLI::App& app) {
  for (CLI::Option* opt : app.get_options()) {
    std::string kind = opt->get_type_name();
    kind = kind.substr(0, kind.find(':'));
    if (kind != "FLOAT" && kind != "INT" && kind != "UINT") continue;
    opt->check(CLI::Validator([kind](std::string& text) { return strict_number(text, kind); }, "", "strict number"));
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) add_strict_number_checks(*sub);
}

double elapsed_seconds() {
  static const auto t0 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace k3::cli
