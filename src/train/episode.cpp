#include "train/episode.h"

#include <chrono>
#include <cmath>

#include "core/error.h"
#include "core/splitmix.h"
#include "kernels/loss/cross_entropy.h"
#include "model/sampler.h"
#include "tokenizer/special_tokens.h"
#include "tokenizer/xtml_chat.h"
#include "tokenizer/xtml_parse.h"

namespace k3::train {

using ojson = nlohmann::ordered_json;

namespace {

// The task's request with these messages.
std::vector<ChatSegment> render_messages(const Task& task, const ojson& messages, bool generation_prompt) {
  ojson req = task.request;
  req["messages"] = messages;
  req["add_generation_prompt"] = generation_prompt;
  return render_chat(req);
}

// Draw t of an episode: a function of (seed, t) alone.
double episode_uniform(uint64_t seed, int64_t t) { return SplitMixUniform{seed ^ splitmix64(uint64_t(t) + 1)}.next(); }

void append(Episode& e, const std::vector<int32_t>& ids, bool sampled, double logp, int32_t policy) {
  for (int32_t id : ids) {
    e.ids.push_back(id);
    e.sampled.push_back(sampled ? 1 : 0);
    e.logp.push_back(sampled ? logp : 0.0);
    e.policy.push_back(sampled ? policy : -1);
    e.reward.push_back(0.0);
  }
}

void finish(Episode& e, const char* end) {
  e.done = true;
  e.end = end;
}

// The assistant message the episode has just closed: parsed, its tool calls run, the conversation continued (or
// the answer scored).
void end_turn(Episode& e, const Tokenizer& tok, Environment& env, const EpisodeOptions& o, RolloutStats& stats) {
  const std::vector<int32_t> turn(e.ids.begin() + e.turn_begin, e.ids.end());
  const XtmlAssistantMessage msg =
      parse_assistant(xtml_pieces_from_ids(tok, turn),
                      request_thinks(e.task.request) ? XtmlStart::kThink : XtmlStart::kResponse);
  ++e.turns;
  bool calls_complete = !msg.tool_calls.empty();
  for (const XtmlToolCall& c : msg.tool_calls) calls_complete = calls_complete && c.complete && !c.raw_arguments;
  ojson assistant = msg.to_openai();
  if (!calls_complete) {  // an answer (a malformed call is one too, and scores as the environment says)
    e.messages.push_back(assistant);
    try {
      e.outcome = env.score(e.task, msg, e.state);
    } catch (const std::exception& ex) {
      e.error = std::string("scoring failed: ") + ex.what();
      e.outcome = 0.0;
      return finish(e, "tool_error");
    }
    return finish(e, "answer");
  }
  if (e.turns >= o.max_turns) return finish(e, "max_turns");
  e.messages.push_back(assistant);
  const ojson before = e.messages;
  const auto t0 = std::chrono::steady_clock::now();
  for (const XtmlToolCall& c : msg.tool_calls) {
    ToolOutcome out;
    try {
      out = env.call(e.task, c.name, c.arguments, e.state);
    } catch (const std::exception& ex) {
      out.error = ex.what();
    }
    ++e.tool_calls;
    if (!out.error.empty()) {
      stats.tool_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      e.error = "tool '" + c.name + "': " + out.error;
      return finish(e, "tool_error");
    }
    e.reward.back() += out.reward;  // credited at the turn's last token
    e.messages.push_back({{"role", "tool"}, {"tool", c.name}, {"content", out.content}});
  }
  stats.tool_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  append(e, turn_continuation(tok, e.task, before, e.messages), false, 0.0, -1);
  e.turn_begin = int64_t(e.ids.size());
}

}  // namespace

std::vector<int32_t> turn_continuation(const Tokenizer& tok, const Task& task, const ojson& through_assistant,
                                       const ojson& with_results) {
  // The tool results and the next generation prompt are the segments after the rendering through the assistant.
  const std::vector<ChatSegment> head = render_messages(task, through_assistant, false);
  const std::vector<ChatSegment> full = render_messages(task, with_results, true);
  K3_CHECK(full.size() > head.size() && std::equal(head.begin(), head.end(), full.begin()),
           "the chat template does not continue the conversation after its assistant message ",
           through_assistant.size());
  return encode_segments(tok, std::vector<ChatSegment>(full.begin() + std::ptrdiff_t(head.size()), full.end()));
}

bool request_thinks(const ojson& request) {
  return !(request.contains("thinking") && request["thinking"].is_boolean() && !request["thinking"].get<bool>());
}

int64_t Episode::generated() const {
  int64_t n = 0;
  for (uint8_t s : sampled) n += s;
  return n;
}

double Episode::dense_reward() const {
  double r = 0;
  for (double x : reward) r += x;
  return r;
}

nlohmann::json Episode::to_json() const {
  return {{"task_index", task_index},
          {"sample", sample},
          {"task", {{"request", task.request}, {"answer", task.answer}, {"reference", task.reference}}},
          {"seed", seed},
          {"messages", messages},
          {"ids", ids},
          {"sampled", sampled},
          {"logp", logp},
          {"policy", policy},
          {"reward", reward},
          {"routing", routing},
          {"prompt_len", prompt_len},
          {"turn_begin", turn_begin},
          {"state", state},
          {"turns", turns},
          {"tool_calls", tool_calls},
          {"done", done},
          {"end", end},
          {"error", error},
          {"outcome", outcome}};
}

Episode Episode::from_json(const nlohmann::json& j) {
  Episode e;
  j.at("task_index").get_to(e.task_index);
  j.at("sample").get_to(e.sample);
  e.task.request = ojson::parse(j.at("task").at("request").dump());
  e.task.answer = j.at("task").at("answer");
  e.task.reference = ojson::parse(j.at("task").at("reference").dump());
  j.at("seed").get_to(e.seed);
  e.messages = ojson::parse(j.at("messages").dump());
  j.at("ids").get_to(e.ids);
  j.at("sampled").get_to(e.sampled);
  j.at("logp").get_to(e.logp);
  j.at("policy").get_to(e.policy);
  j.at("reward").get_to(e.reward);
  j.at("routing").get_to(e.routing);
  j.at("prompt_len").get_to(e.prompt_len);
  j.at("turn_begin").get_to(e.turn_begin);
  e.state = j.at("state");
  j.at("turns").get_to(e.turns);
  j.at("tool_calls").get_to(e.tool_calls);
  j.at("done").get_to(e.done);
  j.at("end").get_to(e.end);
  j.at("error").get_to(e.error);
  j.at("outcome").get_to(e.outcome);
  const size_t T = e.ids.size();
  if (e.sampled.size() != T || e.logp.size() != T || e.policy.size() != T || e.reward.size() != T)
    fail("episode of task ", e.task_index, ": its per-token records do not have ", T, " entries");
  return e;
}

Episode start_episode(const Tokenizer& tok, const Task& task, int64_t task_index, int64_t sample, uint64_t seed) {
  if (!task.request.is_object() || !task.request.contains("messages"))
    fail("task ", task_index, ": the request has no messages");
  Episode e;
  e.task_index = task_index, e.sample = sample, e.task = task, e.seed = seed;
  e.messages = task.request["messages"];
  ojson req = task.request;
  req["add_generation_prompt"] = true;
  append(e, encode_segments(tok, render_chat(req)), false, 0.0, -1);
  e.prompt_len = e.turn_begin = int64_t(e.ids.size());
  return e;
}

RolloutStats run_episodes(Engine& engine, const Tokenizer& tok, Environment& env, std::vector<Episode*>& episodes,
                          const EpisodeOptions& o, int32_t policy_version, int64_t stop_after_done) {
  if (o.max_tokens < 1) fail("episodes: max tokens must be at least 1, got ", o.max_tokens);
  if (o.max_turns < 1) fail("episodes: max turns must be at least 1, got ", o.max_turns);
  if (!(o.temperature > 0.0f)) fail("episodes: the temperature must be > 0, got ", o.temperature);
  const K3Config& c = engine.config();
  const int64_t K = c.num_experts_per_token;
  const int64_t max_context = o.max_context > 0 ? o.max_context : c.max_position_embeddings;
  const int32_t end_of_msg = tok.special_id(K3Special::kEndOfMsg), eos = tok.special_id(K3Special::kEos);
  const auto t0 = std::chrono::steady_clock::now();
  RolloutStats stats;
  if (stop_after_done <= 0) stop_after_done = int64_t(episodes.size());

  std::vector<Episode*> live;
  for (Episode* e : episodes)
    if (!e->done) live.push_back(e);
  auto done_count = [&] {
    int64_t n = 0;
    for (const Episode* e : episodes) n += e->done;
    return n;
  };
  std::vector<std::unique_ptr<EngineSequence>> seqs = engine.new_sequences(int64_t(live.size()));
  std::vector<int64_t> fed(live.size(), 0);  // tokens of each episode the engine holds
  for (Episode* e : live)
    if (o.record_routing) e->routing.assign(size_t(c.num_hidden_layers), {});  // recorded afresh under this policy

  while (done_count() < stop_after_done) {
    std::vector<size_t> active;
    for (size_t i = 0; i < live.size(); ++i)
      if (!live[i]->done) active.push_back(i);
    if (active.empty()) break;
    std::vector<EngineSequence*> batch;
    std::vector<std::vector<int32_t>> tokens;
    for (size_t i : active) {
      batch.push_back(seqs[i].get());
      tokens.emplace_back(live[i]->ids.begin() + fed[i], live[i]->ids.end());
      for (int64_t t = fed[i]; t < int64_t(live[i]->ids.size()); ++t) stats.prefilled += !live[i]->sampled[size_t(t)];
    }
    ForwardHooks hooks;
    if (o.record_routing)
      hooks.topk = [&](int64_t layer, const int32_t* idx, int64_t rows, int64_t k) {
        K3_CHECK(k == K, "episodes: the engine routed to ", k, " experts, the config says ", K);
        int64_t row = 0;
        for (size_t b = 0; b < active.size(); ++b) {
          std::vector<int32_t>& r = live[active[b]]->routing[size_t(layer)];
          const int64_t n = int64_t(tokens[b].size());
          K3_CHECK(row + n <= rows, "episodes: the engine routed ", rows, " rows for more tokens");
          r.insert(r.end(), idx + row * K, idx + (row + n) * K);
          row += n;
        }
      };
    // The engine picks each id (on the GPU without the logits leaving it) with the episode's own draw, and gives
    // its log-probability under softmax(logits / T).
    std::vector<TokenPick> picks;
    for (size_t i : active) {
      TokenPick p;
      p.pick = true, p.greedy = o.greedy, p.temperature = o.temperature, p.want_logprob = !o.greedy;
      p.uniform = o.greedy ? 0.0 : episode_uniform(live[i]->seed, int64_t(live[i]->ids.size()));
      picks.push_back(p);
    }
    const std::vector<PickResult> picked =
        engine.forward_pick(batch, tokens, picks, o.record_routing ? &hooks : nullptr);
    ++stats.engine_calls;
    for (size_t b = 0; b < active.size(); ++b) {
      const size_t i = active[b];
      Episode& e = *live[i];
      fed[i] = int64_t(e.ids.size());
      const int32_t id = picked[b].id;
      append(e, {id}, true, picked[b].logprob, policy_version);
      ++stats.sampled;
      if (id == end_of_msg || id == eos) end_turn(e, tok, env, o, stats);
      if (!e.done && e.generated() >= o.max_tokens) finish(e, "max_tokens");  // also after a tool turn
      if (!e.done && int64_t(e.ids.size()) >= max_context) finish(e, "context");
    }
  }
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

}  // namespace k3::train
