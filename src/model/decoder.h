// The K3 decoder's layer schedule (K3-ARCHITECTURE.md §5.1-5.2), written once for every backend.
//
// The schedule decides what runs in which order: the embedding; per layer AttnRes + RMSNorm, KDA or
// MLA (layer_kind), the partial block sum, AttnRes + RMSNorm, the dense FFN or LatentMoE; the
// final AttnRes + norm and the head. Block AttnRes mixes the completed block sums (the embedding
// first) with the running partial sum; at a block boundary (layer % attn_res_block_size == 0,
// after that layer's attention input is mixed) the partial sum becomes a completed block and the
// next one starts from the attention output.
//
// A backend supplies the ops and owns every buffer; the schedule holds only handles (`Act`) to
// [rows, hidden] activations of the residual stream. The backends are the CPU inference model
// (model/cpu_backend.h, fp32 with fp64 accumulation), the GPU model (model/cuda, bf16 or f32
// parity) and the float64 training model (model/train_backend.h, which also runs the backward
// through decoder_backward). A backend provides:
//
//   using Act = ...;                        a cheap handle (pointer or id), copyable
//   Act embed();                            the batch's token embeddings: the first partial sum
//   void mix(MixSite, int64_t layer, const std::vector<Act>& blocks, Act partial);
//                                           AttnRes over blocks + partial (blocks empty: partial
//                                           itself), then the site's RMSNorm: the next block's input
//   Act attention(int64_t layer);           KDA or MLA of the last mix's output
//   Act ffn(int64_t layer);                 dense FFN or LatentMoE of the last mix's output
//   void block_output(const char* name, int64_t layer, Act out);   hooks and checks of a block output
//   Act start_partial(Act out);             a new partial sum equal to `out` (a block output)
//   void add_partial(Act& partial, Act out);  partial + out (in place, or a new handle)
//   Result head();                          after mix(Output): logits, or the loss
//   bool profiling() const; void synchronize();   per-block wall time (BlockTimings)
//
// The partial sum is never written after it became a block (a new one starts at each boundary), so
// in-place accumulation is safe; the training backend instead keeps every version of it, because
// the backward needs the values each AttnRes use saw.
#pragma once
#include <chrono>
#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/tensor_table.h"

namespace k3 {

// Where an AttnRes + RMSNorm pair feeds: a layer's attention, its FFN, or the head.
enum class MixSite { AttnIn, FfnIn, Output };

// The tensors a mix site reads: AttnRes's pseudo-query factors (res_norm ⊙ res_proj, folded) and the
// RMSNorm weight after it. Output's are global (layer -1).
struct MixTensors {
  TensorKind res_norm, res_proj, norm;
};
inline MixTensors mix_tensors(MixSite site) {
  switch (site) {
    case MixSite::AttnIn: return {TensorKind::AttnResNorm, TensorKind::AttnResProj, TensorKind::InputNorm};
    case MixSite::FfnIn: return {TensorKind::MlpResNorm, TensorKind::MlpResProj, TensorKind::PostAttnNorm};
    case MixSite::Output: break;
  }
  return {TensorKind::OutputAttnResNorm, TensorKind::OutputAttnResProj, TensorKind::OutputNorm};
}

// Seconds spent per block kind while profiling is on (Model::timings, CudaModel::timings).
struct BlockTimings {
  double embed = 0, attnres_norm = 0, kda = 0, mla = 0, dense_ffn = 0, moe = 0, head = 0;
  double total() const { return embed + attnres_norm + kda + mla + dense_ffn + moe + head; }
};

// The handles of one forward that its backward needs (decoder_backward).
template <class Act>
struct DecoderTape {
  struct Layer {
    bool new_block = false;                        // the partial sum restarted at this layer's attention output
    Act before_attn{}, after_attn{}, after_ffn{};  // the partial sum's versions around the layer
  };
  Act embedding{};
  std::vector<Layer> layers;
};

namespace detail {
// tick(slot): with profiling on, waits for the backend and charges the time since the last tick.
template <class Backend>
class BlockClock {
 public:
  BlockClock(Backend& be, BlockTimings* t) : be_(be), t_(t && be.profiling() ? t : nullptr) {}
  void tick(double BlockTimings::*slot) {
    if (!t_) return;
    be_.synchronize();
    const auto now = std::chrono::steady_clock::now();
    t_->*slot += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  Backend& be_;
  BlockTimings* t_;
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};
}  // namespace detail

// Runs the whole forward on `be` and returns be.head(). `timings` (optional) accumulates per-block
// wall time while be.profiling(); `tape` (optional) receives what decoder_backward needs.
template <class Backend>
auto decoder_forward(Backend& be, const K3Config& c, BlockTimings* timings = nullptr,
                     DecoderTape<typename Backend::Act>* tape = nullptr) {
  using Act = typename Backend::Act;
  detail::BlockClock<Backend> clock(be, timings);
  Act partial = be.embed();
  clock.tick(&BlockTimings::embed);
  if (tape) {
    tape->embedding = partial;
    tape->layers.assign(size_t(c.num_hidden_layers), {});
  }
  std::vector<Act> blocks;  // completed block sums, the embedding first
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    be.mix(MixSite::AttnIn, l, blocks, partial);
    const bool new_block = l % c.attn_res_block_size == 0;
    if (new_block) blocks.push_back(partial);
    clock.tick(&BlockTimings::attnres_norm);
    const bool kda = c.layer_kind[size_t(l)] == AttnKind::KDA;
    const Act a = be.attention(l);
    clock.tick(kda ? &BlockTimings::kda : &BlockTimings::mla);
    be.block_output("attn_out", l, a);
    const Act before = partial;
    if (new_block) partial = be.start_partial(a);
    else be.add_partial(partial, a);
    const Act after_attn = partial;

    be.mix(MixSite::FfnIn, l, blocks, partial);
    clock.tick(&BlockTimings::attnres_norm);
    const bool moe = c.is_moe_layer(l);
    const Act f = be.ffn(l);
    clock.tick(moe ? &BlockTimings::moe : &BlockTimings::dense_ffn);
    be.block_output("ffn_out", l, f);
    be.add_partial(partial, f);
    if (tape) tape->layers[size_t(l)] = {new_block, before, after_attn, partial};
  }
  be.mix(MixSite::Output, -1, blocks, partial);
  auto result = be.head();
  clock.tick(&BlockTimings::head);
  return result;
}

// The backward of decoder_forward, walking its tape in reverse. A backend that trains provides:
//   void head_backward();                       the head's gradient into the output mix's input
//   void mix_backward(MixSite, int64_t layer);  back through RMSNorm and AttnRes into the gradients of
//                                               the handles that mix read (ACCUMULATED)
//   void attention_backward(int64_t layer, Act d_out);  d_out: the handle whose gradient is that of
//   void ffn_backward(int64_t layer, Act d_out);        the block output; into the mix's input gradient
//   void add_gradient(Act dst, Act src);        grad(dst) += grad(src)
//   void embed_backward(Act embedding);
// A handle's gradient is complete once every later use has been walked back, which reverse program
// order guarantees.
template <class Backend>
void decoder_backward(Backend& be, const K3Config& c, const DecoderTape<typename Backend::Act>& tape) {
  be.head_backward();
  be.mix_backward(MixSite::Output, -1);
  for (int64_t l = c.num_hidden_layers - 1; l >= 0; --l) {
    const auto& L = tape.layers[size_t(l)];
    be.add_gradient(L.after_attn, L.after_ffn);  // after_ffn = after_attn + ffn_out
    be.ffn_backward(l, L.after_ffn);
    be.mix_backward(MixSite::FfnIn, l);
    if (!L.new_block) be.add_gradient(L.before_attn, L.after_attn);  // after_attn = before_attn + attn_out
    be.attention_backward(l, L.after_attn);
    be.mix_backward(MixSite::AttnIn, l);
  }
  be.embed_backward(tape.embedding);
}

}  // namespace k3
