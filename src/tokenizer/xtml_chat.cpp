#include "tokenizer/xtml_chat.h"

#include <algorithm>
#include <map>
#include <optional>

#include "core/error.h"
#include "core/json.h"
#include "io/file.h"
#include "tokenizer/python_json.h"
#include "tokenizer/tokenizer.h"

namespace k3 {

using ojson = nlohmann::ordered_json;

namespace {

// Python's str.strip(): whitespace by str.isspace() at both ends.
std::string python_strip(const std::string& s) {
  auto space_at = [&](size_t i, size_t& len) { return python_isspace_at(s, i, len); };
  // Leading: walk forward. Trailing: walk forward too, remembering where the last non-space ended.
  size_t begin = 0, len = 0;
  while (begin < s.size() && space_at(begin, len)) begin += len;
  size_t end = begin;
  for (size_t i = begin; i < s.size(); i += len)
    if (!space_at(i, len)) end = i + len;
  return s.substr(begin, end - begin);
}

// Python's str(value) for the scalar values a request puts in attributes and text.
std::string python_str(const ojson& v, const std::string& field) {
  switch (v.type()) {
    case ojson::value_t::string: return v.get<std::string>();
    case ojson::value_t::number_integer: return std::to_string(v.get<int64_t>());
    case ojson::value_t::number_unsigned: return std::to_string(v.get<uint64_t>());
    case ojson::value_t::number_float: {
      const std::string r = python_float_repr(v.get<double>());
      return r == "Infinity" ? "inf" : r == "-Infinity" ? "-inf" : r == "NaN" ? "nan" : r;
    }
    case ojson::value_t::boolean: return v.get<bool>() ? "True" : "False";
    default: fail("chat request: ", field, " must be a string, not ", v.type_name());
  }
}

// Python truthiness of an optional field (missing, null, "", 0, false, [] and {} are false).
bool truthy(const ojson& obj, const char* key) {
  if (!obj.contains(key)) return false;
  const ojson& v = obj[key];
  if (v.is_null()) return false;
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_string()) return !v.get_ref<const std::string&>().empty();
  if (v.is_number()) return v.get<double>() != 0;
  return !v.empty();
}

class SegmentWriter {
 public:
  std::vector<ChatSegment> out;
  std::vector<ChatImagePart>* images = nullptr;  // where image parts go, in order (optional)
  bool assistant = false;                        // segments written now are the assistant's

  void text(const std::string& t) {
    if (!t.empty()) out.push_back({t, false, assistant});  // the reference drops empty segments
  }
  void control(const std::string& t) {
    if (!t.empty()) out.push_back({t, true, assistant});
  }
  void open(const std::string& tag, const std::vector<std::pair<std::string, std::string>>& attrs = {}) {
    control(kXtmlOpen);
    text(tag);
    for (const auto& [k, v] : attrs) {
      text(" " + k);
      text("=\"");
      text(escape_attr(v));
      text("\"");
    }
    control(kXtmlSep);
  }
  void close(const std::string& tag) {
    control(kXtmlClose);
    text(tag);
    control(kXtmlSep);
  }
  void end_of_msg() { control(kXtmlEndOfMsg); }

  // A system message the encoder adds itself (thinking effort, tool choice, response format).
  void internal_system(const std::string& type, const std::string& body) {
    open("message", {{"role", "system"}, {"type", type}});
    text(python_strip(body));
    close("message");
    end_of_msg();
  }

  // A message's content: a string, or a list of parts ({"type": "text", "text": ...} or an image).
  void content(const ojson& msg, const std::string& field) {
    if (!msg.contains("content") || msg["content"].is_null()) return;
    const ojson& c = msg["content"];
    if (c.is_string()) {
      text(c.get<std::string>());
      return;
    }
    if (!c.is_array())
      fail("chat request: ", field, ".content must be a string or a list of parts, not ", c.type_name());
    for (size_t i = 0; i < c.size(); ++i) {
      const std::string pf = field + ".content[" + std::to_string(i) + "]";
      const ojson& part = c[i];
      if (!part.is_object() || !part.contains("type")) fail("chat request: ", pf, " must be an object with a 'type'");
      const std::string type = python_str(part["type"], pf + ".type");
      if (type == "image" || type == "image_url") {
        // The placeholder the vision processor replaces (multimodal/media_prompt.h).
        control(kXtmlImagePlaceholder);
        if (images) images->push_back({part, pf});
      } else {
        if (!part.contains("text")) fail("chat request: ", pf, " (type '", type, "') has no 'text'");
        text(python_str(part["text"], pf + ".text"));
      }
    }
  }

  void tool_declare(const ojson& tools, bool dynamic) {
    const std::string json = python_json_dumps(deep_sorted(tools), /*compact=*/true);
    const std::string body =
        dynamic ? "## New Tools Available\n"
                  "The system dynamically extends the toolset via lazy-loading.\n"
                  "You have access to all existing and extended tools.\n"
                  "Here are the specs for the extended tools.\n\n```json\n" +
                      json + "\n```"
                : "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n" + json + "\n```";
    open("message", {{"role", "system"}, {"type", "tool-declare"}});
    text(body);
    close("message");
    end_of_msg();
  }

 private:
  static std::string escape_attr(const std::string& v) {
    std::string out;
    for (char c : v) {
      if (c == '&') out += "&amp;";
      else if (c == '"') out += "&quot;";
      else out += c;
    }
    return out;
  }
};

// XTML's argument types, as the reference names a JSON value's Python type.
const char* xtml_type(const ojson& v) {
  if (v.is_boolean()) return "boolean";
  if (v.is_null()) return "null";
  if (v.is_number()) return "number";
  if (v.is_string()) return "string";
  if (v.is_object()) return "object";
  return "array";
}

// A tool call's arguments: an object, or a JSON string holding one. A string that is not JSON is
// kept verbatim and rendered as a `json` block (the reference's _xtml_json_block).
struct ToolArguments {
  ojson object = ojson::object();
  std::optional<std::string> raw;
};

ToolArguments normalize_arguments(const ojson* args, const std::string& field) {
  ToolArguments out;
  if (!args || args->is_null()) return out;
  if (args->is_object()) {
    out.object = *args;
    return out;
  }
  if (!args->is_string())
    fail("chat request: ", field, " must be a JSON object or a string holding one, not ", args->type_name());
  const std::string s = args->get<std::string>();
  if (python_strip(s).empty()) return out;
  if (const size_t at = json_depth_violation(s, kMaxJsonDepth); at != std::string::npos)
    fail("chat request: ", field, " nests deeper than ", kMaxJsonDepth, " levels (at byte ", at, ")");
  std::optional<ojson> maybe = try_parse_json<ojson>(s);
  if (!maybe) {
    out.raw = s;
    return out;
  }
  ojson& parsed = *maybe;
  if (!parsed.is_object()) fail("chat request: ", field, " must hold a JSON object, not ", parsed.type_name());
  out.object = std::move(parsed);
  return out;
}

// The function object of a tool call (OpenAI nests it under "function"; a flat call is accepted).
const ojson& call_function(const ojson& call, const std::string& field) {
  if (!call.is_object()) fail("chat request: ", field, " must be an object");
  if (call.contains("function")) {
    if (!call["function"].is_object()) fail("chat request: ", field, ".function must be an object");
    return call["function"];
  }
  return call;
}

std::string call_name(const ojson& call, const std::string& field) {
  const ojson& fn = call_function(call, field);
  const std::string f = field + (call.contains("function") ? ".function" : "");
  if (!fn.contains("name")) fail("chat request: ", f, " has no 'name'");
  return python_str(fn["name"], f + ".name");
}

// Tool results re-ordered into the order of the assistant's tool_calls (the reference's
// normalize_xtml_tool_result_messages): each run of consecutive tool messages whose every
// `tool_call_id` matches a call of the latest assistant message is sorted by the call's position,
// and each message's tool name is set to the matched call's. A run with any unmatched id is left
// as it is.
std::vector<ojson> reorder_tool_results(const ojson& messages) {
  std::vector<ojson> out;
  std::map<std::string, std::pair<int64_t, std::optional<std::string>>> index;  // id -> (position, name)
  size_t i = 0;
  const size_t n = messages.size();
  auto role_of = [&](size_t k) -> std::string {
    const ojson& m = messages[k];
    return m.is_object() && m.contains("role") && m["role"].is_string() ? m["role"].get<std::string>() : "";
  };
  while (i < n) {
    const std::string role = role_of(i);
    if (role == "assistant") {
      index.clear();
      const ojson& m = messages[i];
      if (m.contains("tool_calls") && m["tool_calls"].is_array()) {
        int64_t pos = 0;
        for (const ojson& call : m["tool_calls"]) {
          ++pos;
          if (!call.is_object() || !call.contains("id") || call["id"].is_null()) continue;
          const std::string id = python_str(call["id"], "messages[" + std::to_string(i) + "].tool_calls[].id");
          if (index.count(id)) continue;  // duplicate ids keep their first call
          const ojson* fn = call.contains("function") && call["function"].is_object() ? &call["function"] : &call;
          std::optional<std::string> name;
          if (fn->contains("name") && (*fn)["name"].is_string()) name = (*fn)["name"].get<std::string>();
          index[id] = {pos, name};
        }
      }
      out.push_back(messages[i++]);
      continue;
    }
    if (role != "tool") {
      out.push_back(messages[i++]);
      continue;
    }
    struct Item {
      int64_t pos;
      size_t offset;
      ojson msg;
      std::optional<std::string> name;
    };
    std::vector<Item> run;
    bool unresolved = false;
    for (size_t offset = 0; i < n && role_of(i) == "tool"; ++i, ++offset) {
      const ojson& m = messages[i];
      const ojson* id = m.contains("tool_call_id") ? &m["tool_call_id"] : m.contains("id") ? &m["id"] : nullptr;
      auto it = id && !id->is_null() && (id->is_string() || id->is_number())
                    ? index.find(python_str(*id, "tool_call_id"))
                    : index.end();
      if (it == index.end()) {
        unresolved = true;
        run.push_back({0, offset, m, std::nullopt});
      } else {
        run.push_back({it->second.first, offset, m, it->second.second});
      }
    }
    if (!unresolved)
      std::stable_sort(run.begin(), run.end(), [](const Item& a, const Item& b) {
        return std::tie(a.pos, a.offset) < std::tie(b.pos, b.offset);
      });
    for (Item& item : run) {
      if (!unresolved && item.name) {
        item.msg["tool"] = *item.name;
        if (item.msg.contains("name")) item.msg["name"] = *item.name;
      }
      out.push_back(std::move(item.msg));
    }
  }
  return out;
}

bool bool_field(const ojson& req, const char* key, bool dflt) {
  if (!req.contains(key) || req[key].is_null()) return dflt;
  if (!req[key].is_boolean()) fail("chat request: '", key, "' must be true or false, not ", req[key].type_name());
  return req[key].get<bool>();
}

}  // namespace

// As the reference's extract_response_schema.
ojson response_format_schema(const ojson& rf) {
  if (!rf.is_object() || !rf.contains("json_schema") || rf["json_schema"].is_null()) return nullptr;
  const ojson& js = rf["json_schema"];
  if (!js.is_object()) return js;
  if (js.contains("schema")) return js["schema"];
  if (js.contains("json_schema")) return js["json_schema"];
  return js;
}

std::vector<ChatSegment> render_chat(const ojson& req, std::vector<ChatImagePart>* images) {
  if (!req.is_object()) fail("chat request: expected a JSON object with 'messages'");
  if (!req.contains("messages") || !req["messages"].is_array())
    fail("chat request: 'messages' must be a list of messages");
  const bool thinking = bool_field(req, "thinking", true);
  const bool add_generation_prompt = bool_field(req, "add_generation_prompt", true);

  SegmentWriter w;
  w.images = images;
  if (req.contains("tools") && !req["tools"].is_null()) {
    if (!req["tools"].is_array()) fail("chat request: 'tools' must be a list");
    if (!req["tools"].empty()) w.tool_declare(req["tools"], /*dynamic=*/false);
  }

  if (thinking && req.contains("thinking_effort") && !req["thinking_effort"].is_null()) {
    const ojson& e = req["thinking_effort"];
    const std::string effort = e.is_string() ? e.get<std::string>() : e.dump();
    if (effort != "low" && effort != "high" && effort != "max")
      fail("chat request: thinking_effort '", effort, "' is not supported (the K3 encoder accepts low, high, max)");
    w.internal_system("thinking-effort",
                      "`thinking_effort` guides on how much to think in your thinking channel (not including the "
                      "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                      "Now the system is invoked with `thinking_effort=" +
                          effort + "`.");
  }

  const std::vector<ojson> messages = reorder_tool_results(req["messages"]);
  const ojson* last_calls = nullptr;  // tool_calls of the latest assistant message
  std::vector<ojson> last_calls_store;
  int64_t tool_index = 0;
  for (size_t mi = 0; mi < messages.size(); ++mi) {
    const ojson& m = messages[mi];
    const std::string field = "messages[" + std::to_string(mi) + "]";
    if (!m.is_object()) fail("chat request: ", field, " must be an object");
    if (!m.contains("role")) fail("chat request: ", field, " has no 'role'");
    const std::string role = python_str(m["role"], field + ".role");
    auto name_attr = [&](std::vector<std::pair<std::string, std::string>>& attrs) {
      if (truthy(m, "name")) attrs.emplace_back("name", python_str(m["name"], field + ".name"));
    };
    if (role == "user" || (role == "system" && !truthy(m, "tools"))) {
      std::vector<std::pair<std::string, std::string>> attrs = {{"role", role}};
      name_attr(attrs);
      w.open("message", attrs);
      w.content(m, field);
      w.close("message");
      w.end_of_msg();
    } else if (role == "system") {
      if (!m["tools"].is_array()) fail("chat request: ", field, ".tools must be a list");
      w.tool_declare(m["tools"], /*dynamic=*/true);
    } else if (role == "tool") {
      ++tool_index;
      std::optional<std::string> tool_name;
      // The reference reads message.get("tool", message.get("name")).
      const ojson* tn = m.contains("tool") ? &m["tool"] : m.contains("name") ? &m["name"] : nullptr;
      if (tn && !tn->is_null()) tool_name = python_str(*tn, field + (m.contains("tool") ? ".tool" : ".name"));
      if (!tool_name && last_calls && tool_index <= int64_t(last_calls->size()))
        tool_name = call_name((*last_calls)[size_t(tool_index - 1)], "the matching tool call");
      if (!tool_name)
        fail("chat request: ", field,
             " (a tool result) needs a tool name: give 'tool' or 'name', a 'tool_call_id' matching a preceding "
             "assistant tool call, or follow an assistant message with as many tool_calls");
      w.open("message", {{"role", "tool"}, {"tool", *tool_name}, {"index", std::to_string(tool_index)}});
      w.content(m, field);
      w.close("message");
      w.end_of_msg();
    } else if (role == "assistant") {
      tool_index = 0;
      last_calls = nullptr;
      if (truthy(m, "tool_calls")) {
        if (!m["tool_calls"].is_array()) fail("chat request: ", field, ".tool_calls must be a list");
        last_calls = &m["tool_calls"];
      }
      std::vector<std::pair<std::string, std::string>> attrs = {{"role", "assistant"}};
      name_attr(attrs);
      w.open("message", attrs);
      // What a generation prompt ends with is the prompt's; from there on the assistant writes.
      if (thinking) {
        // The think channel is structural in thinking mode: always opened and closed.
        const char* rkey = truthy(m, "reasoning_content") ? "reasoning_content" : "reasoning";
        w.open("think");
        w.assistant = true;
        if (m.contains(rkey) && !m[rkey].is_null()) {
          const std::string r = python_str(m[rkey], field + "." + rkey);
          if (!python_strip(r).empty()) w.text(r);
        }
        w.close("think");
      }
      w.open("response");
      w.assistant = true;
      w.content(m, field);
      w.close("response");
      if (last_calls) {
        w.open("tools");
        for (size_t ci = 0; ci < last_calls->size(); ++ci) {
          const std::string cf = field + ".tool_calls[" + std::to_string(ci) + "]";
          const ojson& call = (*last_calls)[ci];
          const std::string name = call_name(call, cf);
          const ojson& fn = call_function(call, cf);
          const std::string af = cf + (call.contains("function") ? ".function" : "") + ".arguments";
          const ToolArguments args = normalize_arguments(fn.contains("arguments") ? &fn["arguments"] : nullptr, af);
          w.open("call", {{"tool", name}, {"index", std::to_string(ci + 1)}});
          if (args.raw) {
            w.open("json", {{"type", "object"}});
            w.text(*args.raw);
            w.close("json");
          } else {
            for (const auto& [key, value] : args.object.items()) {
              w.open("argument", {{"key", key}, {"type", xtml_type(value)}});
              w.text(value.is_string() ? value.get<std::string>() : python_json_dumps(value, /*compact=*/false));
              w.close("argument");
            }
          }
          w.close("call");
        }
        w.close("tools");
      }
      w.close("message");
      w.end_of_msg();
      w.assistant = false;
    } else {
      fail("chat request: ", field, ".role '", role, "' is not a K3 chat role (system, user, assistant, tool)");
    }
  }

  if (req.contains("tool_choice") && req["tool_choice"].is_string()) {
    const std::string tc = req["tool_choice"].get<std::string>();
    if (tc == "required")
      w.internal_system("tool-choice",
                        "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.");
    else if (tc == "none")
      w.internal_system(
          "tool-choice",
          "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.");
  }

  if (req.contains("response_format") && !req["response_format"].is_null()) {
    const ojson& rf = req["response_format"];
    std::string type;
    if (rf.is_object() && rf.contains("type") && rf["type"].is_string()) type = rf["type"].get<std::string>();
    else if (rf.is_string()) type = rf.get<std::string>();
    const std::string head = "The system is invoked with `response_format=" + type +
                             "`.\nYour response must be raw JSON data without markdown code blocks (```json) or any "
                             "additional formatting.";
    if (type == "json_object") {
      w.internal_system("response-format", head);
    } else if (type == "json_schema") {
      const std::string schema = python_json_dumps(deep_sorted(response_format_schema(rf)), /*compact=*/true);
      w.internal_system("response-format",
                        head + "\nThe JSON data must match the following schema:\n```json\n" + schema + "\n```");
    }
  }

  if (add_generation_prompt) {
    w.open("message", {{"role", "assistant"}});
    w.open(thinking ? "think" : "response");
  }
  return w.out;
}

std::string join_segments(const std::vector<ChatSegment>& segments) {
  std::string out;
  for (const ChatSegment& s : segments) out += s.text;
  return out;
}

std::vector<int32_t> encode_segments(const Tokenizer& tok, const std::vector<ChatSegment>& segments,
                                     std::vector<uint8_t>* assistant) {
  std::vector<int32_t> ids;
  if (assistant) assistant->clear();
  for (const ChatSegment& s : segments) {
    const std::vector<int32_t> part = tok.encode(s.text, /*allow_special=*/s.special);
    ids.insert(ids.end(), part.begin(), part.end());
    if (assistant) assistant->insert(assistant->end(), part.size(), uint8_t(s.assistant));
  }
  return ids;
}

ojson parse_chat_request(std::string_view text, const std::string& where) { return parse_json<ojson>(text, where); }

ojson load_chat_request(const std::string& path) {
  return parse_chat_request(read_file(path, "the chat request"), path);
}

}  // namespace k3
