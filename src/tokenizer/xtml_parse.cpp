#include "tokenizer/xtml_parse.h"

#include <optional>

#include "core/json.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/python_json.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/xtml_chat.h"

namespace k3 {

using ojson = nlohmann::ordered_json;

std::vector<XtmlPiece> xtml_pieces_from_ids(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  const int32_t open = tok.special_id(K3Special::kOpen), close = tok.special_id(K3Special::kClose),
                sep = tok.special_id(K3Special::kSep), eom = tok.special_id(K3Special::kEndOfMsg);
  std::vector<XtmlPiece> out;
  std::vector<int32_t> run;
  auto flush = [&] {
    if (!run.empty()) out.push_back({XtmlPieceKind::kText, tok.decode(run)});
    run.clear();
  };
  for (int32_t id : ids) {
    if (id >= 0 && id < tok.num_ranks()) {
      run.push_back(id);
      continue;
    }
    flush();
    const XtmlPieceKind kind = id == open    ? XtmlPieceKind::kOpen
                               : id == close ? XtmlPieceKind::kClose
                               : id == sep   ? XtmlPieceKind::kSep
                               : id == eom   ? XtmlPieceKind::kEndOfMsg
                                             : XtmlPieceKind::kOtherSpecial;
    out.push_back({kind, tok.is_special(id) ? tok.decode({id}) : "<id " + std::to_string(id) + ">"});
  }
  flush();
  return out;
}

std::vector<XtmlPiece> xtml_pieces_from_text(std::string_view text) {
  static const std::pair<std::string_view, XtmlPieceKind> controls[] = {{kXtmlOpen, XtmlPieceKind::kOpen},
                                                                        {kXtmlClose, XtmlPieceKind::kClose},
                                                                        {kXtmlSep, XtmlPieceKind::kSep},
                                                                        {kXtmlEndOfMsg, XtmlPieceKind::kEndOfMsg}};
  std::vector<XtmlPiece> out;
  size_t start = 0;
  for (size_t p = text.find("<|"); p != std::string_view::npos; p = text.find("<|", p + 1)) {
    for (const auto& [s, kind] : controls) {
      if (text.compare(p, s.size(), s) != 0) continue;
      if (p > start) out.push_back({XtmlPieceKind::kText, std::string(text.substr(start, p - start))});
      out.push_back({kind, std::string(s)});
      start = p + s.size();
      p = start - 1;
      break;
    }
  }
  if (start < text.size()) out.push_back({XtmlPieceKind::kText, std::string(text.substr(start))});
  return out;
}

namespace {

struct Header {
  std::string tag;
  std::vector<std::pair<std::string, std::string>> attrs;
  std::string attr(const std::string& key) const {
    for (const auto& [k, v] : attrs)
      if (k == key) return v;
    return "";
  }
};

std::string unescape_attr(std::string_view v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (v.compare(i, 6, "&quot;") == 0) {
      out += '"';
      i += 5;
    } else if (v.compare(i, 5, "&amp;") == 0) {
      out += '&';
      i += 4;
    } else {
      out += v[i];
    }
  }
  return out;
}

// `tag key="value" key2="value2"` (values escape " and &, so the next '"' ends a value).
Header parse_header(std::string_view s) {
  Header h;
  size_t i = s.find(' ');
  h.tag = std::string(s.substr(0, i));
  while (i != std::string_view::npos && i < s.size()) {
    const size_t eq = s.find("=\"", i);
    if (eq == std::string_view::npos) break;
    const std::string key(s.substr(i + 1, eq - i - 1));
    const size_t end = s.find('"', eq + 2);
    h.attrs.emplace_back(key, unescape_attr(s.substr(eq + 2, end == std::string_view::npos ? end : end - eq - 2)));
    i = end == std::string_view::npos ? end : end + 1;
  }
  return h;
}

class Parser {
 public:
  Parser(const std::vector<XtmlPiece>& pieces, XtmlAssistantMessage& out) : p_(pieces), out_(out) {}

  void run(XtmlStart start) {
    if (start == XtmlStart::kThink) {
      out_.has_think = true;
      text_until_close("think", out_.think);
    } else if (start == XtmlStart::kResponse) {
      text_until_close("response", out_.response);
    }
    message_body();
  }

 private:
  bool at_end() const { return i_ >= p_.size(); }
  XtmlPieceKind kind() const { return p_[i_].kind; }

  // After <|open|> or <|close|>: the text up to <|sep|>. nullopt when the stream ends first or
  // another control token interrupts (that token is left for the caller).
  std::optional<std::string> read_until_sep() {
    std::string s;
    while (!at_end() && kind() == XtmlPieceKind::kText) s += p_[i_++].text;
    if (at_end()) return std::nullopt;
    if (kind() != XtmlPieceKind::kSep) {
      out_.warnings.push_back("tag '" + s + "' is not followed by <|sep|>");
      return std::nullopt;
    }
    ++i_;
    return s;
  }

  // At <|open|>: consumes `<|open|>HEADER<|sep|>` and returns the header, or nullopt when the
  // stream ends or another control token interrupts the header.
  std::optional<Header> open_element() {
    ++i_;
    const std::optional<std::string> h = read_until_sep();
    if (!h) return std::nullopt;
    return parse_header(*h);
  }

  // <|close|>TAG<|sep|> (the <|close|> already consumed); warns when TAG is not the expected one.
  void close_tag(const std::string& want) {
    const std::optional<std::string> tag = read_until_sep();
    if (tag && *tag != want) out_.warnings.push_back("<|close|>" + *tag + " closes <|open|>" + want);
  }

  // Text of an element up to its <|close|>. Returns true when the element was closed; an
  // <|open|>, <|end_of_msg|> or other special ends it unclosed (and is left for the caller).
  bool text_until_close(const std::string& tag, std::string& dest) {
    while (!at_end()) {
      switch (kind()) {
        case XtmlPieceKind::kText: dest += p_[i_++].text; break;
        case XtmlPieceKind::kClose:
          ++i_;
          close_tag(tag);
          return true;
        case XtmlPieceKind::kSep:
          out_.warnings.push_back("stray <|sep|> inside " + tag);
          ++i_;
          break;
        default: out_.warnings.push_back(tag + " is not closed"); return false;
      }
    }
    return false;
  }

  // An element we do not interpret: skip to its close (nested elements included).
  void skip_element(const std::string& tag) {
    out_.warnings.push_back("skipped unknown element '" + tag + "'");
    int depth = 1;
    while (!at_end() && depth > 0) {
      const XtmlPieceKind k = kind();
      ++i_;
      if (k == XtmlPieceKind::kOpen) ++depth;
      else if (k == XtmlPieceKind::kClose) {
        --depth;
        read_until_sep();
      } else if (k == XtmlPieceKind::kEndOfMsg) {
        --i_;
        return;
      }
    }
  }

  void message_body() {
    while (!at_end()) {
      switch (kind()) {
        case XtmlPieceKind::kOpen: {
          const std::optional<Header> h = open_element();
          if (!h) continue;
          const Header& header = *h;
          if (header.tag == "think") {
            out_.has_think = true;
            text_until_close("think", out_.think);
          } else if (header.tag == "response") {
            text_until_close("response", out_.response);
          } else if (header.tag == "tools") {
            tools();
          } else if (header.tag == "message") {
            // A message header (when the ids include the generation prompt): its body follows.
          } else {
            skip_element(header.tag);
          }
          break;
        }
        case XtmlPieceKind::kClose: {
          ++i_;
          const std::optional<std::string> tag = read_until_sep();
          if (tag && *tag == "message") out_.complete = true;
          else if (tag) out_.warnings.push_back("stray <|close|>" + *tag);
          break;
        }
        case XtmlPieceKind::kEndOfMsg:
          out_.complete = true;
          ++i_;
          return;
        case XtmlPieceKind::kOtherSpecial:
          out_.warnings.push_back("generation ended with special token " + p_[i_].text);
          ++i_;
          return;
        case XtmlPieceKind::kText:
          if (p_[i_].text.find_first_not_of(" \t\r\n") != std::string::npos)
            out_.warnings.push_back("text outside any channel: '" + p_[i_].text.substr(0, 40) + "'");
          ++i_;
          break;
        case XtmlPieceKind::kSep:
          out_.warnings.push_back("stray <|sep|>");
          ++i_;
          break;
      }
    }
  }

  void tools() {
    while (!at_end()) {
      switch (kind()) {
        case XtmlPieceKind::kOpen: {
          const std::optional<Header> h = open_element();
          if (!h) continue;
          if (h->tag == "call") call(*h);
          else skip_element(h->tag);
          break;
        }
        case XtmlPieceKind::kClose:
          ++i_;
          close_tag("tools");
          return;
        case XtmlPieceKind::kText:
          ++i_;  // whitespace between calls, or junk: neither is a call
          break;
        default: return;  // <|end_of_msg|> or another special: the message body decides
      }
    }
  }

  void call(const Header& header) {
    XtmlToolCall c;
    c.name = header.attr("tool");
    const std::string idx = header.attr("index");
    try {
      c.index = idx.empty() ? int64_t(out_.tool_calls.size() + 1) : std::stoll(idx);
    } catch (...) {
      out_.warnings.push_back("tool call index '" + idx + "' is not a number");
      c.index = int64_t(out_.tool_calls.size() + 1);
    }
    while (!at_end()) {
      const XtmlPieceKind k = kind();
      if (k == XtmlPieceKind::kOpen) {
        const std::optional<Header> h = open_element();
        if (!h) continue;
        const Header& arg = *h;
        if (arg.tag == "argument") {
          std::string value;
          const bool closed = text_until_close("argument", value);
          c.arguments[arg.attr("key")] = typed_value(value, arg.attr("type"), closed);
        } else if (arg.tag == "json") {
          std::string raw;
          text_until_close("json", raw);
          // Not JSON, not an object, or nested past kMaxJsonDepth: kept as text.
          std::optional<ojson> parsed = try_parse_json<ojson>(raw);
          if (parsed && parsed->is_object()) c.arguments = std::move(*parsed);
          else c.raw_arguments = raw;
        } else {
          skip_element(arg.tag);
        }
      } else if (k == XtmlPieceKind::kClose) {
        ++i_;
        close_tag("call");
        c.complete = true;
        break;
      } else if (k == XtmlPieceKind::kText) {
        ++i_;
      } else {
        break;
      }
    }
    out_.tool_calls.push_back(std::move(c));
  }

  // A rendered argument back to its JSON value: strings are verbatim, other types are JSON text.
  ojson typed_value(const std::string& value, const std::string& type, bool closed) {
    if (type == "string" || type.empty()) return value;
    // One level less than the bound: the value sits inside the call's arguments object.
    if (std::optional<ojson> v = try_parse_json<ojson>(value, kMaxJsonDepth - 1)) return std::move(*v);
    if (closed)
      out_.warnings.push_back("argument of type " + type + " is not valid JSON (or nests deeper than " +
                              std::to_string(kMaxJsonDepth - 1) + " levels); kept as a string");
    return value;
  }

  const std::vector<XtmlPiece>& p_;
  XtmlAssistantMessage& out_;
  size_t i_ = 0;
};

}  // namespace

XtmlAssistantMessage parse_assistant(const std::vector<XtmlPiece>& pieces, XtmlStart start) {
  XtmlAssistantMessage out;
  Parser(pieces, out).run(start);
  return out;
}

namespace {

// A copy whose strings (keys too) are valid UTF-8, for JSON output.
ojson valid_utf8(const ojson& v, int depth = 0) {
  check_json_walk_depth(depth, "tool-call arguments");
  if (v.is_string()) return to_valid_utf8(v.get_ref<const std::string&>());
  if (v.is_array()) {
    ojson out = ojson::array();
    for (const auto& e : v) out.push_back(valid_utf8(e, depth + 1));
    return out;
  }
  if (v.is_object()) {
    ojson out = ojson::object();
    for (const auto& [k, e] : v.items()) out[to_valid_utf8(k)] = valid_utf8(e, depth + 1);
    return out;
  }
  return v;
}

}  // namespace

ojson XtmlAssistantMessage::to_openai() const {
  ojson m = {{"role", "assistant"}, {"content", to_valid_utf8(response)}};
  if (has_think) m["reasoning_content"] = to_valid_utf8(think);
  if (!tool_calls.empty()) {
    ojson calls = ojson::array();
    for (const XtmlToolCall& c : tool_calls)
      calls.push_back({{"id", "call_" + std::to_string(c.index)},
                       {"type", "function"},
                       {"function",
                        {{"name", to_valid_utf8(c.name)},
                         {"arguments", c.raw_arguments ? to_valid_utf8(*c.raw_arguments)
                                                       : python_json_dumps(valid_utf8(c.arguments), false)}}}});
    m["tool_calls"] = calls;
  }
  return m;
}

}  // namespace k3
