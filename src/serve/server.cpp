#include "serve/server.h"

#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <functional>
#include <mutex>
#include <random>
#include <sstream>

#include "core/error.h"
#include "model/vision.h"
#include "serve/batcher.h"
#include "serve/generation.h"
#include "serve/openai_api.h"

namespace k3::serve {

using ojson = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

struct Server::Impl {
  std::unique_ptr<Engine> engine;
  Tokenizer tok;
  ServeOptions o;
  std::unique_ptr<const VisionEncoder> vision;  // null: requests with images get a 400
  std::unique_ptr<Batcher> batcher;           // after the engine (it stops first), before http (whose handlers use it)
  httplib::Server http;
  int port = -1;

  // `queued` counts the requests generating or waiting for a slot.
  std::mutex trie_mu;
  std::atomic<int64_t> queued{0}, running{0};
  std::atomic<uint64_t> next_id{0};
  const uint64_t id_salt = std::random_device{}();

  // Metrics.
  mutable std::mutex stats_mu;
  int64_t requests_ok = 0, requests_failed = 0, requests_timed_out = 0, prompt_tokens = 0, generation_tokens = 0;
  double ttft_sum = 0.0, tpot_sum = 0.0;
  int64_t ttft_count = 0, tpot_count = 0;

  Impl(std::unique_ptr<Engine> e, Tokenizer t, ServeOptions opts, std::unique_ptr<const VisionEncoder> v)
      : engine(std::move(e)), tok(std::move(t)), o(std::move(opts)), vision(std::move(v)) {}

  // The vocabulary's byte trie for constrained decoding, built by the first request that needs it
  // (about a second at 200K ranks; a server that never constrains never pays it), once.
  std::unique_ptr<const TokenTrie> trie_;
  const TokenTrie* trie_for(const ChatRequest& r) {
    if (!r.constrained) return nullptr;
    std::lock_guard<std::mutex> lock(trie_mu);
    if (!trie_) trie_ = std::make_unique<const TokenTrie>(tok);
    return trie_.get();
  }

  ApiLimits limits() const { return ApiLimits{o.model_id, o.default_max_tokens, o.k3_sampling}; }

  std::string new_id(const char* prefix) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "%s-%016llx%08llx", prefix, (unsigned long long)id_salt,
                  (unsigned long long)next_id.fetch_add(1));
    return buf;
  }

  // One answered request: its tokens, and its time to first token counted from its arrival (the
  // queue wait included) and per output token after the first.
  void record(const Usage& u, const Timing& t, Clock::time_point arrived, bool timed_out) {
    const double since_arrival = std::chrono::duration<double>(Clock::now() - arrived).count();
    std::lock_guard<std::mutex> lock(stats_mu);
    ++requests_ok;
    requests_timed_out += timed_out;
    prompt_tokens += u.prompt_tokens;
    generation_tokens += u.completion_tokens;
    if (u.completion_tokens > 0) ttft_sum += since_arrival - t.decode_seconds, ++ttft_count;
    if (u.completion_tokens > 1) tpot_sum += t.decode_seconds, tpot_count += u.completion_tokens - 1;
  }
  void record_failure(bool timed_out = false) {
    std::lock_guard<std::mutex> lock(stats_mu);
    ++requests_failed;
    requests_timed_out += timed_out;
  }

  // The request's deadline from its arrival.
  void set_deadline(GenerationRequest& g, Clock::time_point arrived) const {
    if (o.request_timeout_seconds > 0)
      g.deadline = arrived + std::chrono::duration_cast<Clock::duration>(
                                 std::chrono::duration<double>(o.request_timeout_seconds));
  }

  static void send_error(httplib::Response& res, const ApiError& e) {
    res.status = e.status;
    res.set_content(dump(e.body()), "application/json");
  }

  bool authorized(const httplib::Request& req, httplib::Response& res) const {
    if (o.api_key.empty()) return true;
    if (req.get_header_value("Authorization") == "Bearer " + o.api_key) return true;
    send_error(res, ApiError(401, "invalid_request_error", "", "Incorrect or missing API key", "invalid_api_key"));
    return false;
  }

  // A place in the queue, or a 429.
  bool admit(httplib::Response& res) {
    if (queued.fetch_add(1) >= o.max_queue + o.max_batch) {
      queued.fetch_sub(1);
      send_error(res, ApiError(429, "rate_limit_error", "",
                               "the server is busy: " + std::to_string(o.max_queue) + " requests are waiting"));
      return false;
    }
    return true;
  }

  // A request's run on a slot: its append, and what the prefix cache supplied.
  struct SlotRun {
    PickFn append;
    RunAhead ahead;
    const Batcher::Slot* slot;
    int64_t cached_tokens() const { return slot->cached_tokens(); }
  };

  // Runs f(SlotRun) on a slot of the batcher for the prompt's sequence at full length, once one is free (a 503
  // when the request's deadline passes first); releases the queue place when leave (a streaming response
  // releases it in its resource releaser instead, which runs even when the provider never does).
  template <class F>
  auto with_slot(const GenerationRequest& g, const PreparedPrompt& prompt, F&& f, bool leave = true) {
    struct Leave {
      Impl* s;
      bool on;
      ~Leave() {
        if (on) s->queued.fetch_sub(1);
      }
    } leave_queue{this, leave};
    std::unique_ptr<Batcher::Slot> slot = batcher->acquire(full_length(prompt), g.deadline);
    if (slot && Clock::now() > g.deadline) slot.reset();  // admitted only after its deadline: nothing runs
    if (!slot) {
      record_failure(true);
      throw ApiError(503, "server_error", "",
                     "the request timed out after waiting for the engine (--request-timeout " +
                         std::to_string(o.request_timeout_seconds) + " s)");
    }
    running.fetch_add(1);
    struct Done {
      Impl* s;
      ~Done() { s->running.fetch_sub(1); }
    } done{this};
    if (prompt.media) slot->set_prompt_rows(prompt.media->rows);
    return f(SlotRun{slot->pick_fn(), slot->run_ahead(), slot.get()});
  }

  // OpenAI's choices[].logprobs of a chat response or chunk.
  ojson chat_lp(const std::vector<TokenLogprob>& lps) const {
    return ojson{{"content", chat_logprobs(tok, lps)}, {"refusal", nullptr}};
  }

  ojson envelope(const std::string& id, const char* object) const {
    return ojson{{"id", id}, {"object", object}, {"created", int64_t(std::time(nullptr))}, {"model", o.model_id}};
  }

  static bool sse(httplib::DataSink& sink, const ojson& j) {
    const std::string s = "data: " + dump(j) + "\n\n";
    return sink.write(s.data(), s.size());
  }
  // The usage chunk (when asked for) and [DONE].
  void end_stream(httplib::DataSink& sink, const std::string& id, const char* object, bool include_usage,
                  const Usage& usage) const {
    if (include_usage) {
      ojson u = envelope(id, object);
      u["choices"] = ojson::array();
      u["usage"] = usage.to_json();
      sse(sink, u);
    }
    sse_done(sink);
  }
  static void sse_done(httplib::DataSink& sink) {
    static const std::string s = "data: [DONE]\n\n";
    sink.write(s.data(), s.size());
    sink.done();
  }

  // The API key, the body parsed and checked, the prompt tokenised and fitted to the context, then a
  // place in the queue: false, with the error sent, when any of them refuses.
  template <class Request, class Parse, class Prepare>
  bool accept(const httplib::Request& req, httplib::Response& res, Request& r, PreparedPrompt& prompt, Parse parse,
              Prepare prepare, Clock::time_point arrived) {
    if (!authorized(req, res)) return false;
    try {
      r = parse(req.body, limits());
      set_deadline(r.gen, arrived);
      r.gen.max_prompt_tokens = o.max_prompt_tokens;
      prompt = prepare(engine->config(), tok, r);
      check_cache_budget(prompt);
    } catch (const ApiError& e) {
      record_failure();
      send_error(res, e);
      return false;
    }
    return admit(res);
  }

  // A request whose sequence could never fit the cache budget, whatever else runs: a 400.
  void check_cache_budget(const PreparedPrompt& prompt) const {
    const int64_t tokens = full_length(prompt);
    size_t need = 0;
    if (!batcher->could_fit(tokens, &need))
      throw ApiError(400, "invalid_request_error", "max_tokens",
                     "the prompt and max_tokens (" + std::to_string(tokens) + " tokens) need " + std::to_string(need) +
                         " bytes of cache, more than this server's budget of " + std::to_string(o.cache_budget),
                     "context_length_exceeded");
  }
  static int64_t full_length(const PreparedPrompt& p) { return int64_t(p.ids.size()) + p.budget; }

  // A JSON response made on a slot of the batcher; an engine error becomes a 500.
  void respond(httplib::Response& res, const GenerationRequest& g, const PreparedPrompt& prompt,
               const std::function<ojson(const SlotRun&)>& make) {
    try {
      res.set_content(dump(with_slot(g, prompt, make)), "application/json");
    } catch (const ApiError& e) {
      send_error(res, e);
    } catch (const Error& e) {
      record_failure();
      send_error(res, ApiError(500, "server_error", "", e.what()));
    }
  }

  // A server-sent-event response whose events `produce` writes on a slot of the batcher (false: the
  // client went away); an engine error becomes an error event. The queue place is released when the
  // response ends, also when the provider never runs.
  void stream(httplib::Response& res, const GenerationRequest& g, std::shared_ptr<const PreparedPrompt> prompt,
              std::function<bool(httplib::DataSink&, const SlotRun&)> produce) {
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, produce, g, prompt](size_t, httplib::DataSink& sink) {
          try {
            return with_slot(
                g, *prompt, [&](const SlotRun& run) { return produce(sink, run); }, false);
          } catch (const ApiError& e) {
            sse(sink, e.body());
            sse_done(sink);
          } catch (const Error& e) {
            record_failure();
            sse(sink, ApiError(500, "server_error", "", e.what()).body());
            sse_done(sink);
          }
          return true;
        },
        [this](bool) { queued.fetch_sub(1); });
  }

  void chat(const httplib::Request& req, httplib::Response& res) {
    const auto arrived = Clock::now();
    auto r = std::make_shared<ChatRequest>();
    auto prompt = std::make_shared<PreparedPrompt>();
    auto prepare = [this](const K3Config& c, const Tokenizer& t, const ChatRequest& q) {
      return prepare_chat(c, t, q, vision.get());
    };
    if (!accept(req, res, *r, *prompt, parse_chat_request_body, prepare, arrived)) return;
    const std::string id = new_id("chatcmpl");
    const K3Config& cfg = engine->config();
    const TokenTrie* trie = nullptr;  // built (once) before taking a slot: the others need not wait on it
    try {
      trie = trie_for(*r);
    } catch (...) {
      queued.fetch_sub(1);  // the queue place accept() took
      throw;
    }
    if (!r->gen.stream) {
      return respond(res, r->gen, *prompt, [&](const SlotRun& run) {
        ChatResult out = run_chat(cfg, run.append, run.ahead, tok, *r, *prompt, {}, trie);
        out.usage.cached_tokens = run.cached_tokens();
        record(out.usage, out.timing, arrived, out.timed_out);
        ojson body = envelope(id, "chat.completion");
        const ojson lp = r->gen.top_logprobs >= 0 ? chat_lp(out.logprobs) : ojson(nullptr);
        body["choices"] = ojson::array(
            {ojson{{"index", 0}, {"message", out.message}, {"logprobs", lp}, {"finish_reason", out.finish_reason}}});
        body["usage"] = out.usage.to_json();
        return body;
      });
    }
    stream(res, r->gen, prompt,
           [this, &cfg, r, prompt, id, arrived, trie](httplib::DataSink& sink, const SlotRun& run) {
             auto chunk = [&](const ojson& delta, const ojson& finish, const std::vector<TokenLogprob>& lps = {}) {
               ojson c = envelope(id, "chat.completion.chunk");
               const ojson lp = lps.empty() ? ojson(nullptr) : chat_lp(lps);
               c["choices"] =
                   ojson::array({ojson{{"index", 0}, {"delta", delta}, {"logprobs", lp}, {"finish_reason", finish}}});
               return c;
             };
             bool open = sse(sink, chunk(ojson{{"role", "assistant"}, {"content", ""}}, nullptr));
             ChatResult out = run_chat(
                 cfg, run.append, run.ahead, tok, *r, *prompt,
                 [&](const ChatDelta& d) {
                   ojson delta = ojson::object();
                   if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
                   if (!d.content.empty()) delta["content"] = d.content;
                   open = open && sse(sink, chunk(delta, nullptr, d.logprobs));
                   return open;
                 },
                 trie);
             out.usage.cached_tokens = run.cached_tokens();
             record(out.usage, out.timing, arrived, out.timed_out);
             if (!open) return false;
             if (out.message.contains("tool_calls")) {  // the calls in one delta, each with its index
               ojson calls = out.message["tool_calls"];
               for (size_t i = 0; i < calls.size(); ++i) {
                 ojson c{{"index", i}};
                 c.update(calls[i]);
                 calls[i] = std::move(c);
               }
               sse(sink, chunk(ojson{{"tool_calls", calls}}, nullptr));
             }
             ojson last = chunk(ojson::object(), out.finish_reason);
             last["usage"] = out.usage.to_json();  // the finish chunk carries the usage too (Moonshot's API)
             sse(sink, last);
             end_stream(sink, id, "chat.completion.chunk", r->gen.include_usage, out.usage);
             return true;
           });
  }

  void completion(const httplib::Request& req, httplib::Response& res) {
    const auto arrived = Clock::now();
    auto r = std::make_shared<CompletionRequest>();
    auto prompt = std::make_shared<PreparedPrompt>();
    if (!accept(req, res, *r, *prompt, parse_completion_request_body, prepare_completion, arrived)) return;
    const std::string id = new_id("cmpl");
    auto choice = [](const std::string& text, const ojson& finish, const ojson& lp = nullptr) {
      return ojson::array({ojson{{"text", text}, {"index", 0}, {"logprobs", lp}, {"finish_reason", finish}}});
    };
    const K3Config& cfg = engine->config();
    if (!r->gen.stream) {
      return respond(res, r->gen, *prompt, [&](const SlotRun& run) {
        TextResult out = run_completion(cfg, run.append, run.ahead, tok, *r, *prompt);
        out.usage.cached_tokens = run.cached_tokens();
        record(out.usage, out.timing, arrived, out.timed_out);
        ojson body = envelope(id, "text_completion");
        int64_t offset = 0;
        const ojson lp = r->gen.top_logprobs >= 0 ? completion_logprobs(tok, out.logprobs, offset) : ojson(nullptr);
        body["choices"] = choice(out.text, out.finish_reason, lp);
        body["usage"] = out.usage.to_json();
        return body;
      });
    }
    stream(res, r->gen, prompt,
           [this, &cfg, r, prompt, id, arrived, choice](httplib::DataSink& sink, const SlotRun& run) {
             bool open = true;
             int64_t offset = 0;  // bytes of completion text the earlier chunks' tokens covered
             TextResult out = run_completion(cfg, run.append, run.ahead, tok, *r, *prompt, [&](const TextDelta& d) {
               ojson c = envelope(id, "text_completion");
               const ojson lp = d.logprobs.empty() ? ojson(nullptr) : completion_logprobs(tok, d.logprobs, offset);
               c["choices"] = choice(d.text, nullptr, lp);
               open = open && sse(sink, c);
               return open;
             });
             out.usage.cached_tokens = run.cached_tokens();
             record(out.usage, out.timing, arrived, out.timed_out);
             if (!open) return false;
             ojson c = envelope(id, "text_completion");
             c["choices"] = choice("", out.finish_reason);
             c["usage"] = out.usage.to_json();
             sse(sink, c);
             end_stream(sink, id, "text_completion", r->gen.include_usage, out.usage);
             return true;
           });
  }

  void routes() {
    http.set_payload_max_length(o.max_body_bytes);
    // A worker thread per request generating or waiting, and a few for /health, /metrics and refusals.
    const size_t workers = size_t(o.max_batch + o.max_queue + 4);
    http.new_task_queue = [workers] { return new httplib::ThreadPool(workers); };
    http.Get("/health", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"status":"ok"})", "application/json");
    });
    http.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
      if (!authorized(req, res)) return;
      const ojson model{{"id", o.model_id},
                        {"object", "model"},
                        {"created", 0},
                        {"owned_by", "k3cpp"},
                        {"max_model_len", engine->config().max_position_embeddings}};
      res.set_content(dump(ojson{{"object", "list"}, {"data", ojson::array({model})}}), "application/json");
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics(), "text/plain; version=0.0.4");
    });
    http.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) { chat(req, res); });
    http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) { completion(req, res); });
    http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      const std::string what = res.status == 404   ? "no route " + req.method + " " + req.path
                               : res.status == 413 ? "the request body is too large"
                                                   : "HTTP error " + std::to_string(res.status);
      res.set_content(dump(ApiError(res.status, "invalid_request_error", "", what).body()), "application/json");
    });
    http.set_exception_handler([this](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
      std::string what = "internal error";
      try {
        std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      record_failure();
      send_error(res, ApiError(500, "server_error", "", what));
    });
  }

  std::string metrics() const {
    std::lock_guard<std::mutex> lock(stats_mu);
    std::ostringstream m;
    auto metric = [&](const char* name, const char* type, const char* help, double v) {
      m << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n" << name << " " << v << "\n";
    };
    metric("k3_requests_succeeded_total", "counter", "Requests answered.", double(requests_ok));
    metric("k3_requests_failed_total", "counter", "Requests refused or failed.", double(requests_failed));
    metric("k3_requests_timed_out_total", "counter", "Requests cut or refused at their timeout.",
           double(requests_timed_out));
    const int64_t run = running.load(), q = queued.load();
    metric("k3_requests_running", "gauge", "Requests generating now.", double(run));
    metric("k3_requests_waiting", "gauge", "Requests waiting for the engine.", double(std::max<int64_t>(0, q - run)));
    const Batcher::Stats b = batcher->stats();
    metric("k3_engine_steps_total", "counter", "Forwards the engine ran.", double(b.steps));
    metric("k3_engine_step_sequences_total", "counter", "Sequences over all forwards (per step: the batch).",
           double(b.step_sequences));
    metric("k3_engine_step_tokens_total", "counter", "Tokens over all forwards.", double(b.step_tokens_total));
    metric("k3_engine_decode_steps_total", "counter", "Forwards in which every sequence added one token.",
           double(b.decode_steps));
    metric("k3_engine_forward_seconds_total", "counter", "Wall time in forwards (per second: how busy the engine is).",
           b.forward_seconds);
    metric("k3_cache_reserved_bytes", "gauge", "Sequence state the running requests may grow to.",
           double(b.reserved_bytes));
    metric("k3_prefix_cache_lookups_total", "counter", "Prompts looked up in the prefix cache.",
           double(b.prefix.lookups));
    metric("k3_prefix_cache_hits_total", "counter", "Prompts resumed from a cached prefix.", double(b.prefix.hits));
    metric("k3_prefix_cache_hit_tokens_total", "counter", "Prompt tokens not prefilled thanks to the cache.",
           double(b.prefix.hit_tokens));
    metric("k3_prefix_cache_bytes", "gauge", "Memory the prefix cache holds.", double(b.prefix.bytes));
    metric("k3_prefix_cache_blocks", "gauge", "Blocks the prefix cache holds.", double(b.prefix.blocks));
    metric("k3_prompt_tokens_total", "counter", "Prompt tokens processed.", double(prompt_tokens));
    metric("k3_generation_tokens_total", "counter", "Tokens generated.", double(generation_tokens));
    metric("k3_time_to_first_token_seconds_sum", "counter", "Arrival to first token, summed.", ttft_sum);
    metric("k3_time_to_first_token_seconds_count", "counter", "Requests with a first token.", double(ttft_count));
    metric("k3_time_per_output_token_seconds_sum", "counter", "Decode time after the first token, summed.", tpot_sum);
    metric("k3_time_per_output_token_seconds_count", "counter", "Tokens after the first.", double(tpot_count));
    return m.str();
  }
};

namespace {

// cpp-httplib (Debian's 0.11, a compiled library) listens with a backlog of 5: a burst of new connections
// overflows the accept queue and clients see resets (64 to 256 streams did). listen() again on the same socket
// only changes its backlog; the socket is the one listening on `port`.
void widen_listen_backlog(int port) {
  for (int fd = 0; fd < 65536; ++fd) {
    int accepting = 0;
    socklen_t len = sizeof accepting;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &len) != 0) continue;
    if (!accepting) continue;
    sockaddr_storage addr{};
    socklen_t alen = sizeof addr;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &alen) != 0) continue;
    int p = -1;
    if (addr.ss_family == AF_INET) p = ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
    if (addr.ss_family == AF_INET6) p = ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port);
    if (p == port) ::listen(fd, SOMAXCONN);
  }
}

}  // namespace

Server::Server(std::unique_ptr<Engine> engine, Tokenizer tok, ServeOptions o,
               std::unique_ptr<const VisionEncoder> vision)
    : impl_(std::make_unique<Impl>(std::move(engine), std::move(tok), std::move(o), std::move(vision))) {
  K3_CHECK(impl_->engine, "serve: no engine");
  K3_CHECK(impl_->o.max_queue >= 0, "serve: max_queue must be >= 0, got ", impl_->o.max_queue);
  K3_CHECK(impl_->o.default_max_tokens >= 1, "serve: default_max_tokens must be >= 1, got ",
           impl_->o.default_max_tokens);
  K3_CHECK(impl_->o.max_prompt_tokens >= 0, "serve: max_prompt_tokens must be >= 0, got ", impl_->o.max_prompt_tokens);
  K3_CHECK(std::isfinite(impl_->o.request_timeout_seconds) && impl_->o.request_timeout_seconds >= 0,
           "serve: request_timeout_seconds must be finite and >= 0, got ", impl_->o.request_timeout_seconds);
  impl_->batcher =
      std::make_unique<Batcher>(*impl_->engine,
                                BatcherOptions{impl_->o.max_batch, impl_->o.cache_budget, impl_->o.prefill_chunk,
                                               std::max(impl_->o.prefill_chunk, int64_t(2048)), impl_->o.prefill_every,
                                               std::chrono::microseconds(2000), impl_->o.prefix_cache_bytes});
  impl_->routes();
}

Server::~Server() { stop(); }

int Server::bind() {
  Impl& s = *impl_;
  if (s.o.port == 0) s.port = s.http.bind_to_any_port(s.o.host);
  else s.port = s.http.bind_to_port(s.o.host, s.o.port) ? s.o.port : -1;
  K3_CHECK(s.port > 0, "serve: cannot listen on ", s.o.host, ":", s.o.port,
           " (address in use, or not an address of this machine)");
  widen_listen_backlog(s.port);
  return s.port;
}

void Server::listen() {
  K3_CHECK(impl_->port > 0, "serve: bind() first");
  impl_->http.listen_after_bind();
}

void Server::stop() {
  if (impl_ && impl_->http.is_running()) impl_->http.stop();
}

std::string Server::metrics_text() const { return impl_->metrics(); }

}  // namespace k3::serve
