// Trainable parameters and their gradients, in float64, in two flat buffers with named views.
//
// Training runs in float64 on the CPU: the golden gradients are float64 reference values, finite
// differences need it, and a tiny model's step is dominated by per-token work, not GEMM speed.
// Names are the release's tensor names (`language_model.model.layers.3.self_attn.q_proj.weight`, from
// the tensor table), so a checkpoint is the parameter buffer written back under the same names. One
// flat buffer each for values and gradients means the optimizer, clipping and checkpointing touch one
// array.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/tensor_init.h"
#include "model/tensor_table.h"

namespace k3::train {

class ParamStore {
 public:
  // Every floating-point tensor of a model directory (config.json + safetensors), widened to f64.
  // MXFP4 expert tensors are not supported for training (decode them to BF16 first).
  static ParamStore from_model_dir(const std::string& dir);

  // A fresh model, initialised in memory from the tensor table (model/tensor_table.h) and its
  // initialisers (model/tensor_init.h): what `k3 init` with `opt` writes and from_model_dir reads
  // back, bit for bit and in the same layout (release names, BF16 tensors rounded to BF16, tensors
  // laid out in name order). MXFP4 experts are refused (training keeps experts in BF16).
  static ParamStore random_init(const K3Config& c, const RandomInitOptions& opt);

  // A gradient lane of `base`: the same tensors, reading `base`'s values (which must outlive it and
  // not be resized), with a gradient buffer of its own. The trainer runs a step's sequences on
  // several lanes at once and sums their gradients in lane order (train/grad_lanes.h). A lane's
  // values are read-only: p_mut()/values() on it throw.
  static ParamStore gradient_lane(const ParamStore& base);

  // Adds a zero-initialised tensor (names must be new; not on a gradient lane).
  void add(const std::string& name, const std::vector<int64_t>& shape);
  // Room for `total` values before a run of add() (the buffers otherwise regrow by copying: at
  // billions of parameters that is minutes and up to twice the memory).
  void reserve(int64_t total);

  bool has(const std::string& name) const { return index_.count(name) != 0; }
  // Value and gradient of a tensor; throws k3::Error naming the tensor when it is absent or, when
  // `numel` >= 0, when its size differs.
  const double* p(const std::string& name, int64_t numel = -1) const;
  double* p_mut(const std::string& name, int64_t numel = -1);
  double* g(const std::string& name, int64_t numel = -1);
  const double* g(const std::string& name, int64_t numel = -1) const;
  const std::vector<int64_t>& shape(const std::string& name) const;
  int64_t numel(const std::string& name) const;
  // Where the tensor starts in values() and grads() (a device mirror of the flat buffers uses the same
  // layout: model/cuda/training).
  int64_t offset(const std::string& name) const;

  std::vector<std::string> names() const;  // sorted
  void zero_grads();
  std::vector<double>& values();
  std::vector<double>& grads() { return grads_; }
  const std::vector<double>& values() const { return shared_values_ ? *shared_values_ : values_; }
  const std::vector<double>& grads() const { return grads_; }

 private:
  struct Entry {
    int64_t offset = 0;
    std::vector<int64_t> shape;
    int64_t numel = 0;
  };
  const Entry& entry(const std::string& name, int64_t numel) const;
  std::map<std::string, Entry> index_;
  std::vector<double> values_, grads_;
  const std::vector<double>* shared_values_ = nullptr;  // a gradient lane's base values
};

// The naming P's tensors use (release or flat), told by its embedding; throws k3::Error naming
// both embedding names when it has neither.
TensorNaming param_naming(const ParamStore& P);

// The first tensor of P (in name order) whose values, or with `gradients` whose gradients, hold a NaN
// or an infinity, as "'NAME' (NaN at flat index I)"; "" when every one is finite. One scan of the flat
// buffer; the tensors are walked only when it finds something.
std::string first_nonfinite_tensor(const ParamStore& P, bool gradients);

}  // namespace k3::train
