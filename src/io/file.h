// Whole-file reads for the small text inputs the engine takes (configs, requests, prompts).
#pragma once
#include <string>

namespace k3 {

// The bytes of path. Throws k3::Error "<path>: cannot open <what>" (with the OS reason) when it
// cannot be read; `what` names the role, e.g. "config".
std::string read_file(const std::string& path, const std::string& what = "file");

}  // namespace k3
