#include "serve/generation.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>

#include "core/error.h"
#include "model/generate.h"
#include "tokenizer/xtml_chat.h"
#include "tokenizer/xtml_parse.h"

namespace k3::serve {

using ojson = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

ojson Usage::to_json() const {
  return ojson{{"prompt_tokens", prompt_tokens},
               {"completion_tokens", completion_tokens},
               {"total_tokens", prompt_tokens + completion_tokens},
               {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
}

namespace {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The tokens the request may generate: its max_tokens, which must fit the context with the prompt when
// the request named it; the server's default is cut to what is left.
// A prompt longer than the server's --max-prompt-tokens is refused the same way.
int64_t generation_budget(const K3Config& cfg, int64_t prompt_tokens, const GenerationRequest& g, const char* param) {
  if (g.max_prompt_tokens > 0 && prompt_tokens > g.max_prompt_tokens)
    throw bad_request(param, "the prompt is " + std::to_string(prompt_tokens) +
                                 " tokens, and this server takes at most " + std::to_string(g.max_prompt_tokens));
  const int64_t ctx = cfg.max_position_embeddings;
  if (ctx <= 0) return g.max_tokens;
  if (prompt_tokens >= ctx)
    throw bad_request(param, "the prompt is " + std::to_string(prompt_tokens) +
                                 " tokens, and this model's context is " + std::to_string(ctx) + " tokens");
  if (g.max_tokens_given && prompt_tokens + g.max_tokens > ctx)
    throw bad_request("max_tokens", "this model's maximum context length is " + std::to_string(ctx) +
                                        " tokens: " + std::to_string(prompt_tokens) + " in the prompt and " +
                                        std::to_string(g.max_tokens) + " asked for");
  return std::min(g.max_tokens, ctx - prompt_tokens);
}

void check_ids(const K3Config& cfg, const std::vector<int32_t>& ids, const char* param) {
  for (int32_t id : ids)
    if (id < 0 || id >= cfg.vocab_size)
      throw bad_request(param, "token id " + std::to_string(id) + " is outside the model's vocabulary of " +
                                   std::to_string(cfg.vocab_size));
}

// The end of a channel's text once generation is over: the first byte of its first stop string
// (*hit set), else the text's end.
size_t stop_end(const std::string& text, const std::vector<std::string>& stops, bool* hit) {
  const size_t p = find_stop(text, stops);
  if (p == std::string::npos) return text.size();
  *hit = true;
  return p;
}

// How much of a channel's text may be sent while generation goes on: up to a stop string's first
// byte when one occurs (*hit set), else all but what could still begin one, cut back to a whole
// UTF-8 character.
size_t final_prefix(const std::string& text, const std::vector<std::string>& stops, bool* hit) {
  bool here = false;
  const size_t end = stop_end(text, stops, &here);
  if (here) {
    *hit = true;
    return end;
  }
  return utf8_complete_prefix(std::string_view(text).substr(0, end - stop_holdback(text, stops)));
}

// Collects the generated tokens' log-probabilities when the request asks for them, and hands out the
// entries not yet sent.
struct LogprobLog {
  explicit LogprobLog(int top) : n_top(top) {}
  int n_top;  // -1: not asked for
  std::vector<TokenLogprob> all;
  size_t sent = 0;
  StepObserver observer() {
    if (n_top < 0) return {};
    return [this](const float* logits, int64_t V, int32_t id) { all.push_back(token_logprob(logits, V, id, n_top)); };
  }
  std::vector<TokenLogprob> take() {
    std::vector<TokenLogprob> out(all.begin() + std::ptrdiff_t(sent), all.end());
    sent = all.size();
    return out;
  }
};

}  // namespace

PreparedPrompt prepare_chat(const K3Config& cfg, const Tokenizer& tok, const ChatRequest& req,
                            const VisionEncoder* vision) {
  PreparedPrompt p;
  try {
    std::vector<ChatImagePart> parts;
    const std::vector<ChatSegment> segments = render_chat(req.body, &parts);
    auto media = std::make_shared<MediaPrompt>(
        encode_media_prompt(tok, vision, cfg.hidden_size, segments, load_chat_images(parts, MediaSources{})));
    p.ids = media->ids;
    if (!media->rows.empty()) p.media = std::move(media);
  } catch (const Error& e) {
    throw bad_request("messages", e.what());
  }
  check_ids(cfg, p.ids, "messages");
  p.budget = generation_budget(cfg, int64_t(p.ids.size()), req.gen, "messages");
  return p;
}

PreparedPrompt prepare_completion(const K3Config& cfg, const Tokenizer& tok, const CompletionRequest& req) {
  PreparedPrompt p;
  p.ids = req.prompt_ids.empty() ? tok.encode(req.prompt_text, false) : req.prompt_ids;
  if (p.ids.empty()) throw bad_request("prompt", "the prompt encodes to no tokens");
  check_ids(cfg, p.ids, "prompt");
  p.budget = generation_budget(cfg, int64_t(p.ids.size()), req.gen, "prompt");
  return p;
}

ChatResult run_chat(const K3Config& cfg, const PickFn& append, const RunAhead& ahead, const Tokenizer& tok,
                    const ChatRequest& req, const PreparedPrompt& prompt,
                    const std::function<bool(const ChatDelta&)>& emit, const TokenTrie* trie) {
  const auto t0 = Clock::now();
  ChatResult r;
  r.usage.prompt_tokens = int64_t(prompt.ids.size());
  const XtmlStart start = req.thinking ? XtmlStart::kThink : XtmlStart::kResponse;

  Sampler sampler(req.gen.sampling);
  size_t sent_reasoning = 0, sent_content = 0;
  bool stop_hit = false, cancelled = false;
  XtmlAssistantMessage msg;
  std::vector<int32_t> made;
  LogprobLog lps(req.gen.top_logprobs);
  std::unique_ptr<TokenTrie> own_trie;
  std::optional<TurnConstraint> grammar;
  if (req.constrained) {
    if (!trie) own_trie = std::make_unique<TokenTrie>(tok), trie = own_trie.get();
    grammar.emplace(tok, *trie, TurnSpec{req.thinking, req.schema, req.forced});
  }
  Clock::time_point first;
  auto step = [&](int32_t id) {
    if (made.empty()) first = Clock::now(), r.timing.first_token_seconds = seconds_since(t0);
    K3_CHECK(!grammar || grammar->accept(id), "constrained decoding: token ", id, " was sampled past the mask");
    made.push_back(id);
    msg = parse_assistant(xtml_pieces_from_ids(tok, made), start);
    ChatDelta d;
    const size_t think_ok = utf8_complete_prefix(msg.think);
    if (think_ok > sent_reasoning) d.reasoning = msg.think.substr(sent_reasoning, think_ok - sent_reasoning);
    const size_t content_ok = final_prefix(msg.response, req.gen.stop, &stop_hit);
    if (content_ok > sent_content) d.content = msg.response.substr(sent_content, content_ok - sent_content);
    sent_reasoning = std::max(sent_reasoning, think_ok);
    sent_content = std::max(sent_content, content_ok);
    if (emit && (!d.reasoning.empty() || !d.content.empty())) {
      d.logprobs = lps.take();
      if (!emit(d)) cancelled = true;
    }
    if (Clock::now() > req.gen.deadline) r.timed_out = true;
    return !cancelled && !stop_hit && !msg.complete && !r.timed_out;
  };
  LogitsMask mask;
  if (grammar) mask = [&](float* logits, int64_t V) { grammar->mask(logits, V); };
  const GenerateResult g =
      generate_until(append, cfg, prompt.ids, prompt.budget, sampler, step, lps.observer(), mask, ahead);
  if (!made.empty()) r.timing.decode_seconds = seconds_since(first);
  r.usage.completion_tokens = int64_t(g.tokens.size());

  // What is left to send: the rest of the reasoning and of the content (up to a stop string), and the
  // log-probabilities not sent yet.
  if (!cancelled) {
    ChatDelta d;
    if (!stop_hit) {
      if (msg.think.size() > sent_reasoning) d.reasoning = msg.think.substr(sent_reasoning);
      const size_t end = stop_end(msg.response, req.gen.stop, &stop_hit);
      if (end > sent_content) d.content = msg.response.substr(sent_content, end - sent_content);
      sent_content = std::max(sent_content, end);
    }
    d.logprobs = lps.take();
    if (emit && (!d.reasoning.empty() || !d.content.empty() || !d.logprobs.empty())) emit(d);
  }
  r.logprobs = std::move(lps.all);
  if (stop_hit) msg.response.resize(sent_content), msg.tool_calls.clear();
  r.message = msg.to_openai();
  const bool ended = msg.complete || g.stopped_on_eos || stop_hit;
  r.finish_reason = !msg.tool_calls.empty() && ended ? "tool_calls" : ended ? "stop" : "length";
  return r;
}

TextResult run_completion(const K3Config& cfg, const PickFn& append, const RunAhead& ahead, const Tokenizer& tok,
                          const CompletionRequest& req, const PreparedPrompt& prompt,
                          const std::function<bool(const TextDelta&)>& emit) {
  const auto t0 = Clock::now();
  TextResult r;
  r.usage.prompt_tokens = int64_t(prompt.ids.size());

  Sampler sampler(req.gen.sampling);
  size_t sent = 0;
  bool stop_hit = false, cancelled = false;
  std::string text;
  std::vector<int32_t> made;
  LogprobLog lps(req.gen.top_logprobs);
  Clock::time_point first;
  auto step = [&](int32_t id) {
    if (made.empty()) first = Clock::now(), r.timing.first_token_seconds = seconds_since(t0);
    made.push_back(id);
    if (id == cfg.eos_token_id) return true;  // generate_until stops on it; it is not text
    text = tok.decode(made);
    const size_t ok = final_prefix(text, req.gen.stop, &stop_hit);
    if (emit && ok > sent && !emit(TextDelta{text.substr(sent, ok - sent), lps.take()})) cancelled = true;
    sent = std::max(sent, ok);
    if (Clock::now() > req.gen.deadline) r.timed_out = true;
    return !cancelled && !stop_hit && !r.timed_out;
  };
  const GenerateResult g =
      generate_until(append, cfg, prompt.ids, prompt.budget, sampler, step, lps.observer(), {}, ahead);
  if (!made.empty()) r.timing.decode_seconds = seconds_since(first);
  r.usage.completion_tokens = int64_t(g.tokens.size());
  if (!cancelled) {
    TextDelta d;
    if (!stop_hit && text.size() > sent) {
      const size_t end = stop_end(text, req.gen.stop, &stop_hit);
      if (end > sent) d.text = text.substr(sent, end - sent);
      sent = std::max(sent, end);
    }
    d.logprobs = lps.take();
    if (emit && (!d.text.empty() || !d.logprobs.empty())) emit(d);
  }
  r.text = text.substr(0, sent);
  r.logprobs = std::move(lps.all);
  r.finish_reason = g.stopped_on_eos || stop_hit ? "stop" : "length";
  return r;
}

}  // namespace k3::serve
