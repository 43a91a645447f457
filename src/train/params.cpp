#include "train/params.h"

#include <filesystem>

#include "core/error.h"
#include "core/finite.h"
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
double* ParamStore::p_mut(const std::string& name, int64_t numel) { return values().data() + entry(name, numel).offset; }
double* ParamStore::g(const std::string& name, int64_t numel) { return grads_.data() + entry(name, numel).offset; }
const double* ParamStore::g(const std::string& name, int64_t numel) const {
  return grads_.data() + entry(name, numel).offset;
}
const std::vector<int64_t>& ParamStore::shape(const std::string& name) const { return entry(name, -1).shape; }
int64_t ParamStore::numel(const std::string& name) const { return entry(name, -1).numel; }

std::vector<std::string> ParamStore::names() const {
  std::vector<std::string> out;
  for (const auto& [n, e] : index_) out.push_back(n);
  return out;
}

void ParamStore::zero_grads() { std::fill(grads_.begin(), grads_.end(), 0.0); }

ParamStore ParamStore::from_model_dir(const std::string& dir) {
  const SafeTensors st = SafeTensors::open(dir);
  ParamStore ps;
  for (const std::string& name : st.names()) {
    const TensorView& t = st.get(name);
    if (t.dtype != DType::F32 && t.dtype != DType::BF16 && t.dtype != DType::F16) {
      if (name.find("weight_packed") != std::string::npos || name.find("weight_scale") != std::string::npos)
        fail(st.path(), ": tensor '", name, "' is MXFP4; training needs BF16/F32 experts");
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
