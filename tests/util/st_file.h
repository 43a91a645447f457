// Raw edits of safetensors files for tests: a file as its JSON header and its data section.
#pragma once
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
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

// Removes a tensor's entry and its bytes (later tensors move down), as a file written without it.
inline bool erase_tensor(StFile& f, const std::string& name) {
  if (!f.header.contains(name)) return false;
  const uint64_t b = f.header[name]["data_offsets"][0], e = f.header[name]["data_offsets"][1];
  f.header.erase(name);
  f.data.erase(size_t(b), size_t(e - b));
  for (auto& [k, v] : f.header.items())
    if (k != "__metadata__" && v["data_offsets"][0].get<uint64_t>() >= e)
      v["data_offsets"] = {v["data_offsets"][0].get<uint64_t>() - (e - b),
                           v["data_offsets"][1].get<uint64_t>() - (e - b)};
  return true;
}

// Applies edit(bytes, nbytes) to one tensor's data in place, the header left as it is.
inline void edit_tensor(const std::filesystem::path& file, const std::string& name,
                        const std::function<void(char*, size_t)>& edit) {
  StFile f = read_st(file);
  if (!f.header.contains(name)) throw std::runtime_error(file.string() + ": no tensor " + name);
  const uint64_t b = f.header[name]["data_offsets"][0], e = f.header[name]["data_offsets"][1];
  edit(f.data.data() + b, size_t(e - b));
  write_bytes(file, read_bytes(file).substr(0, 8 + f.header_len) + f.data);
}

inline void write_st(const std::filesystem::path& p, const StFile& f) {
  write_bytes(p, st_bytes(f.header.dump(), f.data));
}

}  // namespace k3test
