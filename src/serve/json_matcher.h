// Constrained decoding's JSON half: a JSON Schema (the subset below) compiled into a byte-level
// pushdown automaton that says, byte by byte, whether the text so far can still become a document
// the schema accepts. serve/turn_constraint.h turns this into a token mask.
//
// Supported (anything else that constrains is refused at compile, naming the keyword, so a client
// never believes a constraint holds that is not enforced):
//   type (a name or an array of names), properties, required, additionalProperties (false, true or a
//   schema), items, minItems, maxItems, enum, const, minLength, maxLength, anyOf whose alternatives
//   start differently (an object and a string, say: the first byte picks the branch). Annotations
//   (title, description, default, examples, $schema, $id, $comment) are ignored.
// The text is compact-ish JSON: at most kMaxWhitespace whitespace bytes between tokens; strings are
// valid UTF-8 (lead and continuation bytes; overlong forms are not checked) with JSON's escapes; a
// number has at most kMaxDigits digits before and after its point and 3 in its exponent; an object
// key is a property's name written as nlohmann's dump writes it (the same bytes, no other escaping),
// unless additional properties are allowed. These bounds keep every schema's language finite where
// its strings are bounded, so a model cannot wander forever inside structure.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace k3::serve {

// A schema the compiler refuses: what and where (a JSON pointer into the schema).
struct SchemaError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

struct SchemaNode {
  enum class Kind : uint8_t { kAny, kObject, kArray, kString, kNumber, kInteger, kLiterals, kUnion };
  Kind kind = Kind::kAny;
  // kObject: properties (name as dumped JSON, quotes included) and their nodes; which are required;
  // the node of other keys, or -1 when additionalProperties is false.
  std::vector<std::string> names;
  std::vector<int> props;
  uint64_t required = 0;
  int additional = -1;
  // kArray
  int items = 0;
  int64_t min_items = 0, max_items = -1;
  // kString: characters (code points; an escape is one)
  int64_t min_length = 0, max_length = -1;
  // kLiterals: each allowed value as dumped compact JSON (enum, const, true/false, null)
  std::vector<std::string> literals;
  // kUnion: alternatives whose first bytes differ
  std::vector<int> alternatives;
};

class JsonSchema {
 public:
  // Throws SchemaError. Node 0 is "any value".
  static JsonSchema compile(const nlohmann::json& schema);
  static JsonSchema any_object();  // response_format json_object
  const SchemaNode& node(int i) const { return nodes_[size_t(i)]; }
  int root() const { return root_; }

 private:
  int add(SchemaNode n);
  int compile_node(const nlohmann::json& s, const std::string& path);
  std::vector<SchemaNode> nodes_;
  int root_ = 0;
};

class JsonMatcher {
 public:
  static constexpr int kMaxWhitespace = 16;
  static constexpr int kMaxDigits = 20;

  explicit JsonMatcher(const JsonSchema& schema);
  // Consumes b if the text stays a prefix of an accepted document; false (and the matcher in an
  // unspecified state: callers copy it first) otherwise.
  bool feed(uint8_t b);
  // Whether the text so far is a whole accepted document (trailing whitespace allowed).
  bool complete() const;
  // Whether any printable ASCII byte other than '"' and '\\' would be accepted and change nothing a
  // later byte depends on (inside a string with no length bound left to count): the token mask then
  // walks on without copying the matcher.
  bool ascii_transparent() const;

 private:
  enum class F : uint8_t { kValue, kObject, kArray, kString, kKey, kNumber, kLiterals };
  struct Frame {
    explicit Frame(F k, int n = 0) : kind(k), node(n) {}
    F kind;
    uint8_t phase = 0;
    int node;
    int cur = -1;                   // kObject: the property being read (-1: an additional one)
    uint64_t seen = 0;              // kObject: properties given
    int64_t count = 0;              // kArray: items; kString/kKey: characters; kNumber: digits in this part
    int pending = 0;                // kString/kKey: UTF-8 continuation bytes or \u hex digits still due
    std::string buf;                // kLiterals, kKey: the bytes so far (a key: its dumped form, quotes included)
    std::vector<std::string> keys;  // kKey with fixed names: the candidates
  };
  bool start_value(int node, uint8_t c);
  bool value_done();
  bool take_whitespace(uint8_t c);
  bool feed_object(Frame& f, uint8_t c);
  bool feed_array(Frame& f, uint8_t c);
  bool feed_string(Frame& f, uint8_t c);
  bool feed_number(Frame& f, uint8_t c, bool* ended);
  bool feed_literals(Frame& f, uint8_t c, bool* ended);
  bool key_done(Frame& key);
  bool number_complete(const Frame& f) const;
  bool literal_complete(const Frame& f) const;

  const JsonSchema* schema_;
  std::vector<Frame> stack_;
  int ws_ = 0;  // whitespace bytes since the last token
};

}  // namespace k3::serve
