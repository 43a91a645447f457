// The tokenizer of the tests' tiny models: the first 768 o200k ranks (a BPE vocabulary is closed under taking a
// rank prefix), so with K3's 256 specials its ids end exactly at the k3-tiny-a fixture's vocabulary of 1,024.
#pragma once
#include <filesystem>
#include <fstream>
#include <string>

#include "compare.h"

namespace k3test {

// Writes DIR/tiktoken.model (creating DIR); returns DIR.
inline std::string write_tiny_tokenizer(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  std::ifstream in(fixture("tokenizer/o200k.tiktoken"));
  std::ofstream out(dir / "tiktoken.model");
  std::string line;
  for (int i = 0; i < 768 && std::getline(in, line); ++i) out << line << "\n";
  return dir.string();
}

}  // namespace k3test
