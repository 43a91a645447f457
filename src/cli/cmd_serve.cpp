// k3 serve: the OpenAI-compatible HTTP server (serve/server.h) over one model.
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "cli/args.h"
#include "cli/commands.h"
#include "cli/engine.h"
#include "core/error.h"
#if defined(K3_HAVE_SERVE)
#include "serve/server.h"
#endif

namespace k3::cli {

#if defined(K3_HAVE_SERVE)
namespace {

serve::Server* g_server = nullptr;  // for the signal handler: stop() ends listen()

void stop_on_signal(int) {
  if (g_server) g_server->stop();
}

}  // namespace

void register_serve(CLI::App& app) {
  struct Opts {
    std::string model, tokenizer, model_id, api_key;
    std::string host = "127.0.0.1";
    int port = 8000;
    int64_t max_queue = 64, default_max_tokens = 512, max_batch = 16, prefill_chunk = 512, prefill_every = 4;
    uint64_t cache_budget = 0, prefix_cache = uint64_t(1) << 30;
    bool k3_sampling = false;
    double request_timeout = 600.0;
    int64_t max_prompt_tokens = 0;
    DeviceOptions device;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = app.add_subcommand(
      "serve",
      "Serve a model over HTTP with OpenAI's API: POST /v1/chat/completions (K3's XTML chat format, reasoning\n"
      "apart from content, tool calls; streamed as server-sent events with \"stream\": true), POST\n"
      "/v1/completions, GET /v1/models, GET /health, GET /metrics (Prometheus). logprobs, and constrained\n"
      "decoding for response_format json_object/json_schema and tool_choice none/required/named. Up to\n"
      "--max-batch requests generate at once, their sequences sharing each forward (continuous batching:\n"
      "requests join and leave between steps, long prompts go in chunks between decode steps), within\n"
      "--cache-budget; --max-queue more wait in arrival order, later ones get 429. A prefix cache resumes\n"
      "prompts that begin like an earlier one after their shared whole chunks (--prefix-cache). Stops on\n"
      "SIGINT or SIGTERM.");
  sub->add_option("--model", o->model, "model directory (config.json + model.safetensors or shards)")->required();
  sub->add_option("--tokenizer", o->tokenizer, "tokenizer directory (tiktoken.model); default: --model");
  sub->add_option("--model-id", o->model_id, "the id /v1/models lists and requests name (default: --model's name)");
  sub->add_option("--host", o->host, "address to listen on")->capture_default_str();
  sub->add_option("--port", o->port, "port to listen on (0: any free port, printed)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  sub->add_option("--api-key", o->api_key, "require \"Authorization: Bearer KEY\" (default: no key)");
  sub->add_option("--max-queue", o->max_queue, "requests that may wait for the engine before 429s")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  sub->add_option("--max-batch", o->max_batch, "requests generating at once (their sequences batched per forward)")
      ->check(CLI::Range(int64_t(1), int64_t(4096)))
      ->capture_default_str();
  sub->add_option("--cache-budget", o->cache_budget,
                  "bytes of sequence state (KDA state, MLA rows) the running requests may reach at full length "
                  "(prompt + max_tokens); suffixes k, m, g (x1024); 0: no limit. A request that could never fit "
                  "gets 400, one that does not fit now waits")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  sub->add_option("--prefill-chunk", o->prefill_chunk,
                  "prompt tokens of one request per forward: a long prompt goes in chunks between the others' "
                  "decode steps; also the prefix cache's block")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--prefill-every", o->prefill_every,
                  "while requests decode, prompt chunks join every this many forwards (a forward of decodes "
                  "alone replays the GPU's decode graph, one with prompts runs eagerly); 1: every forward")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--prefix-cache", o->prefix_cache,
                  "bytes of prompt-chunk snapshots (KDA state, MLA rows) kept so that prompts beginning like an "
                  "earlier one resume after the shared whole chunks; suffixes k, m, g; 0: off")
      ->transform(CLI::AsSizeValue(false))
      ->default_str("1g");
  sub->add_flag("--k3-sampling", o->k3_sampling,
                "sample every request as K3 is meant to be sampled: temperature 1.0 when thinking and 0.6 when "
                "not, top_p 0.95, no penalties, n 1; a request naming other values gets a 400");
  sub->add_option("--default-max-tokens", o->default_max_tokens,
                  "tokens to generate when a request names no max_tokens (cut to the context left)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--request-timeout", o->request_timeout,
                  "seconds from a request's arrival: waiting for the engine past it gives 503, generating past "
                  "it stops (finish_reason \"length\"); 0: no limit")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  sub->add_option("--max-prompt-tokens", o->max_prompt_tokens,
                  "longer prompts get a 400 before anything runs (a prefill cannot be interrupted); 0: the "
                  "model's context")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  add_device_options(sub, o->device);
  sub->callback([o] {
    std::unique_ptr<Engine> engine = load_engine(o->model, o->device);
    Tokenizer tok = load_tokenizer(o->model, o->tokenizer, engine->config());
    serve::ServeOptions so;
    so.host = o->host;
    so.port = o->port;
    so.api_key = o->api_key;
    so.max_queue = o->max_queue;
    so.default_max_tokens = o->default_max_tokens;
    so.request_timeout_seconds = o->request_timeout;
    so.max_prompt_tokens = o->max_prompt_tokens;
    so.max_batch = o->max_batch;
    so.cache_budget = size_t(o->cache_budget);
    so.prefill_chunk = o->prefill_chunk;
    so.prefill_every = o->prefill_every;
    so.prefix_cache_bytes = size_t(o->prefix_cache);
    so.k3_sampling = o->k3_sampling;
    so.model_id =
        o->model_id.empty() ? std::filesystem::path(o->model).lexically_normal().filename().string() : o->model_id;
    if (so.model_id.empty()) so.model_id = "k3";
    const std::string description = engine->description();
    // The vision tower and projector run for requests with images (when the model has them), on the engine's
    // device: the GPU (bf16) with --device cuda, else the CPU.
    std::unique_ptr<const VisionEncoder> vision;
    if (engine->config().has_vision_config) {
      vision = load_vision_encoder(o->model, engine->options().device);
      std::fprintf(stderr, "[%.2fs] vision tower and projector: %s\n", elapsed_seconds(),
                   vision->description().c_str());
    }
    serve::Server server(std::move(engine), std::move(tok), so, std::move(vision));
    const int port = server.bind();
    std::fprintf(stderr, "k3 serve: %s (%s) at http://%s:%d/v1 (Ctrl-C stops)\n", so.model_id.c_str(),
                 description.c_str(), so.host.c_str(), port);
    g_server = &server;
    std::signal(SIGINT, stop_on_signal);
    std::signal(SIGTERM, stop_on_signal);
    server.listen();
    g_server = nullptr;
    std::fprintf(stderr, "k3 serve: stopped\n");
  });
}

#else  // built without cpp-httplib: the command is there and says what is missing

void register_serve(CLI::App& app) {
  CLI::App* sub = app.add_subcommand("serve", "Serve a model over HTTP (this build has no HTTP server)");
  sub->allow_extras();
  sub->callback([] {
    fail("k3 serve: this build has no HTTP server; install libcpp-httplib-dev (scripts/setup.sh) and rebuild");
  });
}

#endif

}  // namespace k3::cli
