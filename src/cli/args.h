// Argument helpers shared by the k3 subcommands.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace k3::cli {

// "1,2,3" -> {1,2,3}. Throws k3::Error naming the flag and the bad item.
std::vector<int32_t> parse_ids(const std::string& text, const std::string& flag);

// Seconds since the first call (for progress lines).
double elapsed_seconds();

}  // namespace k3::cli
