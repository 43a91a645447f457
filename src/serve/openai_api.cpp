#include "serve/openai_api.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/json.h"
#include "tokenizer/xtml_chat.h"

namespace k3::serve {

using ojson = nlohmann::ordered_json;

ApiError::ApiError(int status_, std::string type_, std::string param_, const std::string& message, std::string code_)
    : std::runtime_error(message),
      status(status_),
      type(std::move(type_)),
      param(std::move(param_)),
      code(std::move(code_)) {}

ojson ApiError::body() const {
  ojson e = ojson::object();
  e["message"] = what();
  e["type"] = type;
  e["param"] = param.empty() ? ojson(nullptr) : ojson(param);
  e["code"] = code.empty() ? ojson(nullptr) : ojson(code);
  return ojson{{"error", e}};
}

ApiError bad_request(const std::string& param, const std::string& message) {
  return ApiError(400, "invalid_request_error", param, message);
}

namespace {

ojson parse_body(std::string_view text) {
  ojson body;
  try {
    body = parse_json<ojson>(text, "the request body");
  } catch (const Error& e) {
    throw bad_request("", e.what());
  }
  if (!body.is_object()) throw bad_request("", "the request body must be a JSON object");
  return body;
}

// A number field in [lo, hi] (open at the low end when lo_open), or `fallback` when absent or null.
double number_field(const ojson& b, const char* key, double fallback, double lo, double hi, bool lo_open = false) {
  if (!b.contains(key) || b[key].is_null()) return fallback;
  const ojson& v = b[key];
  if (!v.is_number()) throw bad_request(key, std::string(key) + " must be a number");
  const double x = v.get<double>();
  const bool low_ok = lo_open ? x > lo : x >= lo;
  if (!std::isfinite(x) || !low_ok || x > hi) {
    throw bad_request(key, std::string(key) + " must be in " + (lo_open ? "(" : "[") + std::to_string(lo) + ", " +
                               std::to_string(hi) + "], got " + v.dump());
  }
  return x;
}

// An integer field (JSON integers only), or nullopt when absent or null.
std::optional<int64_t> int_field(const ojson& b, const char* key) {
  if (!b.contains(key) || b[key].is_null()) return std::nullopt;
  const ojson& v = b[key];
  if (!v.is_number_integer()) throw bad_request(key, std::string(key) + " must be an integer, got " + v.dump());
  return v.get<int64_t>();
}

bool bool_field(const ojson& b, const char* key, bool fallback) {
  if (!b.contains(key) || b[key].is_null()) return fallback;
  if (!b[key].is_boolean()) throw bad_request(key, std::string(key) + " must be true or false");
  return b[key].get<bool>();
}

void check_model(const ojson& b, const ApiLimits& limits) {
  if (!b.contains("model") || b["model"].is_null()) return;
  if (!b["model"].is_string()) throw bad_request("model", "model must be a string");
  const std::string m = b["model"].get<std::string>();
  if (!limits.model_id.empty() && m != limits.model_id)
    throw ApiError(404, "invalid_request_error", "model",
                   "The model '" + m + "' does not exist; this server serves '" + limits.model_id + "'",
                   "model_not_found");
}

// The fields every endpoint shares: sampling, length, stop, stream, and the ones not supported yet
// (refused rather than ignored, so a client never believes it got what it asked for).
GenerationRequest generation_fields(const ojson& b, const ApiLimits& limits, bool chat) {
  GenerationRequest g;
  std::optional<int64_t> mt = int_field(b, "max_tokens");
  if (chat) {
    if (std::optional<int64_t> mct = int_field(b, "max_completion_tokens")) mt = mct;
  }
  if (mt && *mt < 1)
    throw bad_request(chat && b.contains("max_completion_tokens") ? "max_completion_tokens" : "max_tokens",
                      "max_tokens must be at least 1, got " + std::to_string(*mt));
  g.max_tokens_given = mt.has_value();
  g.max_tokens = mt.value_or(limits.default_max_tokens);

  const double temperature = number_field(b, "temperature", 1.0, 0.0, 2.0);
  const double top_p = number_field(b, "top_p", 1.0, 0.0, 1.0, true);
  int64_t top_k = int_field(b, "top_k").value_or(0);
  if (top_k == -1) top_k = 0;  // vLLM's spelling of "no cut"
  if (top_k < 0) throw bad_request("top_k", "top_k must be -1, 0 (no cut) or positive, got " + std::to_string(top_k));
  g.sampling.greedy = temperature == 0.0;
  g.sampling.temperature = g.sampling.greedy ? 1.0f : float(temperature);
  g.sampling.top_p = float(top_p);
  g.sampling.top_k = top_k;
  if (std::optional<int64_t> seed = int_field(b, "seed")) g.sampling.seed = uint64_t(*seed);

  if (std::optional<int64_t> n = int_field(b, "n"); n && *n != 1)
    throw bad_request("n", "only n = 1 is supported, got " + std::to_string(*n));

  if (b.contains("stop") && !b["stop"].is_null()) {
    const ojson& s = b["stop"];
    if (s.is_string()) g.stop.push_back(s.get<std::string>());
    else if (s.is_array()) {
      if (s.size() > 4) throw bad_request("stop", "stop takes at most 4 sequences, got " + std::to_string(s.size()));
      for (const ojson& x : s) {
        if (!x.is_string()) throw bad_request("stop", "stop must be a string or an array of strings");
        g.stop.push_back(x.get<std::string>());
      }
    } else {
      throw bad_request("stop", "stop must be a string or an array of strings");
    }
    for (const std::string& x : g.stop)
      if (x.empty()) throw bad_request("stop", "stop sequences must not be empty");
  }

  g.stream = bool_field(b, "stream", false);
  if (b.contains("stream_options") && !b["stream_options"].is_null()) {
    if (!g.stream) throw bad_request("stream_options", "stream_options is only allowed when stream is true");
    if (!b["stream_options"].is_object()) throw bad_request("stream_options", "stream_options must be an object");
    g.include_usage = bool_field(b["stream_options"], "include_usage", false);
  }

  for (const char* key : {"presence_penalty", "frequency_penalty"}) {
    if (number_field(b, key, 0.0, -2.0, 2.0) != 0.0)
      throw bad_request(key, std::string(key) + " is not supported by k3 serve yet (only 0)");
  }
  if (chat) {
    const std::optional<int64_t> top = int_field(b, "top_logprobs");
    if (top && (*top < 0 || *top > 20))
      throw bad_request("top_logprobs", "top_logprobs must be in [0, 20], got " + std::to_string(*top));
    const bool on = bool_field(b, "logprobs", false);
    if (top && !on) throw bad_request("top_logprobs", "top_logprobs needs logprobs to be true");
    if (on) g.top_logprobs = int(top.value_or(0));
  } else if (const std::optional<int64_t> n = int_field(b, "logprobs")) {
    if (*n < 0 || *n > 5) throw bad_request("logprobs", "logprobs must be in [0, 5], got " + std::to_string(*n));
    g.top_logprobs = int(*n);
  }
  if (b.contains("logit_bias") && !b["logit_bias"].is_null() && !b["logit_bias"].empty())
    throw bad_request("logit_bias", "logit_bias is not supported by k3 serve yet");
  return g;
}

// A schema from the request, compiled for constrained decoding; what it cannot hold is a 400 naming
// `param`.
std::shared_ptr<const JsonSchema> request_schema(const ojson& schema, const std::string& param) {
  try {
    return std::make_shared<const JsonSchema>(JsonSchema::compile(nlohmann::json::parse(schema.dump())));
  } catch (const SchemaError& e) {
    throw bad_request(param, e.what());
  }
}

// The tools a request declares (its `tools`, and any system message's), for a forced call: each one's
// name and parameter schema (none: any object). A name a forced call could not write back exactly,
// or a schema constrained decoding cannot hold, is a 400.
std::vector<ForcedTool> declared_tools(const ojson& b) {
  std::vector<std::pair<const ojson*, std::string>> lists;
  if (b.contains("tools") && b["tools"].is_array()) lists.push_back({&b["tools"], "tools"});
  for (size_t i = 0; i < b["messages"].size(); ++i) {
    const ojson& m = b["messages"][i];
    if (m.is_object() && m.contains("tools") && m["tools"].is_array())
      lists.push_back({&m["tools"], "messages[" + std::to_string(i) + "].tools"});
  }
  std::vector<ForcedTool> out;
  for (const auto& [list, where] : lists) {
    for (size_t i = 0; i < list->size(); ++i) {
      const std::string at = where + "[" + std::to_string(i) + "]";
      const ojson& t = (*list)[i];
      const ojson& fn = t.is_object() && t.contains("function") ? t["function"] : t;
      if (!fn.is_object() || !fn.contains("name") || !fn["name"].is_string())
        throw bad_request(at, "a tool needs a function name");
      ForcedTool f;
      f.name = fn["name"].get<std::string>();
      const bool plain = !f.name.empty() && std::all_of(f.name.begin(), f.name.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
      });
      if (!plain) throw bad_request(at, "a forced call needs tool names of letters, digits, '_', '-' and '.'");
      f.parameters = fn.contains("parameters") && !fn["parameters"].is_null()
                         ? request_schema(fn["parameters"], at + ".function.parameters")
                         : std::make_shared<const JsonSchema>(JsonSchema::any_object());
      out.push_back(std::move(f));
    }
  }
  return out;
}

// One value from several spellings: the first one given; another that disagrees is a 400 naming both.
template <class T>
struct Agreed {
  std::optional<T> value;
  std::string from;
  void take(const std::optional<T>& v, const std::string& param) {
    if (!v) return;
    if (value && *value != *v)
      throw bad_request(param, param + " disagrees with " + from + " (give one, or the same value in both)");
    if (!value) value = v, from = param;
  }
};

std::optional<std::string> effort_field(const ojson& o, const char* key, const std::string& param) {
  if (!o.contains(key) || o[key].is_null()) return std::nullopt;
  const ojson& e = o[key];
  if (!e.is_string() || (e != "low" && e != "high" && e != "max"))
    throw bad_request(param, param + " must be \"low\", \"high\" or \"max\", got " + e.dump());
  return e.get<std::string>();
}

// The three thinking spellings (see ChatRequest) read into r.thinking / r.effort, and the body rewritten to the
// one render_chat reads.
void resolve_thinking(ChatRequest& r) {
  ojson& b = r.body;
  Agreed<bool> on, keep;
  Agreed<std::string> effort;
  if (b.contains("thinking") && !b["thinking"].is_null()) {
    const ojson& t = b["thinking"];
    if (t.is_boolean()) {
      on.take(t.get<bool>(), "thinking");
    } else if (t.is_object()) {
      if (!t.contains("type") || (t["type"] != "enabled" && t["type"] != "disabled"))
        throw bad_request("thinking.type", "thinking.type must be \"enabled\" or \"disabled\"");
      on.take(t["type"] == "enabled", "thinking.type");
      if (t.contains("keep") && !t["keep"].is_null()) {
        if (!t["keep"].is_boolean()) throw bad_request("thinking.keep", "thinking.keep must be true or false");
        keep.take(t["keep"].get<bool>(), "thinking.keep");
      }
      effort.take(effort_field(t, "effort", "thinking.effort"), "thinking.effort");
    } else {
      throw bad_request("thinking", "thinking must be a boolean or {\"type\": \"enabled\" | \"disabled\", ...}");
    }
  }
  if (b.contains("chat_template_kwargs") && !b["chat_template_kwargs"].is_null()) {
    const ojson& k = b["chat_template_kwargs"];
    if (!k.is_object()) throw bad_request("chat_template_kwargs", "chat_template_kwargs must be an object");
    if (k.contains("thinking") && !k["thinking"].is_null()) {
      if (!k["thinking"].is_boolean())
        throw bad_request("chat_template_kwargs.thinking", "chat_template_kwargs.thinking must be true or false");
      on.take(k["thinking"].get<bool>(), "chat_template_kwargs.thinking");
    }
    if (k.contains("preserve_thinking") && !k["preserve_thinking"].is_null()) {
      if (!k["preserve_thinking"].is_boolean())
        throw bad_request("chat_template_kwargs.preserve_thinking",
                          "chat_template_kwargs.preserve_thinking must be true or false");
      keep.take(k["preserve_thinking"].get<bool>(), "chat_template_kwargs.preserve_thinking");
    }
    effort.take(effort_field(k, "thinking_effort", "chat_template_kwargs.thinking_effort"),
                "chat_template_kwargs.thinking_effort");
  }
  effort.take(effort_field(b, "reasoning_effort", "reasoning_effort"), "reasoning_effort");
  effort.take(effort_field(b, "thinking_effort", "thinking_effort"), "thinking_effort");
  r.thinking = on.value.value_or(true);
  if (!r.thinking && effort.value)
    throw bad_request(effort.from, effort.from + " needs thinking, which this request turns off");
  r.effort = r.thinking ? effort.value.value_or("max") : "";
  if (!keep.value.value_or(true))
    for (ojson& m : b["messages"])
      if (m.is_object() && m.contains("role") && m["role"] == "assistant") m.erase("reasoning_content");
  for (const char* k : {"thinking", "chat_template_kwargs", "reasoning_effort", "thinking_effort"}) b.erase(k);
  b["thinking"] = r.thinking;
  if (r.thinking) b["thinking_effort"] = r.effort;
}

// K3's fixed sampling (ApiLimits::k3_sampling): the request may name only the fixed values.
void fix_k3_sampling(const ojson& b, GenerationRequest& g, bool thinking) {
  const double temperature = thinking ? 1.0 : 0.6, top_p = 0.95;
  auto require = [&](const char* key, double want, const std::string& shown) {
    if (b.contains(key) && !b[key].is_null() && (!b[key].is_number() || b[key].get<double>() != want))
      throw bad_request(key, std::string("this server samples as K3 does: ") + key + " is " + shown + ", got " +
                                 b[key].dump());
  };
  require("temperature", temperature, thinking ? "1.0 when thinking" : "0.6 without thinking");
  require("top_p", top_p, "0.95");
  require("presence_penalty", 0.0, "0");
  require("frequency_penalty", 0.0, "0");
  if (b.contains("top_k") && !b["top_k"].is_null() && b["top_k"] != 0 && b["top_k"] != -1)
    throw bad_request("top_k", "this server samples as K3 does: no top_k cut, got " + b["top_k"].dump());
  g.sampling.greedy = false;
  g.sampling.temperature = float(temperature);
  g.sampling.top_p = float(top_p);
  g.sampling.top_k = 0;
}

}  // namespace

ChatRequest parse_chat_request_body(std::string_view text, const ApiLimits& limits) {
  ChatRequest r;
  r.body = parse_body(text);
  const ojson& b = r.body;
  check_model(b, limits);
  if (!b.contains("messages") || !b["messages"].is_array() || b["messages"].empty())
    throw bad_request("messages", "messages must be a non-empty array");
  r.gen = generation_fields(b, limits, true);
  resolve_thinking(r);
  if (limits.k3_sampling) fix_k3_sampling(b, r.gen, r.thinking);
  if (b.contains("response_format") && !b["response_format"].is_null()) {
    const ojson& rf = b["response_format"];
    if (!rf.is_object() || !rf.contains("type") || !rf["type"].is_string())
      throw bad_request("response_format", "response_format must be an object with a string type");
    const std::string type = rf["type"].get<std::string>();
    if (type == "json_object") {
      r.constrained = true;
      r.schema = std::make_shared<const JsonSchema>(JsonSchema::any_object());
    } else if (type == "json_schema") {
      const ojson schema = response_format_schema(rf);  // what the prompt shows the model
      if (schema.is_null())
        throw bad_request("response_format.json_schema", "response_format json_schema needs json_schema.schema");
      r.schema = request_schema(schema, "response_format.json_schema.schema");
      r.constrained = true;
    } else if (type != "text") {
      throw bad_request("response_format.type",
                        "response_format type must be text, json_object or json_schema, got " + type);
    }
  }
  if (b.contains("tool_choice") && !b["tool_choice"].is_null()) {
    const ojson& tc = b["tool_choice"];
    if (tc == "none") {
      r.constrained = true;  // no tools block, enforced
    } else if (tc == "required" || (tc.is_object() && tc.value("type", "") == "function")) {
      std::vector<ForcedTool> tools = declared_tools(b);
      if (tools.empty()) throw bad_request("tool_choice", "tool_choice " + tc.dump() + " needs tools");
      if (tc.is_object()) {
        if (!tc.contains("function") || !tc["function"].is_object() || !tc["function"].contains("name") ||
            !tc["function"]["name"].is_string())
          throw bad_request("tool_choice", "tool_choice needs function.name");
        const std::string name = tc["function"]["name"].get<std::string>();
        const auto it = std::find_if(tools.begin(), tools.end(), [&](const ForcedTool& t) { return t.name == name; });
        if (it == tools.end())
          throw bad_request("tool_choice", "tool_choice names '" + name + "', which is not a tool");
        tools = {*it};
      }
      if (!r.schema) r.forced = std::move(tools), r.constrained = true;
      else throw bad_request("tool_choice", "a forced tool call and a JSON response_format exclude each other");
    } else if (tc != "auto") {
      throw bad_request("tool_choice",
                        "tool_choice must be \"auto\", \"none\", \"required\" or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}, got " +
                            tc.dump());
    }
  }
  return r;
}

CompletionRequest parse_completion_request_body(std::string_view text, const ApiLimits& limits) {
  CompletionRequest r;
  const ojson b = parse_body(text);
  check_model(b, limits);
  if (!b.contains("prompt")) throw bad_request("prompt", "prompt is required");
  const ojson& p = b["prompt"];
  if (p.is_string()) {
    r.prompt_text = p.get<std::string>();
    if (r.prompt_text.empty()) throw bad_request("prompt", "prompt must not be empty");
  } else if (p.is_array() && !p.empty() && p.size() == 1 && p[0].is_string()) {
    r.prompt_text = p[0].get<std::string>();
    if (r.prompt_text.empty()) throw bad_request("prompt", "prompt must not be empty");
  } else if (p.is_array() && !p.empty() && p[0].is_number_integer()) {
    for (const ojson& x : p) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > std::numeric_limits<int32_t>::max())
        throw bad_request("prompt", "a prompt of token ids must hold non-negative integers only");
      r.prompt_ids.push_back(int32_t(x.get<int64_t>()));
    }
  } else {
    throw bad_request("prompt",
                      "prompt must be a non-empty string or a non-empty array of token ids "
                      "(one prompt per request)");
  }
  if (b.contains("echo") && bool_field(b, "echo", false)) throw bad_request("echo", "echo is not supported yet");
  if (b.contains("suffix") && !b["suffix"].is_null()) throw bad_request("suffix", "suffix is not supported");
  if (std::optional<int64_t> bo = int_field(b, "best_of"); bo && *bo != 1)
    throw bad_request("best_of", "only best_of = 1 is supported");
  r.gen = generation_fields(b, limits, false);
  if (limits.k3_sampling) fix_k3_sampling(b, r.gen, false);
  return r;
}

size_t utf8_complete_prefix(std::string_view s) {
  // Walk back over at most 3 continuation bytes to the last lead byte; keep it if its sequence is whole.
  size_t n = s.size();
  size_t i = n;
  int cont = 0;
  while (i > 0 && cont < 4 && (uint8_t(s[i - 1]) & 0xC0) == 0x80) --i, ++cont;
  if (i == 0) return n;  // only continuation bytes: not ours to fix
  const uint8_t lead = uint8_t(s[i - 1]);
  const int need = lead < 0x80             ? 0
                   : (lead & 0xE0) == 0xC0 ? 1
                   : (lead & 0xF0) == 0xE0 ? 2
                   : (lead & 0xF8) == 0xF0 ? 3
                                           : -1;
  if (need < 0) return n;      // not a lead byte: invalid anyway, sent as is (replaced on dump)
  if (cont >= need) return n;  // whole
  return i - 1;                // cut: hold back the lead byte and what follows
}

size_t find_stop(std::string_view text, const std::vector<std::string>& stops) {
  size_t best = std::string_view::npos;
  for (const std::string& s : stops) {
    const size_t p = text.find(s);
    if (p < best) best = p;
  }
  return best;
}

size_t stop_holdback(std::string_view text, const std::vector<std::string>& stops) {
  size_t hold = 0;
  for (const std::string& s : stops) {
    // the longest proper prefix of s that is a suffix of text
    for (size_t k = std::min(s.size() - 1, text.size()); k > hold; --k) {
      if (text.compare(text.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  return hold;
}

std::string dump(const ojson& j) { return j.dump(-1, ' ', false, ojson::error_handler_t::replace); }

}  // namespace k3::serve
