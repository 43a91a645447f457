// k3 eval: evaluate a checkpoint. Held-out perplexity, long-context retrieval accuracy against
// prompt length (also past the training length), expert load per MoE layer; eval.json and PNG plots.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/args.h"
#include "cli/commands.h"
#include "cli/engine.h"
#include "core/error.h"
#include "core/validate.h"
#include "eval/eval.h"
#include "eval/plots.h"
#include "eval/run_metrics.h"
#include "io/safetensors.h"
#include "train/checkpoint.h"

namespace k3::cli {

namespace fs = std::filesystem;

namespace {

std::vector<int64_t> parse_lengths(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || v < 2)
      fail("--lengths: '", item, "' is not a token count >= 2 (e.g. 256,512,1024)");
    out.push_back(v);
  }
  if (out.empty()) fail("--lengths: no lengths given");
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

nlohmann::ordered_json layer_json(const eval::ExpertLoad::LayerStats& s) {
  return {{"layer", s.layer},         {"assignments", s.assignments},
          {"max_vio", s.max_vio},     {"min_share", s.min_share},
          {"max_share", s.max_share}, {"unused_experts", s.unused_experts},
          {"share", s.share},         {"counts", s.counts}};
}

}  // namespace

void register_eval(CLI::App& app) {
  struct Opts {
    std::string model, tokenizer, heldout, filler, run, lengths, out = "k3-eval", tasks = "passkey,multikey";
    int64_t train_length = 0, samples = 20, heldout_tokens = 32768, keys = 4;
    bool no_plots = false;
    DeviceOptions device;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = app.add_subcommand(
      "eval",
      "Evaluate a checkpoint with the inference engine and write OUTDIR/eval.json plus PNG plots.\n"
      "  held-out loss: mean next-token NLL (nats) and perplexity over the first --heldout-tokens of\n"
      "    --heldout (a `k3 data` shard), in windows of the training length cut at document boundaries\n"
      "    as `k3 train` does, beside the shard's unigram entropy (the loss of a frequency-only model).\n"
      "  expert load: on those windows, the share of routed assignments per expert in every MoE layer,\n"
      "    MaxVio (max load / mean load - 1), min/max share.\n"
      "  retrieval: passkey and multi-key recall prompts (filler sentences from --filler) of each\n"
      "    --lengths, default L/4, L/2, L, 2L, 4L for the training length L (--train-length, else the\n"
      "    longest seq_len the run trained at up to this checkpoint, from RUN/metrics.jsonl); --samples\n"
      "    each with fixed seeds; greedy decoding of as many tokens as the answer has; exact match.\n"
      "    K3 has no positional encoding, so lengths past L show how far it extrapolates.\n"
      "  plots (gnuplot, pngcairo): loss.png and maxvio.png from --run, retrieval.png, expert_load.png;\n"
      "    their data and scripts go to OUTDIR/plot-data/. Without gnuplot (apt-get install gnuplot-nox)\n"
      "    the JSON, data and scripts are still written and the PNGs are skipped.\n"
      "--model may be a run directory (its `latest` checkpoint is used and it is also --run); for a\n"
      "RUN/step-N checkpoint, RUN is used as --run when it holds metrics.jsonl.");
  sub->add_option("--model", o->model, "checkpoint directory (config.json + model.safetensors), or a run directory")
      ->required();
  sub->add_option("--tokenizer", o->tokenizer,
                  "tokenizer directory (tiktoken.model); default: --model. Needed for retrieval");
  sub->add_option("--heldout", o->heldout, "held-out token shard (`k3 data`) for loss/perplexity and expert load");
  sub->add_option("--heldout-tokens", o->heldout_tokens, "held-out tokens to evaluate at most")->capture_default_str();
  sub->add_option("--filler", o->filler,
                  "directory (its *.txt) or file of plain-text filler documents, one sentence per line, for retrieval");
  sub->add_option("--run", o->run,
                  "training run directory (RUN/metrics.jsonl): loss and MaxVio plots, training length");
  sub->add_option("--lengths", o->lengths,
                  "retrieval prompt lengths in tokens, e.g. 256,512,1024 (default: L/4,L/2,L,2L,4L)");
  sub->add_option("--train-length", o->train_length, "the final training sequence length L (default: from --run)");
  sub->add_option("--samples", o->samples, "retrieval prompts per task and length")->capture_default_str();
  sub->add_option("--tasks", o->tasks, "retrieval tasks: passkey, multikey or both")->capture_default_str();
  sub->add_option("--keys", o->keys, "key/value pairs in a multikey prompt")->capture_default_str();
  sub->add_option("--out", o->out, "output directory (eval.json, *.png, plot-data/)")->capture_default_str();
  add_device_options(sub, o->device);
  sub->add_flag("--no-plots", o->no_plots, "write eval.json only");
  sub->callback([o] {
    require_integer("--samples", o->samples, 1, 1000000);
    require_integer("--heldout-tokens", o->heldout_tokens, 2, int64_t(1) << 40);
    require_integer("--keys", o->keys, 1, 24);
    require_integer("--train-length", o->train_length, 0, int64_t(1) << 24);  // 0: not given
    if (o->heldout.empty() && o->filler.empty())
      fail("nothing to evaluate: give --heldout SHARD (loss, expert load) and/or --filler DIR (retrieval)");
    const std::vector<int64_t> given_lengths = o->lengths.empty() ? std::vector<int64_t>{} : parse_lengths(o->lengths);
    std::vector<data::RetrievalTask> tasks;
    {
      std::stringstream ss(o->tasks);
      std::string t;
      while (std::getline(ss, t, ',')) tasks.push_back(data::parse_retrieval_task(t));
      if (tasks.empty()) fail("--tasks: no task given");
    }

    // The checkpoint, and the run it came from.
    std::string model_dir = o->model, run_dir = o->run, run_note;
    if (!fs::is_directory(model_dir)) fail("--model ", model_dir, ": no such directory");
    if (!fs::exists(fs::path(model_dir) / "config.json")) {
      const std::string latest = train::latest_checkpoint(model_dir);
      if (latest.empty())
        fail("--model ", model_dir, ": not a checkpoint (no config.json) nor a run directory (no 'latest')");
      if (run_dir.empty()) run_dir = model_dir, run_note = "the --model run directory";
      model_dir = latest;
    } else if (run_dir.empty()) {
      const fs::path parent = fs::absolute(model_dir).lexically_normal().parent_path();
      const fs::path parent2 = parent.filename().empty() ? parent.parent_path() : parent;
      if (eval::checkpoint_step(model_dir) >= 0 && fs::exists(parent2 / "metrics.jsonl"))
        run_dir = parent2.string(), run_note = "the checkpoint's parent directory";
    }
    const int64_t step = eval::checkpoint_step(model_dir);
    std::unique_ptr<eval::RunMetrics> run;
    if (!run_dir.empty()) {
      run = std::make_unique<eval::RunMetrics>(eval::read_run_metrics(run_dir));
      std::fprintf(stderr, "[%.2fs] run: %s (%zu steps%s%s)\n", elapsed_seconds(), run->path.c_str(), run->steps.size(),
                   run_note.empty() ? "" : ", ", run_note.c_str());
    }

    std::unique_ptr<Engine> m = load_engine(model_dir, o->device);
    const K3Config& cfg = m->config();

    // The training length L.
    int64_t L = o->train_length;
    std::string L_source = "--train-length";
    if (L <= 0 && run) {
      L = run->trained_length(step);
      L_source = step >= 0 ? "longest seq_len in " + run->path + " up to step " + std::to_string(step)
                           : "longest seq_len in " + run->path;
      if (run->last_seq_len() > L)
        std::fprintf(stderr,
                     "note: the run goes on to seq_len %lld after this checkpoint; lengths are relative to %lld, what "
                     "step %lld trained at\n",
                     (long long)run->last_seq_len(), (long long)L, (long long)step);
    }
    if (L <= 0 && (!o->heldout.empty() || (!o->filler.empty() && o->lengths.empty())))
      fail(
          "the training length is unknown: give --train-length L (the final stage's sequence length), or --run RUN "
          "whose metrics.jsonl records it");
    if (L < 2 && L > 0) fail("--train-length must be >= 2, got ", L);

    nlohmann::ordered_json J;
    J["model"] = model_dir;
    J["step"] = step >= 0 ? nlohmann::ordered_json(step) : nlohmann::ordered_json(nullptr);
    J["config"] = {{"source", cfg.source},           {"vocab_size", cfg.vocab_size},
                   {"hidden_size", cfg.hidden_size}, {"num_hidden_layers", cfg.num_hidden_layers},
                   {"num_experts", cfg.num_experts}, {"num_experts_per_token", cfg.num_experts_per_token}};
    J["train_length"] = L > 0 ? nlohmann::ordered_json(L) : nlohmann::ordered_json(nullptr);
    J["train_length_source"] = L > 0 ? L_source : "";
    fs::create_directories(o->out);

    // 1 + 3. Held-out loss and expert load.
    std::unique_ptr<eval::HeldoutResult> heldout;
    eval::ExpertLoad load(cfg);
    std::vector<eval::ExpertLoad::LayerStats> load_stats;
    if (!o->heldout.empty()) {
      if (!fs::exists(o->heldout)) fail("--heldout ", o->heldout, ": no such file (build one with `k3 data`)");
      const train::TokenShard shard = train::TokenShard::open(o->heldout);
      train::check_shard_for_model(shard, o->heldout, cfg);
      const int64_t total = std::min(o->heldout_tokens, shard.size());
      std::fprintf(stderr, "[%.2fs] held-out: %lld of %lld tokens of %s in windows of %lld\n", elapsed_seconds(),
                   (long long)total, (long long)shard.size(), o->heldout.c_str(), (long long)L);
      int64_t next_report = total / 10;
      heldout = std::make_unique<eval::HeldoutResult>(
          eval::heldout_loss(*m, shard, o->heldout_tokens, L, &load, [&](int64_t done, int64_t all) {
            if (done >= next_report || done == all) {
              std::fprintf(stderr, "[%.2fs] held-out: %lld/%lld tokens\n", elapsed_seconds(), (long long)done,
                           (long long)all);
              next_report = done + std::max<int64_t>(all / 10, 1);
            }
          }));
      load_stats = load.stats();
      J["heldout"] = {{"shard", o->heldout},
                      {"tokens", heldout->tokens},
                      {"window", heldout->window},
                      {"windows", heldout->windows},
                      {"sequences", heldout->sequences},
                      {"predictions", heldout->predictions},
                      {"loss", heldout->loss},
                      {"perplexity", heldout->perplexity},
                      {"unigram_entropy", heldout->unigram_entropy},
                      {"unigram_perplexity", std::exp(heldout->unigram_entropy)},
                      {"seconds", heldout->seconds}};
      nlohmann::ordered_json layers = nlohmann::ordered_json::array();
      double sum_vio = 0, max_vio = 0;
      for (const auto& s : load_stats) {
        layers.push_back(layer_json(s));
        sum_vio += s.max_vio;
        max_vio = std::max(max_vio, s.max_vio);
      }
      J["expert_load"] = {{"source", "held-out windows"},
                          {"tokens", heldout->tokens},
                          {"num_experts", cfg.num_experts},
                          {"experts_per_token", cfg.num_experts_per_token},
                          {"mean_max_vio", load_stats.empty() ? 0.0 : sum_vio / double(load_stats.size())},
                          {"max_max_vio", max_vio},
                          {"layers", layers}};
    } else {
      J["heldout"] = nullptr;
      J["expert_load"] = nullptr;
      std::fprintf(stderr, "note: no --heldout: held-out loss and expert load skipped\n");
    }

    // 2. Retrieval.
    std::vector<eval::RetrievalPoint> points;
    std::vector<int64_t> lengths;
    if (!o->filler.empty()) {
      const std::string tok_dir = o->tokenizer.empty() ? model_dir : o->tokenizer;
      if (!Tokenizer::dir_has_tokenizer(tok_dir))
        fail(tok_dir, ": no tiktoken.model; retrieval prompts are text, so give --tokenizer DIR (the run's tokenizer)");
      const Tokenizer tok = Tokenizer::load_dir(tok_dir);
      if (tok.vocab_size() > cfg.vocab_size)
        fail(tok_dir, ": the tokenizer has ", tok.vocab_size(), " ids but the model's vocab_size is ", cfg.vocab_size,
             " (", cfg.source, ")");
      const data::RetrievalTaskGenerator gen(tok, data::read_filler_documents(o->filler, "--filler"));
      lengths = o->lengths.empty()
                    ? std::vector<int64_t>{std::max<int64_t>(2, L / 4), std::max<int64_t>(2, L / 2), L, 2 * L, 4 * L}
                    : given_lengths;
      lengths.erase(std::unique(lengths.begin(), lengths.end()), lengths.end());
      for (data::RetrievalTask task : tasks)
        for (int64_t len : lengths) {
          eval::RetrievalPoint p = eval::retrieval_accuracy(*m, tok, gen, task, len, o->samples, int(o->keys));
          if (p.skipped)
            std::fprintf(stderr, "[%.2fs] %s @ %lld tokens: skipped (%s)\n", elapsed_seconds(), p.task.c_str(),
                         (long long)len, p.note.c_str());
          else
            std::fprintf(stderr, "[%.2fs] %s @ %lld tokens: %lld/%lld correct (%.2f), mean depth %.2f, %.1f s\n",
                         elapsed_seconds(), p.task.c_str(), (long long)len, (long long)p.correct, (long long)p.samples,
                         p.accuracy, p.mean_depth, p.seconds);
          points.push_back(std::move(p));
        }
      nlohmann::ordered_json res = nlohmann::ordered_json::array();
      for (const auto& p : points) {
        nlohmann::ordered_json d = nlohmann::ordered_json::array();
        for (const auto& s : p.details)
          d.push_back({{"seed", s.seed},
                       {"prompt_tokens", s.prompt_tokens},
                       {"depth", s.depth},
                       {"answer", s.answer},
                       {"output", s.output},
                       {"correct", s.correct}});
        res.push_back({{"task", p.task},
                       {"length", p.length},
                       {"length_over_train_length",
                        L > 0 ? nlohmann::ordered_json(double(p.length) / double(L)) : nlohmann::ordered_json(nullptr)},
                       {"skipped", p.skipped},
                       {"note", p.note},
                       {"samples", p.samples},
                       {"correct", p.correct},
                       {"accuracy", p.accuracy},
                       {"mean_depth", p.mean_depth},
                       {"mean_prompt_tokens", p.mean_prompt_tokens},
                       {"seconds", p.seconds},
                       {"details", d}});
      }
      J["retrieval"] = {{"tokenizer", tok_dir},
                        {"filler", o->filler},
                        {"samples", o->samples},
                        {"keys", o->keys},
                        {"decoding", "greedy, as many tokens as the answer encodes to; exact text match"},
                        {"lengths", lengths},
                        {"results", res}};
    } else {
      J["retrieval"] = nullptr;
      std::fprintf(stderr, "note: no --filler: retrieval skipped\n");
    }

    // The run.
    if (run) {
      nlohmann::ordered_json r = {{"metrics", run->path}, {"steps", run->steps.size()}};
      if (!run->steps.empty()) {
        const auto& last = run->steps.back();
        r["last_step"] = last.step;
        r["last_loss"] = last.loss;
        r["last_tokens"] = last.tokens;
        r["last_seq_len"] = last.seq_len;
        r["last_max_vio"] = last.max_vio;
      }
      nlohmann::ordered_json ev = nlohmann::ordered_json::array();
      for (const auto& e : run->evals)
        ev.push_back({{"step", e.step}, {"eval_loss", e.eval_loss}, {"unigram_entropy", e.unigram_entropy}});
      r["evals"] = ev;
      J["run"] = r;
    } else {
      J["run"] = nullptr;
    }

    // 4. Plots.
    nlohmann::ordered_json plots = nlohmann::ordered_json::array();
    std::vector<eval::PlotResult> plot_results;
    std::string gnuplot;
    if (!o->no_plots) {
      gnuplot = eval::find_gnuplot();
      if (gnuplot.empty())
        std::fprintf(stderr,
                     "warning: gnuplot not found: PNG plots skipped (install it: apt-get install gnuplot-nox); "
                     "data and scripts are written to %s/plot-data/\n",
                     o->out.c_str());
      std::fprintf(stderr, "[%.2fs] plots\n", elapsed_seconds());
      plot_results = eval::write_plots(o->out, run.get(), heldout.get(), step, points, L, load_stats, gnuplot);
      for (const auto& p : plot_results)
        plots.push_back({{"name", p.name}, {"png", p.png}, {"drawn", p.drawn}, {"script", p.script}, {"note", p.note}});
    }
    J["plots"] = plots;
    J["gnuplot"] = gnuplot.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(gnuplot);
    const std::string json_path = (fs::path(o->out) / "eval.json").string();
    // Decoded model outputs may hold invalid UTF-8 (a byte-level token alone): written as U+FFFD.
    write_file_atomic(json_path, J.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n");

    // 5. Summary.
    std::printf("k3 eval: %s%s\n", model_dir.c_str(),
                step >= 0 ? (" (step " + std::to_string(step) + ")").c_str() : "");
    if (L > 0) std::printf("training length L = %lld (%s)\n", (long long)L, L_source.c_str());
    if (heldout) {
      std::printf("\nheld-out: %lld tokens, %lld predictions in %lld windows of %lld\n", (long long)heldout->tokens,
                  (long long)heldout->predictions, (long long)heldout->windows, (long long)heldout->window);
      std::printf("  loss %.4f nats/token, perplexity %.2f; unigram entropy %.4f (perplexity %.2f)\n", heldout->loss,
                  heldout->perplexity, heldout->unigram_entropy, std::exp(heldout->unigram_entropy));
      std::printf("\nexpert load (%lld experts, top-%lld, on the held-out tokens)\n", (long long)cfg.num_experts,
                  (long long)cfg.num_experts_per_token);
      std::printf("  %-6s %8s %10s %10s %7s\n", "layer", "MaxVio", "min share", "max share", "unused");
      for (const auto& s : load_stats)
        std::printf("  %-6lld %8.3f %10.4f %10.4f %7lld\n", (long long)s.layer, s.max_vio, s.min_share, s.max_share,
                    (long long)s.unused_experts);
      if (!load_stats.empty()) std::printf("  (uniform share: %.4f)\n", 1.0 / double(cfg.num_experts));
    }
    if (!points.empty()) {
      std::printf("\nretrieval accuracy (%lld samples each, greedy, exact match)\n", (long long)o->samples);
      std::printf("  %-8s", "length");
      if (L > 0) std::printf(" %7s", "x L");
      for (auto t : tasks) std::printf(" %10s", data::retrieval_task_name(t));
      std::printf("\n");
      for (int64_t len : lengths) {
        std::printf("  %-8lld", (long long)len);
        if (L > 0) std::printf(" %7.2f", double(len) / double(L));
        for (auto t : tasks)
          for (const auto& p : points)
            if (p.length == len && p.task == data::retrieval_task_name(t)) {
              if (p.skipped) std::printf(" %10s", "-");
              else std::printf(" %10.2f", p.accuracy);
            }
        std::printf("\n");
      }
    }
    if (run && !run->steps.empty()) {
      const auto& last = run->steps.back();
      double mv = 0;
      for (double v : last.max_vio) mv = std::max(mv, v);
      std::printf("\nrun: %zu steps, last step %lld: loss %.4f, max MaxVio %.3f over %zu layers\n", run->steps.size(),
                  (long long)last.step, last.loss, mv, last.max_vio.size());
    }
    std::printf("\nwrote %s\n", json_path.c_str());
    for (const auto& p : plot_results)
      if (p.drawn) std::printf("wrote %s\n", p.png.c_str());
      else std::printf("skipped %s.png: %s\n", p.name.c_str(), p.note.c_str());
  });
}

}  // namespace k3::cli
