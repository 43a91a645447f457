// `k3 serve`'s HTTP server (cpp-httplib): the OpenAI-compatible endpoints over one engine.
//
//   GET  /health                 {"status": "ok"} (no API key needed)
//   GET  /v1/models              the one model served
//   POST /v1/chat/completions    chat in K3's XTML format: reasoning_content apart from content, tool
//                                calls parsed, streamed as server-sent events when "stream" is true;
//                                logprobs; response_format and tool_choice held by constrained decoding
//   POST /v1/completions         plain text (or token ids) in, text out, streamed likewise
//   GET  /metrics                Prometheus text: requests, tokens, time to first token and per
//                                output token
// Bad requests get OpenAI's error body with status 400 (401 without the API key when one is set,
// 404 for unknown routes and other models' names, 429 when the queue is full).
//
// Up to max_batch requests generate at once, their sequences batched into each forward of the engine
// (continuous batching, serve/batcher.h), within the cache budget; up to max_queue more wait, in
// arrival order, later ones are refused with 429. A streaming request whose client goes away stops
// generating at the next token; one past its timeout too.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "model/engine.h"
#include "model/vision.h"
#include "tokenizer/tokenizer.h"

namespace k3::serve {

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8000;              // 0: any free port (bind() returns it)
  std::string api_key;          // non-empty: requests need "Authorization: Bearer <key>"
  std::string model_id = "k3";  // what /v1/models lists and requests may name
  int64_t max_queue = 64;       // requests waiting for the engine before 429s
  int64_t max_batch = 16;       // requests generating at once (their sequences share each forward)
  size_t cache_budget = 0;      // bytes of sequence state (at full length) admitted at once; 0: no limit
  int64_t prefill_chunk = 512;  // prompt tokens of one request per forward (and the prefix cache's block)
  int64_t prefill_every = 4;    // while requests decode, prompt chunks join every this many forwards
  size_t prefix_cache_bytes = size_t(1) << 30;  // prompt-chunk snapshots kept for later prompts; 0: none
  bool k3_sampling = false;                     // K3's fixed sampling for every request (serve/openai_api.h, ApiLimits)
  int64_t default_max_tokens = 512;             // when a request names no max_tokens (cut to the context left)
  // From a request's arrival: a request still waiting for the engine then gets 503, one generating
  // stops at its next token (finish_reason "length"). 0: no limit.
  double request_timeout_seconds = 600.0;
  // Longer prompts get a 400 before anything runs (a prefill cannot be interrupted); 0: the model's
  // context.
  int64_t max_prompt_tokens = 0;
  size_t max_body_bytes = 16u << 20;
};

class Server {
 public:
  // vision (optional): the model's vision tower and projector; chat requests with images need it.
  Server(std::unique_ptr<Engine> engine, Tokenizer tok, ServeOptions o,
         std::unique_ptr<const VisionEncoder> vision = nullptr);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds the listening socket; returns the port (the chosen one when options.port is 0). Throws
  // k3::Error when the address cannot be bound.
  int bind();
  // Serves until stop() (from another thread or a signal handler's thread).
  void listen();
  void stop();

  // The /metrics text (Prometheus exposition format).
  std::string metrics_text() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace k3::serve
