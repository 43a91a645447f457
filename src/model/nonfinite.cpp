#include "model/nonfinite.h"

#include <cstring>

#include "core/error.h"
#include "core/finite.h"
#include "model/tensor_table.h"

namespace k3 {

namespace {

// Whether a tensor of the text model belongs to `layer` (-1: to no layer). The vision tower's
// tensors are not the text forward's and never match.
bool in_layer(const std::string& name, int64_t layer) {
  const TensorPlace p = tensor_place(name);
  return p.text && p.layer == layer;
}

}  // namespace

std::string find_nonfinite_weight(const SafeTensors& st, int64_t layer) {
  for (const std::string& name : st.names()) {
    if (!in_layer(name, layer)) continue;
    const TensorView& t = st.get(name);
    int64_t bad = -1;
    std::string what;
    switch (t.dtype) {
      // (TensorView data is aligned to its dtype: safetensors.h.)
      case DType::F32: bad = first_nonfinite(reinterpret_cast<const float*>(t.data), int64_t(t.nbytes / 4)); break;
      case DType::BF16:
        bad = detail::first_all_ones_exponent<uint16_t, uint16_t, 0x7f80u>(reinterpret_cast<const uint16_t*>(t.data),
                                                                           int64_t(t.nbytes / 2));
        break;
      case DType::F16:
        bad = detail::first_all_ones_exponent<uint16_t, uint16_t, 0x7c00u>(reinterpret_cast<const uint16_t*>(t.data),
                                                                           int64_t(t.nbytes / 2));
        break;
      case DType::U8:
        if (is_mxfp4_scale_name(name)) {
          const void* hit = std::memchr(t.data, 0xFF, t.nbytes);
          if (hit) bad = static_cast<const uint8_t*>(hit) - t.data;
          what = "the MXFP4 scale byte 0xFF (E8M0 NaN)";
        }
        break;
      default: break;
    }
    if (bad >= 0) {
      if (t.dtype != DType::U8) {  // a float: NaN, +Inf or -Inf
        float v;
        widen_to_f32(&v, t.data + size_t(bad) * dtype_size(t.dtype), t.dtype, 1);
        what = nonfinite_name(v);
      }
      return *t.file + ": tensor '" + name + "' holds " + what + " at flat index " + std::to_string(bad);
    }
  }
  return "";
}

void fail_nonfinite(const K3Config& c, const SafeTensors& st, const char* block, int64_t layer, int64_t row,
                    float value) {
  std::string where;
  if (layer >= 0)
    where = std::string("layer ") + std::to_string(layer) + "'s " + block + " (" +
            (std::strcmp(block, "attn_out") == 0 ? (c.layer_kind[size_t(layer)] == AttnKind::KDA ? "KDA" : "MLA")
                                                 : (c.is_moe_layer(layer) ? "LatentMoE" : "dense FFN")) +
            ")";
  else where = std::string("the ") + block;
  // The layer's own tensors, then the embedding (a forward that does not check it shows it first in
  // layer 0).
  std::string cause = find_nonfinite_weight(st, layer);
  if (cause.empty() && layer >= 0) cause = find_nonfinite_weight(st, -1);
  fail("non-finite value (", nonfinite_name(value), ") in the forward pass: first in ", where, ", token row ", row,
       "; ",
       cause.empty() ? "every weight there is finite, so the values overflowed in its arithmetic (check the config's "
                       "scales: " +
                           c.source + ")"
                     : "cause: " + cause);
}

void fail_nonfinite_logits(const K3Config& c, const SafeTensors& st, int64_t row, float value,
                           const std::string& note) {
  std::string cause;
  for (int64_t l = -1; l < c.num_hidden_layers && cause.empty(); ++l) cause = find_nonfinite_weight(st, l);
  fail("non-finite value (", nonfinite_name(value), ") in the logits, row ", row, note, "; ",
       cause.empty()
           ? "every weight is finite, so the values overflowed in the arithmetic (check the config's scales: " +
                 c.source + ")"
           : "cause: " + cause);
}

void check_block_finite(const K3Config& c, const SafeTensors& st, const char* block, int64_t layer, const float* x,
                        int64_t rows, int64_t cols) {
  const int64_t bad = first_nonfinite(x, rows * cols);
  if (bad >= 0) fail_nonfinite(c, st, block, layer, bad / cols, x[bad]);
}

}  // namespace k3
