#include "eval/run_metrics.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/jsonl.h"

namespace k3::eval {

namespace fs = std::filesystem;

namespace {

double number_or_nan(const nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_number()) return std::numeric_limits<double>::quiet_NaN();
  return it->get<double>();
}

}  // namespace

int64_t RunMetrics::trained_length(int64_t max_step) const {
  int64_t L = 0;
  for (const StepRecord& s : steps)
    if (max_step < 0 || s.step <= max_step) L = std::max(L, s.seq_len);
  return L;
}

int64_t RunMetrics::tokens_at(int64_t step) const {
  for (const StepRecord& s : steps)
    if (s.step == step) return s.tokens;
  return -1;
}

RunMetrics read_run_metrics(const std::string& run_or_file) {
  RunMetrics r;
  r.path = fs::is_directory(run_or_file) ? (fs::path(run_or_file) / "metrics.jsonl").string() : run_or_file;
  std::error_code ec;
  if (!fs::exists(r.path, ec))
    fail(r.path, ": cannot open the run's metrics (expected RUN/metrics.jsonl written by `k3 train --out RUN`)");
  std::map<int64_t, StepRecord> steps;
  std::map<int64_t, EvalRecord> evals;
  // A run in progress may be caught mid-write: read_jsonl drops a torn last line.
  for (const JsonlRecord& rec : read_jsonl(r.path, "run metrics").records) try {
      const nlohmann::json& j = rec.value;
      const int64_t lineno = rec.line;
      if (!j.contains("step") || !j["step"].is_number_integer())
        fail(r.path, ":", lineno, ": a record needs an integer \"step\"");
      const int64_t step = j["step"].get<int64_t>();
      if (j.contains("eval_loss")) {
        EvalRecord e;
        e.step = step;
        e.eval_loss = number_or_nan(j, "eval_loss");
        e.unigram_entropy = number_or_nan(j, "unigram_entropy");
        e.predictions = j.value("eval_predictions", int64_t(0));
        evals[step] = e;
        continue;
      }
      StepRecord s;
      s.step = step;
      s.loss = number_or_nan(j, "loss");
      if (j.value("skipped", false)) s.loss = std::numeric_limits<double>::quiet_NaN();
      s.tokens = j.value("tokens", int64_t(0));
      s.seq_len = j.value("seq_len", int64_t(0));
      s.stage = j.value("stage", int64_t(0));
      if (j.contains("max_vio")) {
        if (!j["max_vio"].is_array()) fail(r.path, ":", lineno, ": \"max_vio\" is not an array");
        for (const auto& v : j["max_vio"]) s.max_vio.push_back(v.is_number() ? v.get<double>() : std::nan(""));
      }
      steps[step] = std::move(s);
    } catch (const nlohmann::json::exception& e) {  // a field of the wrong type, from value()
      fail(r.path, ":", rec.line, ": ", e.what());
    }
  for (auto& [k, s] : steps) r.steps.push_back(std::move(s));
  for (auto& [k, e] : evals) r.evals.push_back(e);
  return r;
}

int64_t checkpoint_step(const std::string& dir) {
  std::string name = fs::path(dir).filename().string();
  if (name.empty()) name = fs::path(dir).parent_path().filename().string();  // "RUN/step-50/"
  if (name.rfind("step-", 0) != 0 || name.size() == 5) return -1;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

}  // namespace k3::eval
