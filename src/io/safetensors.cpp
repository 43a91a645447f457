#include "io/safetensors.h"
#include "io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <unordered_set>

#include "core/error.h"
#include "core/json.h"
#include "io/file.h"
#include "io/output_file.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace k3 {

// Headers of real checkpoints are a few MB (the released K3 shard with the most tensors has
// ~6k entries); 100 MB rejects garbage length fields without refusing any real file.
static constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorView::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

SafeTensors::SafeTensors() = default;
SafeTensors::~SafeTensors() = default;
SafeTensors::SafeTensors(SafeTensors&&) noexcept = default;
SafeTensors& SafeTensors::operator=(SafeTensors&&) noexcept = default;

SafeTensors SafeTensors::open(const std::string& path) {
  SafeTensors st;
  st.path_ = path;
  std::error_code ec;
  if (!fs::exists(path, ec)) fail(path, ": no such file or directory");
  if (!fs::is_directory(path, ec)) {
    st.add_file(path, nullptr);
    return st;
  }
  fs::path index = fs::path(path) / "model.safetensors.index.json";
  if (fs::exists(index, ec)) {
    const json j = parse_json(read_file(index.string(), "safetensors index"), index.string(), {kMaxJsonDepth, true});
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      fail(index.string(), ": expected an object with a \"weight_map\" object");
    std::map<std::string, std::vector<std::string>> by_file;
    for (auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string()) fail(index.string(), ": weight_map[\"", name, "\"] is not a file name");
      by_file[file.get<std::string>()].push_back(name);
    }
    if (by_file.empty()) fail(index.string(), ": weight_map is empty");
    for (auto& [file, names] : by_file) {
      if (file.find('/') != std::string::npos || file.empty() || file == "." || file == "..")
        fail(index.string(), ": shard name '", file, "' must be a plain file name");
      st.add_file((fs::path(path) / file).string(), &names);
    }
    return st;
  }
  // Hugging Face's single-file name wins over other .safetensors files lying beside it.
  if (fs::exists(fs::path(path) / "model.safetensors", ec)) {
    st.add_file((fs::path(path) / "model.safetensors").string(), nullptr);
    return st;
  }
  std::vector<std::string> found;
  for (auto& e : fs::directory_iterator(path, ec))
    if (e.path().extension() == ".safetensors") found.push_back(e.path().string());
  if (found.empty()) fail(path, ": no model.safetensors.index.json and no *.safetensors file");
  if (found.size() > 1)
    fail(path, ": ", found.size(),
         " .safetensors files but no model.safetensors.index.json to say which tensor is where");
  st.add_file(found[0], nullptr);
  return st;
}

void SafeTensors::add_file(const std::string& file, const std::vector<std::string>* expected_names) {
  auto mf = std::make_unique<MappedFile>(file, "safetensors file");
  const size_t size = mf->size();
  if (size < 8) fail(file, ": truncated: ", size, " bytes, a safetensors file starts with an 8-byte header length");
  uint64_t hlen;
  std::memcpy(&hlen, mf->data(), 8);
  if (hlen > kMaxHeaderBytes) fail(file, ": header length ", hlen, " exceeds the ", kMaxHeaderBytes, "-byte bound");
  if (8 + hlen > size)
    fail(file, ": truncated: header says ", hlen, " bytes but the file has ", size - 8, " after the length");
  // Unique keys: a tensor named twice would be read as the last entry here and the first elsewhere.
  const json h = parse_json(std::string_view(reinterpret_cast<const char*>(mf->data()) + 8, size_t(hlen)),
                            file + ": header", {kMaxJsonDepth, /*unique_keys=*/true});
  if (!h.is_object()) fail(file, ": header is not a JSON object");
  const size_t base = 8 + hlen;
  const size_t data_size = size - base;
  const std::string* file_name = nullptr;
  files_.push_back(std::move(mf));
  MappedFile& m = *files_.back();
  file_name = &m.path();

  // The names the index places in this file, hashed: a release shard holds ~5,000 tensors.
  std::optional<std::unordered_set<std::string_view>> expected;
  if (expected_names) expected.emplace(expected_names->begin(), expected_names->end());
  struct Span {
    size_t b, e;
    std::string name;
  };
  std::vector<Span> spans;  // every tensor of the file, also those the index places elsewhere
  for (auto& [name, v] : h.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) fail(file, ": __metadata__ is not an object");
      for (auto& [k, s] : v.items()) {
        if (!s.is_string()) fail(file, ": __metadata__[\"", k, "\"] is not a string");
        metadata_[k] = s.get<std::string>();
      }
      continue;
    }
    const std::string where = file + ": tensor '" + name + "'";
    if (!v.is_object()) fail(where, ": entry is not an object");
    if (!v.contains("dtype") || !v["dtype"].is_string()) fail(where, ": missing string field \"dtype\"");
    if (!v.contains("shape") || !v["shape"].is_array()) fail(where, ": missing array field \"shape\"");
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
      fail(where, ": missing field \"data_offsets\" [begin, end]");
    TensorView t;
    t.name = name;
    std::string dt = v["dtype"].get<std::string>();
    if (!dtype_from_name(dt, &t.dtype))
      fail(where, ": unsupported dtype ", dt, " (k3cpp reads F32, BF16, F16, U8, I64)");
    unsigned __int128 numel = 1;
    for (auto& d : v["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) fail(where, ": shape entries must be non-negative integers");
      t.shape.push_back(d.get<int64_t>());
      numel *= uint64_t(t.shape.back());
      // Bound the byte size, not just numel, so numel * dtype_size below cannot wrap in 64 bits.
      if (numel * dtype_size(t.dtype) > (unsigned __int128)(1ull << 62))
        fail(where, ": shape ", v["shape"].dump(), " is too large");
    }
    for (auto& d : v["data_offsets"])
      if (!d.is_number_unsigned() && !(d.is_number_integer() && d.get<int64_t>() >= 0))
        fail(where, ": data_offsets must be non-negative integers");
    const uint64_t b = v["data_offsets"][0].get<uint64_t>(), e = v["data_offsets"][1].get<uint64_t>();
    if (b > e) fail(where, ": data_offsets begin ", b, " > end ", e);
    if (e > data_size)
      fail(where, ": data_offsets end ", e, " is past the end of the data (", data_size,
           " bytes; file truncated or header lies)");
    const uint64_t want = uint64_t(numel) * dtype_size(t.dtype);
    if (e - b != want)
      fail(where, ": shape ", t.shape_str(), " x ", dt, " needs ", want, " bytes but data_offsets span ", e - b);
    spans.push_back({size_t(b), size_t(e), name});
    if (expected && !expected->count(name))
      continue;  // in the shard, but the index places it elsewhere: the index wins
    if (tensors_.count(name)) fail(where, ": tensor name appears twice in the checkpoint");
    t.nbytes = size_t(e - b);
    t.file = file_name;
    t.file_offset = base + size_t(b);
    t.data = m.data() + base + b;
    if (reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) != 0) {
      // Valid but unusual: keep an aligned copy so kernels may load dtype-sized words.
      auto copy = std::make_unique<std::vector<uint8_t>>(t.data, t.data + t.nbytes);
      t.data = copy->data();
      realigned_.push_back(std::move(copy));
    }
    tensors_.emplace(name, std::move(t));
  }
  // The tensors' bytes must tile the data section, as the safetensors format requires: no two
  // overlapping, and no byte that belongs to no tensor (a gap or a tail that other readers reject,
  // and where nothing checked would hide). Empty tensors occupy no bytes and may sit anywhere.
  std::sort(spans.begin(), spans.end(),
            [](const Span& x, const Span& y) { return x.b < y.b || (x.b == y.b && x.e < y.e); });
  size_t covered = 0;
  const Span* last = nullptr;
  for (const Span& s : spans) {
    if (s.e == s.b) continue;
    if (s.b < covered)
      fail(file, ": tensors '", last->name, "' and '", s.name, "' overlap (bytes ", s.b, "..", std::min(s.e, covered),
           " of the data section)");
    if (s.b > covered)
      fail(file, ": bytes ", covered, "..", s.b, " of the data section belong to no tensor (before tensor '", s.name,
           "')");
    covered = s.e;
    last = &s;
  }
  if (covered != data_size)
    fail(file, ": the last ", data_size - covered, " bytes of the file (after byte ", base + covered,
         ") belong to no tensor");
  if (expected_names)
    for (const std::string& n : *expected_names)
      if (!tensors_.count(n)) fail(file, ": the index places tensor '", n, "' in this shard but it is not there");
}

const TensorView& SafeTensors::get(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    // Name the file to look in: the one checkpoint file, or the index of a sharded checkpoint.
    const std::string where = files_.size() == 1  ? files_[0]->path()
                              : files_.size() > 1 ? (fs::path(path_) / "model.safetensors.index.json").string()
                                                  : path_;
    fail(where, ": missing tensor '", name, "'");
  }
  return it->second;
}

std::vector<std::string> SafeTensors::names() const {
  std::vector<std::string> out;
  for (auto& [n, t] : tensors_) out.push_back(n);
  return out;
}

static void check_shape(const TensorView& t, const std::vector<int64_t>& expect) {
  if (expect.empty()) return;
  if (t.shape != expect) {
    TensorView e;
    e.shape = expect;
    fail(*t.file, ": tensor '", t.name, "' has shape ", t.shape_str(), ", expected ", e.shape_str());
  }
}

std::vector<float> SafeTensors::read_f32(const std::string& name, const std::vector<int64_t>& expect) const {
  const TensorView& t = get(name);
  check_shape(t, expect);
  if (t.dtype != DType::F32 && t.dtype != DType::BF16 && t.dtype != DType::F16)
    fail(*t.file, ": tensor '", name, "' has dtype ", dtype_name(t.dtype), ", expected a float dtype");
  std::vector<float> out(size_t(t.numel()));
  widen_to_f32(out.data(), t.data, t.dtype, out.size());
  return out;
}

std::vector<int64_t> SafeTensors::read_i64(const std::string& name) const {
  const TensorView& t = get(name);
  if (t.dtype != DType::I64) fail(*t.file, ": tensor '", name, "' has dtype ", dtype_name(t.dtype), ", expected I64");
  std::vector<int64_t> out(size_t(t.numel()));
  if (t.nbytes) std::memcpy(out.data(), t.data, t.nbytes);  // memcpy from/to null is UB even for 0 bytes
  return out;
}

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  size_t off = 0;
  std::vector<size_t> sizes;
  for (const auto& t : tensors) {
    size_t n = dtype_size(t.dtype);
    for (int64_t d : t.shape) {
      if (d < 0) fail(path, ": tensor '", t.name, "' has a negative dimension");
      n *= size_t(d);
    }
    if (t.name == "__metadata__") fail(path, ": tensor name '__metadata__' is reserved for the metadata");
    if (h.contains(t.name)) fail(path, ": tensor '", t.name, "' given twice");
    h[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {off, off + n}}};
    sizes.push_back(n);
    off += n;
  }
  std::string hs = h.dump();
  while ((8 + hs.size()) % 8 != 0) hs.push_back(' ');  // keep the data section 8-byte aligned
  const uint64_t hlen = hs.size();
  OutputFile out(path);
  out.write(&hlen, 8);
  out.write(hs.data(), hs.size());
  for (size_t i = 0; i < tensors.size(); ++i) out.write(tensors[i].data, sizes[i]);
  out.commit();
}

}  // namespace k3
