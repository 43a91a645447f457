// Continuous batching for `k3 serve`: the sequences of many requests share each forward of one engine.
//
// A request takes a Slot (acquire), which stands for one sequence of the engine and its share of the cache
// budget, and generates through Slot::append (an AppendFn, model/generate.h) exactly as generate_until does
// through Engine::session: append blocks until the engine thread has consumed the tokens and returns the last
// one's logits. The engine thread runs one forward per step over every slot that is waiting: a decode adds its
// token, a prompt its next chunk (decodes first, then prompts in arrival order while the step stays within
// step_tokens, the oldest prompt always getting its chunk), so a long prompt holds the others' decoding back by
// one chunk at a time, never by its whole prefill. While sequences decode, prompt chunks join one step in
// prefill_every: a step of decodes alone replays the GPU's decode graph, one with prompts runs eagerly, so prompts
// wait a few steps and go in together (which shortens their time to first token; docs/BENCHMARKS.md). A prompt's
// chunks end at multiples of prefill_chunk in its
// sequence, whatever else runs: where its forwards begin and end depends on the prompt alone (the rounding of
// a chunked prefill depends on its chunks on the GPU), and a prefix cache can resume at any chunk's end with
// the very state a prefill from the start has there. Requests join at any step and leave when they drop their
// slot; sampling, grammar masks and writing to clients run on the requests' own threads while the engine
// computes.
//
// A step starts once every slot that has begun generating is waiting, or `gather` after the first of them began
// to wait (a request busy elsewhere, e.g. writing to a slow client, holds the others back no longer than that).
//
// A slot may run ahead (Slot::run_ahead, model/generate.h's RunAhead): the engine thread then appends the id it
// picked last and picks again at every step, while fewer than kAheadDepth of its results wait to be taken, and
// the request's thread takes them in order. Its sampling and writing then overlap the next forward instead of
// holding it back; a step waits for no slot that runs ahead, and starts at once when one is ready.
//
// Admission: at most max_batch slots at once, and the state of their sequences at full length (prompt plus the
// tokens they may generate, Engine::sequence_bytes) within cache_budget bytes. acquire() waits, first come first
// served, until both hold or its deadline passes.
//
// With a prefix cache, a new prompt first resumes from the longest cached prefix of whole chunks, and every
// full chunk of a prompt is snapshotted into the cache after its step (serve/prefix_cache.h).
//
// The engine's sequences are made (one pool of max_batch, reused), run, reset and freed only on the engine thread
// (the engine is not thread-safe).
// An engine error in a forward fails every append of that step (k3::Error); those slots refuse further
// appends. A sequence that cannot be made or restored fails its own slot only, and a snapshot that fails is
// dropped (the prompt is then cached no further).
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "model/engine.h"
#include "model/generate.h"
#include "serve/prefix_cache.h"

namespace k3::serve {

struct BatcherOptions {
  int64_t max_batch = 16;       // slots (sequences generating) at once
  size_t cache_budget = 0;      // bytes of sequence state admitted at once; 0: no limit
  int64_t prefill_chunk = 512;  // prompt tokens of one sequence in one step
  int64_t step_tokens = 2048;   // tokens a step takes when prompts wait (decodes always all go)
  int64_t prefill_every = 4;    // while sequences decode, prompt chunks join every this many steps
  std::chrono::microseconds gather{2000};
  // Bytes of prompt-chunk snapshots kept for later prompts (serve/prefix_cache.h; blocks of prefill_chunk
  // tokens); 0: no prefix cache.
  size_t prefix_cache_bytes = 0;
};

class Batcher {
  struct SlotState;

 public:
  using Clock = std::chrono::steady_clock;

  Batcher(Engine& engine, BatcherOptions o);
  ~Batcher();  // stop(), then joins the engine thread
  // From now on appends and acquires fail (k3::Error), those waiting too; the engine thread ends.
  void stop();
  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  class Slot {
   public:
    ~Slot();
    Slot(const Slot&) = delete;
    Slot& operator=(const Slot&) = delete;
    // Appends tokens to this slot's sequence (once the engine thread has run them) and returns what `pick` asks
    // of the last one (Engine::forward_pick: the engine's pick of the next id and/or its logits). Throws
    // k3::Error when the engine failed on this slot's step or the batcher is stopping.
    PickResult step(const std::vector<int32_t>& tokens, const TokenPick& pick);
    // step() returning the last token's logits.
    std::vector<float> append(const std::vector<int32_t>& tokens);
    AppendFn fn() {
      return [this](const std::vector<int32_t>& t) { return append(t); };
    }
    PickFn pick_fn() {
      return [this](const std::vector<int32_t>& t, const TokenPick& p) { return step(t, p); };
    }
    // Decode steps of this slot run on the engine thread without waiting for step() (after RunAhead::stop the
    // slot takes no further steps: its sequence may hold tokens past those taken).
    RunAhead run_ahead();
    // Prompt tokens the prefix cache supplied (0 until the first append has run, or without a hit).
    int64_t cached_tokens() const;
    // Input rows of the first append's tokens (an image prompt's projected tokens: multimodal/media_prompt.h),
    // before it. The data must outlive that append. The prefix cache then serves and keeps only the prompt's
    // chunks before the first row (the ids of an image's rows do not say which image it was).
    void set_prompt_rows(std::vector<InputRows> rows);

   private:
    friend class Batcher;
    Slot(Batcher* b, SlotState* s) : b_(b), s_(s) {}
    Batcher* b_;
    SlotState* s_;
  };

  // A slot for a sequence that will hold at most max_tokens tokens, once one is free and its state fits the
  // budget; nullptr when the deadline passes first. Throws k3::Error when the sequence could never fit the
  // budget (the message names the bytes).
  std::unique_ptr<Slot> acquire(int64_t max_tokens, Clock::time_point deadline);
  // Whether a sequence of `tokens` tokens could ever fit the cache budget (alone); *need gets its bytes.
  bool could_fit(int64_t tokens, size_t* need) const;

  struct Stats {
    int64_t slots = 0;              // held now
    int64_t admitting = 0;          // acquire() calls waiting now
    size_t reserved_bytes = 0;      // the held slots' state at full length
    int64_t steps = 0;              // forwards run
    int64_t step_sequences = 0;     // sequences over all steps (/ steps: the mean batch)
    int64_t step_tokens_total = 0;  // tokens over all steps
    int64_t decode_steps = 0;       // steps in which every sequence added one token
    double forward_seconds = 0.0;   // wall time in the engine's forwards (/ the time elapsed: how busy it was)
    PrefixCache::Stats prefix;      // all zero without a prefix cache
  };
  Stats stats() const;

 private:
  struct Job;
  void loop();
  void step(std::unique_lock<std::mutex>& lock);  // one forward over the waiting slots (called locked)
  void release(SlotState* s);
  void ahead_start(SlotState* s, int32_t first, int64_t steps, int32_t stop_id, std::function<TokenPick()> pick);
  PickResult ahead_next(SlotState* s);
  void ahead_stop(SlotState* s);
  bool ahead_ready(const SlotState* s) const;              // (locked)
  bool any_ahead_ready() const;                            // (locked)
  void ahead_end(SlotState* s, const std::string& error);  // (locked)
  void ahead_off(SlotState* s);  // (locked) no further steps ahead, and no further next_pick calls
  void notify_loop();  // the notifier thread: wakes the readers of the slots in to_notify_

  // Results a slot running ahead may hold untaken: one being taken while the next step computes the next.
  static constexpr size_t kAheadDepth = 2;

  Engine& engine_;
  const BatcherOptions o_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_, done_cv_, admit_cv_;
  std::vector<std::unique_ptr<SlotState>> slots_;  // held slots
  // Released slots' state, deleted by the engine thread once no step of its refers to them (a slot running ahead
  // may be released while its step computes).
  std::vector<std::unique_ptr<SlotState>> dead_;
  std::deque<SlotState*> waiting_;                        // slots with an append in flight, in arrival order
  std::vector<std::unique_ptr<EngineSequence>> to_free_;  // released slots' sequences (reset on the engine thread)
  // Fresh sequences for new slots: one pool made at the first step, of max_batch places or as many as the cache
  // budget could admit (the GPU then runs a decode step over any of them as one launch per block step); released
  // ones reset and returned here. Slots past the pool get sequences of their own.
  std::vector<std::unique_ptr<EngineSequence>> free_;
  bool pool_made_ = false;
  Clock::time_point first_wait_;
  std::deque<uint64_t> admission_;  // acquire() calls waiting, in arrival order (the front is admitted next)
  uint64_t next_ticket_ = 0;
  int64_t admitting_ = 0, steps_ = 0, step_sequences_ = 0, step_tokens_total_ = 0, decode_steps_ = 0;
  double forward_seconds_ = 0.0;
  int64_t started_ = 0;        // held slots that have made their first append
  int64_t since_prompts_ = 0;  // steps since the last that took prompt chunks
  int64_t ahead_on_ = 0;       // held slots running ahead
  size_t reserved_ = 0;
  std::unique_ptr<PrefixCache> cache_;  // null: no prefix cache
  bool stop_ = false;
  std::thread thread_;
  // The readers of a step's results are woken by a thread of their own (one wake-up each), while the engine thread
  // runs the next step.
  std::mutex notify_mu_;
  std::condition_variable notify_cv_;
  std::vector<SlotState*> to_notify_;
  bool notifying_ = false, notify_stop_ = false;
  std::thread notifier_;
};

}  // namespace k3::serve
