#include "train/model_train.h"

#include <algorithm>
#include <memory>

#include "core/error.h"
#include "train/ffn_block.h"
#include "train/kda_block.h"
#include "train/mla_block.h"
#include "train/ops.h"

namespace k3::train {

ModelNames model_names(const ParamStore& P, const K3Config& c) {
  ModelNames n;
  if (P.has("language_model.model.embed_tokens.weight")) {
    n.root = "language_model.model.";
    n.lm_head = "language_model.lm_head.weight";
  } else if (P.has("model.embed_tokens.weight")) {
    n.root = "model.";
    n.lm_head = "lm_head.weight";
  } else {
    fail("training parameters: no embed_tokens.weight under language_model.model. or model.");
  }
  if (!P.has(n.lm_head)) {
    if (!c.tie_word_embeddings) fail("training parameters: ", n.lm_head, " is missing and the config does not tie embeddings");
    n.lm_head = n.root + "embed_tokens.weight";
  }
  return n;
}

std::vector<std::string> trainable_names(const ParamStore& P) {
  std::vector<std::string> out;
  for (const std::string& n : P.names())
    if (n.find("e_score_correction_bias") == std::string::npos) out.push_back(n);
  return out;
}

namespace {

// One AttnRes use: which nodes it mixed, with which query tensors.
struct ResUse {
  std::vector<int> srcs;  // node ids; empty = skipped (h is the node `direct`)
  int direct = -1;
  std::string norm_name, proj_name;
  std::vector<double> h, xn;  // AttnRes output and its RMSNorm
  std::string ln_name;        // the pre-norm weight
};

struct LayerTape {
  ResUse attn_in, ffn_in;
  bool attn_new_block = false;
  int prefix_before_attn = -1, prefix_after_attn = -1, prefix_after_ffn = -1;
  bool kda = true, moe = false;
  std::unique_ptr<KdaBlockTape> kda_tape;
  std::unique_ptr<MlaBlockTape> mla_tape;
  std::unique_ptr<GluTape> dense_tape;
  std::unique_ptr<MoeTape> moe_tape;
};

std::vector<double> query_of(const ParamStore& P, const std::string& norm, const std::string& proj, int64_t D) {
  const double *a = P.p(norm, D), *b = P.p(proj, D);
  std::vector<double> q(static_cast<size_t>(D));
  for (int64_t i = 0; i < D; ++i) q[size_t(i)] = a[i] * b[i];
  return q;
}

}  // namespace

double sequence_loss(ParamStore& P, const K3Config& c, const std::vector<int32_t>& ids, bool backward, double grad_scale,
                     std::vector<double>* logits_out, const TrainHooks* hooks) {
  const int64_t T = int64_t(ids.size()), D = c.hidden_size, V = c.vocab_size;
  if (T < 1) fail("training: empty sequence");
  const double eps = c.rms_norm_eps;
  const ModelNames nm = model_names(P, c);
  const std::string lp = nm.root + "layers.";

  // Nodes: versions of the running block sum (node 0 = the embedding).
  std::vector<std::vector<double>> node;
  const double* E = P.p(nm.root + "embed_tokens.weight", V * D);
  node.emplace_back(static_cast<size_t>(T * D));
  for (int64_t t = 0; t < T; ++t) {
    if (ids[size_t(t)] < 0 || ids[size_t(t)] >= V) fail("training: token id ", ids[size_t(t)], " outside [0, ", V, ")");
    std::copy_n(E + int64_t(ids[size_t(t)]) * D, D, &node[0][size_t(t * D)]);
  }
  std::vector<int> blocks;  // completed block sums (node ids)
  int prefix = 0;

  auto attnres = [&](ResUse& u, int partial, const std::string& norm, const std::string& proj, const std::string& ln) {
    u.ln_name = ln;
    u.h.resize(size_t(T * D));
    if (blocks.empty()) {
      u.direct = partial;
      u.h = node[size_t(partial)];
    } else {
      u.srcs = blocks;
      u.srcs.push_back(partial);
      u.norm_name = norm;
      u.proj_name = proj;
      std::vector<const double*> src;
      for (int s : u.srcs) src.push_back(node[size_t(s)].data());
      const std::vector<double> q = query_of(P, norm, proj, D);
      attnres_fwd(u.h.data(), src, q.data(), eps, T, D);
    }
    u.xn.resize(size_t(T * D));
    rmsnorm_fwd(u.xn.data(), u.h.data(), P.p(ln, D), eps, T, D);
  };

  std::vector<LayerTape> tape(static_cast<size_t>(c.num_hidden_layers));
  std::vector<double> out(size_t(T * D));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    LayerTape& L = tape[size_t(l)];
    const std::string p = lp + std::to_string(l) + ".";
    attnres(L.attn_in, prefix, p + "self_attention_res_norm.weight", p + "self_attention_res_proj.weight",
            p + "input_layernorm.weight");
    L.prefix_before_attn = prefix;
    if (l % c.attn_res_block_size == 0) {
      blocks.push_back(prefix);
      L.attn_new_block = true;
    }
    L.kda = c.layer_kind[size_t(l)] == AttnKind::KDA;
    if (L.kda) {
      L.kda_tape = std::make_unique<KdaBlockTape>();
      kda_block_forward(P, p, c, l, L.attn_in.xn.data(), T, out.data(), L.kda_tape.get());
    } else {
      L.mla_tape = std::make_unique<MlaBlockTape>();
      mla_block_forward(P, p, c, l, L.attn_in.xn.data(), T, out.data(), L.mla_tape.get());
    }
    if (hooks && hooks->tensor) hooks->tensor("attn_out", l, out.data(), T, D);
    node.push_back(out);
    if (!L.attn_new_block)
      for (int64_t i = 0; i < T * D; ++i) node.back()[size_t(i)] += node[size_t(prefix)][size_t(i)];
    prefix = L.prefix_after_attn = int(node.size()) - 1;

    attnres(L.ffn_in, prefix, p + "mlp_res_norm.weight", p + "mlp_res_proj.weight", p + "post_attention_layernorm.weight");
    L.moe = c.is_moe_layer(l);
    if (L.moe) {
      L.moe_tape = std::make_unique<MoeTape>();
      const double* bias = hooks && hooks->router_bias ? hooks->router_bias(l)
                           : P.has(p + "block_sparse_moe.gate.e_score_correction_bias")
                               ? P.p(p + "block_sparse_moe.gate.e_score_correction_bias")
                               : nullptr;
      moe_ffn_forward(P, p, c, l, L.ffn_in.xn.data(), T, out.data(), L.moe_tape.get(), bias);
      if (hooks && hooks->on_moe) hooks->on_moe(l, *L.moe_tape);
    } else {
      L.dense_tape = std::make_unique<GluTape>();
      dense_ffn_forward(P, p, c, l, L.ffn_in.xn.data(), T, out.data(), L.dense_tape.get());
    }
    if (hooks && hooks->tensor) hooks->tensor("ffn_out", l, out.data(), T, D);
    node.push_back(out);
    for (int64_t i = 0; i < T * D; ++i) node.back()[size_t(i)] += node[size_t(prefix)][size_t(i)];
    prefix = L.prefix_after_ffn = int(node.size()) - 1;
  }

  ResUse fin;
  attnres(fin, prefix, nm.root + "output_attn_res_norm.weight", nm.root + "output_attn_res_proj.weight",
          nm.root + "norm.weight");
  std::vector<double> logits(size_t(T * V));
  const double* Wh = P.p(nm.lm_head, V * D);
  linear_fwd(logits.data(), fin.xn.data(), Wh, T, D, V);
  std::vector<int32_t> target(static_cast<size_t>(T), -1);
  for (int64_t t = 0; t + 1 < T; ++t) target[size_t(t)] = ids[size_t(t + 1)];
  std::vector<double> dlogits(backward ? size_t(T * V) : 0);
  const double loss = cross_entropy(logits.data(), target.data(), T, V, backward ? dlogits.data() : nullptr, grad_scale);
  if (logits_out) *logits_out = std::move(logits);
  if (!backward) return loss;

  // ---- backward ----
  std::vector<std::vector<double>> dnode(node.size(), std::vector<double>(size_t(T * D), 0.0));
  std::vector<double> dh(static_cast<size_t>(T * D)), dxn(static_cast<size_t>(T * D)), dq(static_cast<size_t>(D));
  // Back through RMSNorm and AttnRes (or the skipped AttnRes) into the node gradients.
  auto attnres_back = [&](const ResUse& u) {
    rmsnorm_bwd(dh.data(), P.g(u.ln_name, D), dxn.data(), u.h.data(), P.p(u.ln_name, D), eps, T, D);
    if (u.srcs.empty()) {
      for (int64_t i = 0; i < T * D; ++i) dnode[size_t(u.direct)][size_t(i)] += dh[size_t(i)];
      return;
    }
    std::vector<const double*> src;
    std::vector<double*> dsrc;
    for (int s : u.srcs) {
      src.push_back(node[size_t(s)].data());
      dsrc.push_back(dnode[size_t(s)].data());
    }
    const std::vector<double> q = query_of(P, u.norm_name, u.proj_name, D);
    std::fill(dq.begin(), dq.end(), 0.0);
    attnres_bwd(dsrc, dq.data(), dh.data(), src, q.data(), eps, T, D);
    // q = norm ⊙ proj
    const double *a = P.p(u.norm_name, D), *b = P.p(u.proj_name, D);
    double *da = P.g(u.norm_name, D), *db = P.g(u.proj_name, D);
    for (int64_t i = 0; i < D; ++i) {
      da[i] += dq[size_t(i)] * b[i];
      db[i] += dq[size_t(i)] * a[i];
    }
  };

  linear_bwd(dxn.data(), P.g(nm.lm_head, V * D), dlogits.data(), fin.xn.data(), Wh, T, D, V);
  attnres_back(fin);
  
  for (int64_t l = c.num_hidden_layers - 1; l >= 0; --l) {
    LayerTape& L = tape[size_t(l)];
    const std::string p = lp + std::to_string(l) + ".";
    // prefix_after_ffn = prefix_after_attn + ffn_out
    const std::vector<double>& dpost = dnode[size_t(L.prefix_after_ffn)];
    for (int64_t i = 0; i < T * D; ++i) dnode[size_t(L.prefix_after_attn)][size_t(i)] += dpost[size_t(i)];
    if (L.moe) moe_ffn_backward(P, p, c, l, *L.moe_tape, dpost.data(), dxn.data());
    else dense_ffn_backward(P, p, c, l, *L.dense_tape, dpost.data(), dxn.data());
    attnres_back(L.ffn_in);
    // prefix_after_attn = (new block ? 0 : prefix_before_attn) + attn_out
    const std::vector<double>& dmid = dnode[size_t(L.prefix_after_attn)];
    if (!L.attn_new_block)
      for (int64_t i = 0; i < T * D; ++i) dnode[size_t(L.prefix_before_attn)][size_t(i)] += dmid[size_t(i)];
    if (L.kda) kda_block_backward(P, p, c, l, *L.kda_tape, dmid.data(), dxn.data());
    else mla_block_backward(P, p, c, l, *L.mla_tape, dmid.data(), dxn.data());
    attnres_back(L.attn_in);
  }
  double* dE = P.g(nm.root + "embed_tokens.weight", V * D);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) dE[int64_t(ids[size_t(t)]) * D + d] += dnode[0][size_t(t * D + d)];
  return loss;
}

}  // namespace k3::train
