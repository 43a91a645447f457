#include "serve/json_matcher.h"

#include <algorithm>
#include <cctype>

namespace k3::serve {

using Kind = SchemaNode::Kind;

namespace {

// Nodes every schema has: 0 any value, then what "any" dispatches to by first byte.
constexpr int kAnyNode = 0, kAnyObject = 1, kAnyArray = 2, kAnyString = 3, kAnyNumber = 4, kAnyWord = 5;

bool is_ws(uint8_t c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
bool is_digit(uint8_t c) { return c >= '0' && c <= '9'; }

// Object and array phases.
enum : uint8_t { kOpen, kAfterKey, kAfterColon, kAfterValue, kAfterComma, kInValue };
// String phases.
enum : uint8_t { kChars, kEscape, kHex, kUtf8 };
// Number phases; kZero, kInt, kFrac and kExp may end the number.
enum : uint8_t { kStart, kSign, kZero, kInt, kDot, kFrac, kE, kESign, kExp };

std::string dumped(const nlohmann::json& v) { return v.dump(); }

}  // namespace

// ---- schema --------------------------------------------------------------------------------------------

int JsonSchema::add(SchemaNode n) {
  nodes_.push_back(std::move(n));
  return int(nodes_.size()) - 1;
}

JsonSchema JsonSchema::any_object() {
  JsonSchema s = compile(nlohmann::json::object());
  s.root_ = kAnyObject;
  return s;
}

JsonSchema JsonSchema::compile(const nlohmann::json& schema) {
  JsonSchema s;
  s.add(SchemaNode{});  // kAnyNode
  SchemaNode obj;
  obj.kind = Kind::kObject;
  obj.additional = kAnyNode;
  s.add(obj);  // kAnyObject
  SchemaNode arr;
  arr.kind = Kind::kArray;
  arr.items = kAnyNode;
  s.add(arr);  // kAnyArray
  SchemaNode str;
  str.kind = Kind::kString;
  s.add(str);  // kAnyString
  SchemaNode num;
  num.kind = Kind::kNumber;
  s.add(num);  // kAnyNumber
  SchemaNode words;
  words.kind = Kind::kLiterals;
  words.literals = {"true", "false", "null"};
  s.add(words);  // kAnyWord
  s.root_ = s.compile_node(schema, "");
  return s;
}

namespace {

// The bytes a value of `node` can start with.
void first_bytes(const JsonSchema& s, int node, bool (&out)[256]) {
  const SchemaNode& n = s.node(node);
  switch (n.kind) {
    case Kind::kAny:
      for (int c : {'{', '[', '"', '-', 't', 'f', 'n'}) out[c] = true;
      for (int c = '0'; c <= '9'; ++c) out[c] = true;
      break;
    case Kind::kObject: out[int('{')] = true; break;
    case Kind::kArray: out[int('[')] = true; break;
    case Kind::kString: out[int('"')] = true; break;
    case Kind::kNumber:
    case Kind::kInteger:
      out[int('-')] = true;
      for (int c = '0'; c <= '9'; ++c) out[c] = true;
      break;
    case Kind::kLiterals:
      for (const std::string& l : n.literals) out[uint8_t(l[0])] = true;
      break;
    case Kind::kUnion:
      for (int a : n.alternatives) first_bytes(s, a, out);
      break;
  }
}

bool starts_with(const JsonSchema& s, int node, uint8_t c) {
  bool f[256] = {};
  first_bytes(s, node, f);
  return f[c];
}

const char* const kAnnotations[] = {"title", "description", "default", "examples", "$schema", "$id", "$comment"};

int64_t count_field(const nlohmann::json& s, const char* key, const std::string& path) {
  const nlohmann::json& v = s[key];
  if (!v.is_number_integer() || v.get<int64_t>() < 0)
    throw SchemaError(path + "/" + key + ": must be a non-negative integer");
  return v.get<int64_t>();
}

}  // namespace

int JsonSchema::compile_node(const nlohmann::json& s, const std::string& path) {
  const std::string where = path.empty() ? "the schema" : path;
  if (s.is_boolean()) {
    if (s.get<bool>()) return kAnyNode;
    throw SchemaError(where + ": the schema false accepts nothing");
  }
  if (!s.is_object()) throw SchemaError(where + ": a schema must be an object or a boolean");
  static const char* const kKnown[] = {"type",  "properties", "required",  "additionalProperties",
                                       "items", "minItems",   "maxItems",  "enum",
                                       "const", "minLength",  "maxLength", "anyOf"};
  for (const auto& [key, value] : s.items()) {
    bool ok = false;
    for (const char* k : kKnown) ok = ok || key == k;
    for (const char* k : kAnnotations) ok = ok || key == k;
    if (!ok) throw SchemaError(path + "/" + key + ": the keyword is not supported by constrained decoding");
  }
  if (s.contains("enum") || s.contains("const")) {
    SchemaNode n;
    n.kind = Kind::kLiterals;
    if (s.contains("const")) n.literals.push_back(dumped(s["const"]));
    if (s.contains("enum")) {
      if (!s["enum"].is_array() || s["enum"].empty()) throw SchemaError(path + "/enum: must be a non-empty array");
      for (const nlohmann::json& v : s["enum"]) n.literals.push_back(dumped(v));
    }
    return add(std::move(n));
  }
  if (s.contains("anyOf")) {
    for (const auto& [key, value] : s.items()) {
      bool annotation = key == "anyOf";
      for (const char* k : kAnnotations) annotation = annotation || key == k;
      if (!annotation)
        throw SchemaError(path + "/" + key + ": keywords beside anyOf are not supported by constrained decoding");
    }
    const nlohmann::json& alts = s["anyOf"];
    if (!alts.is_array() || alts.empty()) throw SchemaError(path + "/anyOf: must be a non-empty array");
    SchemaNode u;
    u.kind = Kind::kUnion;
    for (size_t i = 0; i < alts.size(); ++i)
      u.alternatives.push_back(compile_node(alts[i], path + "/anyOf/" + std::to_string(i)));
    bool seen[256] = {};
    for (int a : u.alternatives) {
      bool f[256] = {};
      first_bytes(*this, a, f);
      for (int c = 0; c < 256; ++c) {
        if (f[c] && seen[c])
          throw SchemaError(path + "/anyOf: alternatives that can start with the same character ('" +
                            std::string(1, char(c)) + "') are not supported by constrained decoding");
        seen[c] = seen[c] || f[c];
      }
    }
    return add(std::move(u));
  }

  std::vector<std::string> types;
  if (s.contains("type")) {
    const nlohmann::json& t = s["type"];
    if (t.is_string()) types.push_back(t.get<std::string>());
    else if (t.is_array() && !t.empty()) {
      for (const nlohmann::json& x : t) {
        if (!x.is_string()) throw SchemaError(path + "/type: must be a type name or an array of them");
        types.push_back(x.get<std::string>());
      }
    } else {
      throw SchemaError(path + "/type: must be a type name or an array of them");
    }
  } else if (s.contains("properties") || s.contains("required") || s.contains("additionalProperties")) {
    types.push_back("object");
  } else if (s.contains("items") || s.contains("minItems") || s.contains("maxItems")) {
    types.push_back("array");
  } else if (s.contains("minLength") || s.contains("maxLength")) {
    types.push_back("string");
  } else {
    return kAnyNode;
  }

  std::vector<int> nodes;
  bool have_number = false;
  for (const std::string& t : types) {
    SchemaNode n;
    if (t == "object") {
      n.kind = Kind::kObject;
      n.additional = kAnyNode;
      if (s.contains("additionalProperties")) {
        const nlohmann::json& a = s["additionalProperties"];
        n.additional = a.is_boolean() && !a.get<bool>() ? -1 : compile_node(a, path + "/additionalProperties");
      }
      if (s.contains("properties")) {
        if (!s["properties"].is_object()) throw SchemaError(path + "/properties: must be an object");
        for (const auto& [name, sub] : s["properties"].items()) {
          n.names.push_back(dumped(name));
          n.props.push_back(compile_node(sub, path + "/properties/" + name));
        }
      }
      if (s.contains("required")) {
        if (!s["required"].is_array()) throw SchemaError(path + "/required: must be an array of names");
        for (const nlohmann::json& r : s["required"]) {
          if (!r.is_string()) throw SchemaError(path + "/required: must be an array of names");
          const std::string d = dumped(r);
          size_t i = 0;
          while (i < n.names.size() && n.names[i] != d) ++i;
          if (i == n.names.size()) {
            if (n.additional < 0)
              throw SchemaError(path + "/required: '" + r.get<std::string>() +
                                "' is neither a property nor allowed as an additional one");
            n.names.push_back(d);
            n.props.push_back(n.additional);
          }
          if (i >= 64) throw SchemaError(path + "/properties: more than 64 properties");
          n.required |= uint64_t(1) << i;
        }
      }
      if (n.names.size() > 64) throw SchemaError(path + "/properties: more than 64 properties");
    } else if (t == "array") {
      n.kind = Kind::kArray;
      n.items = s.contains("items") ? compile_node(s["items"], path + "/items") : kAnyNode;
      if (s.contains("minItems")) n.min_items = count_field(s, "minItems", path);
      if (s.contains("maxItems")) n.max_items = count_field(s, "maxItems", path);
      if (n.max_items >= 0 && n.max_items < n.min_items) throw SchemaError(path + ": maxItems < minItems");
    } else if (t == "string") {
      n.kind = Kind::kString;
      if (s.contains("minLength")) n.min_length = count_field(s, "minLength", path);
      if (s.contains("maxLength")) n.max_length = count_field(s, "maxLength", path);
      if (n.max_length >= 0 && n.max_length < n.min_length) throw SchemaError(path + ": maxLength < minLength");
    } else if (t == "number" || t == "integer") {
      if (have_number) continue;  // integer and number together: number
      have_number = true;
      const bool number = std::find(types.begin(), types.end(), "number") != types.end();
      n.kind = number ? Kind::kNumber : Kind::kInteger;
    } else if (t == "boolean") {
      n.kind = Kind::kLiterals;
      n.literals = {"true", "false"};
    } else if (t == "null") {
      n.kind = Kind::kLiterals;
      n.literals = {"null"};
    } else {
      throw SchemaError(path + "/type: unknown type '" + t + "'");
    }
    nodes.push_back(add(std::move(n)));
  }
  if (nodes.size() == 1) return nodes[0];
  SchemaNode u;
  u.kind = Kind::kUnion;
  u.alternatives = nodes;  // distinct types start differently
  return add(std::move(u));
}

// ---- matcher -------------------------------------------------------------------------------------------

JsonMatcher::JsonMatcher(const JsonSchema& schema) : schema_(&schema) { stack_.emplace_back(F::kValue, schema.root()); }

bool JsonMatcher::take_whitespace(uint8_t) {
  if (ws_ >= kMaxWhitespace) return false;
  ++ws_;
  return true;
}

bool JsonMatcher::feed(uint8_t c) {
  for (;;) {
    if (stack_.empty()) return is_ws(c) && take_whitespace(c);  // after the document: whitespace only
    Frame& f = stack_.back();
    bool ended = false;
    switch (f.kind) {
      case F::kValue: {
        if (is_ws(c)) return take_whitespace(c);
        const int node = f.node;
        stack_.pop_back();
        return start_value(node, c);
      }
      case F::kObject: return feed_object(f, c);
      case F::kArray: return feed_array(f, c);
      case F::kString:
      case F::kKey: return feed_string(f, c);
      case F::kNumber:
        if (!feed_number(f, c, &ended)) return false;
        break;
      case F::kLiterals:
        if (!feed_literals(f, c, &ended)) return false;
        break;
    }
    if (!ended) return true;
    // A number or literal ended before c: c belongs to what encloses it.
  }
}

bool JsonMatcher::start_value(int node, uint8_t c) {
  ws_ = 0;
  const SchemaNode& n = schema_->node(node);
  Frame f(F::kValue, node);
  bool ended = false;
  switch (n.kind) {
    case Kind::kAny:
      return start_value(c == '{'                  ? kAnyObject
                         : c == '['                ? kAnyArray
                         : c == '"'                ? kAnyString
                         : c == '-' || is_digit(c) ? kAnyNumber
                                                   : kAnyWord,
                         c);
    case Kind::kUnion:
      for (int a : n.alternatives)
        if (starts_with(*schema_, a, c)) return start_value(a, c);
      return false;
    case Kind::kObject:
      if (c != '{') return false;
      f.kind = F::kObject;
      stack_.push_back(std::move(f));
      return true;
    case Kind::kArray:
      if (c != '[') return false;
      f.kind = F::kArray;
      stack_.push_back(std::move(f));
      return true;
    case Kind::kString:
      if (c != '"') return false;
      f.kind = F::kString;
      stack_.push_back(std::move(f));
      return true;
    case Kind::kNumber:
    case Kind::kInteger:
      f.kind = F::kNumber;
      f.phase = kStart;
      stack_.push_back(std::move(f));
      return feed_number(stack_.back(), c, &ended) && !ended;
    case Kind::kLiterals:
      f.kind = F::kLiterals;
      stack_.push_back(std::move(f));
      return feed_literals(stack_.back(), c, &ended) && !ended;
  }
  return false;
}

bool JsonMatcher::value_done() {
  ws_ = 0;
  if (stack_.empty()) return true;
  Frame& p = stack_.back();
  if (p.kind == F::kObject) p.phase = kAfterValue;
  if (p.kind == F::kArray) p.phase = kAfterValue, ++p.count;
  return true;
}

bool JsonMatcher::feed_object(Frame& f, uint8_t c) {
  const SchemaNode& n = schema_->node(f.node);
  const uint64_t all = n.names.size() >= 64 ? ~uint64_t(0) : (uint64_t(1) << n.names.size()) - 1;
  switch (f.phase) {
    case kOpen:
    case kAfterComma: {
      if (is_ws(c)) return take_whitespace(c);
      ws_ = 0;
      if (c == '}' && f.phase == kOpen) {
        if ((f.seen & n.required) != n.required) return false;
        stack_.pop_back();
        return value_done();
      }
      if (c != '"') return false;
      Frame k(F::kKey, f.node);
      k.buf = "\"";
      if (n.additional < 0) {  // the key is one of the properties not given yet
        for (size_t i = 0; i < n.names.size(); ++i)
          if (!((f.seen >> i) & 1)) k.keys.push_back(n.names[i]);
        if (k.keys.empty()) return false;
      }
      stack_.push_back(std::move(k));
      return true;
    }
    case kAfterKey: {
      if (is_ws(c)) return take_whitespace(c);
      ws_ = 0;
      if (c != ':') return false;
      f.phase = kAfterColon;
      stack_.emplace_back(F::kValue, f.cur >= 0 ? n.props[size_t(f.cur)] : n.additional);
      return true;
    }
    case kAfterValue:
      if (is_ws(c)) return take_whitespace(c);
      ws_ = 0;
      if (c == ',') {
        if (n.additional < 0 && (f.seen & all) == all) return false;  // no key left to give
        f.phase = kAfterComma;
        return true;
      }
      if (c == '}') {
        if ((f.seen & n.required) != n.required) return false;
        stack_.pop_back();
        return value_done();
      }
      return false;
    default: return false;
  }
}

bool JsonMatcher::feed_array(Frame& f, uint8_t c) {
  const SchemaNode& n = schema_->node(f.node);
  switch (f.phase) {
    case kOpen:
    case kAfterComma: {
      if (is_ws(c)) return take_whitespace(c);
      if (c == ']' && f.phase == kOpen) {
        if (n.min_items > 0) return false;
        stack_.pop_back();
        return value_done();
      }
      if (n.max_items >= 0 && f.count >= n.max_items) return false;
      f.phase = kInValue;
      const int items = n.items;
      return start_value(items, c);  // f is not used after this: start_value pushes
    }
    case kAfterValue:
      if (is_ws(c)) return take_whitespace(c);
      ws_ = 0;
      if (c == ',') {
        if (n.max_items >= 0 && f.count >= n.max_items) return false;
        f.phase = kAfterComma;
        return true;
      }
      if (c == ']') {
        if (f.count < n.min_items) return false;
        stack_.pop_back();
        return value_done();
      }
      return false;
    default: return false;
  }
}

bool JsonMatcher::key_done(Frame& key) {
  const std::string name = std::move(key.buf);
  stack_.pop_back();
  Frame& obj = stack_.back();
  const SchemaNode& n = schema_->node(obj.node);
  obj.cur = -1;
  for (size_t i = 0; i < n.names.size(); ++i) {
    if (n.names[i] != name) continue;
    if ((obj.seen >> i) & 1) return false;  // given twice
    obj.cur = int(i);
    obj.seen |= uint64_t(1) << i;
    break;
  }
  if (obj.cur < 0 && n.additional < 0) return false;
  obj.phase = kAfterKey;
  return true;
}

bool JsonMatcher::feed_string(Frame& f, uint8_t c) {
  const bool key = f.kind == F::kKey;
  if (key && !f.keys.empty()) {  // fixed names: the bytes must stay a prefix of one of them
    f.buf.push_back(char(c));
    bool any = false, whole = false;
    for (const std::string& k : f.keys) {
      if (k.size() < f.buf.size() || k.compare(0, f.buf.size(), f.buf) != 0) continue;
      any = true;
      whole = whole || k.size() == f.buf.size();
    }
    if (!any) return false;
    return whole ? key_done(f) : true;  // a dumped name ends at its only unescaped quote
  }
  if (key) f.buf.push_back(char(c));
  const SchemaNode& n = schema_->node(f.node);
  const int64_t min_len = key ? 0 : n.min_length, max_len = key ? -1 : n.max_length;
  switch (f.phase) {
    case kChars:
      if (c == '"') {
        if (f.count < min_len) return false;
        if (key) return key_done(f);
        stack_.pop_back();
        return value_done();
      }
      if (max_len >= 0 && f.count >= max_len) return false;
      if (c == '\\') {
        f.phase = kEscape;
        return true;
      }
      if (c < 0x20) return false;
      if (c < 0x80) {
        ++f.count;
        return true;
      }
      if (c >= 0xC2 && c <= 0xDF) f.pending = 1;
      else if (c >= 0xE0 && c <= 0xEF) f.pending = 2;
      else if (c >= 0xF0 && c <= 0xF4) f.pending = 3;
      else return false;
      ++f.count;
      f.phase = kUtf8;
      return true;
    case kEscape:
      if (c == 'u') {
        f.phase = kHex;
        f.pending = 4;
        return true;
      }
      if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' || c == 't') {
        ++f.count;
        f.phase = kChars;
        return true;
      }
      return false;
    case kHex:
      if (!std::isxdigit(c)) return false;
      if (--f.pending == 0) ++f.count, f.phase = kChars;
      return true;
    case kUtf8:
      if ((c & 0xC0) != 0x80) return false;
      if (--f.pending == 0) f.phase = kChars;
      return true;
    default: return false;
  }
}

bool JsonMatcher::number_complete(const Frame& f) const {
  return f.phase == kZero || f.phase == kInt || f.phase == kFrac || f.phase == kExp;
}

bool JsonMatcher::feed_number(Frame& f, uint8_t c, bool* ended) {
  const bool integer = schema_->node(f.node).kind == Kind::kInteger;
  auto digit_in = [&](uint8_t next_phase, int limit) {
    if (f.phase != next_phase) f.count = 0;
    if (f.count >= limit) return false;
    ++f.count;
    f.phase = next_phase;
    return true;
  };
  switch (f.phase) {
    case kStart:
      if (c == '-') return f.phase = kSign, true;
      [[fallthrough]];
    case kSign:
      if (c == '0') return f.phase = kZero, true;
      if (c >= '1' && c <= '9') return digit_in(kInt, kMaxDigits);
      return false;
    case kInt:
      if (is_digit(c)) return digit_in(kInt, kMaxDigits);
      [[fallthrough]];
    case kZero:
      if (!integer && c == '.') return f.phase = kDot, true;
      if (!integer && (c == 'e' || c == 'E')) return f.phase = kE, true;
      break;
    case kDot: return is_digit(c) && digit_in(kFrac, kMaxDigits);
    case kFrac:
      if (is_digit(c)) return digit_in(kFrac, kMaxDigits);
      if (c == 'e' || c == 'E') return f.phase = kE, true;
      break;
    case kE:
      if (c == '+' || c == '-') return f.phase = kESign, true;
      [[fallthrough]];
    case kESign: return is_digit(c) && digit_in(kExp, 3);
    case kExp:
      if (is_digit(c)) return digit_in(kExp, 3);
      break;
    default: return false;
  }
  // c does not continue the number: it ends here if it can, and c goes to what encloses it.
  if (!number_complete(f)) return false;
  stack_.pop_back();
  value_done();
  *ended = true;
  return true;
}

bool JsonMatcher::literal_complete(const Frame& f) const {
  for (const std::string& l : schema_->node(f.node).literals)
    if (l == f.buf) return true;
  return false;
}

bool JsonMatcher::feed_literals(Frame& f, uint8_t c, bool* ended) {
  f.buf.push_back(char(c));
  for (const std::string& l : schema_->node(f.node).literals)
    if (l.size() >= f.buf.size() && l.compare(0, f.buf.size(), f.buf) == 0) return true;
  f.buf.pop_back();
  if (!literal_complete(f)) return false;
  stack_.pop_back();
  value_done();
  *ended = true;
  return true;
}

bool JsonMatcher::complete() const {
  if (stack_.empty()) return true;
  if (stack_.size() != 1) return false;
  const Frame& f = stack_.back();
  return (f.kind == F::kNumber && number_complete(f)) || (f.kind == F::kLiterals && literal_complete(f));
}

bool JsonMatcher::ascii_transparent() const {
  if (stack_.empty()) return false;
  const Frame& f = stack_.back();
  if (f.kind != F::kString || f.phase != kChars) return false;
  const SchemaNode& n = schema_->node(f.node);
  return n.max_length < 0 && f.count >= n.min_length;
}

}  // namespace k3::serve
