// Names of the grouped GEMMs' configurations (moe_cuda.h, GemmConfig): what bench_cuda_moe --variants
// takes and the tests print. Plain C++, built with or without the CUDA backend.
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "kernels/moe/moe_cuda.h"

namespace k3::moe::cuda {

std::string gemm_config_name(const GemmConfig& c) {
  std::string s;
  auto add = [&s](const std::string& part) { s += (s.empty() ? "" : "+") + part; };
  if (c.kernel == GemmConfig::Kernel::kMmaSync) add("mma.sync");
  if (!c.expert_raster) add("row-major");
  if (!c.skip_empty_rows) add("no-skip");
  if (c.narrow_weight_tiles) add("narrow");
  if (c.max_ctas != 0) add("ctas=" + std::to_string(c.max_ctas));
  if (!c.dynamic_schedule) add("static");
  return s.empty() ? "default" : s;
}

GemmConfig parse_gemm_config(const std::string& name) {
  constexpr const char* kKnown =
      "default, or parts joined by '+': mma.sync, row-major, no-skip, narrow, ctas=N, static";
  if (name == "default") return {};
  GemmConfig c;
  std::string seen = "+";  // the parts taken so far, each followed by '+'
  size_t i = 0;
  while (i <= name.size()) {
    size_t j = name.find('+', i);
    if (j == std::string::npos) j = name.size();
    const std::string part = name.substr(i, j - i);
    const std::string key = part.rfind("ctas=", 0) == 0 ? "ctas=" : part;
    if (seen.find("+" + key + "+") != std::string::npos) fail("GEMM variant '", name, "': '", key, "' given twice");
    seen += key + "+";
    if (part == "mma.sync") {
      c.kernel = GemmConfig::Kernel::kMmaSync;
    } else if (part == "row-major") {
      c.expert_raster = false;
    } else if (part == "no-skip") {
      c.skip_empty_rows = false;
    } else if (part == "narrow") {
      c.narrow_weight_tiles = true;
    } else if (part == "static") {
      c.dynamic_schedule = false;
    } else if (key == "ctas=") {
      const std::string n = part.substr(5);
      const bool digits = !n.empty() && n.find_first_not_of("0123456789") == std::string::npos;
      errno = 0;
      const long v = digits ? std::strtol(n.c_str(), nullptr, 10) : 0;
      if (!digits || errno != 0 || v < 1 || v > INT_MAX)
        fail("GEMM variant '", name, "': ctas=N needs a positive integer N, got '", n, "'");
      c.max_ctas = int(v);
    } else {
      fail("GEMM variant '", name, "': unknown part '", part, "' (expected ", kKnown, ")");
    }
    i = j + 1;
  }
  return c;
}

}  // namespace k3::moe::cuda
