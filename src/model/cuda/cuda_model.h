// The Kimi K3 text model on one NVIDIA Hopper GPU: the CUDA twin of model/model.h.
//
// Same contract as k3::Model::forward: every sequence's new tokens are appended after what its cache
// holds, so one entry point serves full recomputation, prefill and decoding. Weights are uploaded
// once at load; the per-sequence state (KDA conv tails and fp32 recurrent state, MLA latent rows)
// lives on the device in a CudaSequenceCache; only token ids go up and logits come down.
//
// Two precisions (docs/CUDA.md, "The model on the GPU"):
//   BF16  the serving path: bf16 weights (routed experts bf16 or MXFP4 as stored) and bf16 activations
//         into every GEMM; fp32 residual stream, AttnRes, norms' math, softmax, router, KDA state and
//         MoE aggregate. KDA prefill runs the 16-token tensor-core chunk kernel, decode the fused
//         recurrence; MLA prefill the flash kernel, decode the absorbed split-K kernel.
//   F32   the parity path (TF32 off everywhere): fp32 activations, and the CPU's own accumulation
//         choices (kernels/gemm/linear.h, docs/NUMERICS.md): GEMMs accumulate in fp64 on fp64 copies of
//         the weights, MLA attention keeps kvh, scores and sums in fp64 (always in the expanded form,
//         decode included, where the CPU switches to the absorbed form; both are fp64), the KDA
//         recurrence runs token by token in fp32. Checked against the float64 golden fixtures at the
//         CPU's bars.
// Not thread-safe: one model, one caller, the default stream.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/generate.h"
#include "model/layers.h"

namespace k3 {

enum class GpuPrecision { BF16, F32 };
const char* gpu_precision_name(GpuPrecision p);
// "bf16" or "f32"; anything else is a k3::Error naming `what` (e.g. the CLI flag).
GpuPrecision parse_gpu_precision(const std::string& s, const char* what);

// Empty when the GPU kernels can run a model of this config in this precision, else what they cannot
// take (config fields named). CudaModel::load refuses such a config up front; usable without a GPU.
std::string gpu_config_problem(const K3Config& c, GpuPrecision p);

class CudaModel;

// One sequence's decoding state on the device. Made by CudaModel::new_cache(); usable only with
// the model that made it.
class CudaSequenceCache {
 public:
  ~CudaSequenceCache();
  CudaSequenceCache(const CudaSequenceCache&) = delete;
  CudaSequenceCache& operator=(const CudaSequenceCache&) = delete;
  int64_t length() const;  // tokens consumed so far
  size_t bytes() const;    // device memory held

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  friend class CudaModel;
  explicit CudaSequenceCache(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A copy of part of a sequence's device state (CudaModel::copy_state): its MLA rows [begin, end) and its KDA
// tails and state at `end`, in device memory.
class CudaStateCopy {
 public:
  ~CudaStateCopy();
  size_t bytes() const;
  struct Impl;
  explicit CudaStateCopy(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class CudaModel {
 public:
  // dir: a Hugging Face model directory, as Model::load. Throws k3::Error when the build has no CUDA
  // backend, no Hopper GPU is visible, or the weights do not fit.
  static std::unique_ptr<CudaModel> load(const std::string& dir, GpuPrecision precision);
  static std::unique_ptr<CudaModel> load(const std::string& config_path, const std::string& weights_path,
                                         GpuPrecision precision);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const K3Config& config() const;
  GpuPrecision precision() const;
  size_t weight_bytes() const;  // device memory held by the weights
  // Device memory a sequence's state takes at `tokens` tokens (CudaSequenceCache::bytes() with its rows exactly
  // filled; a pool grows its rows geometrically, by up to 2x that).
  size_t sequence_bytes(int64_t tokens) const;
  std::unique_ptr<CudaSequenceCache> new_cache() const;
  // B caches whose device state lives in one pool (with one more place, which pads decode graphs): a decode
  // step over any of them (one new token each, at least 4 cached, leading the forward's sequences) runs the
  // short conv, KDA core, MLA cache append and absorbed decode as one launch each, whatever their order and
  // lengths; a prefill over all of them in order with equal token counts runs the conv and KDA core as one.
  // Any other use is correct too, one sequence at a time. Each sequence's MLA rows grow on their own.
  std::vector<std::unique_ptr<CudaSequenceCache>> new_caches(int64_t B) const;

  // As Model::forward: appends tokens[b] to *caches[b] and returns fp32 logits on the host, one row
  // per new token (all_positions) or per sequence. Hooks receive `attn_out`, `ffn_out` (fp32, copied
  // to the host) and the routed experts, with the fixtures' names.
  std::vector<float> forward(const std::vector<CudaSequenceCache*>& caches,
                             const std::vector<std::vector<int32_t>>& tokens, bool all_positions,
                             const ForwardHooks* hooks = nullptr);

  // As Engine::forward_pick: appends like forward(.., false), then per sequence what picks[b] asks. Ids are chosen
  // on the device (kernels/sample/pick_cuda.h) and only the rows whose logits are asked for come to the host;
  // every row is checked for non-finite logits all the same.
  std::vector<PickResult> forward_pick(const std::vector<CudaSequenceCache*>& caches,
                                       const std::vector<std::vector<int32_t>>& tokens,
                                       const std::vector<TokenPick>& picks, const ForwardHooks* hooks = nullptr);
  // Decode graphs (on by default): forward_pick runs a decode step over sequences of one pool (one new token each,
  // at least 4 cached, BF16, not the reference forms, profiling off) as a CUDA graph captured once per pool and
  // batch bucket, rather than as ~40 launches per layer. The same kernels on the same inputs: a graph step gives
  // the eager step's bits (tested). A capture that fails turns them off for the model (graphs_off_reason says why).
  void set_graphs(bool on);
  std::string graphs_off_reason() const;
  int64_t graph_count() const;  // graphs held now
  // Makes `c` fresh (length 0, zero KDA tails and state) in its place in its pool (Engine::reset).
  void reset_cache(CudaSequenceCache& c) const;

  // A prefix cache's copies (Engine::snapshot / restore): the state of `c` with its MLA rows from rows_from, and
  // a fresh cache made to hold the state a contiguous chain of copies describes (rows of each in order, the KDA
  // state of the last). Device-to-device copies on the default stream.
  std::unique_ptr<CudaStateCopy> copy_state(const CudaSequenceCache& c, int64_t rows_from) const;
  void restore_state(CudaSequenceCache& c, const std::vector<const CudaStateCopy*>& chain) const;

  // Profiling: with it on, forward() waits for the GPU after every block and charges the wall time to
  // the block's kind (the waits themselves cost a few microseconds each: use for a breakdown, not
  // for throughput).
  void set_profile(bool on);
  // The specification forms (K3_REFERENCE=1 at load, as for the CPU model): the KDA recurrence token by
  // token instead of 16-token chunks, and MLA expanded (keys and values of every cached position)
  // instead of absorbed, whatever the number of new tokens. The f32 path always runs them.
  void set_reference(bool on);
  bool reference() const;
  const BlockTimings& timings() const;
  void reset_timings();

  struct Impl;

 private:
  CudaModel();
  std::unique_ptr<Impl> impl_;
};

}  // namespace k3
