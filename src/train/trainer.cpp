#include "train/trainer.h"

#include <omp.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <sstream>

#include "core/error.h"
#include "core/finite.h"
#include "core/json.h"
#include "core/memory.h"
#include "core/splitmix.h"
#include "core/validate.h"
#include "dist/group.h"
#include "io/dir_lock.h"
#include "io/file.h"
#include "io/jsonl.h"
#include "io/output_file.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/params.h"
#include "model/tensor_init.h"
#include "tokenizer/tokenizer.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "train/optimizer.h"
#include "train/sft_data.h"
#include "train/train_device.h"

namespace k3::train {

namespace fs = std::filesystem;

constexpr int64_t kMaxStageTokens = int64_t(1) << 50;

std::vector<Stage> parse_stages(const std::string& text) {
  std::vector<Stage> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const size_t colon = item.find(':');
    Stage s;
    try {
      if (colon == std::string::npos) throw std::invalid_argument("no colon");
      size_t u1 = 0, u2 = 0;
      s.seq_len = std::stoll(item.substr(0, colon), &u1);
      s.tokens = std::stoll(item.substr(colon + 1), &u2);
      if (u1 != colon || u2 != item.size() - colon - 1) throw std::invalid_argument("junk");
    } catch (const std::exception&) {
      fail("--stages: '", item, "' is not SEQ_LEN:TOKENS (e.g. 256:200000)");
    }
    if (s.seq_len < 2 || s.tokens < s.seq_len) fail("--stages: '", item, "' needs SEQ_LEN >= 2 and TOKENS >= SEQ_LEN");
    if (s.tokens > kMaxStageTokens) fail("--stages: '", item, "' has more than 2^50 tokens");
    out.push_back(s);
  }
  if (out.empty()) fail("--stages: no stages given");
  return out;
}

namespace {

// The held-out sequences of a run, evaluated as a whole: their mean loss per prediction.
struct EvalSet {
  std::vector<std::vector<int32_t>> pieces;
  std::vector<TokenMask> trained;  // empty: every token
  int64_t predictions = 0;
  double unigram_entropy = 0.0;
};

// The first `tokens` of the shard, windows of `len`, documents cut as in training; and the entropy of those
// tokens' unigram distribution.
EvalSet shard_eval_set(const TokenShard& shard, int64_t tokens, int64_t len) {
  EvalSet e;
  tokens = std::min(tokens, shard.size());
  for (int64_t pos = 0; pos + 2 <= tokens; pos += len)
    for (auto& p : window_pieces(shard, pos, std::min(len, tokens - pos))) {
      e.predictions += int64_t(p.size()) - 1;
      e.pieces.push_back(std::move(p));
    }
  e.unigram_entropy = unigram_entropy(shard.tokens(), tokens);
  return e;
}

// Every conversation of an SFT file, the loss over the assistant's tokens.
EvalSet sft_eval_set(SftData data) {
  EvalSet e;
  for (SftExample& ex : data.examples) {
    e.pieces.push_back(std::move(ex.ids));
    e.trained.push_back(std::move(ex.trained));
  }
  e.predictions = data.trained_tokens;
  e.unigram_entropy = std::numeric_limits<double>::quiet_NaN();
  return e;
}

EvalResult evaluate(TrainDevice& device, const EvalSet& set) {
  EvalResult r;
  r.predictions = set.predictions;
  r.loss = device.forward_loss(set.pieces, set.trained.empty() ? nullptr : &set.trained) /
           double(std::max<int64_t>(r.predictions, 1));
  r.unigram_entropy = set.unigram_entropy;
  return r;
}

void check_train_options(const TrainOptions& o) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  constexpr int64_t imax = std::numeric_limits<int64_t>::max();
  // Bounds that keep the step arithmetic in range and a step's token buffer allocatable: 2^50
  // tokens is ~100,000x the K3 report's pre-training budget.
  require_integer("--tokens", o.tokens, 1, kMaxStageTokens);
  require_integer("--tokens-per-step", o.tokens_per_step, 2, int64_t(1) << 30);
  require_number("--lr", o.lr, 0, inf, /*lo_open=*/true);
  require_number("--min-lr-ratio", o.min_lr_ratio, 0, 1);
  require_number("--warmup", o.warmup_fraction, 0, 1, false, /*hi_open=*/true);
  require_number("--weight-decay", o.weight_decay, 0, inf);
  require_number("--clip", o.clip, 0, inf);
  require_number("--router-lr-scale", o.router_lr_scale, 0, inf, /*lo_open=*/true);
  require_number("--qb-ema", o.balance.ema_decay, 0, 1, false, /*hi_open=*/true);
  require_integer("--qb-bins", o.balance.num_bins, 2, 1000000);
  require_integer("--grad-lanes", o.grad_lanes, 0, imax);
  require_integer("--save-every", o.save_every, 1, imax);
  require_integer("--eval-tokens", o.eval_tokens, 2, imax);
  require_integer("--eval-every", o.eval_every, 0, imax);
  if (o.eval_every > 0 && o.eval_path.empty()) fail("--eval-every needs --eval-data");
  require_integer("log_every", o.log_every, 0, imax);
  require_integer("--epochs", o.epochs, 1, int64_t(1) << 20);
  require_integer("--max-seq-len", o.max_seq_len, 0, imax);
}

// What a run was started with. A resume must repeat its identity (the config, the seed, the tokens
// per step and the window order: what the model is and which data it sees); its plan (the stages and
// the optimizer's schedule) may change only with --change-plan, e.g. to train longer. The data
// shard, --save-every, --eval-* and --grad-lanes may always change.
nlohmann::json run_recipe(const TrainOptions& o, const std::string& config_text, const std::vector<Stage>& stages,
                          const SftData* sft) {
  nlohmann::json st = nlohmann::json::array();
  for (const Stage& s : stages) st.push_back(std::to_string(s.seq_len) + ":" + std::to_string(s.tokens));
  nlohmann::json r = {{"identity",
                       {{"--config", parse_json(config_text, o.config_path)},
                        {"--seed", o.seed},
                        {"--tokens-per-step", o.tokens_per_step},
                        {"--sequential", !o.shuffle}}},
                      {"plan",
                       {{"--stages", st},
                        {"--lr", o.lr},
                        {"--min-lr-ratio", o.min_lr_ratio},
                        {"--warmup", o.warmup_fraction},
                        {"--weight-decay", o.weight_decay},
                        {"--clip", o.clip},
                        {"--router-lr-scale", o.router_lr_scale},
                        {"--balance", balance_method_name(o.balance.method)},
                        {"--qb-ema", o.balance.ema_decay},
                        {"--qb-bins", o.balance.num_bins}}}};
  if (sft) {  // the steps are cut from the conversations: the same data, the same steps
    r["identity"]["--data"] = {{"conversations", sft->examples.size()}, {"tokens", sft->tokens}};
    r["plan"]["--epochs"] = o.epochs;
    r["plan"].erase("--stages");  // derived from the data and --epochs, not given
  }
  return r;
}

// The differences of one part of a recipe, as "--flag: the run used X, this command gives Y; ...".
std::string recipe_diff(const nlohmann::json& saved, const nlohmann::json& now) {
  std::string diff;
  for (const auto& [flag, was] : saved.items()) {
    if (!now.contains(flag) || now[flag] == was) continue;
    diff += diff.empty() ? "" : "; ";
    if (flag == "--config") diff += "--config: the config differs from the run's (its copy is in that directory)";
    else diff += flag + ": the run used " + was.dump() + ", this command gives " + now[flag].dump();
  }
  return diff;
}

// Refuses a resume whose identity differs from the run's, or whose plan does without --change-plan.
void check_resume_recipe(const nlohmann::json& saved, const nlohmann::json& now, bool change_plan,
                         const std::string& state_file) {
  const std::string identity = recipe_diff(saved.value("identity", nlohmann::json::object()), now["identity"]);
  if (!identity.empty())
    fail(state_file, ": --resume with settings that differ from the run's (repeat the run's own): ", identity);
  const std::string plan = recipe_diff(saved.value("plan", nlohmann::json::object()), now["plan"]);
  if (plan.empty()) return;
  if (!change_plan)
    fail(state_file,
         ": --resume with another plan than the run's (repeat the run's own, or pass --change-plan to "
         "continue on the new one): ",
         plan);
  std::fprintf(stderr, "note: --change-plan: continuing on a new plan: %s\n", plan.c_str());
}

}  // namespace

TrainResult train(const TrainOptions& opt) {
  check_train_options(opt);
  // Under a launcher every rank runs this function on the same step: rank 0 owns the run directory (its lock,
  // metrics and checkpoints), and the CPU trainer shares each step's sequences out (train_device.h).
  dist::Group& world = dist::world();
  const bool lead = world.rank() == 0;
  if (opt.gpu && world.size() > 1)
    fail(
        "--device cuda runs on one process: the GPU trainer's data parallelism over NCCL is not built; "
        "the CPU trainer runs data-parallel under mpirun");
  // One process per run directory: the lock is held until train() returns (or the process dies).
  std::unique_ptr<DirectoryLock> run_lock;
  if (lead) run_lock = std::make_unique<DirectoryLock>(opt.out_dir, "run directory");
  world.barrier();  // no rank reads the directory before rank 0 holds it
  const K3Config c = load_config(opt.config_path);
  const std::string config_text = read_file(opt.config_path, "config");
  const bool sft = !opt.sft_data.empty();
  TokenShard shard;
  SftData sft_data;
  SftPlan sft_plan;
  std::vector<int64_t> sft_tokens_before;    // [steps + 1]: the tokens of the steps before each
  std::vector<std::string> tokenizer_files;  // SFT: copied into every checkpoint
  EvalSet eval_set;
  std::vector<Stage> stages = opt.stages;
  if (sft) {
    if (!stages.empty()) fail("SFT runs take no --stages: the conversations are the sequences");
    const int64_t max_len = opt.max_seq_len > 0 ? opt.max_seq_len : c.max_position_embeddings;
    if (max_len > c.max_position_embeddings)
      fail("--max-seq-len ", max_len, " exceeds max_position_embeddings ", c.max_position_embeddings, " of ", c.source);
    const Tokenizer tok = Tokenizer::load_dir(opt.tokenizer_dir);
    tok.check_fits(c.vocab_size, opt.tokenizer_dir, c.source);
    for (const char* f : {"tiktoken.model", "tokenizer_config.json"})
      if (fs::is_regular_file(fs::path(opt.tokenizer_dir) / f))
        tokenizer_files.push_back((fs::path(opt.tokenizer_dir) / f).string());
    sft_data = load_sft_data(opt.sft_data, tok, c.vocab_size, max_len);
    std::vector<int64_t> lengths;
    for (const SftExample& ex : sft_data.examples) lengths.push_back(int64_t(ex.ids.size()));
    sft_plan = plan_sft_steps(lengths, opt.epochs, opt.tokens_per_step, opt.shuffle, opt.seed);
    sft_tokens_before.push_back(0);
    for (int64_t s = 0; s < sft_plan.steps(); ++s) {
      int64_t t = 0;
      for (int64_t k = sft_plan.step_begin[size_t(s)]; k < sft_plan.step_begin[size_t(s + 1)]; ++k)
        t += lengths[size_t(sft_plan.order[size_t(k)])];
      sft_tokens_before.push_back(sft_tokens_before.back() + t);
    }
    std::fprintf(stderr,
                 "%s: %lld conversations, %lld tokens, %lld of them the assistant's (trained); %lld cut to %lld "
                 "tokens, %lld without an assistant token in them dropped\n",
                 opt.sft_data.c_str(), (long long)sft_data.examples.size(), (long long)sft_data.tokens,
                 (long long)sft_data.trained_tokens, (long long)sft_data.truncated, (long long)max_len,
                 (long long)sft_data.untrained);
    if (!opt.eval_path.empty()) eval_set = sft_eval_set(load_sft_data(opt.eval_path, tok, c.vocab_size, max_len));
    stages.push_back({max_len, sft_tokens_before.back()});
  } else {
    shard = TokenShard::open(opt.data_path);
    check_shard_for_model(shard, opt.data_path, c);
    if (stages.empty()) stages.push_back({std::min<int64_t>(256, c.max_position_embeddings), opt.tokens});
  }
  int64_t total_steps = 0;
  std::vector<int64_t> stage_end;  // cumulative steps
  if (sft) {
    total_steps = sft_plan.steps();
    stage_end.push_back(total_steps);  // one stage: the conversations cut to max_len
  } else {
    for (const Stage& s : stages) {
      if (s.seq_len > c.max_position_embeddings)
        fail("stage sequence length ", s.seq_len, " exceeds max_position_embeddings ", c.max_position_embeddings,
             " of ", c.source);
      if (s.seq_len > opt.tokens_per_step)
        fail("stage sequence length ", s.seq_len, " exceeds --tokens-per-step ", opt.tokens_per_step);
      total_steps += std::max<int64_t>(1, s.tokens / opt.tokens_per_step);
      stage_end.push_back(total_steps);
    }
  }
  const int64_t warmup =
      std::min<int64_t>(total_steps - 1, int64_t(std::ceil(opt.warmup_fraction * double(total_steps))));
  if (!sft && !opt.eval_path.empty()) {
    const TokenShard eval_shard = TokenShard::open(opt.eval_path);
    check_shard_for_model(eval_shard, opt.eval_path, c);
    eval_set = shard_eval_set(eval_shard, opt.eval_tokens, stages.back().seq_len);
  }

  // Parameters: a fresh random init, made in memory from the tensor table (what `k3 init --seed`
  // would write), or the latest checkpoint.
  const std::string resume_dir = opt.resume ? latest_checkpoint(opt.out_dir) : "";
  if (opt.resume && resume_dir.empty()) fail(opt.out_dir, ": --resume, but there is no checkpoint (no 'latest')");
  ParamStore P;
  if (resume_dir.empty() && !opt.init_model.empty()) {
    P = ParamStore::from_model_dir(opt.init_model);
  } else if (resume_dir.empty()) {
    RandomInitOptions ri;
    ri.seed = opt.seed;
    P = ParamStore::random_init(c, ri);
  } else {
    P = ParamStore::from_model_dir(resume_dir);
  }
  OptimizerConfig oc;
  oc.weight_decay = opt.weight_decay;
  oc.router_lr_scale = opt.router_lr_scale;
  Optimizer optimizer(P, oc, k3_head_splits(P, c));

  int64_t step = 0, data_pos = 0, lanes = opt.grad_lanes;
  const std::string metrics_path = (fs::path(opt.out_dir) / "metrics.jsonl").string();
  const nlohmann::json recipe = run_recipe(opt, config_text, stages, sft ? &sft_data : nullptr);
  dist::check_same_on_every_rank(world, recipe.dump() + "\n" + opt.data_path + "\n" + opt.sft_data + "\n" + opt.out_dir,
                                 "the run's settings (config, data, run directory and flags)");
  TrainResult res;
  OptimizerState resume_optimizer;
  nlohmann::json resume_balancers;
  if (!resume_dir.empty()) {
    TrainState st;
    load_checkpoint(resume_dir, P, st);
    const std::string state_file = (fs::path(resume_dir) / "train_state.bin").string();
    try {
      if (st.meta.contains("recipe")) check_resume_recipe(st.meta["recipe"], recipe, opt.change_plan, state_file);
      else if (st.meta.value("shuffle", true) != opt.shuffle)  // a run saved before recipes were kept
        fail(state_file, ": the run was started ", opt.shuffle ? "with --sequential" : "with shuffled windows",
             "; resume it the same way");
      step = st.meta.at("step").get<int64_t>();
      data_pos = st.meta.at("data_pos").get<int64_t>();
      const int64_t saved_lanes = st.meta.value("grad_lanes", int64_t(1));  // runs before lanes summed serially
      if (lanes == 0) lanes = saved_lanes;
      else if (lanes != saved_lanes)
        std::fprintf(stderr,
                     "note: resuming with %lld gradient lanes, the run used %lld: gradients are summed in a "
                     "different order, so losses will not repeat bit for bit\n",
                     (long long)lanes, (long long)saved_lanes);
      if (const int64_t saved_ranks = st.meta.value("ranks", int64_t(1)); saved_ranks != world.size())
        std::fprintf(stderr,
                     "note: resuming on %d rank%s, the run used %lld: the step's gradients are summed in another "
                     "order, so losses will not repeat bit for bit\n",
                     world.size(), world.size() == 1 ? "" : "s", (long long)saved_ranks);
      resume_optimizer = {st.meta.at("optimizer"), st.optimizer};
      resume_balancers = st.meta.at("balancers");
    } catch (const nlohmann::json::exception& e) {
      fail(state_file, ": corrupt training state (", e.what(), ")");
    }
    // Metrics after the checkpoint belong to the run that was cut off: drop them (and a line torn by
    // the kill).
    std::string kept;
    if (fs::exists(metrics_path)) {
      const JsonlFile m = read_jsonl(metrics_path, "run metrics", InputRole::kOwnState);
      if (m.dropped_torn_last_line) std::fprintf(stderr, "note: %s: dropped a torn last line\n", metrics_path.c_str());
      for (const JsonlRecord& r : m.records) {
        const auto it = r.value.find("step");
        if (it == r.value.end() || !it->is_number_integer())
          fail(metrics_path, ":", r.line, ": a record needs an integer \"step\"");
        if (it->get<int64_t>() > step) continue;
        kept += r.text + "\n";
        if (r.value.contains("loss") && r.value["loss"].is_number()) res.last_loss = r.value["loss"].get<double>();
      }
    }
    if (lead) write_file_atomic(metrics_path, kept);
    res.steps = step;
    res.last_checkpoint = resume_dir;
    if (step >= total_steps)
      std::fprintf(stderr, "%s: the run is already complete (step %lld of %lld); nothing to train\n",
                   opt.out_dir.c_str(), (long long)step, (long long)total_steps);
    else
      std::fprintf(stderr, "resumed from %s at step %lld (data position %lld)\n", resume_dir.c_str(), (long long)step,
                   (long long)data_pos);
  } else if (lead) {
    write_file_atomic(metrics_path, "");
  }
  if (lanes == 0) {
    // One lane per thread, as many as fit: each lane past the first holds a model-sized float64
    // gradient buffer (an explicit --grad-lanes is refused instead when it does not fit).
    // Under mpirun the ranks of one node share its memory.
    lanes = omp_get_max_threads();
    const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    const uint64_t per_lane = uint64_t(P.grads().size()) * sizeof(double),
                   avail = available_memory_bytes() / uint64_t(std::max(1, local ? std::atoi(local) : 1));
    const int64_t fit = per_lane == 0 ? lanes : int64_t(std::min<uint64_t>(avail / per_lane, uint64_t(lanes - 1))) + 1;
    if (fit < lanes)
      std::fprintf(stderr, "note: %lld gradient lanes (of %lld threads) fit in the %s of memory available\n",
                   (long long)fit, (long long)lanes, format_bytes(avail).c_str());
    lanes = std::max<int64_t>(1, fit);
  }
  if (lanes < 1) fail("--grad-lanes must be at least 1 (or 0 for the thread count), got ", lanes);
  const std::unique_ptr<TrainDevice> device = opt.gpu
                                                  ? make_cuda_train_device(P, c, optimizer, opt.balance, opt.cuda)
                                                  : make_cpu_train_device(P, c, optimizer, opt.balance, lanes, &world);
  if (!resume_dir.empty()) {
    try {
      device->load_state(resume_optimizer, resume_balancers);
    } catch (const nlohmann::json::exception& e) {
      fail((fs::path(resume_dir) / "train_state.bin").string(), ": corrupt training state (", e.what(), ")");
    }
  }
  std::fprintf(stderr, "training on %s\n", device->describe().c_str());
  struct Appender {  // metrics.jsonl, one record per line (rank 0's)
    int fd;
    ~Appender() {
      if (fd >= 0) ::close(fd);
    }
  } metrics{lead ? open_append(metrics_path) : -1};
  auto append_metrics = [&](const std::string& line) {
    if (lead) append_all(metrics.fd, line + "\n", metrics_path);
  };

  auto save = [&]() {
    TrainState st;
    st.meta = {{"step", step},           {"data_pos", data_pos}, {"total_steps", total_steps},
               {"shuffle", opt.shuffle}, {"grad_lanes", lanes},  {"ranks", world.size()},
               {"recipe", recipe}};
    OptimizerState os;
    nlohmann::json bj;
    device->save_state(P, os, bj);
    // Every rank holds the same state; rank 0 writes it, and every rank knows where.
    if (!lead) return (fs::path(opt.out_dir) / step_name(step)).string();
    st.meta["optimizer"] = os.header;
    st.optimizer = std::move(os.data);
    st.meta["balancers"] = bj;
    return save_checkpoint(opt.out_dir, step, config_text, P, st, tokenizer_files);
  };

  int64_t evaluated_at = -1;  // the step of the last held-out evaluation
  auto run_eval = [&]() {
    evaluated_at = step;
    res.eval = evaluate(*device, eval_set);
    if (!std::isfinite(res.eval.loss))
      fail(opt.eval_path, ": the held-out loss after step ", step, " is ", nonfinite_name(res.eval.loss),
           " although every parameter is finite");
    nlohmann::json rec = {{"eval_loss", res.eval.loss}, {"eval_predictions", res.eval.predictions}, {"step", step}};
    if (sft) {
      std::fprintf(stderr, "held-out after step %lld: loss %.4f nats/token over %lld assistant tokens\n",
                   (long long)step, res.eval.loss, (long long)res.eval.predictions);
    } else {
      std::fprintf(stderr,
                   "held-out after step %lld: loss %.4f nats/token over %lld predictions; unigram entropy %.4f "
                   "nats/token\n",
                   (long long)step, res.eval.loss, (long long)res.eval.predictions, res.eval.unigram_entropy);
      rec["unigram_entropy"] = res.eval.unigram_entropy;
    }
    append_metrics(rec.dump());
  };

  const auto t0 = std::chrono::steady_clock::now();
  const int64_t first_step = step;
  while (step < total_steps) {
    size_t si = 0;
    while (step >= stage_end[si]) ++si;
    const int64_t L = stages[si].seq_len;
    const int64_t windows = std::max<int64_t>(1, opt.tokens_per_step / L);
    std::vector<std::vector<int32_t>> pieces;
    std::vector<TokenMask> masks;  // SFT: the assistant's tokens
    int64_t count = 0, epoch = 0;
    if (sft) {
      for (int64_t k = sft_plan.step_begin[size_t(step)]; k < sft_plan.step_begin[size_t(step + 1)]; ++k) {
        const SftExample& ex = sft_data.examples[size_t(sft_plan.order[size_t(k)])];
        pieces.push_back(ex.ids);
        masks.push_back(ex.trained);
        count += target_count(int64_t(ex.ids.size()), {}, &ex.trained);
      }
      data_pos = sft_plan.step_begin[size_t(step + 1)];
      epoch = sft_plan.step_begin[size_t(step)] / int64_t(sft_data.examples.size());
    }
    for (int64_t w = 0; !sft && w < windows; ++w) {
      // data_pos: the next window's start (sequential) or the number of windows drawn (shuffled).
      const int64_t start =
          opt.shuffle ? int64_t(splitmix64(opt.seed * 0x100000001b3ULL ^ uint64_t(data_pos)) % uint64_t(shard.size()))
                      : data_pos;
      for (auto& p : window_pieces(shard, start, L)) pieces.push_back(std::move(p));
      data_pos = opt.shuffle ? data_pos + 1 : (data_pos + L) % shard.size();
    }
    if (!sft)
      for (const auto& p : pieces) count += int64_t(p.size()) - 1;
    double loss = device->gradients(pieces, sft ? &masks : nullptr, 1.0 / double(std::max<int64_t>(count, 1)));
    loss /= double(std::max<int64_t>(count, 1));
    const double lr = cosine_lr(step, warmup, total_steps, opt.lr, opt.lr * opt.min_lr_ratio);
    std::string bad_gradient;
    const double gnorm = device->clip(opt.clip, &bad_gradient);
    const std::vector<double> maxvio = device->finish_balance();
    const bool finite = std::isfinite(loss) && std::isfinite(gnorm) && bad_gradient.empty();
    // Steps are numbered from 1, as in the progress lines and metrics.jsonl.
    const std::string saved = res.last_checkpoint.empty() ? "no checkpoint has been written yet"
                                                          : "the last checkpoint is " + res.last_checkpoint;
    if (!finite && !opt.skip_nonfinite)
      fail("step ", step + 1, ": non-finite ", std::isfinite(loss) ? "gradient" : "loss", " (loss ", loss,
           ", gradient norm ", gnorm, bad_gradient.empty() ? "" : ", first in the gradient of " + bad_gradient,
           "); stopping. Lower --lr, or pass --skip-nonfinite to skip such steps; ", saved);
    if (finite) {
      // The update itself can overflow (a huge lr, a broken optimizer state): never save that.
      if (const std::string bad = device->update(lr); !bad.empty())
        fail("step ", step + 1, ": the optimizer update made parameter ", bad, " (lr ", lr,
             "); stopping before it is saved; ", saved);
    }
    if (count == 0)
      std::fprintf(stderr,
                   "warning: step %lld: its windows hold no prediction (only end-of-document ids); "
                   "nothing was learned\n",
                   (long long)step + 1);
    ++step;
    ++res.steps_run;

    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const int64_t tokens = sft ? sft_tokens_before[size_t(step)] : step * windows * L;
    const double done_tokens =
        sft ? double(tokens - sft_tokens_before[size_t(first_step)]) : double((step - first_step) * windows * L);
    nlohmann::json rec = {
        {"step", step},      {"stage", si},       {"seq_len", L},
        {"loss", loss},      {"lr", lr},          {"grad_norm", gnorm},
        {"tokens", tokens},  {"targets", count},  {"tokens_per_s", done_tokens / std::max(secs, 1e-9)},
        {"max_vio", maxvio}, {"skipped", !finite}};
    if (sft) rec["epoch"] = epoch + 1;
    const std::string line = rec.dump();
    append_metrics(line);
    if (opt.log_every > 0 && (step % opt.log_every == 0 || step == total_steps)) {
      double mv = 0;
      for (double v : maxvio) mv = std::max(mv, v);
      const double eta = secs / double(step - first_step) * double(total_steps - step);
      const std::string where = sft ? "epoch " + std::to_string(epoch + 1) + "/" + std::to_string(opt.epochs) + " (" +
                                          std::to_string(pieces.size()) + " conversations)"
                                    : "stage " + std::to_string(si) + " (len " + std::to_string(L) + ")";
      std::fprintf(stderr, "step %lld/%lld  %s  loss %.4f  lr %.2e  |g| %.3f  MaxVio %.3f  %.0f tok/s  ETA %.0fs\n",
                   (long long)step, (long long)total_steps, where.c_str(), loss, lr, gnorm, mv,
                   done_tokens / std::max(secs, 1e-9), eta);
    }
    res.steps = step;
    res.last_loss = loss;
    // Evaluated before the checkpoint: a run killed in between redoes both (the record is past the
    // checkpoint it resumes from), never leaves a checkpointed step without its evaluation.
    if (!opt.eval_path.empty() && opt.eval_every > 0 && step % opt.eval_every == 0) run_eval();
    if (step % opt.save_every == 0 || step == total_steps) {
      res.last_checkpoint = save();
      world.barrier();  // a rank that stops here (on_step, the end) finds the checkpoint written
    }
    if (opt.on_step && !opt.on_step(line)) break;
  }
  if (!opt.eval_path.empty() && evaluated_at != step) run_eval();
  return res;
}

}  // namespace k3::train
