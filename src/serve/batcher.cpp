#include "serve/batcher.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <string>

#include "core/error.h"

namespace k3::serve {

// One append in flight: its tokens, how many the engine has consumed, and what it returns.
struct Batcher::Job {
  const std::vector<int32_t>* tokens = nullptr;
  TokenPick pick;  // what the last token's step returns
  size_t consumed = 0;
  PickResult result;
  std::string error;
  bool finished = false;
};

struct Batcher::SlotState {
  std::unique_ptr<EngineSequence> seq;      // made by the engine thread at the slot's first step
  int64_t length = 0;                       // tokens the sequence holds
  size_t reserved = 0;                      // bytes of the admission budget held
  bool prompt_done = false;                 // the first append (the prompt) has been run
  bool looked_up = false;                   // its prompt was looked up in the prefix cache
  bool started = false;                     // it has made its first append (counted in started_)
  PrefixCache::Node* node = nullptr;        // the cached block its prompt's prefix ends with (pinned), if any
  int64_t cached = 0;                       // tokens that prefix covers
  int64_t restored = 0;                     // prompt tokens the cache supplied
  std::vector<PrefixCache::Node*> restore;  // the chain to restore before its first step
  std::vector<InputRows> prompt_rows;       // input rows of its prompt (set_prompt_rows)
  int64_t cacheable = INT64_MAX;            // prompt tokens the prefix cache may serve and keep (before any row)
  Job* job = nullptr;                       // the append in flight
  std::string broken;                       // why appends are refused (an engine error on this sequence)
  // Running ahead (Slot::run_ahead): each step appends ahead_token and picks with ahead_pick(). The engine's side
  // is under the batcher's lock; the results under the slot's own (`out`), which its reader takes alone, so that
  // the readers of a step's results never queue on the lock the engine needs for the next step.
  bool ahead = false;                     // running ahead now
  bool ran_ahead = false;                 // has run ahead (steps are refused from then on)
  int32_t ahead_token = 0;                // what its next step appends
  int64_t ahead_steps = 0;                // steps it may still run
  int32_t ahead_stop_id = -1;             // no step after one that picked this id
  std::function<TokenPick()> ahead_pick;  // the pick of its next step (called locked)
  struct Out {
    std::mutex mu;
    std::condition_variable cv;      // a result came, or the run ended
    std::deque<PickResult> results;  // made, not taken yet
    std::string error;               // why the run ended, when it failed
    bool ended = false;              // no result will join `results` any more
    std::atomic<size_t> untaken{0};  // results.size(), for the engine's lock-free look
  } out;
};

Batcher::Batcher(Engine& engine, BatcherOptions o) : engine_(engine), o_(o) {
  K3_CHECK(o_.max_batch >= 1, "serve: max_batch must be >= 1, got ", o_.max_batch);
  K3_CHECK(o_.prefill_chunk >= 1, "serve: prefill_chunk must be >= 1, got ", o_.prefill_chunk);
  K3_CHECK(o_.step_tokens >= 1, "serve: step_tokens must be >= 1, got ", o_.step_tokens);
  K3_CHECK(o_.prefill_every >= 1, "serve: prefill_every must be >= 1, got ", o_.prefill_every);
  K3_CHECK(o_.gather.count() >= 0, "serve: gather must be >= 0");
  if (o_.prefix_cache_bytes > 0) cache_ = std::make_unique<PrefixCache>(o_.prefill_chunk, o_.prefix_cache_bytes);
  notifier_ = std::thread([this] { notify_loop(); });
  thread_ = std::thread([this] { loop(); });
}

Batcher::~Batcher() {
  stop();
  thread_.join();
  {
    std::lock_guard<std::mutex> n(notify_mu_);
    notify_stop_ = true;
  }
  notify_cv_.notify_all();
  notifier_.join();
}

void Batcher::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  admit_cv_.notify_all();
}

bool Batcher::could_fit(int64_t tokens, size_t* need) const {
  *need = engine_.sequence_bytes(std::max<int64_t>(tokens, 0));
  return o_.cache_budget == 0 || *need <= o_.cache_budget;
}

std::unique_ptr<Batcher::Slot> Batcher::acquire(int64_t max_tokens, Clock::time_point deadline) {
  size_t need = 0;
  if (!could_fit(max_tokens, &need))
    fail("a sequence of ", max_tokens, " tokens needs ", need, " bytes of cache, more than the server's budget of ",
         o_.cache_budget, " (--cache-budget)");
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t ticket = next_ticket_++;
  admission_.push_back(ticket);
  ++admitting_;
  auto admissible = [&] {
    return stop_ || (ticket == admission_.front() && int64_t(slots_.size()) < o_.max_batch &&
                     (o_.cache_budget == 0 || reserved_ + need <= o_.cache_budget));
  };
  bool ok = true;
  if (deadline == Clock::time_point::max()) admit_cv_.wait(lock, admissible);  // (no timeout: a wait_until that
  else ok = admit_cv_.wait_until(lock, deadline, admissible);                  // far ahead may overflow)
  --admitting_;
  admission_.erase(std::find(admission_.begin(), admission_.end(), ticket));  // admitted, or gave up its place
  admit_cv_.notify_all();
  if (stop_) fail("serve: the server is stopping");
  if (!ok) return nullptr;
  auto s = std::make_unique<SlotState>();
  s->reserved = need;
  reserved_ += need;
  SlotState* raw = s.get();
  slots_.push_back(std::move(s));
  return std::unique_ptr<Slot>(new Slot(this, raw));
}

Batcher::Slot::~Slot() { b_->release(s_); }

void Batcher::Slot::set_prompt_rows(std::vector<InputRows> rows) {
  std::lock_guard<std::mutex> lock(b_->mu_);
  K3_CHECK(!s_->started, "serve: prompt rows after the slot's first step");
  s_->cacheable = INT64_MAX;
  for (const InputRows& r : rows) s_->cacheable = std::min(s_->cacheable, r.at);
  s_->prompt_rows = std::move(rows);
}

int64_t Batcher::Slot::cached_tokens() const {
  std::lock_guard<std::mutex> lock(b_->mu_);
  return s_->restored;
}

void Batcher::release(SlotState* s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find_if(slots_.begin(), slots_.end(), [&](const auto& p) { return p.get() == s; });
    if (it == slots_.end()) return;
    reserved_ -= s->reserved;
    started_ -= s->started;
    ahead_off(s);
    PrefixCache::unpin(s->node);
    if (s->seq) to_free_.push_back(std::move(s->seq));  // (reset by the engine thread once its step is over)
    dead_.push_back(std::move(*it));
    slots_.erase(it);
  }
  work_cv_.notify_all();  // a step may be gathering for this slot; its sequence is to be freed
  admit_cv_.notify_all();
}

std::vector<float> Batcher::Slot::append(const std::vector<int32_t>& tokens) {
  return step(tokens, TokenPick::logits()).logits;
}

PickResult Batcher::Slot::step(const std::vector<int32_t>& tokens, const TokenPick& pick) {
  K3_CHECK(!tokens.empty(), "serve: append of no tokens");
  Batcher& b = *b_;
  Job job;
  job.tokens = &tokens;
  job.pick = pick;
  std::unique_lock<std::mutex> lock(b.mu_);
  if (!s_->broken.empty()) fail(s_->broken);
  if (b.stop_) fail("serve: the server is stopping");
  K3_CHECK(!s_->ran_ahead, "serve: a step on a slot that ran ahead");
  s_->job = &job;
  if (!s_->started) s_->started = true, ++b.started_;
  if (b.waiting_.empty()) b.first_wait_ = Clock::now();
  b.waiting_.push_back(s_);
  b.work_cv_.notify_all();
  b.done_cv_.wait(lock, [&] { return job.finished; });
  s_->job = nullptr;
  if (!job.error.empty()) fail(job.error);
  return std::move(job.result);
}

RunAhead Batcher::Slot::run_ahead() {
  RunAhead r;
  r.start = [b = b_, s = s_](int32_t first, int64_t steps, int32_t stop_id, std::function<TokenPick()> pick) {
    b->ahead_start(s, first, steps, stop_id, std::move(pick));
  };
  r.next = [b = b_, s = s_] { return b->ahead_next(s); };
  r.stop = [b = b_, s = s_] { b->ahead_stop(s); };
  return r;
}

void Batcher::ahead_start(SlotState* s, int32_t first, int64_t steps, int32_t stop_id,
                          std::function<TokenPick()> pick) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!s->broken.empty()) fail(s->broken);
    if (stop_) fail("serve: the server is stopping");
    K3_CHECK(!s->ran_ahead && s->started, "serve: a run ahead must follow the slot's first step, once");
    s->ahead = s->ran_ahead = true;
    ++ahead_on_;
    s->ahead_token = first, s->ahead_steps = steps, s->ahead_stop_id = stop_id;
    s->ahead_pick = std::move(pick);
    std::lock_guard<std::mutex> out(s->out.mu);
    s->out.ended = steps <= 0;
  }
  work_cv_.notify_all();
}

PickResult Batcher::ahead_next(SlotState* s) {
  SlotState::Out& o = s->out;
  std::unique_lock<std::mutex> lock(o.mu);
  o.cv.wait(lock, [&] { return !o.results.empty() || o.ended; });
  if (o.results.empty()) {
    if (!o.error.empty()) fail(o.error);
    fail("serve: next() past the steps a run ahead was given, or after its stop()");
  }
  PickResult r = std::move(o.results.front());
  o.results.pop_front();
  const bool was_full = o.untaken.fetch_sub(1) == kAheadDepth;
  lock.unlock();
  if (was_full) {  // ready again: (the empty section orders this against the engine's look before it waits)
    { std::lock_guard<std::mutex> engine(mu_); }
    work_cv_.notify_all();
  }
  return r;
}

void Batcher::ahead_off(SlotState* s) {
  ahead_on_ -= s->ahead;
  s->ahead = false, s->ahead_steps = 0, s->ahead_pick = nullptr;
}

void Batcher::ahead_stop(SlotState* s) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!s->ahead) return;
  ahead_off(s);
  std::lock_guard<std::mutex> out(s->out.mu);
  s->out.ended = true;
  s->out.results.clear();
  s->out.untaken = 0;
}

// Locked: the batcher's lock (the engine's side), not the slot's.
bool Batcher::ahead_ready(const SlotState* s) const {
  return s->ahead && s->ahead_steps > 0 && s->out.untaken.load() < kAheadDepth && s->broken.empty();
}

// The end of a run ahead (locked): an error, or the last result given.
void Batcher::ahead_end(SlotState* s, const std::string& error) {
  s->ahead_steps = 0;
  std::lock_guard<std::mutex> out(s->out.mu);
  s->out.ended = true;
  if (s->out.error.empty()) s->out.error = error;
}

void Batcher::notify_loop() {
  std::unique_lock<std::mutex> lock(notify_mu_);
  for (;;) {
    notify_cv_.wait(lock, [&] { return notify_stop_ || !to_notify_.empty(); });
    if (to_notify_.empty()) return;
    std::vector<SlotState*> batch;
    batch.swap(to_notify_);
    notifying_ = true;
    lock.unlock();
    for (SlotState* s : batch) s->out.cv.notify_one();
    lock.lock();
    notifying_ = false;
    notify_cv_.notify_all();  // (the engine thread may wait for it to be idle)
  }
}

bool Batcher::any_ahead_ready() const {
  if (ahead_on_ == 0) return false;
  for (const auto& s : slots_)
    if (ahead_ready(s.get())) return true;
  return false;
}

void Batcher::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || !waiting_.empty() || !to_free_.empty() || any_ahead_ready(); });
    if (!to_free_.empty()) {  // sequences of released slots, reset for new slots here where the engine runs
      auto dead = std::move(to_free_);
      to_free_.clear();
      lock.unlock();
      std::vector<std::unique_ptr<EngineSequence>> fresh;
      for (auto& seq : dead) {
        try {
          engine_.reset(*seq);
          fresh.push_back(std::move(seq));
        } catch (const std::exception&) {  // (an engine error: the sequence is dropped, a new one made later)
        }
      }
      dead.clear();
      lock.lock();
      for (auto& seq : fresh) free_.push_back(std::move(seq));
      continue;
    }
    if (stop_) {
      for (SlotState* s : waiting_) s->job->error = "serve: the server is stopping", s->job->finished = true;
      waiting_.clear();
      done_cv_.notify_all();
      for (const auto& s : slots_) {
        ahead_end(s.get(), "serve: the server is stopping");
        s->out.cv.notify_all();
      }
      return;
    }
    // Gather: wait (a short while) for the slots that are still sampling their next token, unless slots running
    // ahead are ready (they wait for nobody).
    if (!any_ahead_ready())
      work_cv_.wait_until(lock, first_wait_ + o_.gather, [&] {
        return stop_ || int64_t(waiting_.size()) + ahead_on_ >= started_ || !to_free_.empty();
      });
    if (stop_ || !to_free_.empty()) continue;
    try {
      step(lock);
    } catch (const std::exception& e) {  // (allocation failures outside the engine): fail what waits, go on
      if (!lock.owns_lock()) lock.lock();
      for (SlotState* s : waiting_)
        s->job->error = s->broken = std::string("serve: ") + e.what(), s->job->finished = true;
      waiting_.clear();
      done_cv_.notify_all();
    }
  }
}

void Batcher::step(std::unique_lock<std::mutex>& lock) {
  if (!dead_.empty()) {  // no step refers to them any more; the notifier may, until it is idle
    std::unique_lock<std::mutex> n(notify_mu_);
    notify_cv_.wait(n, [&] { return to_notify_.empty() && !notifying_; });
    dead_.clear();
  }
  // The step: the slots running ahead that are ready, every waiting decode, then prompt chunks in arrival order.
  // The first `ahead` entries are the slots running ahead (their rows and picks are theirs, not a job's).
  std::vector<SlotState*> step;
  std::vector<size_t> take;
  int64_t tokens = 0;
  for (const auto& s : slots_)
    if (ahead_ready(s.get())) step.push_back(s.get()), take.push_back(1), ++tokens;
  const size_t ahead = step.size();
  auto left_of = [](const SlotState* s) { return s->job->tokens->size() - s->job->consumed; };
  for (SlotState* s : waiting_)
    if (left_of(s) == 1) step.push_back(s), take.push_back(1), ++tokens;
  const size_t decodes = step.size();
  // Prompts: when nothing decodes, or at every prefill_every-th step.
  const bool prompts = step.empty() || ++since_prompts_ >= o_.prefill_every;
  bool first_prompt = true;
  for (SlotState* s : waiting_) {
    if (!prompts) break;
    if (left_of(s) == 1) continue;
    if (cache_ && !s->looked_up && !s->prompt_done) {  // a new prompt: resume from its longest cached prefix
      s->looked_up = true;
      s->restore = cache_->match(*s->job->tokens);
      while (!s->restore.empty() && int64_t(s->restore.size()) * o_.prefill_chunk > s->cacheable) s->restore.pop_back();
      if (!s->restore.empty()) {
        s->node = s->restore.back();
        PrefixCache::pin(s->node);
        s->restored = s->cached = s->length = int64_t(s->restore.size()) * o_.prefill_chunk;
        s->job->consumed = size_t(s->length);
      }
    }
    const size_t left = left_of(s);
    // Chunks end at multiples of prefill_chunk in the sequence: where a prompt's forwards begin and end
    // depends on the prompt alone, never on what shares the step (a chunk that does not fit waits).
    const int64_t pos = s->length;
    const size_t n = std::min(left, size_t(o_.prefill_chunk - pos % o_.prefill_chunk));
    if (!first_prompt && tokens + int64_t(n) > o_.step_tokens) continue;
    first_prompt = false;
    step.push_back(s), take.push_back(n), tokens += int64_t(n);
  }
  if (step.empty()) return;
  if (step.size() > decodes) since_prompts_ = 0;
  // (A slot running ahead may be released while this step runs, its sequence then queued in to_free_, which only
  // this thread resets, after the step.)
  std::vector<EngineSequence*> ahead_seqs;
  for (size_t i = 0; i < ahead; ++i) ahead_seqs.push_back(step[i]->seq.get());
  std::vector<std::vector<int32_t>> rows;
  std::vector<TokenPick> picks_of(step.size(), TokenPick::none());
  for (size_t i = 0; i < step.size(); ++i) {
    if (i < ahead) {
      rows.push_back({step[i]->ahead_token});
      picks_of[i] = step[i]->ahead_pick();
      continue;
    }
    const Job& j = *step[i]->job;
    rows.emplace_back(j.tokens->begin() + std::ptrdiff_t(j.consumed),
                      j.tokens->begin() + std::ptrdiff_t(j.consumed + take[i]));
  }
  // A slot's sequence is made here, at its first step, from the cache's chain; one that cannot be made fails
  // that slot alone. The forward runs over the others; a failure there fails them all (their state is
  // undefined). A snapshot that fails is dropped, and that prompt is cached no further.
  // The picks: a step that ends its append returns what the append asked; a prompt's middle chunk nothing.
  for (size_t i = ahead; i < step.size(); ++i) {
    const Job& j = *step[i]->job;
    if (j.consumed + take[i] == j.tokens->size()) picks_of[i] = j.pick;
  }
  // Fresh sequences for slots that start now: from the pool (made here at the first step) while it lasts.
  std::vector<std::unique_ptr<EngineSequence>> spare;
  size_t starting = 0;
  for (const SlotState* s : step) starting += s->seq ? 0 : 1;
  if (!pool_made_ && starting > 0) {
    pool_made_ = true;
    lock.unlock();
    // As many places as the budget could ever admit at once (each sequence's fixed state at least).
    int64_t places = o_.max_batch;
    if (o_.cache_budget > 0)
      places = std::clamp<int64_t>(int64_t(o_.cache_budget / std::max<size_t>(engine_.sequence_bytes(1), 1)), 1,
                                   o_.max_batch);
    try {
      spare = engine_.new_sequences(places);
    } catch (const std::exception&) {  // (no room for the whole pool: sequences are made one by one below)
    }
    lock.lock();
  }
  while (spare.size() < starting && !free_.empty()) {
    spare.push_back(std::move(free_.back()));
    free_.pop_back();
  }
  lock.unlock();
  std::vector<std::string> failed(step.size());
  std::vector<EngineSequence*> seqs;
  std::vector<std::vector<int32_t>> ok_rows;
  std::vector<TokenPick> picks;
  std::vector<int64_t> row_of(step.size(), -1);
  for (size_t i = 0; i < step.size(); ++i) {
    SlotState* s = step[i];
    try {
      if (i < ahead) {
        row_of[i] = int64_t(seqs.size());
        seqs.push_back(ahead_seqs[i]);
        ok_rows.push_back(std::move(rows[i]));
        picks.push_back(picks_of[i]);
        continue;
      }
      if (!s->seq) {
        if (!spare.empty()) {
          s->seq = std::move(spare.back());
          spare.pop_back();
        } else {
          s->seq = std::move(engine_.new_sequences(1).front());
        }
        if (!s->restore.empty()) {
          std::vector<const SequenceSnapshot*> chain;
          for (const PrefixCache::Node* n : s->restore) chain.push_back(n->snap.get());
          engine_.restore(*s->seq, chain);
          s->restore.clear();
        }
      }
      row_of[i] = int64_t(seqs.size());
      seqs.push_back(s->seq.get());
      ok_rows.push_back(std::move(rows[i]));
      picks.push_back(picks_of[i]);
    } catch (const std::exception& e) {
      failed[i] = std::string("the engine failed: ") + e.what();
    }
  }
  std::vector<PickResult> results;
  std::vector<std::unique_ptr<SequenceSnapshot>> snaps(step.size());
  std::vector<bool> uncached(step.size(), false);
  std::string error;
  // Prompt rows within this step's chunks, from the chunk's start.
  ForwardHooks rows_in;
  for (size_t i = ahead; i < step.size(); ++i) {
    const SlotState* s = step[i];
    if (row_of[i] < 0 || s->prompt_done || s->prompt_rows.empty()) continue;
    const int64_t c0 = int64_t(s->job->consumed), c1 = c0 + int64_t(take[i]);
    std::vector<InputRows> in;
    for (const InputRows& r : s->prompt_rows) {
      const int64_t a = std::max(r.at, c0), b = std::min(r.at + r.n, c1);
      if (a < b) in.push_back(InputRows{a - c0, b - a, r.data + (a - r.at) * engine_.config().hidden_size});
    }
    if (in.empty()) continue;
    rows_in.input_rows.resize(seqs.size());
    rows_in.input_rows[size_t(row_of[i])] = std::move(in);
  }
  const auto t0 = Clock::now();
  try {
    if (!seqs.empty())
      results = engine_.forward_pick(seqs, ok_rows, picks, rows_in.input_rows.empty() ? nullptr : &rows_in);
  } catch (const std::exception& e) {
    error = std::string("the engine failed: ") + e.what();
  }
  const double forward_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  for (size_t i = ahead; i < step.size() && cache_ && error.empty(); ++i) {  // whole chunks that continue the
    const SlotState* s = step[i];                                            // cached prefix join the cache
    if (row_of[i] < 0 || s->prompt_done || int64_t(take[i]) != o_.prefill_chunk || s->cached != s->length ||
        s->length + int64_t(take[i]) > s->cacheable)
      continue;
    try {
      snaps[i] = engine_.snapshot(*s->seq, s->length);
    } catch (const std::exception&) {
      uncached[i] = true;
    }
  }
  lock.lock();
  for (auto& seq : spare) free_.push_back(std::move(seq));
  ++steps_;
  step_sequences_ += int64_t(seqs.size());
  step_tokens_total_ += tokens;
  decode_steps_ += tokens == int64_t(step.size());
  forward_seconds_ += forward_seconds;
  // Slots running ahead: the result joins the slot's queue (a slot released or stopped meanwhile drops it), and
  // the picked id is the next step's token.
  for (size_t i = 0; i < ahead; ++i) {
    SlotState* s = step[i];
    s->length += 1;
    if (!s->ahead) continue;
    if (!error.empty()) {
      s->broken = error;
      ahead_end(s, error);
      continue;
    }
    PickResult& r = results[size_t(row_of[i])];
    s->ahead_token = r.id;
    s->ahead_steps = r.id == s->ahead_stop_id ? 0 : s->ahead_steps - 1;
    {
      std::lock_guard<std::mutex> out(s->out.mu);
      s->out.results.push_back(std::move(r));
      ++s->out.untaken;
      s->out.ended = s->ahead_steps == 0;
    }
  }
  for (size_t i = ahead; i < step.size(); ++i) {
    SlotState* s = step[i];
    Job& j = *s->job;
    if (snaps[i]) {
      PrefixCache::Node* n = cache_->insert(s->node, j.tokens->data() + j.consumed, std::move(snaps[i]));
      PrefixCache::unpin(s->node);
      PrefixCache::pin(s->node = n);
      s->cached += o_.prefill_chunk;
    }
    if (uncached[i]) s->cached = -1;  // never equal to its length again
    j.consumed += take[i];
    s->length += int64_t(take[i]);
    const std::string& why = !failed[i].empty() ? failed[i] : error;
    if (!why.empty()) {
      j.error = s->broken = why;
    } else if (j.consumed < j.tokens->size()) {
      continue;  // more of its prompt next step
    } else {
      j.result = std::move(results[size_t(row_of[i])]);
    }
    j.finished = true;
    s->prompt_done = true;
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), s));
  }
  if (!waiting_.empty()) first_wait_ = Clock::now();
  if (ahead > 0) {  // the readers are woken off this thread, which goes on to the next step
    {
      std::lock_guard<std::mutex> n(notify_mu_);
      to_notify_.insert(to_notify_.end(), step.begin(), step.begin() + std::ptrdiff_t(ahead));
    }
    notify_cv_.notify_one();
  }
  done_cv_.notify_all();
}

Batcher::Stats Batcher::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  Stats st;
  st.slots = int64_t(slots_.size());
  st.admitting = admitting_;
  st.reserved_bytes = reserved_;
  st.steps = steps_;
  st.step_sequences = step_sequences_;
  st.step_tokens_total = step_tokens_total_;
  st.decode_steps = decode_steps_;
  st.forward_seconds = forward_seconds_;
  if (cache_) st.prefix = cache_->stats();
  return st;
}

}  // namespace k3::serve
