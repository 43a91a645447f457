#include "serve/prefix_cache.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace k3::serve {

PrefixCache::PrefixCache(int64_t block, size_t budget) : block_(block), budget_(budget) {
  K3_CHECK(block_ >= 1, "prefix cache: block must be >= 1, got ", block_);
}

std::vector<PrefixCache::Node*> PrefixCache::match(const std::vector<int32_t>& tokens) {
  ++stats_.lookups;
  std::vector<Node*> chain;
  Node* at = nullptr;
  const size_t B = size_t(block_);
  for (size_t k = 0; (k + 1) * B < tokens.size(); ++k) {  // "<": one token must be left to run
    Node* next = nullptr;
    for (auto& c : children_of(at))
      if (std::memcmp(c->tokens.data(), tokens.data() + k * B, B * sizeof(int32_t)) == 0) next = c.get();
    if (!next) break;
    chain.push_back(at = next);
  }
  const uint64_t now = ++clock_;
  for (Node* n : chain) n->last_use = now;
  if (!chain.empty()) ++stats_.hits, stats_.hit_tokens += int64_t(chain.size()) * block_;
  return chain;
}

PrefixCache::Node* PrefixCache::insert(Node* parent, const int32_t* tokens, std::unique_ptr<SequenceSnapshot> snap) {
  const size_t B = size_t(block_);
  auto& kids = children_of(parent);
  for (auto& c : kids)
    if (std::memcmp(c->tokens.data(), tokens, B * sizeof(int32_t)) == 0) {
      c->last_use = ++clock_;
      return c.get();
    }
  auto n = std::make_unique<Node>();
  n->tokens.assign(tokens, tokens + B);
  n->parent = parent;
  n->depth = parent ? parent->depth + 1 : 1;
  n->last_use = ++clock_;
  stats_.bytes += snap->bytes() + B * sizeof(int32_t);
  n->snap = std::move(snap);
  ++stats_.blocks;
  Node* raw = n.get();
  kids.push_back(std::move(n));
  ++raw->pins;  // not evicted by its own insertion
  evict();
  --raw->pins;
  return raw;
}

void PrefixCache::evict() {
  while (stats_.bytes > budget_) {
    // The least recently used leaf no running sequence extends.
    Node* victim = nullptr;
    std::vector<Node*> stack;
    for (auto& r : roots_) stack.push_back(r.get());
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      for (auto& c : n->children) stack.push_back(c.get());
      if (n->children.empty() && n->pins == 0 && (!victim || n->last_use < victim->last_use)) victim = n;
    }
    if (!victim) return;  // everything left is in use
    auto& kids = children_of(victim->parent);
    stats_.bytes -= victim->snap->bytes() + size_t(block_) * sizeof(int32_t);
    --stats_.blocks;
    kids.erase(std::find_if(kids.begin(), kids.end(), [&](const auto& p) { return p.get() == victim; }));
  }
}

}  // namespace k3::serve
