// The one interface every command drives (generate, logits, eval, and the server and RL to come):
// a K3 model loaded onto a device, its per-sequence state, and the forward. The CPU engine runs
// model/model.h, the GPU engine model/cuda/cuda_model.h; both run the one decoder schedule
// (model/decoder.h) over their backend, so callers never branch on the device.
//
// forward() appends tokens[b] to sequence b and returns fp32 logits on the host: one row per new
// token (all_positions) or the last row of each sequence. A fresh sequence plus all tokens is a full
// forward; one token per call after a prefill is incremental decoding.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/cuda/cuda_model.h"
#include "model/generate.h"
#include "model/layers.h"
#include "model/model.h"
#include "model/vision.h"

namespace k3 {

enum class Device { CPU, CUDA };

// Numerics of an engine. CPU: F32 (fp32 activations, fp64 accumulation), BF16 (the CPU twin of the GPU's bf16
// path, PathOptions::bf16_activations) or F64 (the float64 engine, model/training/engine_f64.h: the trainer's
// numbers). CUDA: BF16 (serving) or F32 (parity).
enum class Precision { F32, BF16, F64 };

struct EngineOptions {
  Device device = Device::CPU;
  Precision precision = Precision::F32;
};
// "cpu"/"cuda" and "f32"/"bf16"/"f64"; anything else is a k3::Error naming `what` (e.g. the CLI flag).
Device parse_device(const std::string& s, const char* what);
Precision parse_precision(const std::string& s, const char* what);
const char* device_name(Device d);
const char* precision_name(Precision p);

// The vision tower and projector of the model directory `dir` for an engine on `device`: on the GPU in bf16
// (model/cuda/vision_cuda.h: CudaVisionModel, whatever the text model's precision) for Device::CUDA, on the CPU
// (model/vision.h: VisionModel) otherwise.
std::unique_ptr<VisionEncoder> load_vision_encoder(const std::string& dir, Device device);

// One sequence's state in an engine (KDA conv tails and recurrent state, MLA latent rows), on the
// engine's device. Made by Engine::new_sequences; usable only with the engine that made it.
class EngineSequence {
 public:
  virtual ~EngineSequence() = default;
  virtual int64_t length() const = 0;  // tokens consumed so far
  virtual size_t bytes() const = 0;    // memory held
};

// A copy of part of a sequence's state, for a prefix cache (serve/prefix_cache.h): the MLA rows of positions
// [begin, end) and the KDA conv tails and recurrent state after position end - 1, on the engine's device. A chain
// of snapshots with contiguous rows from 0 restores the state of a sequence of `end` tokens, bit for bit.
class SequenceSnapshot {
 public:
  virtual ~SequenceSnapshot() = default;
  int64_t begin = 0, end = 0;
  virtual size_t bytes() const = 0;  // memory held
};
// What every Engine::restore checks first: `chain` is non-empty and contiguous from position 0 (a null snapshot
// breaks it), and the sequence, which holds `length` tokens, is fresh. k3::Error otherwise.
void check_restore_chain(const std::vector<const SequenceSnapshot*>& chain, int64_t length);

class Engine {
 public:
  virtual ~Engine() = default;
  // dir: a Hugging Face model directory (config.json + model.safetensors or shards).
  static std::unique_ptr<Engine> load(const std::string& dir, const EngineOptions& o);
  // An engine over a model already loaded (tests and tools that also use the model directly).
  static std::unique_ptr<Engine> on_cpu(std::shared_ptr<Model> m);
  static std::unique_ptr<Engine> on_gpu(std::shared_ptr<CudaModel> m);

  virtual const K3Config& config() const = 0;
  virtual EngineOptions options() const = 0;
  virtual std::string description() const;  // "cpu (f32)", "cuda (bf16)", "cpu (f32), experts over 4 ranks"
  virtual size_t weight_bytes() const = 0;  // bytes the weights take on the device (mapped bytes on the CPU)
  // Memory one sequence's state takes on the device once it holds `tokens` tokens (KDA conv tails and state, MLA
  // rows exactly filled): what a server admits against its cache budget. The GPU grows a sequence's MLA rows
  // geometrically, so its EngineSequence::bytes() can be up to twice the rows' share.
  virtual size_t sequence_bytes(int64_t tokens) const = 0;

  // B sequences made together: a forward over all of them, in order and with equal token counts,
  // may run per-sequence steps as one launch (the GPU's pooled caches).
  virtual std::vector<std::unique_ptr<EngineSequence>> new_sequences(int64_t B) = 0;
  virtual std::vector<float> forward(const std::vector<EngineSequence*>& seqs,
                                     const std::vector<std::vector<int32_t>>& tokens, bool all_positions,
                                     const ForwardHooks* hooks = nullptr) = 0;

  // forward(seqs, tokens, false), but per sequence only what picks[b] asks: its next id (TokenPick: greedy or
  // temperature sampling, exactly pick_on_host's rule) and/or its last logits. The GPU chooses ids on the device
  // and copies only the logits asked for; the CPU picks on the host.
  // hooks: ForwardHooks' input rows (an image's projected tokens); the GPU's decode graphs take none.
  virtual std::vector<PickResult> forward_pick(const std::vector<EngineSequence*>& seqs,
                                               const std::vector<std::vector<int32_t>>& tokens,
                                               const std::vector<TokenPick>& picks,
                                               const ForwardHooks* hooks = nullptr);
  // Makes `seq` fresh again (length 0, zero state), as new_sequences made it, keeping its place in its pool:
  // a server reuses the pool it made once rather than allocating per request.
  virtual void reset(EngineSequence& seq) = 0;

  // The state of `seq` as it is now (its length is the snapshot's end), with the MLA rows from position
  // `rows_from` (0 <= rows_from <= length).
  virtual std::unique_ptr<SequenceSnapshot> snapshot(EngineSequence& seq, int64_t rows_from) = 0;
  // Makes the fresh sequence `seq` (length 0) hold the state the chain describes: chain[0] begins at 0, each
  // next one where the previous ends, the KDA state is the last one's. Throws k3::Error otherwise.
  virtual void restore(EngineSequence& seq, const std::vector<const SequenceSnapshot*>& chain) = 0;

  // Per-block wall time while on (on the GPU each block then waits for the device).
  virtual void set_profile(bool on) = 0;
  virtual const BlockTimings& timings() const = 0;
  virtual void reset_timings() = 0;

  // A full forward of rows on fresh sequences: logits of every position, rows in order.
  std::vector<float> forward_fresh(const std::vector<std::vector<int32_t>>& rows, const ForwardHooks* hooks = nullptr);
  // On a fresh sequence, the log-probability of each ids[t] after ids[0..t), [T] (entry 0 is 0): a teacher's in
  // on-policy distillation. From the fp32 logits, as forward_pick's; the float64 engine's from its float64 ones.
  virtual std::vector<double> sequence_logprobs(const std::vector<int32_t>& ids);
  // A new single-sequence session for generate(): each call appends tokens and returns the last logits
  // (session) or what the pick asks (pick_session).
  AppendFn session();
  // first_rows: input rows of the first call's tokens (an image prompt's projected tokens, ForwardHooks).
  PickFn pick_session(std::vector<InputRows> first_rows = {});
};

// generate() (model/generate.h) on a fresh sequence of `e`.
GenerateResult generate(Engine& e, const std::vector<int32_t>& prompt, int64_t max_new_tokens, Sampler& sampler,
                        const std::function<void(int32_t)>& on_token = {});

}  // namespace k3
