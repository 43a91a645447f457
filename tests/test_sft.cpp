// Supervised fine-tuning (`k3 sft`, train/sft_data.h) on the CPU:
//   - the chat template's assistant segments are exactly what a model writes after a generation prompt: for every
//     assistant message of a conversation, the rendering before it equals the generation prompt of the messages
//     before it, and it runs through its <|end_of_msg|> (plain, multi-turn with reasoning, tool calls and results,
//     thinking off, a named assistant);
//   - the data loader: ids and trained tokens as the chat encoder gives them, long conversations cut, errors named
//     by file and line;
//   - the step plan: every conversation once per epoch, in steps that fit;
//   - the masked loss: the cross-entropy of the trained tokens alone, from the logits, and its gradient against
//     finite differences;
//   - `k3 sft` end to end on k3-tiny-a: the held-out loss of the answers falls, a run stopped and resumed gives the
//     same losses bit for bit, and its checkpoint chats.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "model/config.h"
#include "model/params.h"
#include "model/training/model_train.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/xtml_chat.h"
#include "train/checkpoint.h"
#include "train/sft_data.h"
#include "train/trainer.h"
#include "util/cli.h"
#include "util/compare.h"
#include "util/error_of.h"
#include "util/finite_diff.h"
#include "util/sft_corpus.h"
#include "util/temp_dir.h"
#include "util/train_corpus.h"

using namespace k3;
using namespace k3::train;
using k3test::fixture;
using ::testing::HasSubstr;
using ojson = nlohmann::ordered_json;

namespace {

const ojson kWeather = ojson::parse(R"([{"type": "function", "function": {"name": "weather",
  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])");

// Conversations with every kind of turn.
std::vector<ojson> conversations() {
  std::vector<ojson> v;
  v.push_back(ojson::parse(R"({"messages": [{"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"}]})"));
  v.push_back(ojson::parse(R"({"messages": [{"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "reasoning_content": "Add them.", "content": "4"},
    {"role": "user", "content": [{"type": "text", "text": "and 3+3?"}]},
    {"role": "assistant", "reasoning_content": "Again.", "content": "6"}]})"));
  ojson tools = ojson::parse(R"({"messages": [{"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
      {"id": "a", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}},
      {"id": "b", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Rome\"}"}}]},
    {"role": "tool", "tool_call_id": "a", "content": "sun"},
    {"role": "tool", "tool_call_id": "b", "content": "rain"},
    {"role": "assistant", "content": "Paris: sun. Rome: rain."}]})");
  tools["tools"] = kWeather;
  v.push_back(tools);
  v.push_back(ojson::parse(R"({"thinking": false, "messages": [{"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Bye!"}]})"));
  v.push_back(ojson::parse(R"({"messages": [{"role": "user", "content": "Name?"},
    {"role": "assistant", "name": "kimi", "content": "Kimi."}]})"));
  return v;
}

// The runs of consecutive assistant segments: [begin, end) segment indices.
std::vector<std::pair<size_t, size_t>> assistant_runs(const std::vector<ChatSegment>& s) {
  std::vector<std::pair<size_t, size_t>> runs;
  for (size_t i = 0; i < s.size(); ++i)
    if (s[i].assistant && (i == 0 || !s[i - 1].assistant)) runs.push_back({i, i});
  for (auto& [b, e] : runs)
    for (e = b; e < s.size() && s[e].assistant;) ++e;
  return runs;
}

std::string join(const std::vector<ChatSegment>& s, size_t begin, size_t end) {
  std::string out;
  for (size_t i = begin; i < end; ++i) out += s[i].text;
  return out;
}

Tokenizer tiny_tokenizer(const k3test::TempDir& dir) {
  return Tokenizer::load_dir(k3test::write_tiny_tokenizer(dir.path() / "tok"));
}

}  // namespace

TEST(SftChat, AssistantSegmentsAreWhatFollowsTheGenerationPrompt) {
  for (const ojson& conv : conversations()) {
    ojson full = conv;
    full["add_generation_prompt"] = false;
    const std::vector<ChatSegment> segs = render_chat(full);
    const auto runs = assistant_runs(segs);
    std::vector<size_t> assistant_at;  // message indices of the assistant turns
    for (size_t i = 0; i < conv["messages"].size(); ++i)
      if (conv["messages"][i]["role"] == "assistant") assistant_at.push_back(i);
    ASSERT_EQ(runs.size(), assistant_at.size()) << conv.dump();
    for (size_t k = 0; k < runs.size(); ++k) {
      ojson before = conv;
      before["messages"] = ojson::array();
      for (size_t i = 0; i < assistant_at[k]; ++i) before["messages"].push_back(conv["messages"][i]);
      before["add_generation_prompt"] = true;
      std::string prompt = join_segments(render_chat(before));
      // A named assistant's header carries its name; the generation prompt has none.
      if (conv["messages"][assistant_at[k]].contains("name")) {
        const std::string plain = "role=\"assistant\"";
        prompt.insert(prompt.rfind(plain) + plain.size(), " name=\"kimi\"");
      }
      EXPECT_EQ(join(segs, 0, runs[k].first), prompt) << "assistant message " << k << " of " << conv.dump();
      const std::string run = join(segs, runs[k].first, runs[k].second);
      EXPECT_TRUE(run.ends_with(std::string(kXtmlClose) + "message" + kXtmlSep + kXtmlEndOfMsg)) << run;
      const size_t next = k + 1 < runs.size() ? runs[k + 1].first : segs.size();
      for (size_t i = runs[k].second; i < next; ++i) EXPECT_FALSE(segs[i].assistant);
    }
  }
}

TEST(SftData, IdsAndTrainedTokensAreTheChatEncodersAndLongOnesAreCut) {
  k3test::TempDir dir("sft-data");
  const Tokenizer tok = tiny_tokenizer(dir);
  const std::string path = dir.file("c.jsonl");
  {
    std::ofstream f(path);
    for (const ojson& c : conversations()) f << c.dump() << "\n\n";  // blank lines are skipped
  }
  const SftData d = load_sft_data(path, tok, 1024, 1 << 20);
  ASSERT_EQ(d.examples.size(), conversations().size());
  int64_t tokens = 0, trained = 0;
  for (size_t i = 0; i < d.examples.size(); ++i) {
    ojson r = conversations()[i];
    r["add_generation_prompt"] = false;
    const std::vector<ChatSegment> segs = render_chat(r);
    std::vector<uint8_t> want_mask;
    EXPECT_EQ(d.examples[i].ids, encode_segments(tok, segs, &want_mask));
    EXPECT_EQ(d.examples[i].trained, want_mask);
    EXPECT_EQ(d.examples[i].line, int64_t(2 * i + 1));
    // The trained tokens are the assistant segments' own encodings.
    std::string trained_text;
    for (size_t t = 0; t < want_mask.size(); ++t)
      if (want_mask[t]) trained_text += tok.decode({d.examples[i].ids[t]});
    std::string want_text;
    for (const ChatSegment& s : segs)
      if (s.assistant) want_text += s.text;
    EXPECT_EQ(trained_text, want_text);
    tokens += int64_t(d.examples[i].ids.size());
    trained += target_count(int64_t(d.examples[i].ids.size()), {}, &d.examples[i].trained);
  }
  EXPECT_EQ(d.tokens, tokens);
  EXPECT_EQ(d.trained_tokens, trained);
  EXPECT_EQ(d.truncated, 0);

  // Cut just past the earliest first assistant token: the conversations whose first assistant token lies past the
  // cut are dropped, the others keep their first `cut` tokens.
  std::vector<int64_t> first(d.examples.size());
  for (size_t i = 0; i < d.examples.size(); ++i)
    first[i] = int64_t(std::find(d.examples[i].trained.begin(), d.examples[i].trained.end(), 1) -
                       d.examples[i].trained.begin());
  const int64_t cut = *std::min_element(first.begin(), first.end()) + 2;
  int64_t kept = 0, longer = 0;
  for (size_t i = 0; i < d.examples.size(); ++i) kept += first[i]<cut, longer += int64_t(d.examples[i].ids.size())> cut;
  const SftData short_data = load_sft_data(path, tok, 1024, cut);
  EXPECT_EQ(short_data.conversations, int64_t(conversations().size()));
  EXPECT_EQ(short_data.truncated, longer);
  EXPECT_EQ(int64_t(short_data.examples.size()), kept);
  EXPECT_EQ(short_data.untrained, int64_t(d.examples.size()) - kept);
  for (const SftExample& ex : short_data.examples) {
    const SftExample& whole = d.examples[size_t(ex.line - 1) / 2];
    ASSERT_EQ(ex.ids.size(), std::min<size_t>(whole.ids.size(), size_t(cut)));
    EXPECT_TRUE(std::equal(ex.ids.begin(), ex.ids.end(), whole.ids.begin()));
    EXPECT_TRUE(std::equal(ex.trained.begin(), ex.trained.end(), whole.trained.begin()));
  }
  EXPECT_THAT(k3test::error_of([&] { load_sft_data(path, tok, 1024, 4); }), HasSubstr("nothing to train"));
}

TEST(SftData, BadConversationsAreNamedByLine) {
  k3test::TempDir dir("sft-bad");
  const Tokenizer tok = tiny_tokenizer(dir);
  const std::string good = conversations()[0].dump();
  auto error_for = [&](const std::string& second_line, int64_t vocab = 1024) {
    const std::string path = dir.file("bad.jsonl");
    std::ofstream(path) << good << "\n" << second_line << "\n";
    return k3test::error_of([&] { load_sft_data(path, tok, vocab, 1 << 20); });
  };
  EXPECT_THAT(error_for("{\"messages\": [}"), HasSubstr("bad.jsonl:2"));
  EXPECT_THAT(error_for("[1, 2]"), HasSubstr("bad.jsonl:2: expected a chat request object with 'messages'"));
  EXPECT_THAT(error_for(R"({"messages": [{"role": "user", "content": "hi"}]})"),
              HasSubstr("bad.jsonl:2: no assistant message"));
  EXPECT_THAT(error_for(R"({"add_generation_prompt": true, "messages": [{"role": "assistant", "content": "x"}]})"),
              HasSubstr("bad.jsonl:2: add_generation_prompt is true"));
  EXPECT_THAT(error_for(R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": )"
                        R"({"url": "x.png"}}]}, {"role": "assistant", "content": "a cat"}]})"),
              AllOf(HasSubstr("bad.jsonl:2"), HasSubstr("messages[0].content[0] is an image")));
  EXPECT_THAT(error_for(R"({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]})"),
              AllOf(HasSubstr("bad.jsonl:2"), HasSubstr("messages[0].role 'robot'")));
  EXPECT_THAT(error_for(good, 300), AllOf(HasSubstr("bad.jsonl:1"), HasSubstr("vocabulary of 300")));
  const std::string empty = dir.file("empty.jsonl");
  std::ofstream(empty) << "\n";
  EXPECT_THAT(k3test::error_of([&] { load_sft_data(empty, tok, 1024, 1 << 20); }),
              HasSubstr("nothing to train: no conversations"));
  EXPECT_THAT(k3test::error_of([&] { load_sft_data(dir.file("absent.jsonl"), tok, 1024, 1 << 20); }),
              HasSubstr("absent.jsonl"));
}

TEST(SftPlan, EveryConversationOncePerEpochInStepsThatFit) {
  const std::vector<int64_t> lengths = {30, 5, 70, 12, 12, 40, 200, 8, 64, 1};
  for (bool shuffle : {false, true}) {
    const SftPlan p = plan_sft_steps(lengths, 3, 100, shuffle, 9);
    ASSERT_EQ(p.order.size(), 3 * lengths.size());
    EXPECT_EQ(p.step_begin.front(), 0);
    EXPECT_EQ(p.step_begin.back(), int64_t(p.order.size()));
    std::vector<std::vector<int64_t>> epochs(3);
    for (int64_t s = 0; s < p.steps(); ++s) {
      const int64_t b = p.step_begin[size_t(s)], e = p.step_begin[size_t(s + 1)];
      ASSERT_LT(b, e);
      EXPECT_EQ(b / 10, (e - 1) / 10) << "step " << s << " spans two epochs";
      int64_t tokens = 0;
      for (int64_t k = b; k < e; ++k) tokens += lengths[size_t(p.order[size_t(k)])];
      if (e - b > 1) {
        EXPECT_LE(tokens, 100) << "step " << s;
      }
      // Greedy: the next conversation would not have fitted.
      if (e < int64_t(p.order.size()) && e % 10 != 0) {
        EXPECT_GT(tokens + lengths[size_t(p.order[size_t(e)])], 100);
      }
      for (int64_t k = b; k < e; ++k) epochs[size_t(k / 10)].push_back(p.order[size_t(k)]);
    }
    for (const auto& ep : epochs) EXPECT_EQ(std::set<int64_t>(ep.begin(), ep.end()).size(), lengths.size());
    if (!shuffle) {
      EXPECT_EQ(epochs[0], std::vector<int64_t>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
    } else {
      EXPECT_NE(epochs[0], epochs[1]);  // a new order each epoch
      EXPECT_EQ(p.order, plan_sft_steps(lengths, 3, 100, true, 9).order);
      EXPECT_NE(p.order, plan_sft_steps(lengths, 3, 100, true, 10).order);
    }
  }
  EXPECT_THROW(plan_sft_steps(lengths, 0, 100, false, 0), Error);
}

// The masked loss is the cross-entropy of the trained tokens, from the logits; its gradient matches finite
// differences of that loss (float64, k3-tiny-a).
TEST(SftLoss, IsTheTrainedTokensCrossEntropyAndItsGradient) {
  ParamStore P = ParamStore::from_model_dir(fixture("k3-tiny-a"));
  const K3Config c = load_config(fixture("k3-tiny-a/config.json"));
  const std::vector<int32_t> ids = {5, 900, 17, 260, 3, 3, 700, 41, 1000, 12, 64, 8};
  const TokenMask mask = {1, 0, 0, 0, 1, 1, 0, 1, 1, 1, 0, 1};  // mask[0] is not read
  std::vector<double> logits;
  P.zero_grads();
  const double loss = sequence_loss(P, c, ids, {}, true, 1.0, &logits, nullptr, &mask);
  const int64_t V = c.vocab_size;
  double want = 0;
  for (size_t t = 0; t + 1 < ids.size(); ++t) {
    if (!mask[t + 1]) continue;
    const double* z = &logits[t * size_t(V)];
    double mx = -std::numeric_limits<double>::infinity(), s = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, z[v]);
    for (int64_t v = 0; v < V; ++v) s += std::exp(z[v] - mx);
    want += mx + std::log(s) - z[ids[t + 1]];
  }
  EXPECT_NEAR(loss, want, 1e-12 * want);
  EXPECT_EQ(target_count(int64_t(ids.size()), {}, &mask), 6);

  std::vector<double> fd, an;
  auto masked = [&] { return sequence_loss(P, c, ids, {}, false, 0.0, nullptr, nullptr, &mask); };
  for (const std::string& n : trainable_names(P)) {
    const bool pick = n.find("lm_head") != std::string::npos || n.find("embed_tokens") != std::string::npos ||
                      n.find("layers.0.self_attn") != std::string::npos || n.find("layers.3.mlp") != std::string::npos;
    if (!pick) continue;
    const int64_t k = P.numel(n);
    for (int64_t j : {int64_t(0), k / 3, k / 2 + 1, k - 1}) {
      an.push_back(P.g(n)[j]);
      fd.push_back(k3test::central_difference(&P.p_mut(n)[j], masked));
    }
  }
  ASSERT_GT(an.size(), 8u);
  EXPECT_LE(k3test::rel_l2(an.data(), fd.data(), fd.size()), 1e-6);
  const TokenMask short_mask(3, 1);
  EXPECT_THAT(k3test::error_of([&] { sequence_loss(P, c, ids, {}, false, 0.0, nullptr, nullptr, &short_mask); }),
              HasSubstr("trained-token mask has 3 entries for a sequence of 12 tokens"));
}

TEST(SftCli, LearnsTheAnswersResumesExactlyAndItsCheckpointChats) {
  k3test::SftCorpus c;
  const std::string a = c.dir.file("a");
  const k3test::Outcome r = k3test::run_k3(k3test::sft_args(c, a));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("48 conversations"));
  EXPECT_THAT(r.output, HasSubstr("epoch 3/3"));
  EXPECT_THAT(r.output, HasSubstr("held-out loss"));
  const std::vector<double> l = k3test::losses(a);
  const std::vector<std::pair<int64_t, double>> held = k3test::eval_losses(a);
  ASSERT_FALSE(held.empty());
  std::printf("first step %.4f, last step %.4f, held-out %.4f\n", l.front(), l.back(), held.back().second);
  EXPECT_LT(held.back().second, l.front() - 2.0) << "the answers were not learned";

  // The same run stopped after 3 steps and resumed: the same losses, bit for bit.
  TrainOptions o;
  o.init_model = c.model, o.config_path = c.model + "/config.json", o.tokenizer_dir = c.model;
  o.sft_data = c.train, o.eval_path = c.held_out, o.out_dir = c.dir.file("b");
  o.epochs = 3, o.tokens_per_step = 512, o.lr = 3e-3, o.warmup_fraction = 0.03, o.seed = 5, o.grad_lanes = 2;
  o.save_every = 1, o.log_every = 0;
  int steps = 0;
  o.on_step = [&](const std::string&) { return ++steps < 3; };
  EXPECT_EQ(k3::train::train(o).steps, 3);
  o.on_step = nullptr, o.resume = true;
  EXPECT_EQ(k3::train::train(o).steps, int64_t(l.size()));
  EXPECT_EQ(k3test::losses(o.out_dir), l);
  EXPECT_EQ(k3test::eval_losses(o.out_dir).back(), held.back());  // (the stopped run also evaluated at its end)

  // Another data file is another run: refused on resume.
  std::ofstream(c.dir.file("other.jsonl")) << k3test::addition_conversations(10, 3);
  o.sft_data = c.dir.file("other.jsonl");
  EXPECT_THAT(k3test::error_of([&] { k3::train::train(o); }), HasSubstr("--data"));

  // The checkpoint, which carries the tokenizer, answers a chat request in the trained form: reasoning, a response
  // of digits, the message closed (the initial model writes neither).
  const std::string req = c.dir.file("req.json");
  std::ofstream(req) << R"({"messages": [{"role": "user", "content": "What is 2 plus 3?"}]})";
  const k3test::Outcome g =
      k3test::run_k3({"generate", "--model", latest_checkpoint(a), "--request", req, "--max-new-tokens", "48"});
  ASSERT_EQ(g.status, 0) << g.output;
  EXPECT_THAT(g.output, HasSubstr("stopped on eos"));
  const size_t at = g.output.find("message: ");
  ASSERT_NE(at, std::string::npos) << g.output;
  const nlohmann::json msg = nlohmann::json::parse(g.output.substr(at + 9, g.output.find('\n', at) - at - 9));
  EXPECT_THAT(msg["reasoning_content"].get<std::string>(), HasSubstr(" + ")) << g.output;
  const std::string answer = msg["content"].get<std::string>();
  EXPECT_TRUE(!answer.empty() && answer.find_first_not_of("0123456789") == std::string::npos) << g.output;
}

TEST(SftCli, BadFlagsAreClearErrors) {
  k3test::SftCorpus c;
  auto run = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = k3test::sft_args(c, c.dir.file("x"));
    args.insert(args.end(), extra.begin(), extra.end());
    return k3test::run_k3(args);
  };
  k3test::Outcome r = run({"--epochs", "0"});
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.output, HasSubstr("--epochs"));
  r = run({"--max-seq-len", "2000000"});
  EXPECT_THAT(r.output, HasSubstr("exceeds max_position_embeddings"));
  r = run({"--tokenizer", c.dir.file("nowhere")});
  EXPECT_THAT(r.output, HasSubstr("no tiktoken.model to encode the conversations with; give --tokenizer DIR"));
  r = run({"--precision", "f32"});
  EXPECT_THAT(r.output, HasSubstr("--precision is for --device cuda"));
}
