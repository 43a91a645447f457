// `k3 serve` under load: an in-process server (serve/server.h) on the loopback and S client threads, each
// sending streamed text completions back to back for --seconds, at each stream count of --streams. Prints per
// stream count the requests answered and failed, the tokens generated, the aggregate tokens/s, time to first
// token (median and 95th percentile, from sending the request) and per output token (mean over requests), the
// engine's mean batch (sequences per forward, from /metrics), how busy it was (the share of the phase spent in
// forwards) and its forwards per second, and the process's resident memory before and after the phase. Every request must complete (200, its [DONE] and its usage chunk); a failure is counted and
// shown. The load test of the server: `--streams 64 --seconds 60` on the CPU fixture model.
//
//   build/bench_serve_load --model DIR [--tokenizer DIR] [--device cpu|cuda] [--streams 1,4,16] [--seconds 15]
//                          [--prompt-tokens 64] [--max-tokens 64] [--max-batch N] [--prefill-chunk 512] [--prefill-every 4]
//                          [--shared-prefix 0] [--prefix-cache 1g]
//
// Prompts are random ids of the tokenizer's ranks (one fixed prompt per client, so a client's requests are
// alike); sampling at temperature 1 with a seed per request. Without --tokenizer (and no tiktoken.model in
// the model directory) the first vocab_size - 256 ranks of tests/fixtures/tokenizer/o200k.tiktoken are used.
// --max-batch defaults to the largest stream count. --shared-prefix N puts the same N random tokens before every
// client's prompt (a shared system prompt); --prefix-cache 0 turns the server's prefix cache off, to compare.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#if defined(K3_HAVE_SERVE)
#include <httplib.h>

#include <nlohmann/json.hpp>

#include "cli/engine.h"
#include "core/error.h"
#include "model/engine.h"
#include "serve/server.h"
#include "tokenizer/tokenizer.h"

using namespace k3;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

namespace {

double rss_mib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  return 0.0;
}

struct RequestResult {
  bool ok = false;
  double ttft = 0.0, total = 0.0;
  int64_t tokens = 0;
  std::string why;  // a failure's status, error event or cut
};

// One streamed completion: time to its first text chunk, its tokens (the usage chunk), [DONE] seen.
RequestResult one_request(int port, const json& body) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(600, 0);
  RequestResult r;
  std::string buf;
  bool done = false;
  const auto t0 = Clock::now();
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.set_header("Content-Type", "application/json");
  req.body = body.dump();
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    buf.append(data, n);
    for (size_t end; (end = buf.find("\n\n")) != std::string::npos; buf.erase(0, end + 2)) {
      const std::string ev = buf.substr(0, end);
      if (ev.rfind("data: ", 0) != 0) continue;
      if (ev == "data: [DONE]") {
        done = true;
        continue;
      }
      const json j = json::parse(ev.substr(6), nullptr, false);
      if (j.is_discarded()) continue;
      if (j.contains("error")) r.why = "error event: " + j["error"].value("message", j["error"].dump());
      if (r.ttft == 0.0 && j.contains("choices") && !j["choices"].empty() && j["choices"][0].value("text", "") != "")
        r.ttft = std::chrono::duration<double>(Clock::now() - t0).count();
      if (j.contains("usage") && j["usage"].is_object()) r.tokens = j["usage"].value("completion_tokens", int64_t(0));
    }
    return true;
  };
  auto res = c.send(req);
  r.total = std::chrono::duration<double>(Clock::now() - t0).count();
  r.ok = res && res->status == 200 && done && r.tokens > 0;
  if (!r.ok && r.why.empty())
    r.why = !res                 ? "no response (" + httplib::to_string(res.error()) + ")"
            : res->status != 200 ? "HTTP " + std::to_string(res->status) + ": " + res->body.substr(0, 200)
            : !done              ? "no [DONE]"
                                 : "no tokens";
  return r;
}

double metric(int port, const std::string& name) {
  httplib::Client c("127.0.0.1", port);
  auto m = c.Get("/metrics");
  if (!m) return 0.0;
  const size_t p = m->body.find("\n" + name + " ");
  return p == std::string::npos ? 0.0 : std::stod(m->body.substr(p + name.size() + 2));
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(q * double(v.size() - 1) + 0.5))];
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CLI::App app{"k3 serve under load: aggregate tokens/s, time to first token and per output token"};
  std::string model, tokenizer, streams_list = "1,4,16";
  cli::DeviceOptions device;
  double seconds = 15;
  int64_t prompt_tokens = 64, max_tokens = 64, max_batch = 0, prefill_chunk = 512, prefill_every = 4, shared_prefix = 0;
  uint64_t prefix_cache = uint64_t(1) << 30;
  app.add_option("--model", model, "model directory")->required();
  app.add_option("--tokenizer", tokenizer, "tokenizer directory (default: --model's, else o200k's first ranks)");
  cli::add_device_options(&app, device);
  app.add_option("--streams", streams_list, "concurrent client streams, one phase each")->capture_default_str();
  app.add_option("--seconds", seconds, "length of each phase (requests started in it complete)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--prompt-tokens", prompt_tokens, "prompt length")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--max-tokens", max_tokens, "tokens per reply")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--max-batch", max_batch, "the server's --max-batch (0: the largest stream count)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--prefill-chunk", prefill_chunk, "the server's --prefill-chunk")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--prefill-every", prefill_every, "the server's --prefill-every")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--shared-prefix", shared_prefix, "tokens every prompt begins with")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--prefix-cache", prefix_cache, "the server's --prefix-cache (0: off)")
      ->transform(CLI::AsSizeValue(false))
      ->default_str("1g");
  CLI11_PARSE(app, argc, argv);
  try {
    std::vector<int> streams;
    for (size_t pos = 0; pos < streams_list.size();) {
      size_t end = streams_list.find(',', pos);
      if (end == std::string::npos) end = streams_list.size();
      const int s = std::stoi(streams_list.substr(pos, end - pos));
      K3_CHECK(s >= 1 && s <= 1024, "--streams: each count must be in [1, 1024], got ", s);
      streams.push_back(s);
      pos = end + 1;
    }
    K3_CHECK(!streams.empty(), "--streams: no stream counts");
    std::unique_ptr<Engine> engine = cli::load_engine(model, device);
    const K3Config cfg = engine->config();
    // The tokenizer: given, the model's, or o200k's first ranks.
    std::filesystem::path tmp;
    if (tokenizer.empty() && !Tokenizer::dir_has_tokenizer(model)) {
      tmp = std::filesystem::temp_directory_path() / ("bench_serve_load_tok_" + std::to_string(::getpid()));
      std::filesystem::create_directories(tmp);
      std::ifstream in(std::string(K3_SOURCE_DIR_FOR_BENCH) + "/tests/fixtures/tokenizer/o200k.tiktoken");
      std::ofstream out(tmp / "tiktoken.model");
      std::string line;
      for (int64_t i = 0; i < cfg.vocab_size - 256 && std::getline(in, line); ++i) out << line << "\n";
      tokenizer = tmp.string();
    }
    Tokenizer tok = cli::load_tokenizer(model, tokenizer, cfg);
    const int64_t ranks = tok.num_ranks();
    if (!tmp.empty()) std::filesystem::remove_all(tmp);

    serve::ServeOptions so;
    so.port = 0;
    so.model_id = "bench";
    so.max_batch = max_batch > 0 ? max_batch : *std::max_element(streams.begin(), streams.end());
    so.max_queue = 1024;
    so.prefill_chunk = prefill_chunk;
    so.prefill_every = prefill_every;
    so.prefix_cache_bytes = size_t(prefix_cache);
    so.default_max_tokens = max_tokens;
    const std::string description = engine->description();
    serve::Server server(std::move(engine), std::move(tok), so);
    const int port = server.bind();
    std::thread listener([&] { server.listen(); });
    for (int i = 0; i < 200 && !httplib::Client("127.0.0.1", port).Get("/health"); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));

    std::printf(
        "%s on %s; prompts of %lld + %lld shared tokens, replies of up to %lld, --max-batch %lld, prefix cache %s, "
        "%.0f s a phase\n",
        model.c_str(), description.c_str(), (long long)prompt_tokens, (long long)shared_prefix, (long long)max_tokens,
        (long long)so.max_batch, prefix_cache > 0 ? "on" : "off", seconds);
    std::mt19937_64 shared_rng(12345);
    json shared = json::array();
    for (int64_t i = 0; i < shared_prefix; ++i) shared.push_back(int64_t(shared_rng() % uint64_t(ranks)));
    std::printf("%7s %8s %6s %8s %10s %9s %9s %9s %7s %6s %8s %9s %9s\n", "streams", "requests", "failed", "tokens",
                "tok/s", "ttft p50", "ttft p95", "tpot ms", "batch", "busy", "steps/s", "RSS MiB", "after");
    uint64_t seed = 1;
    for (const int S : streams) {
      const double rss0 = rss_mib();
      const double steps0 = metric(port, "k3_engine_steps_total"),
                   seqs0 = metric(port, "k3_engine_step_sequences_total"),
                   busy0 = metric(port, "k3_engine_forward_seconds_total");
      std::mutex mu;
      std::vector<RequestResult> results;
      const Clock::time_point t0 = Clock::now();
      const Clock::time_point until =
          t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
      std::vector<std::thread> clients;
      for (int s = 0; s < S; ++s)
        clients.emplace_back([&, s] {
          std::mt19937_64 rng(seed * 1000 + uint64_t(s));
          json prompt = shared;
          for (int64_t i = 0; i < prompt_tokens; ++i) prompt.push_back(int64_t(rng() % uint64_t(ranks)));
          for (int k = 0; Clock::now() < until; ++k) {
            const json body = {{"model", "bench"},
                               {"prompt", prompt},
                               {"max_tokens", max_tokens},
                               {"temperature", 1.0},
                               {"seed", int64_t(rng() % 1000000)},
                               {"stream", true},
                               {"stream_options", {{"include_usage", true}}}};
            const RequestResult r = one_request(port, body);
            std::lock_guard<std::mutex> lock(mu);
            results.push_back(r);
          }
        });
      for (auto& c : clients) c.join();
      ++seed;
      const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
      int64_t failed = 0, tokens = 0;
      std::vector<std::string> reasons;  // the distinct failures, first three
      std::vector<double> ttft;
      double tpot_sum = 0.0;
      int64_t tpot_n = 0;
      for (const RequestResult& r : results) {
        if (!r.ok) {
          ++failed;
          if (reasons.size() < 3 && std::find(reasons.begin(), reasons.end(), r.why) == reasons.end())
            reasons.push_back(r.why);
          continue;
        }
        tokens += r.tokens;
        ttft.push_back(r.ttft);
        if (r.tokens > 1) tpot_sum += (r.total - r.ttft) / double(r.tokens - 1), ++tpot_n;
      }
      const double steps = metric(port, "k3_engine_steps_total") - steps0,
                   seqs = metric(port, "k3_engine_step_sequences_total") - seqs0,
                   busy = metric(port, "k3_engine_forward_seconds_total") - busy0;
      std::printf("%7d %8zu %6lld %8lld %10.1f %8.3fs %8.3fs %9.2f %7.2f %5.0f%% %8.1f %9.1f %9.1f\n", S,
                  results.size(), (long long)failed, (long long)tokens, double(tokens) / wall, percentile(ttft, 0.5),
                  percentile(ttft, 0.95), tpot_n ? 1e3 * tpot_sum / double(tpot_n) : 0.0,
                  steps > 0 ? seqs / steps : 0.0, 100.0 * busy / wall, steps / wall, rss0, rss_mib());
      for (const std::string& w : reasons) std::printf("        failed: %s\n", w.c_str());
    }
    server.stop();
    listener.join();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_serve_load: %s\n", e.what());
    return 1;
  }
}

#else
int main() {
  std::printf("bench_serve_load: this build has no HTTP server (libcpp-httplib-dev); nothing to measure.\n");
  return 0;
}
#endif
