#include "train/checkpoint.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>

#include "core/error.h"
#include "core/json.h"
#include "io/file.h"
#include "io/safetensors.h"

namespace k3::train {

namespace fs = std::filesystem;

namespace {
constexpr char kMagic[8] = {'K', '3', 'T', 'R', 'N', 'S', '0', '1'};
}  // namespace

std::string step_name(int64_t step) {
  char b[32];
  std::snprintf(b, sizeof b, "step-%08lld", (long long)step);
  return b;
}

namespace {

void append_doubles(std::string& out, const std::vector<double>& v) {
  out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(double));
}

// A model directory's files in `dir`: config.json, the extra files (`what` names them in errors) and
// model.safetensors, F32 copies under the release names.
void write_model_files(const fs::path& dir, const std::string& config_json, const ParamStore& P,
                       const std::vector<std::string>& extra_files, const char* what,
                       const std::map<std::string, std::string>& meta) {
  write_file_atomic((dir / "config.json").string(), config_json);
  for (const std::string& f : extra_files)
    write_file_atomic((dir / fs::path(f).filename()).string(), read_file(f, what));
  std::vector<std::vector<float>> f32;
  std::vector<TensorToWrite> tensors;
  const std::vector<std::string> names = P.names();
  f32.reserve(names.size());
  for (const std::string& n : names) {
    const double* v = P.p(n);
    f32.emplace_back(v, v + P.numel(n));
    tensors.push_back({n, DType::F32, P.shape(n), f32.back().data()});
  }
  write_safetensors((dir / "model.safetensors").string(), tensors, meta);
}

}  // namespace

void write_model_dir(const std::string& dir, const std::string& config_json, const ParamStore& P,
                     const std::vector<std::string>& extra_files) {
  const fs::path final_dir(dir), tmp = final_dir.parent_path() / (".tmp-" + final_dir.filename().string());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  write_model_files(tmp, config_json, P, extra_files, "a file the model directory carries", {{"format", "pt"}});
  fs::remove_all(final_dir);
  fs::rename(tmp, final_dir);
}

std::string save_checkpoint(const std::string& out_dir, int64_t step, const std::string& config_json,
                            const ParamStore& P, const TrainState& state, const std::vector<std::string>& extra_files) {
  fs::create_directories(out_dir);
  for (const auto& e : fs::directory_iterator(out_dir))  // leftovers of a killed save
    if (e.path().filename().string().rfind(".tmp-", 0) == 0) fs::remove_all(e.path());
  const std::string name = step_name(step);
  const fs::path tmp = fs::path(out_dir) / (".tmp-" + name), final_dir = fs::path(out_dir) / name;
  // mkdir, not create_directories: nothing may already stand at the temporary's name (the loop above
  // removed what a killed save left; the run directory's lock keeps other writers out).
  std::error_code ec;
  if (!fs::create_directory(tmp, ec) || ec)
    fail(tmp.string(), ": cannot create the checkpoint's temporary directory (", ec ? ec.message() : "it exists", ")");

  write_model_files(tmp, config_json, P, extra_files, "a file the checkpoint carries",
                    {{"format", "pt"}, {"k3_train_step", std::to_string(step)}});
  const std::vector<std::string> names = P.names();

  // train_state.bin: magic, u64 JSON length, JSON, then the doubles in the order the JSON lists.
  nlohmann::json header = {{"meta", state.meta}, {"optimizer_size", state.optimizer.size()}};
  nlohmann::json params = nlohmann::json::array();
  for (const std::string& n : names) params.push_back({n, P.numel(n)});
  header["params"] = params;
  nlohmann::json bal = nlohmann::json::array();
  for (const auto& b : state.balancers) bal.push_back(b.size());
  header["balancers"] = bal;
  const std::string js = header.dump();
  std::string bytes(kMagic, 8);
  const uint64_t len = js.size();
  bytes.append(reinterpret_cast<const char*>(&len), 8);
  bytes += js;
  for (const std::string& n : names)
    bytes.append(reinterpret_cast<const char*>(P.p(n)), size_t(P.numel(n)) * sizeof(double));
  append_doubles(bytes, state.optimizer);
  for (const auto& b : state.balancers) append_doubles(bytes, b);
  write_file_atomic((tmp / "train_state.bin").string(), bytes);

  if (fs::exists(final_dir)) fs::remove_all(final_dir);  // a re-save of the same step
  fs::rename(tmp, final_dir);
  write_file_atomic((fs::path(out_dir) / "latest").string(), name + "\n");
  return final_dir.string();
}

std::string latest_checkpoint(const std::string& out_dir) {
  const fs::path p = fs::path(out_dir) / "latest";
  if (!fs::exists(p)) return "";
  std::string name = read_file(p.string(), "checkpoint pointer", InputRole::kOwnState);
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) name.pop_back();
  const fs::path dir = fs::path(out_dir) / name;
  if (name.empty() || !fs::is_directory(dir))
    fail(p.string(), ": names '", name, "', which is not a checkpoint directory");
  return dir.string();
}

void load_checkpoint(const std::string& step_dir, ParamStore& P, TrainState& state) {
  const std::string path = (fs::path(step_dir) / "train_state.bin").string();
  const std::string bytes = read_file(path, "training state");
  if (bytes.size() < 16 || std::memcmp(bytes.data(), kMagic, 8) != 0)
    fail(path, ": not a k3 training state (bad magic)");
  uint64_t len = 0;
  std::memcpy(&len, bytes.data() + 8, 8);
  if (len > bytes.size() - 16) fail(path, ": truncated header");
  const nlohmann::json header = parse_json(std::string_view(bytes).substr(16, len), path + ": header");
  size_t off = 16 + len;
  auto take = [&](double* dst, size_t n, const std::string& what) {
    if ((bytes.size() - off) / sizeof(double) < n) fail(path, ": truncated in ", what);
    std::memcpy(dst, bytes.data() + off, n * sizeof(double));
    off += n * sizeof(double);
  };
  // A count read from the header, bounded by the bytes left, before anything is allocated for it.
  auto count = [&](const nlohmann::json& v, const std::string& what) {
    const uint64_t n = v.get<uint64_t>();
    if (n > (bytes.size() - off) / sizeof(double))
      fail(path, ": the header gives ", what, " ", n, " values, more than the file holds (truncated or corrupt)");
    return size_t(n);
  };
  try {
    const auto& params = header.at("params");
    if (params.size() != P.names().size())
      fail(path, ": holds ", params.size(), " parameters, the model has ", P.names().size());
    for (const auto& e : params) {
      const std::string n = e.at(0).get<std::string>();
      const int64_t numel = e.at(1).get<int64_t>();
      if (!P.has(n) || P.numel(n) != numel)
        fail(path, ": parameter '", n, "' (", numel, " values) does not match the model");
      take(P.p_mut(n), size_t(numel), n);
    }
    state.meta = header.at("meta");
    state.optimizer.resize(count(header.at("optimizer_size"), "the optimizer state"));
    take(state.optimizer.data(), state.optimizer.size(), "optimizer state");
    state.balancers.clear();
    for (const auto& b : header.at("balancers")) {
      state.balancers.emplace_back(count(b, "a balancer state"));
      take(state.balancers.back().data(), state.balancers.back().size(), "balancer state");
    }
  } catch (const nlohmann::json::exception& e) {  // a missing key or a value of the wrong type
    fail(path, ": corrupt header (", e.what(), ")");
  }
  if (off != bytes.size()) fail(path, ": ", bytes.size() - off, " unexpected trailing bytes");
}

}  // namespace k3::train
