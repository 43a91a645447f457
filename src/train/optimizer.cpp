#include "train/optimizer.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "core/error.h"
#include "model/tensor_table.h"

namespace k3::train {

namespace {

int64_t dims_above_one(const std::vector<int64_t>& shape) {
  int64_t n = 0;
  for (int64_t d : shape) n += d > 1;
  return n;
}

}  // namespace

const char* param_group_name(ParamGroup g) {
  switch (g) {
    case ParamGroup::Muon: return "muon";
    case ParamGroup::AdamW: return "adamw";
    case ParamGroup::Frozen: return "frozen";
  }
  return "?";
}

bool is_router_weight(const std::string& name) {
  const auto id = parse_tensor_name(name);
  return id && id->kind == TensorKind::MoeRouter && id->part == TensorPart::Whole;
}

ParamGroup default_param_group(const std::string& name, const std::vector<int64_t>& shape) {
  // The table's word for K3 tensors: the router's selection bias is not trained (Frozen); embedding
  // rows and LM-head rows are per-token lookups/readouts, not linear maps whose spectrum matters
  // (Muon literature, Moonlight and K2, keeps them on AdamW), and so are norm gains, A_log, dt_bias
  // and conv taps.
  if (const auto id = parse_tensor_name(name)) {
    const TensorInfo& t = tensor_info(id->kind);
    if (!t.trainable) return ParamGroup::Frozen;
    if (!t.muon) return ParamGroup::AdamW;
  }
  // Vectors and single rows (a [1, D] AttnRes pseudo-query, a one-head b_proj): orthogonalising a
  // single row would only normalise it (sign-SGD-like), so they get AdamW; so do tensors of 3+ dims.
  if (dims_above_one(shape) <= 1 || shape.size() != 2) return ParamGroup::AdamW;
  return ParamGroup::Muon;
}

std::map<std::string, int64_t> k3_head_splits(const ParamStore& P, const K3Config& c) {
  std::map<std::string, int64_t> out;
  const TensorTable table(c);
  for (const TensorEntry& e : table.entries()) {
    const HeadBlocks b = head_blocks(c, e.kind);
    if (b.heads == 0) continue;
    for (TensorNaming n : {TensorNaming::Release, TensorNaming::Flat}) {
      const std::string name = table.name(e, n);
      if (!P.has(name)) continue;
      const std::vector<int64_t>& s = P.shape(name);
      if (s.size() != 2 || s[0] != b.heads * b.rows)
        fail("per-head Muon: '", name, "' should have ", b.heads, "x", b.rows, " = ", b.heads * b.rows,
             " rows, shape is [", s.empty() ? 0 : s[0], s.size() > 1 ? ", ..." : "", "]");
      out[name] = b.heads;
    }
  }
  return out;
}

double muon_scale(MuonScale s, int64_t rows, int64_t cols, double rms) {
  if (s == MuonScale::MatchAdamRms) return rms * std::sqrt(double(std::max(rows, cols)));
  return std::sqrt(std::max(1.0, double(rows) / double(cols)));
}

void newton_schulz(const double* G, double* out, int64_t rows, int64_t cols, int steps) {
  constexpr double a = NewtonSchulzQuintic::a, b = NewtonSchulzQuintic::b, c = NewtonSchulzQuintic::c;
  const int64_t n = rows * cols;
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += G[i] * G[i];
  const double norm = std::sqrt(ss);
  if (norm == 0.0) {
    std::fill(out, out + n, 0.0);
    return;
  }
  // Work on the wide orientation (r <= c) so the Gram matrix A = XXᵀ is the small one.
  const bool tr = rows > cols;
  const int64_t r = tr ? cols : rows, w = tr ? rows : cols;
  std::vector<double> X(static_cast<size_t>(n)), Y(static_cast<size_t>(n)), A(static_cast<size_t>(r * r)),
      B(static_cast<size_t>(r * r));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) X[size_t(tr ? j * rows + i : i * cols + j)] = G[i * cols + j] / norm;
  for (int s = 0; s < steps; ++s) {
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(r), int(r), int(w), 1.0, X.data(), int(w), X.data(),
                int(w), 0.0, A.data(), int(r));
    B = A;  // B = b·A + c·A·A
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(r), int(r), int(r), c, A.data(), int(r), A.data(),
                int(r), b, B.data(), int(r));
    Y = X;  // Y = a·X + B·X
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(r), int(w), int(r), 1.0, B.data(), int(r), X.data(),
                int(w), a, Y.data(), int(w));
    X.swap(Y);
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[i * cols + j] = X[size_t(tr ? j * rows + i : i * cols + j)];
}

Optimizer::Optimizer(const ParamStore& P, OptimizerConfig cfg, const std::map<std::string, int64_t>& head_splits,
                     const ParamGroupRule& rule)
    : cfg_(cfg) {
  if (!(cfg_.beta1 >= 0 && cfg_.beta1 < 1 && cfg_.beta2 >= 0 && cfg_.beta2 < 1))
    fail("optimizer: betas must be in [0, 1)");
  if (!(cfg_.momentum >= 0 && cfg_.momentum < 1)) fail("optimizer: Muon momentum must be in [0, 1)");
  if (cfg_.ns_steps < 1) fail("optimizer: ns_steps must be >= 1");
  for (const auto& [name, h] : head_splits)
    if (!P.has(name)) fail("optimizer: per-head split names '", name, "', which is not a parameter");
  int64_t off = 0;
  for (const std::string& name : P.names()) {
    ParamPlan pl;
    pl.name = name;
    const std::vector<int64_t>& shape = P.shape(name);
    pl.numel = P.numel(name);
    pl.group = rule(name, shape);
    pl.decay = pl.group != ParamGroup::Frozen && (cfg_.decay_vectors || dims_above_one(shape) >= 2);
    if (pl.group == ParamGroup::Muon) {
      if (shape.size() < 2) fail("optimizer: Muon needs a matrix, '", name, "' has ", shape.size(), " dimension(s)");
      // Higher-rank tensors are flattened to [dim0, rest], as the common Muon implementation does.
      pl.rows = shape[0];
      pl.cols = pl.rows > 0 ? pl.numel / pl.rows : 0;
    }
    if (is_router_weight(name)) pl.lr_scale = cfg_.router_lr_scale;
    auto it = head_splits.find(name);
    if (it != head_splits.end()) {
      if (pl.group != ParamGroup::Muon) fail("optimizer: per-head split for '", name, "', which is not a Muon matrix");
      if (it->second < 1 || pl.rows % it->second != 0)
        fail("optimizer: ", it->second, " heads do not divide the ", pl.rows, " rows of '", name, "'");
      pl.heads = it->second;
    }
    pl.state_offset = off;
    pl.state_size = pl.group == ParamGroup::AdamW ? 2 * pl.numel : pl.group == ParamGroup::Muon ? pl.numel : 0;
    off += pl.state_size;
    plan_.push_back(std::move(pl));
  }
  state_size_ = off;  // the state itself is allocated by the first step() or load_state()
}

const ParamPlan& Optimizer::plan_of(const std::string& name) const {
  for (const ParamPlan& p : plan_)
    if (p.name == name) return p;
  fail("optimizer: no parameter '", name, "'");
}

std::vector<int> newton_schulz_owners(const std::vector<ParamPlan>& plan, int ranks) {
  K3_CHECK(ranks >= 1, "Newton-Schulz sharding: need at least one rank, got ", ranks);
  std::vector<int> owner(plan.size(), -1);
  std::vector<size_t> muon;
  std::vector<double> cost(plan.size(), 0.0);
  for (size_t i = 0; i < plan.size(); ++i) {
    const ParamPlan& p = plan[i];
    if (p.group != ParamGroup::Muon) continue;
    const double rb = double(p.rows / p.heads), cols = double(p.cols);
    cost[i] = double(p.heads) * rb * cols * std::min(rb, cols);
    muon.push_back(i);
  }
  std::stable_sort(muon.begin(), muon.end(), [&](size_t a, size_t b) { return cost[a] > cost[b]; });
  std::vector<double> load(size_t(ranks), 0.0);
  for (size_t i : muon) {
    const size_t r = size_t(std::min_element(load.begin(), load.end()) - load.begin());
    owner[i] = int(r);
    load[r] += cost[i];
  }
  return owner;
}

void Optimizer::step(ParamStore& P, double step_lr, dist::Group* group) {
  if (int64_t(state_.size()) != state_size_) state_.assign(size_t(state_size_), 0.0);
  ++t_;
  const double bc1 = 1.0 - std::pow(cfg_.beta1, double(t_)), bc2 = 1.0 - std::pow(cfg_.beta2, double(t_));
  const double sqrt_bc2 = std::sqrt(bc2);
  const int ranks = group ? group->size() : 1, me = group ? group->rank() : 0;
  const std::vector<int> owner = ranks > 1 ? newton_schulz_owners(plan_, ranks) : std::vector<int>();
  std::vector<double> mine;  // under a group: this rank's orthogonalised updates, in plan order
  std::vector<double> u;
  auto orthogonalise = [&](const ParamPlan& pl, const double* uu, double* o) {
    const int64_t rb = pl.rows / pl.heads;  // rows per head block (contiguous in row-major)
    for (int64_t h = 0; h < pl.heads; ++h)
      newton_schulz(uu + h * rb * pl.cols, o + h * rb * pl.cols, rb, pl.cols, cfg_.ns_steps);
  };
  auto apply_muon = [&](const ParamPlan& pl, const double* o) {
    const double lr = step_lr * pl.lr_scale;
    const double keep = pl.decay ? 1.0 - lr * cfg_.weight_decay : 1.0;
    const double scale = muon_scale(cfg_.muon_scale, pl.rows / pl.heads, pl.cols, cfg_.muon_rms);
    double* W = P.p_mut(pl.name, pl.numel);
    for (int64_t i = 0; i < pl.numel; ++i) {
      W[i] *= keep;
      W[i] -= lr * scale * o[size_t(i)];
    }
  };
  std::vector<double> o;
  for (size_t k = 0; k < plan_.size(); ++k) {
    const ParamPlan& pl = plan_[k];
    if (pl.group == ParamGroup::Frozen) continue;
    const double lr = step_lr * pl.lr_scale;
    const double* g = P.g(pl.name, pl.numel);
    double* st = state_.data() + pl.state_offset;
    if (pl.group == ParamGroup::AdamW) {
      double* W = P.p_mut(pl.name, pl.numel);
      const double keep = pl.decay ? 1.0 - lr * cfg_.weight_decay : 1.0;
      double* m = st;
      double* v = st + pl.numel;
      // torch.optim.AdamW's arithmetic: decay, then p -= (lr/bc1)·m / (sqrt(v)/sqrt(bc2) + eps).
      const double step_size = lr / bc1;
      for (int64_t i = 0; i < pl.numel; ++i) {
        m[i] = cfg_.beta1 * m[i] + (1.0 - cfg_.beta1) * g[i];
        v[i] = cfg_.beta2 * v[i] + (1.0 - cfg_.beta2) * g[i] * g[i];
        W[i] *= keep;
        W[i] -= step_size * m[i] / (std::sqrt(v[i]) / sqrt_bc2 + cfg_.eps);
      }
      continue;
    }
    // Muon: every rank keeps the momentum (elementwise); the owner orthogonalises.
    double* buf = st;
    u.resize(size_t(pl.numel));
    for (int64_t i = 0; i < pl.numel; ++i) {
      buf[i] = cfg_.momentum * buf[i] + g[i];
      u[size_t(i)] = cfg_.nesterov ? g[i] + cfg_.momentum * buf[i] : buf[i];
    }
    if (ranks == 1) {
      o.resize(size_t(pl.numel));
      orthogonalise(pl, u.data(), o.data());
      apply_muon(pl, o.data());
    } else if (owner[k] == me) {
      const size_t at = mine.size();
      mine.resize(at + size_t(pl.numel));
      orthogonalise(pl, u.data(), mine.data() + at);
    }
  }
  if (ranks == 1) return;
  // Every rank's updates, rank after rank, each in plan order: the layout newton_schulz_owners implies.
  const std::vector<double> all = dist::all_gather(*group, mine);
  std::vector<int64_t> at(size_t(ranks) + 1, 0);
  for (size_t k = 0; k < plan_.size(); ++k)
    if (owner[k] >= 0) at[size_t(owner[k]) + 1] += plan_[k].numel;
  for (int r = 0; r < ranks; ++r) at[size_t(r) + 1] += at[size_t(r)];
  K3_ASSERT(int64_t(all.size()) == at.back());
  for (size_t k = 0; k < plan_.size(); ++k)
    if (owner[k] >= 0) {
      apply_muon(plan_[k], all.data() + at[size_t(owner[k])]);
      at[size_t(owner[k])] += plan_[k].numel;
    }
}

OptimizerState Optimizer::save_state() const {
  OptimizerState s;
  s.header = state_header();
  s.data = state_;
  if (int64_t(s.data.size()) != state_size_) s.data.assign(size_t(state_size_), 0.0);  // before any step
  return s;
}

nlohmann::json Optimizer::state_header() const {
  nlohmann::json tensors = nlohmann::json::array();
  for (const ParamPlan& p : plan_)
    tensors.push_back({{"name", p.name},
                       {"group", param_group_name(p.group)},
                       {"numel", p.numel},
                       {"heads", p.heads},
                       {"offset", p.state_offset},
                       {"size", p.state_size}});
  return {{"format", "k3-optimizer-v1"},
          {"step", t_},
          {"config",
           {{"weight_decay", cfg_.weight_decay},
            {"decay_vectors", cfg_.decay_vectors},
            {"beta1", cfg_.beta1},
            {"beta2", cfg_.beta2},
            {"eps", cfg_.eps},
            {"momentum", cfg_.momentum},
            {"nesterov", cfg_.nesterov},
            {"ns_steps", cfg_.ns_steps},
            {"muon_scale", cfg_.muon_scale == MuonScale::MatchAdamRms ? "match-adam-rms" : "shape-ratio"},
            {"muon_rms", cfg_.muon_rms},
            {"router_lr_scale", cfg_.router_lr_scale}}},
          {"tensors", tensors}};
}

int64_t check_optimizer_state(const OptimizerState& s, const std::vector<ParamPlan>& plan, size_t state_size) {
  // The hyperparameters in the header are a record, not checked: changing e.g. weight decay on
  // resume is the caller's choice. The structure must match exactly.
  try {
    const nlohmann::json& h = s.header;
    if (h.at("format").get<std::string>() != "k3-optimizer-v1")
      fail("optimizer state: unknown format '", h.at("format").get<std::string>(), "'");
    const nlohmann::json& ts = h.at("tensors");
    if (ts.size() != plan.size()) fail("optimizer state: ", ts.size(), " tensors, this optimizer has ", plan.size());
    for (size_t i = 0; i < plan.size(); ++i) {
      const ParamPlan& p = plan[i];
      const nlohmann::json& t = ts[i];
      if (t.at("name").get<std::string>() != p.name || t.at("group").get<std::string>() != param_group_name(p.group) ||
          t.at("numel").get<int64_t>() != p.numel || t.at("heads").get<int64_t>() != p.heads ||
          t.at("offset").get<int64_t>() != p.state_offset || t.at("size").get<int64_t>() != p.state_size)
        fail("optimizer state: tensor ", i, " is '", t.at("name").get<std::string>(), "' (",
             t.at("group").get<std::string>(), ", ", t.at("numel").get<int64_t>(), " elements, ",
             t.at("heads").get<int64_t>(), " heads), expected '", p.name, "' (", param_group_name(p.group), ", ",
             p.numel, ", ", p.heads, ")");
    }
    if (s.data.size() != state_size) fail("optimizer state: ", s.data.size(), " values, expected ", state_size);
    const int64_t t = h.at("step").get<int64_t>();
    if (t < 0) fail("optimizer state: negative step");
    return t;
  } catch (const nlohmann::json::exception& e) {
    fail("optimizer state: ", e.what());
  }
}

void Optimizer::load_state(const OptimizerState& s) {
  t_ = check_optimizer_state(s, plan_, size_t(state_size_));
  state_ = s.data;
}

double clip_grad_norm(ParamStore& P, double max_norm, const std::vector<std::string>* names) {
  double ss = 0;
  if (names) {
    for (const std::string& n : *names) {
      const double* g = P.g(n);
      for (int64_t i = 0, e = P.numel(n); i < e; ++i) ss += g[i] * g[i];
    }
  } else {
    for (double g : P.grads()) ss += g * g;
  }
  const double norm = std::sqrt(ss);
  if (max_norm > 0 && norm > max_norm) {
    const double f = max_norm / norm;
    if (names) {
      for (const std::string& n : *names) {
        double* g = P.g(n);
        for (int64_t i = 0, e = P.numel(n); i < e; ++i) g[i] *= f;
      }
    } else {
      for (double& g : P.grads()) g *= f;
    }
  }
  return norm;
}

double cosine_lr(int64_t step, int64_t warmup, int64_t total, double peak, double min_lr) {
  if (warmup < 0 || total <= warmup) fail("cosine schedule: need 0 <= warmup (", warmup, ") < total (", total, ")");
  if (step < 0) fail("cosine schedule: negative step ", step);
  if (step < warmup) return peak * double(step + 1) / double(warmup);
  if (step >= total) return min_lr;
  const double progress = double(step - warmup) / double(total - warmup);
  return min_lr + (peak - min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

}  // namespace k3::train
