// The prefix cache of `k3 serve`: snapshots of sequences' state at the ends of their prompt chunks, so that a
// prompt which begins like an earlier one (a shared system prompt, the earlier turns of a conversation) resumes
// there instead of prefilling it again.
//
// Blocks are the batcher's prompt chunks (serve/batcher.h: a prompt's forwards end at multiples of the chunk size
// in its sequence, whatever else runs). A node of the trie is one block of tokens after its parent's; it holds
// the block's MLA rows and the KDA conv tails and recurrent state at the block's end (Engine::snapshot), so rows
// of a shared prefix are held once. Restoring a chain of nodes gives, bit for bit, the state that prefilling
// those blocks chunk by chunk gives, and the rest of the prompt then runs through the very forwards it would
// have run through without the cache: greedy output with the cache equals output without it. KDA's state is
// exact only at a block's end, so a prompt resumes at the longest cached prefix of whole blocks that still leaves
// one token to run (its logits start the reply).
//
// Memory: at most `budget` bytes of snapshots; inserting past it evicts least recently used leaves that no
// running sequence extends (pinned nodes stay). Not thread-safe: the batcher calls it under its lock.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "model/engine.h"

namespace k3::serve {

class PrefixCache {
 public:
  struct Node {
    std::vector<int32_t> tokens;  // the block
    Node* parent = nullptr;       // nullptr: the first block of a prompt
    std::vector<std::unique_ptr<Node>> children;
    std::unique_ptr<SequenceSnapshot> snap;
    uint64_t last_use = 0;
    int pins = 0;   // running sequences whose next block would hang here
    int depth = 0;  // blocks from the root, this one included
  };

  PrefixCache(int64_t block, size_t budget);
  int64_t block() const { return block_; }

  // The longest chain of cached blocks that prefixes `tokens` and leaves at least one token after it, root
  // first (empty: no hit). Counts the lookup and the reused tokens.
  std::vector<Node*> match(const std::vector<int32_t>& tokens);
  // The block tokens[0, block) after `parent` (nullptr: a prompt's first block) with its snapshot; returns its
  // node, the existing one when another sequence cached the same block first (the snapshot is then dropped).
  // May evict other nodes to stay within the budget.
  Node* insert(Node* parent, const int32_t* tokens, std::unique_ptr<SequenceSnapshot> snap);
  static void pin(Node* n) {
    if (n) ++n->pins;
  }
  static void unpin(Node* n) {
    if (n) --n->pins;
  }

  struct Stats {
    int64_t lookups = 0, hits = 0, hit_tokens = 0, blocks = 0;
    size_t bytes = 0;
  };
  Stats stats() const { return stats_; }

 private:
  void evict();
  std::vector<std::unique_ptr<Node>>& children_of(Node* parent) { return parent ? parent->children : roots_; }

  const int64_t block_;
  const size_t budget_;
  std::vector<std::unique_ptr<Node>> roots_;
  uint64_t clock_ = 0;
  Stats stats_;
};

}  // namespace k3::serve
