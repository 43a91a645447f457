// The optimizers and gradient clipping on the GPU: the CUDA twin of train/optimizer.h (AdamW, Muon with
// Per-Head Muon, global-norm clipping), for the GPU trainer's fp32 master weights and fp32 gradients.
//
// Layout: `params` and `grads` are device fp32 mirrors of ParamStore's values() / grads(), tensor by
// tensor at ParamStore::offset(name). Optimizer state lives on the device in fp32, laid out exactly
// like the CPU Optimizer's flat state (AdamW m then v, Muon momentum, at each ParamPlan's state_offset),
// and is saved / loaded in the CPU's OptimizerState format (doubles, the same header), so a checkpoint
// moves between CPU and GPU runs and resumes either way.
//
// Arithmetic (what differs from the float64 CPU twin, and why it is safe):
// * Elementwise updates (AdamW moments and step, Muon momentum, decay and step) load and store fp32 but
//   compute in double in registers, in the CPU's order of operations: each stored value is rounded
//   once, so the only departure from the CPU is the fp32 storage of weights and state (2^-24 relative).
// * Muon: every Muon tensor is cut into its ParamPlan::heads row blocks; blocks of one shape (across
//   tensors too: the experts of a layer share one) are orthogonalised together, one strided-batched
//   GEMM per Newton–Schulz product. A block is transposed on the way in when it is tall, as the CPU
//   does, so the Gram matrix A = XXᵀ is the small one. The Frobenius norm of each block is a
//   deterministic two-pass sum of squares in double; a zero block gives a zero update (the CPU's exact
//   zero test). The GEMMs are pedantic fp32 (TF32 off), with X, A and B kept in fp32 between them and
//   the polynomial's sums in double. With `newton_schulz_bf16` the iteration runs as Muon is usually
//   run, on bf16 matrices: X, A and B are stored in bf16 and every product has fp32 accumulation, with
//   the polynomial's terms in cuBLAS's epilogue (B = c·A·A + b·A, X ← B·X + a·X, in fp32 before the
//   rounding to bf16). That moves no fp32 matrix through memory between the products; against the
//   fp32 path it adds one bf16 rounding of A and X inside the sums, the size of the rounding of the
//   operands that bf16 products have anyway.
// * Every reduction is in a fixed order (no floating-point atomics): results are bitwise identical
//   run to run.
// Device pointers; the default stream; no host synchronisation inside step() or clip_grad_norm_cuda.
#pragma once
#include <cstdint>
#include <vector>

#include "core/cuda.h"
#include "kernels/gemm/linear_cuda.h"
#include "model/params.h"
#include "train/optimizer.h"

namespace k3::train {

class CudaOptimizer {
 public:
  // `plan`: the CPU Optimizer built on the same ParamStore (its plan(), config(), state layout and
  // save/load format are the truth; its own state and step count are not copied: load_state does that).
  // params / grads: device fp32 [P.values().size()] flat mirrors (kept by pointer; they, P's layout
  // and ctx must outlive this). newton_schulz_bf16: run Newton–Schulz's GEMMs with bf16 operands
  // (fp32 accumulation) instead of pedantic fp32. The device state (AdamW m, v; Muon momentum) starts
  // at zero, step count 0. Throws k3::Error when the plan does not match P.
  CudaOptimizer(const Optimizer& plan, const ParamStore& P, float* params, float* grads, gemm::cuda::GemmContext& ctx,
                bool newton_schulz_bf16);
  ~CudaOptimizer();
  CudaOptimizer(const CudaOptimizer&) = delete;
  CudaOptimizer& operator=(const CudaOptimizer&) = delete;

  // One update of `params` from `grads` (the caller zeroes / accumulates / clips them) at learning rate
  // lr (times each tensor's ParamPlan::lr_scale). Device only: queued on the default stream.
  void step(double lr);

  int64_t steps_taken() const { return t_; }
  const std::vector<ParamPlan>& plan() const { return plan_; }

  // Device tables (plain data, public only so that the kernels can name them).
  // One AdamW tensor: elements [start, start + numel) of the concatenation of all AdamW tensors.
  struct AdamSegment {
    int64_t start = 0, param = 0, state = 0, numel = 0;  // param / state: offsets in params / state
    double lr_scale = 1.0;
    int64_t decay = 0;
  };
  // One Muon row block [rows, cols] (a head of a Per-Head Muon tensor, or the whole matrix).
  struct MuonBlock {
    int64_t param = 0, state = 0;  // offsets of the block's first element in params / state
    double lr_scale = 1.0;
    int64_t decay = 0;
  };
  // `count` blocks of one shape, orthogonalised together: blocks [first, first + count) of the table.
  struct MuonBatch {
    int64_t first = 0, count = 0, rows = 0, cols = 0;
    int64_t r = 0, w = 0;  // the Newton–Schulz orientation: r = min(rows, cols) <= w = max(rows, cols)
    bool tall = false;     // rows > cols: the block is transposed into X
    double scale = 0;      // muon_scale of the block shape
  };

  // Device -> host (synchronises): the CPU Optimizer's format (the fp32 state widened to double).
  OptimizerState save_state() const;
  // Checks the header's format, tensors (names, groups, sizes, heads, offsets) and the data size as
  // the CPU's load_state does, then host -> device (each double rounded to fp32).
  void load_state(const OptimizerState& s);

 private:
  void normalized_momentum(const MuonBatch& b, uint16_t* x16);  // X = u/‖u‖_F into x_ (and x16)
  void muon_batch(const MuonBatch& b, double lr);               // fp32 Newton–Schulz
  void muon_batch_bf16(const MuonBatch& b, double lr);          // bf16 Newton–Schulz (newton_schulz_bf16)

  OptimizerConfig cfg_;
  std::vector<ParamPlan> plan_;
  nlohmann::json header_;  // the CPU save_state's header ("step" rewritten on save)
  float* params_;
  float* grads_;
  gemm::cuda::GemmContext& ctx_;
  bool ns_bf16_;
  int64_t t_ = 0;
  int64_t state_size_ = 0;
  cuda::DeviceBuffer<float> state_;  // [state_size_] the CPU's flat state layout, fp32

  // AdamW: one launch over every AdamW tensor, a segment table on the device.
  int64_t adam_segments_ = 0, adam_elems_ = 0;
  cuda::DeviceBuffer<AdamSegment> adam_table_;  // [segments], ascending start

  // Muon: blocks grouped by shape into batches (a block table on the device) and the Newton–Schulz scratch.
  std::vector<MuonBatch> batches_;
  cuda::DeviceBuffer<MuonBlock> blocks_;             // every Muon block, batch by batch
  cuda::DeviceBuffer<float> x_;                      // [n·r·w] the momentum direction, normalised (fp32)
  cuda::DeviceBuffer<float> y_, a_, b_;              // fp32 Newton–Schulz: Y [n·r·w]; A, B [n·r·r]
  cuda::DeviceBuffer<uint16_t> xb_, xnb_, ab_, bb_;  // bf16 Newton–Schulz: X, next X [n·r·w]; A, B [n·r·r]
  cuda::DeviceBuffer<double> partial_, norm_;        // Frobenius norm: partial sums, per block
};

// Global L2 norm of grads[0, n) (deterministic two-pass reduction in double: fixed per-block partial
// sums, then one block sums them in order), and when norm > max_norm > 0 the grads scaled by
// max_norm/norm (each product in double, rounded once), all on the device with no host sync. The
// pre-clip norm is written to *norm_out (device double) and the number of non-finite gradient entries
// (NaN or ±Inf) to *nonfinite (device int64). As on the CPU, a non-finite entry makes the norm NaN or
// Inf; an Inf norm scales every gradient by 0 (the non-finite ones become NaN), a NaN norm clips nothing.
// workspace: device memory of clip_grad_norm_workspace_bytes(n) bytes (caller-owned scratch).
size_t clip_grad_norm_workspace_bytes(int64_t n);
void clip_grad_norm_cuda(float* grads, int64_t n, double max_norm, double* norm_out, int64_t* nonfinite,
                         void* workspace);

}  // namespace k3::train
