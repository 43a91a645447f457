#include "serve/turn_constraint.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "tokenizer/special_tokens.h"

namespace k3::serve {

TokenTrie::TokenTrie(const Tokenizer& tok) {
  const int64_t n = tok.num_ranks();
  bytes_.resize(size_t(n));
  same_.assign(size_t(n), -1);
  nodes_.emplace_back();  // the root
  for (int64_t id = 0; id < n; ++id) {
    std::string b = tok.decode({int32_t(id)});
    int32_t at = 0;
    for (unsigned char c : b) {
      int32_t child = nodes_[size_t(at)].first_child;
      while (child >= 0 && nodes_[size_t(child)].byte != c) child = nodes_[size_t(child)].next_sibling;
      if (child < 0) {
        Node node;
        node.byte = c;
        node.next_sibling = nodes_[size_t(at)].first_child;
        child = int32_t(nodes_.size());
        nodes_.push_back(node);
        nodes_[size_t(at)].first_child = child;
      }
      at = child;
    }
    if (at == 0) continue;  // no bytes: never sampled under a constraint
    same_[size_t(id)] = nodes_[size_t(at)].token;
    nodes_[size_t(at)].token = int32_t(id);
    bytes_[size_t(id)] = std::move(b);
  }
  // Renumber the nodes in depth-first order, the order masks walk them in: a walk then reads the
  // array front to back instead of chasing links across it.
  std::vector<int32_t> order, todo = {0};
  order.reserve(nodes_.size());
  while (!todo.empty()) {
    const int32_t n = todo.back();
    todo.pop_back();
    order.push_back(n);
    std::vector<int32_t> kids;
    for (int32_t c = nodes_[size_t(n)].first_child; c >= 0; c = nodes_[size_t(c)].next_sibling) kids.push_back(c);
    todo.insert(todo.end(), kids.rbegin(), kids.rend());  // the first child is visited first
  }
  std::vector<int32_t> where(nodes_.size());
  for (size_t i = 0; i < order.size(); ++i) where[size_t(order[i])] = int32_t(i);
  std::vector<Node> sorted(nodes_.size());
  for (size_t i = 0; i < order.size(); ++i) {
    Node n = nodes_[size_t(order[i])];
    if (n.first_child >= 0) n.first_child = where[size_t(n.first_child)];
    if (n.next_sibling >= 0) n.next_sibling = where[size_t(n.next_sibling)];
    sorted[i] = n;
  }
  nodes_ = std::move(sorted);
}

TurnConstraint::TurnConstraint(const Tokenizer& tok, const TokenTrie& trie, TurnSpec spec)
    : trie_(&trie), spec_(std::move(spec)) {
  const int32_t open = tok.special_id(K3Special::kOpen), close = tok.special_id(K3Special::kClose),
                sep = tok.special_id(K3Special::kSep), eom = tok.special_id(K3Special::kEndOfMsg);
  structural_ = {open, close, sep, eom};
  using K = Step::Kind;
  auto special = [&](int32_t id) { steps_.push_back(Step{K::kSpecial, "", id}); };
  auto literal = [&](const char* t) { steps_.push_back(Step{K::kLiteral, t, 0}); };
  if (spec_.thinking) {
    steps_.push_back(Step{K::kFree, "", 0});
    special(close), literal("think"), special(sep), special(open), literal("response"), special(sep);
  }
  if (spec_.forced.empty()) {
    steps_.push_back(Step{spec_.schema ? K::kJson : K::kFree, "", 0});
    special(close), literal("response"), special(sep);
  } else {
    special(close), literal("response"), special(sep);  // an empty response
    special(open), literal("tools"), special(sep);
    special(open), literal("call tool=\"");
    steps_.push_back(Step{K::kChoice, "", 0});
    special(sep);
    special(open), literal("json type=\"object\""), special(sep);
    steps_.push_back(Step{K::kJson, "", 0});
    special(close), literal("json"), special(sep), special(close), literal("call"), special(sep);
    special(close), literal("tools"), special(sep);
  }
  special(close), literal("message"), special(sep), special(eom);
  enter(state_, 0);
}

void TurnConstraint::enter(State& s, size_t step) const {
  s.step = step, s.pos = 0;
  s.typed.clear();
  if (step < steps_.size() && steps_[step].kind == Step::Kind::kJson)
    s.json.emplace(s.choice >= 0 ? *spec_.forced[size_t(s.choice)].parameters : *spec_.schema);
  else s.json.reset();
}

bool TurnConstraint::feed_byte(State& s, uint8_t c) const {
  if (s.step >= steps_.size()) return false;
  const Step& st = steps_[s.step];
  switch (st.kind) {
    case Step::Kind::kFree: return true;
    case Step::Kind::kLiteral:
      if (uint8_t(st.text[s.pos]) != c) return false;
      if (++s.pos == st.text.size()) enter(s, s.step + 1);
      return true;
    case Step::Kind::kSpecial: return false;
    case Step::Kind::kJson: return s.json->feed(c);
    case Step::Kind::kChoice: {
      s.typed.push_back(char(c));
      bool any = false;
      for (size_t i = 0; i < spec_.forced.size(); ++i) {
        const std::string t = choice_text(spec_.forced[i]);
        if (t.size() < s.typed.size() || t.compare(0, s.typed.size(), s.typed) != 0) continue;
        any = true;
        if (t.size() == s.typed.size()) {  // ends with a quote, which no name holds: one match
          s.choice = int(i);
          enter(s, s.step + 1);
          break;
        }
      }
      return any;
    }
  }
  return false;
}

bool TurnConstraint::feed_special(State& s, int32_t id) const {
  if (s.step >= steps_.size()) return false;
  const Step& st = steps_[s.step];
  switch (st.kind) {
    case Step::Kind::kSpecial:
      if (id != st.special) return false;
      enter(s, s.step + 1);
      return true;
    case Step::Kind::kJson:
      if (!s.json->complete()) return false;
      [[fallthrough]];
    case Step::Kind::kFree:  // a free or JSON step ends where the special that follows it comes
      if (s.step + 1 >= steps_.size() || steps_[s.step + 1].kind != Step::Kind::kSpecial ||
          steps_[s.step + 1].special != id)
        return false;
      enter(s, s.step + 2);
      return true;
    case Step::Kind::kLiteral:
    case Step::Kind::kChoice: return false;
  }
  return false;
}

void TurnConstraint::mark(int32_t node, std::vector<char>& allowed) const {
  for (int32_t id = trie_->nodes()[size_t(node)].token; id >= 0; id = trie_->next_same(id))
    if (size_t(id) < allowed.size()) allowed[size_t(id)] = 1;
}

void TurnConstraint::walk(int32_t node, const State& s, std::vector<char>& allowed) const {
  if (s.step < steps_.size() && steps_[s.step].kind == Step::Kind::kJson && s.json->ascii_transparent())
    return walk_string(node, 0, s, allowed);
  const std::vector<TokenTrie::Node>& nodes = trie_->nodes();
  for (int32_t child = nodes[size_t(node)].first_child; child >= 0; child = nodes[size_t(child)].next_sibling) {
    State next = s;
    if (!feed_byte(next, nodes[size_t(child)].byte)) continue;
    mark(child, allowed);
    walk(child, next, allowed);
  }
}

// Inside an unbounded JSON string the state between characters is `s` itself, whatever was written:
// ASCII and whole UTF-8 characters are walked with only the count of continuation bytes still due;
// a quote or a backslash (at a character boundary) goes back to the general walk from a copy of s.
void TurnConstraint::walk_string(int32_t node, int pending, const State& s, std::vector<char>& allowed) const {
  const std::vector<TokenTrie::Node>& nodes = trie_->nodes();
  for (int32_t child = nodes[size_t(node)].first_child; child >= 0; child = nodes[size_t(child)].next_sibling) {
    const uint8_t b = nodes[size_t(child)].byte;
    int due = -1;  // continuation bytes due after b; -1: b is not plain string content here
    if (pending > 0) due = (b & 0xC0) == 0x80 ? pending - 1 : -1;
    else if (b >= 0x20 && b < 0x80 && b != '"' && b != '\\') due = 0;
    else if (b >= 0xC2 && b <= 0xDF) due = 1;
    else if (b >= 0xE0 && b <= 0xEF) due = 2;
    else if (b >= 0xF0 && b <= 0xF4) due = 3;
    if (due >= 0) {
      mark(child, allowed);
      walk_string(child, due, s, allowed);
    } else if (pending == 0 && (b == '"' || b == '\\')) {
      State next = s;
      if (!feed_byte(next, b)) continue;
      mark(child, allowed);
      walk(child, next, allowed);
    }
  }
}

void TurnConstraint::mask(float* logits, int64_t V) const {
  std::vector<char> allowed(size_t(V), 0);
  for (int32_t id : structural_) {
    State s = state_;
    if (id < V && feed_special(s, id)) allowed[size_t(id)] = 1;
  }
  if (state_.step < steps_.size() && steps_[state_.step].kind == Step::Kind::kFree) {
    for (int64_t id = 0; id < std::min(V, trie_->num_ranks()); ++id)
      if (!trie_->bytes(int32_t(id)).empty()) allowed[size_t(id)] = 1;
  } else {
    walk(0, state_, allowed);
  }
  bool any = false;
  for (int64_t id = 0; id < V; ++id) {
    if (allowed[size_t(id)]) any = true;
    else logits[id] = -INFINITY;
  }
  K3_CHECK(any, "constrained decoding: no token can continue the reply (step ", state_.step, " of ", steps_.size(),
           ")");
}

bool TurnConstraint::accept(int32_t id) {
  State s = state_;
  bool ok;
  if (id >= 0 && id < trie_->num_ranks() && !trie_->bytes(id).empty()) {
    ok = true;
    for (unsigned char c : trie_->bytes(id)) ok = ok && feed_byte(s, c);
  } else {
    ok = feed_special(s, id);
  }
  if (ok) state_ = std::move(s);
  return ok;
}

}  // namespace k3::serve
