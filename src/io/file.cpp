#include "io/file.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace k3 {

std::string read_file(const std::string& path, const std::string& what) {
  if (std::filesystem::is_directory(path)) fail(path, ": cannot open ", what, " (it is a directory)");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, ": cannot open ", what, " (", std::strerror(errno), ")");
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) fail(path, ": read error in ", what);
  return ss.str();
}

}  // namespace k3
