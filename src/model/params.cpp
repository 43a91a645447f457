#include "model/params.h"

#include <algorithm>
#include <filesystem>

#include "core/dtype.h"
#include "core/error.h"
#include "core/finite.h"
#include "core/memory.h"
#include "core/splitmix.h"
#include "io/safetensors.h"

namespace k3::train {

ParamStore ParamStore::gradient_lane(const ParamStore& base) {
  ParamStore lane;
  lane.index_ = base.index_;
  lane.shared_values_ = &base.values();
  lane.grads_.assign(base.grads_.size(), 0.0);
  return lane;
}

std::vector<double>& ParamStore::values() {
  if (shared_values_) fail("a gradient lane's parameter values are read-only");
  return values_;
}

void ParamStore::add(const std::string& name, const std::vector<int64_t>& shape) {
  if (shared_values_) fail("parameter '", name, "' added to a gradient lane");
  if (index_.count(name)) fail("parameter '", name, "' added twice");
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) fail("parameter '", name, "' has a negative dimension");
    n *= d;
  }
  index_[name] = {int64_t(values_.size()), shape, n};
  values_.resize(values_.size() + size_t(n), 0.0);
  grads_.resize(values_.size(), 0.0);
}

void ParamStore::reserve(int64_t total) {
  values_.reserve(size_t(total));
  grads_.reserve(size_t(total));
  advise_huge_pages(values_.data(), values_.capacity() * sizeof(double));
  advise_huge_pages(grads_.data(), grads_.capacity() * sizeof(double));
}

const ParamStore::Entry& ParamStore::entry(const std::string& name, int64_t numel) const {
  auto it = index_.find(name);
  if (it == index_.end()) fail("parameter '", name, "' is missing");
  if (numel >= 0 && it->second.numel != numel)
    fail("parameter '", name, "' has ", it->second.numel, " elements, expected ", numel);
  return it->second;
}

const double* ParamStore::p(const std::string& name, int64_t numel) const {
  return values().data() + entry(name, numel).offset;
}
double* ParamStore::p_mut(const std::string& name, int64_t numel) {
  return values().data() + entry(name, numel).offset;
}
double* ParamStore::g(const std::string& name, int64_t numel) { return grads_.data() + entry(name, numel).offset; }
const double* ParamStore::g(const std::string& name, int64_t numel) const {
  return grads_.data() + entry(name, numel).offset;
}
const std::vector<int64_t>& ParamStore::shape(const std::string& name) const { return entry(name, -1).shape; }
int64_t ParamStore::numel(const std::string& name) const { return entry(name, -1).numel; }
int64_t ParamStore::offset(const std::string& name) const { return entry(name, -1).offset; }

std::vector<std::string> ParamStore::names() const {
  std::vector<std::string> out;
  for (const auto& [n, e] : index_) out.push_back(n);
  return out;
}

void ParamStore::zero_grads() { std::fill(grads_.begin(), grads_.end(), 0.0); }

ParamStore ParamStore::from_model_dir(const std::string& dir) {
  const SafeTensors st = SafeTensors::open(dir);
  ParamStore ps;
  int64_t total = 0;
  for (const std::string& name : st.names()) {
    const TensorView& t = st.get(name);
    if (t.dtype == DType::F32 || t.dtype == DType::BF16 || t.dtype == DType::F16) total += t.numel();
  }
  ps.reserve(total);
  for (const std::string& name : st.names()) {
    const TensorView& t = st.get(name);
    if (t.dtype != DType::F32 && t.dtype != DType::BF16 && t.dtype != DType::F16) {
      if (is_mxfp4_name(name)) fail(st.path(), ": tensor '", name, "' is MXFP4; training needs BF16/F32 experts");
      continue;  // non-float tensors are not parameters
    }
    ps.add(name, t.shape);
    const std::vector<float> v = st.read_f32(name);
    if (const int64_t bad = first_nonfinite(v.data(), int64_t(v.size())); bad >= 0)
      fail(*t.file, ": tensor '", name, "' holds ", nonfinite_name(v[size_t(bad)]), " at flat index ", bad,
           " (training needs finite weights)");
    double* dst = ps.p_mut(name);
    for (size_t i = 0; i < v.size(); ++i) dst[i] = double(v[i]);
  }
  return ps;
}

ParamStore ParamStore::random_init(const K3Config& c, const RandomInitOptions& opt) {
  if (opt.mxfp4_experts)
    fail(c.source, ": training keeps routed experts in BF16; MXFP4 experts are for k3 init --mxfp4");
  const TensorTable table(c);
  std::vector<std::string> names;
  names.reserve(table.entries().size());
  for (const TensorEntry& e : table.entries()) names.push_back(table.name(e));
  // Laid out in name order, as from_model_dir lays out a checkpoint (SafeTensors::names() is sorted):
  // the flat buffer's order is the order of whole-buffer sums (clipping), so it is part of the result.
  std::vector<size_t> order(names.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return names[a] < names[b]; });
  ParamStore ps;
  int64_t total = 0;
  for (const TensorEntry& e : table.entries()) total += e.numel();
  ps.reserve(total);
  for (size_t i : order) ps.add(names[i], table.entries()[i].shape);
  // Drawn in table order (the random stream's order), each rounded to the dtype k3 init stores it in.
  auto draw = [&](TensorInitializer& init, size_t i, int64_t begin, int64_t n, std::vector<float>& v) {
    const TensorEntry& e = table.entries()[i];
    v.resize(size_t(n));
    init.fill(v.data(), n);
    if (init.stored_dtype(e) == DType::BF16) round_to_bf16(v.data(), n);
    double* dst = ps.p_mut(names[i], e.numel()) + begin;
    for (int64_t j = 0; j < n; ++j) dst[j] = double(v[size_t(j)]);
  };
  if (!opt.parallel_streams) {
    TensorInitializer init(c, opt);
    std::vector<float> v;
    for (size_t i = 0; i < names.size(); ++i) {
      init.begin(table.entries()[i]);
      draw(init, i, 0, table.entries()[i].numel(), v);
    }
    return ps;
  }
  struct Block {
    size_t tensor;
    int64_t begin, n;
  };
  std::vector<Block> blocks;
  for (size_t i = 0; i < names.size(); ++i)
    for (int64_t b = 0; b < table.entries()[i].numel(); b += kInitBlock)
      blocks.push_back({i, b, std::min(kInitBlock, table.entries()[i].numel() - b)});
#pragma omp parallel
  {
    std::vector<float> v;
#pragma omp for schedule(dynamic)
    for (int64_t k = 0; k < int64_t(blocks.size()); ++k) {
      const Block& b = blocks[size_t(k)];
      RandomInitOptions o = opt;
      o.seed = splitmix64(splitmix64(opt.seed ^ (uint64_t(b.tensor) << 32)) ^ uint64_t(b.begin / kInitBlock));
      TensorInitializer init(c, o);
      init.begin(table.entries()[b.tensor]);
      draw(init, b.tensor, b.begin, b.n, v);
    }
  }
  return ps;
}

TensorNaming param_naming(const ParamStore& P) {
  const auto n = detect_naming([&](const std::string& name) { return P.has(name); });
  if (!n)
    fail("training parameters: no '", tensor_name(TensorNaming::Release, TensorKind::TokenEmbd), "' or '",
         tensor_name(TensorNaming::Flat, TensorKind::TokenEmbd), "'");
  return *n;
}

std::string first_nonfinite_tensor(const ParamStore& P, bool gradients) {
  const std::vector<double>& all = gradients ? P.grads() : P.values();
  if (first_nonfinite(all.data(), int64_t(all.size())) < 0) return "";
  for (const std::string& n : P.names()) {
    const double* x = gradients ? P.g(n) : P.p(n);
    if (const int64_t bad = first_nonfinite(x, P.numel(n)); bad >= 0)
      return "'" + n + "' (" + nonfinite_name(x[bad]) + " at flat index " + std::to_string(bad) + ")";
  }
  return "";
}

}  // namespace k3::train
