// Raw edits of safetensors files for tests: a file as its JSON header and its data section.
#pragma once
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace k3test {

inline std::string read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

inline void write_bytes(const std::filesystem::path& p, const std::string& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(b.data(), std::streamsize(b.size()));
  if (!out.good()) throw std::runtime_error("cannot write " + p.string());
}

struct StFile {
  nlohmann::json header;
  std::string data;  // the bytes after the header
  uint64_t header_len = 0;
};

inline StFile read_st(const std::filesystem::path& p) {
  const std::string b = read_bytes(p);
  StFile f;
  if (b.size() < 8) throw std::runtime_error(p.string() + ": not a safetensors file");
  std::memcpy(&f.header_len, b.data(), 8);
  f.header = nlohmann::json::parse(b.substr(8, f.header_len));
  f.data = b.substr(8 + f.header_len);
  return f;
}

// The header as given (padded to keep the data 8-byte aligned) in front of the data.
inline std::string st_bytes(const std::string& header_text, const std::string& data) {
  std::string h = header_text;
  while ((8 + h.size()) % 8) h += ' ';
  const uint64_t n = h.size();
  return std::string(reinterpret_cast<const char*>(&n), 8) + h + data;
}

inline void write_st(const std::filesystem::path& p, const StFile& f) { write_bytes(p, st_bytes(f.header.dump(), f.data)); }

}  // namespace k3test
