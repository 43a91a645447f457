#include "eval/plots.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "io/file.h"
#include "io/jsonl.h"
#include "io/output_file.h"

namespace k3::eval {

namespace fs = std::filesystem;

namespace {

const char kTerminal[] = "set terminal pngcairo size 1100,650 font 'sans,11' noenhanced\n";
const char* const kColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                               "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

std::string num(double v) {
  if (!std::isfinite(v)) return "NaN";
  char b[64];
  std::snprintf(b, sizeof b, "%.8g", v);
  return b;
}

std::string fixed4(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.4f", v);
  return b;
}

std::string quote(const std::string& s) {  // for /bin/sh
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// A centred moving average that skips NaNs (a NaN stays NaN).
std::vector<double> smooth(const std::vector<double>& v, int64_t w) {
  if (w <= 1) return v;
  std::vector<double> out(v.size(), std::nan(""));
  const int64_t n = int64_t(v.size()), h = w / 2;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(v[size_t(i)])) continue;
    double s = 0;
    int64_t c = 0;
    for (int64_t j = std::max<int64_t>(0, i - h); j <= std::min(n - 1, i + h); ++j)
      if (std::isfinite(v[size_t(j)])) s += v[size_t(j)], ++c;
    out[size_t(i)] = s / double(c);
  }
  return out;
}

int64_t smoothing_window(size_t n) { return n >= 100 ? int64_t(n / 50) | 1 : 1; }

// Stage boundaries: (step, seq_len) where the sequence length changes (the first step included).
std::vector<std::pair<int64_t, int64_t>> stage_starts(const RunMetrics& run) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t last = -1;
  for (const StepRecord& s : run.steps)
    if (s.seq_len != last) out.push_back({s.step, s.seq_len}), last = s.seq_len;
  return out;
}

std::string stage_markers(const RunMetrics& run) {
  std::ostringstream g;
  for (const auto& [step, L] : stage_starts(run)) {
    g << "set arrow from " << step << ", graph 0 to " << step << ", graph 1 nohead dt 2 lc rgb 'gray50'\n";
    g << "set label 'seq_len " << L << "' at " << step << ", graph 0.97 left offset 0.5,0 tc rgb 'gray30'\n";
  }
  return g.str();
}

struct Writer {
  std::string out_dir, data_dir, gnuplot;
  std::vector<PlotResult> results;

  // Plots into out_dir, their data and scripts into out_dir/plot-data (created).
  Writer(const std::string& out, const std::string& gp)
      : out_dir(out), data_dir((fs::path(out) / "plot-data").string()), gnuplot(gp) {
    fs::create_directories(data_dir);
  }

  void emit(const std::string& name, const std::vector<std::pair<std::string, std::string>>& data_files,
            const std::string& script) {
    PlotResult r;
    r.name = name;
    for (const auto& [file, text] : data_files) write_file_atomic((fs::path(data_dir) / file).string(), text);
    r.script = (fs::path(data_dir) / (name + ".gp")).string();
    // gnuplot draws into plot-data/; the PNG then reaches OUTDIR through the one output writer.
    const std::string drawn = name + ".png.drawn";
    write_file_atomic(r.script, std::string(kTerminal) + "set output '" + drawn + "'\n" + script);
    const fs::path png = fs::path(out_dir) / (name + ".png"), drawn_path = fs::path(data_dir) / drawn;
    if (gnuplot.empty()) {
      r.note = "gnuplot not found: data and script written, PNG skipped";
    } else {
      // The command runs in data_dir (the script names its files relative to it), so the log path
      // must not be relative to ours.
      const fs::path log = fs::absolute(fs::path(data_dir) / (name + ".log"));
      std::error_code ec;
      fs::remove(drawn_path, ec);
      const std::string cmd = "cd " + quote(data_dir) + " && " + quote(gnuplot) + " " + quote(name + ".gp") + " > " +
                              quote(log.string()) + " 2>&1";
      const int st = std::system(cmd.c_str());
      std::ifstream lf(log);
      std::string complaint((std::istreambuf_iterator<char>(lf)), std::istreambuf_iterator<char>());
      if (st == 0 && fs::exists(drawn_path) && fs::file_size(drawn_path) > 0) {
        write_file_atomic(png.string(), read_file(drawn_path.string(), "plot"));
        fs::remove(drawn_path, ec);
        r.drawn = true;
        r.png = png.string();
        fs::remove(log, ec);
      } else {
        r.note = "gnuplot failed (status " + std::to_string(st) + "): " + complaint.substr(0, 400);
      }
    }
    results.push_back(std::move(r));
  }

  void skip(const std::string& name, const std::string& why) {
    PlotResult r;
    r.name = name;
    r.note = why;
    results.push_back(std::move(r));
  }
};

}  // namespace

std::string find_gnuplot() {
  if (const char* e = std::getenv("K3_GNUPLOT")) return ::access(e, X_OK) == 0 ? std::string(e) : std::string();
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    if (dir.empty()) continue;
    const fs::path p = fs::path(dir) / "gnuplot";
    if (::access(p.c_str(), X_OK) == 0) return p.string();
  }
  return "";
}

std::vector<PlotResult> write_plots(const std::string& out_dir, const RunMetrics* run, const HeldoutResult* heldout,
                                    int64_t eval_step, const std::vector<RetrievalPoint>& retrieval,
                                    int64_t train_length, const std::vector<ExpertLoad::LayerStats>& load,
                                    const std::string& gnuplot) {
  Writer w(out_dir, gnuplot);

  // --- loss.png
  if (!run) {
    w.skip("loss", "no --run given: the loss curve needs RUN/metrics.jsonl");
  } else if (run->steps.empty()) {
    w.skip("loss", run->path + " has no step records");
  } else {
    std::vector<double> loss;
    for (const StepRecord& s : run->steps) loss.push_back(s.loss);
    const int64_t sw = smoothing_window(loss.size());
    const std::vector<double> sm = smooth(loss, sw);
    std::ostringstream d;
    d << "# step tokens loss loss_smoothed(" << sw << " steps)\n";
    for (size_t i = 0; i < run->steps.size(); ++i)
      d << run->steps[i].step << ' ' << run->steps[i].tokens << ' ' << num(loss[i]) << ' ' << num(sm[i]) << '\n';
    std::ostringstream e;
    e << "# step eval_loss unigram_entropy\n";
    for (const EvalRecord& r : run->evals)
      e << r.step << ' ' << num(r.eval_loss) << ' ' << num(r.unigram_entropy) << '\n';
    std::ostringstream t;
    t << "# step eval_loss unigram_entropy (this eval)\n";
    if (heldout && eval_step >= 0)
      t << eval_step << ' ' << num(heldout->loss) << ' ' << num(heldout->unigram_entropy) << '\n';
    std::ostringstream g;
    g << "set title 'Training loss: " << run->path << "'\n"
      << "set xlabel 'step (" << run->steps.back().tokens << " training tokens at step " << run->steps.back().step
      << ")'\n"
      << "set ylabel 'loss (nats / token)'\nset grid\nset key below\n"
      << "set datafile missing 'NaN'\n"
      << stage_markers(*run);
    const double H =
        heldout ? heldout->unigram_entropy : (run->evals.empty() ? NAN : run->evals.back().unigram_entropy);
    g << "plot 'loss.dat' using 1:3 with lines lw " << (sw > 1 ? "1 lc rgb '#a6c8e6'" : "2 lc rgb '#1f77b4'")
      << " title 'train loss (per step)'";
    if (sw > 1)
      g << ", \\\n  'loss.dat' using 1:4 with lines lw 2.5 lc rgb '#1f77b4' title 'train loss (moving average, " << sw
        << " steps)'";
    if (!run->evals.empty())
      g << ", \\\n  'run_eval.dat' using 1:2 with points pt 7 ps 1.6 lc rgb '#d62728' title 'held-out loss (k3 train)'";
    if (heldout && eval_step >= 0)
      g << ", \\\n  'this_eval.dat' using 1:2 with points pt 9 ps 2.2 lc rgb '#2ca02c' title 'held-out loss (this "
           "eval, "
        << fixed4(heldout->loss) << ")'";
    if (std::isfinite(H))
      g << ", \\\n  " << num(H) << " with lines dt 3 lw 2 lc rgb 'gray40' title 'held-out unigram entropy ("
        << fixed4(H) << ")'";
    g << "\n";
    w.emit("loss", {{"loss.dat", d.str()}, {"run_eval.dat", e.str()}, {"this_eval.dat", t.str()}}, g.str());
  }

  // --- maxvio.png
  size_t n_layers = 0;
  if (run)
    for (const StepRecord& s : run->steps) n_layers = std::max(n_layers, s.max_vio.size());
  if (!run) {
    w.skip("maxvio", "no --run given: MaxVio over steps needs RUN/metrics.jsonl");
  } else if (n_layers == 0) {
    w.skip("maxvio", run->path + " has no max_vio values");
  } else {
    const int64_t sw = smoothing_window(run->steps.size());
    std::vector<std::vector<double>> cols(n_layers);
    for (const StepRecord& s : run->steps)
      for (size_t l = 0; l < n_layers; ++l) cols[l].push_back(l < s.max_vio.size() ? s.max_vio[l] : std::nan(""));
    double lo = INFINITY, hi = 0;
    for (auto& c : cols) {
      c = smooth(c, sw);
      for (double v : c)
        if (std::isfinite(v) && v > 0) lo = std::min(lo, v), hi = std::max(hi, v);
    }
    // Model layer numbers when the run's layer count matches this model's MoE layers.
    auto layer_name = [&](size_t i) {
      return load.size() == n_layers ? "layer " + std::to_string(load[i].layer) : "MoE layer " + std::to_string(i);
    };
    std::ostringstream d;
    d << "# step";
    for (size_t l = 0; l < n_layers; ++l) d << " maxvio_" << l;
    d << "   (moving average over " << sw << " steps)\n";
    for (size_t i = 0; i < run->steps.size(); ++i) {
      d << run->steps[i].step;
      for (size_t l = 0; l < n_layers; ++l) d << ' ' << num(cols[l][i]);
      d << '\n';
    }
    std::ostringstream g;
    g << "set title 'MaxVio per MoE layer (max expert load / mean load - 1, per training batch"
      << (sw > 1 ? ", moving average over " + std::to_string(sw) + " steps" : std::string()) << ")'\n"
      << "set xlabel 'step'\nset ylabel 'MaxVio'\nset grid\nset key outside right top\nset datafile missing 'NaN'\n";
    if (hi > 0 && lo < INFINITY && hi / lo > 30) g << "set logscale y\n";
    else g << "set yrange [0:*]\n";
    g << stage_markers(*run);
    g << "plot ";
    for (size_t l = 0; l < n_layers; ++l)
      g << (l ? ", \\\n  " : "") << "'maxvio.dat' using 1:" << l + 2 << " with lines lw 2 lc rgb '" << kColors[l % 10]
        << "'" << (l >= 10 ? " dt 2" : "") << " title '" << layer_name(l) << "'";
    g << "\n";
    w.emit("maxvio", {{"maxvio.dat", d.str()}}, g.str());
  }

  // --- retrieval.png
  std::vector<int64_t> lengths;
  std::vector<std::string> tasks;
  for (const RetrievalPoint& p : retrieval) {
    if (std::find(lengths.begin(), lengths.end(), p.length) == lengths.end()) lengths.push_back(p.length);
    if (std::find(tasks.begin(), tasks.end(), p.task) == tasks.end()) tasks.push_back(p.task);
  }
  std::sort(lengths.begin(), lengths.end());
  if (lengths.empty()) {
    w.skip("retrieval", "no retrieval results");
  } else {
    std::ostringstream d;
    d << "# length";
    for (const auto& t : tasks) d << ' ' << t << "_accuracy";
    d << '\n';
    for (int64_t L : lengths) {
      d << L;
      for (const auto& t : tasks) {
        double acc = NAN;
        for (const RetrievalPoint& p : retrieval)
          if (p.length == L && p.task == t && !p.skipped) acc = p.accuracy;
        d << ' ' << num(acc);
      }
      d << '\n';
    }
    const double x0 = double(lengths.front()) / 1.4, x1 = double(lengths.back()) * 1.4;
    std::ostringstream g;
    g << "set title 'Retrieval accuracy against prompt length (greedy, exact match; K3 has no positional encoding)'\n"
      << "set xlabel 'prompt length (tokens, log2 scale)'\nset ylabel 'accuracy'\nset grid\n"
      << "set logscale x 2\nset xrange [" << num(x0) << ":" << num(x1) << "]\nset yrange [-0.03:1.08]\n"
      << "set key below\nset datafile missing 'NaN'\nset xtics (";
    for (size_t i = 0; i < lengths.size(); ++i) g << (i ? ", " : "") << "'" << lengths[i] << "' " << lengths[i];
    g << ")\n";
    if (train_length > 0) {
      g << "set object 1 rect from " << train_length
        << ", graph 0 to graph 1, graph 1 behind fc rgb '#f0f0f0' fs solid noborder\n"
        << "set arrow from " << train_length << ", graph 0 to " << train_length
        << ", graph 1 nohead dt 2 lw 2 lc rgb 'black'\n"
        << "set label 'train length L = " << train_length << "' at " << train_length
        << ", graph 0.97 right offset -0.7,0\n"
        << "set label 'beyond the training length' at " << train_length
        << ", graph 0.97 left offset 0.7,0 tc rgb 'gray40'\n";
    }
    g << "plot ";
    for (size_t i = 0; i < tasks.size(); ++i)
      g << (i ? ", \\\n  " : "") << "'retrieval.dat' using 1:" << i + 2 << " with linespoints lw 2 pt " << (i ? 4 : 7)
        << (i ? " dt 2" : "") << " ps " << (i ? "2.2" : "1.5") << " lc rgb '" << kColors[i % 10] << "' title '"
        << tasks[i] << "'";
    g << "\n";
    w.emit("retrieval", {{"retrieval.dat", d.str()}}, g.str());
  }

  // --- expert_load.png
  if (load.empty() || load[0].counts.empty()) {
    w.skip("expert_load", "no MoE layers / no routed tokens");
  } else {
    const size_t E = load[0].counts.size(), N = load.size();
    double mx = 2.0;
    std::ostringstream d;
    d << "# rows: MoE layers; columns: experts; value: load / mean load (1 = balanced)\n";
    for (const auto& s : load) {
      for (size_t e = 0; e < E; ++e) {
        const double rel = s.share[e] * double(E);
        mx = std::max(mx, rel);
        d << (e ? " " : "") << num(rel);
      }
      d << '\n';
    }
    std::ostringstream g;
    g << "set title 'Expert load on the held-out tokens (" << load[0].assignments
      << " routed assignments per layer): load / mean load'\n"
      << "set xlabel 'expert'\nset ylabel 'MoE layer (MaxVio)'\nset view map\nunset key\n"
      << "set xrange [-0.5:" << E - 0.5 << "]\nset yrange [" << N - 0.5 << ":-0.5]\n"
      << "set cbrange [0:" << num(mx) << "]\nset cblabel 'load / mean load'\n"
      << "set palette defined (0 '#2166ac', 1 'white', " << num(mx) << " '#b2182b')\n"
      << "set xtics 1 out\nset ytics (";
    for (size_t i = 0; i < N; ++i) {
      char b[96];
      std::snprintf(b, sizeof b, "%s'%lld (%.2f)' %zu", i ? ", " : "", (long long)load[i].layer, load[i].max_vio, i);
      g << b;
    }
    g << ")\nset tics nomirror\n";
    g << "plot 'expert_load.dat' matrix with image";
    if (E <= 32 && N <= 24) g << ", \\\n  '' matrix using 1:2:(sprintf('%.2f', $3)) with labels font 'sans,8'";
    g << "\n";
    w.emit("expert_load", {{"expert_load.dat", d.str()}}, g.str());
  }
  return w.results;
}

std::vector<PlotResult> write_rl_plots(const std::string& out_dir, const std::string& metrics_path,
                                       const std::string& gnuplot) {
  Writer w(out_dir, gnuplot);
  std::ostringstream it, ev;
  it << "# iteration reward success tokens_per_episode effort_violations logprob_mismatch_max logprob_mismatch_mean "
        "kl tool_calls_per_episode\n";
  ev << "# iteration eval_success eval_tokens eval_sampled_success\n";
  int64_t n = 0;
  bool any_positive = false;  // a mismatch or KL above zero (a deterministic run's are all zero)
  for (const JsonlRecord& r : read_jsonl(metrics_path, "RL metrics", InputRole::kOwnState).records) {
    const nlohmann::json& j = r.value;
    auto get = [&](const char* k) { return j.contains(k) && j[k].is_number() ? j[k].get<double>() : NAN; };
    if (j.contains("eval_success")) {
      ev << num(get("iteration")) << ' ' << num(get("eval_success")) << ' ' << num(get("eval_tokens")) << ' '
         << num(get("eval_sampled_success")) << '\n';
    } else if (j.contains("reward")) {
      ++n;
      for (const char* k : {"logprob_mismatch_max", "logprob_mismatch_mean", "kl"}) any_positive |= get(k) > 0;
      it << num(get("iteration")) << ' ' << num(get("reward")) << ' ' << num(get("success")) << ' '
         << num(get("tokens_per_episode")) << ' ' << num(get("effort_violations")) << ' '
         << num(get("logprob_mismatch_max")) << ' ' << num(get("logprob_mismatch_mean")) << ' ' << num(get("kl")) << ' '
         << num(get("tool_calls_per_episode")) << '\n';
    }
  }
  if (n == 0) {
    for (const char* p : {"rl_reward", "rl_length", "rl_mismatch"}) w.skip(p, metrics_path + " has no iterations");
    return w.results;
  }
  const std::vector<std::pair<std::string, std::string>> data = {{"rl.dat", it.str()}, {"rl_eval.dat", ev.str()}};
  const std::string head = "set xlabel 'iteration'\nset grid\nset key below\nset datafile missing 'NaN'\n";
  w.emit("rl_reward", data,
         head + "set title 'Reward: " + metrics_path + "'\nset ylabel 'per episode'\n" +
             "plot 'rl.dat' using 1:2 with lines lw 2 lc rgb '#1f77b4' title 'mean reward', \\\n"
             "  'rl.dat' using 1:3 with lines lw 2 lc rgb '#2ca02c' title 'success (sampled)', \\\n"
             "  'rl.dat' using 1:9 with lines lw 1.5 dt 2 lc rgb '#7f7f7f' title 'tool calls per episode', \\\n"
             "  'rl_eval.dat' using 1:2 with linespoints pt 7 ps 1.4 lc rgb '#d62728' title 'held-out success "
             "(greedy)', \\\n"
             "  'rl_eval.dat' using 1:4 with linespoints pt 5 ps 1.2 lc rgb '#9467bd' title 'held-out success "
             "(sampled)'\n");
  w.emit("rl_length", data,
         head + "set title 'Length: " + metrics_path + "'\nset ylabel 'tokens per episode'\n" +
             "set y2label 'episodes over the effort budget'\nset y2tics\nset ytics nomirror\n"
             "plot 'rl.dat' using 1:4 with lines lw 2 lc rgb '#1f77b4' title 'tokens per episode', \\\n"
             "  'rl_eval.dat' using 1:3 with linespoints pt 7 ps 1.4 lc rgb '#d62728' title 'held-out (greedy)', \\\n"
             "  'rl.dat' using 1:5 axes x1y2 with lines lw 1.5 dt 2 lc rgb '#ff7f0e' title 'over budget'\n");
  // A log scale, on which zeros (bit-for-bit iterations) are left out; when every value is zero, a linear one.
  auto column = [&](int c) {
    return "($" + std::to_string(c) + (any_positive ? " > 0 ? $" + std::to_string(c) + " : NaN)" : ")");
  };
  w.emit("rl_mismatch", data,
         head + "set title 'Trainer against sampler: " + metrics_path + "'\n" +
             (any_positive ? "set logscale y\n" : "set yrange [-1:1]\n") +
             "set ylabel '|log p_trainer - log p_sampler|" + (any_positive ? "" : " (all zero: bit for bit)") +
             "'\nplot 'rl.dat' using 1:" + column(6) +
             " with lines lw 2 lc rgb '#d62728' title 'largest', \\\n"
             "  'rl.dat' using 1:" +
             column(7) +
             " with lines lw 2 lc rgb '#1f77b4' title 'mean', \\\n"
             "  'rl.dat' using 1:" +
             column(8) + " with lines lw 1.5 dt 2 lc rgb '#7f7f7f' title 'KL term'\n");
  return w.results;
}

}  // namespace k3::eval
