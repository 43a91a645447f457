#include "train/sft_data.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "core/splitmix.h"
#include "io/file.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/xtml_chat.h"

namespace k3::train {

namespace {

bool has_assistant_message(const nlohmann::ordered_json& request) {
  for (const auto& m : request["messages"])
    if (m.is_object() && m.contains("role") && m["role"].is_string() &&
        m["role"].get_ref<const std::string&>() == "assistant")
      return true;
  return false;
}

}  // namespace

SftData load_sft_data(const std::string& path, const Tokenizer& tok, int64_t vocab_size, int64_t max_len) {
  if (max_len < 2) fail("SFT data: the longest sequence must be at least 2 tokens, got ", max_len);
  const std::string text = read_file(path, "SFT conversations");
  SftData d;
  int64_t line = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string_view row(text.data() + pos, end - pos);
    pos = end + 1;
    ++line;
    if (row.find_first_not_of(" \t\r") == std::string_view::npos) continue;  // blank lines
    const std::string where = path + ":" + std::to_string(line);
    nlohmann::ordered_json request = parse_chat_request(row, where);
    if (!request.is_object() || !request.contains("messages") || !request["messages"].is_array())
      fail(where, ": expected a chat request object with 'messages'");
    if (request.contains("add_generation_prompt") && request["add_generation_prompt"].is_boolean() &&
        request["add_generation_prompt"].get<bool>())
      fail(where, ": add_generation_prompt is true; a training conversation ends with its last message");
    request["add_generation_prompt"] = false;
    if (!has_assistant_message(request)) fail(where, ": no assistant message, so nothing to train on");
    ++d.conversations;
    std::vector<ChatImagePart> images;
    std::vector<ChatSegment> segments;
    try {
      segments = render_chat(request, &images);
    } catch (const Error& e) {
      fail(where, ": ", e.what());
    }
    if (!images.empty()) fail(where, ": ", images[0].field, " is an image; k3 sft trains on text conversations only");
    SftExample ex;
    ex.line = line;
    ex.ids = encode_segments(tok, segments, &ex.trained);
    for (int32_t id : ex.ids)
      if (id < 0 || id >= vocab_size)
        fail(where, ": token id ", id, " is outside the model's vocabulary of ", vocab_size,
             " (a tokenizer for another model?)");
    if (int64_t(ex.ids.size()) > max_len) {
      ex.ids.resize(size_t(max_len)), ex.trained.resize(size_t(max_len));
      ++d.truncated;
    }
    const int64_t targets = target_count(int64_t(ex.ids.size()), {}, &ex.trained);
    if (targets == 0) {
      ++d.untrained;
      continue;
    }
    d.tokens += int64_t(ex.ids.size());
    d.trained_tokens += targets;
    d.examples.push_back(std::move(ex));
  }
  if (d.examples.empty())
    fail(path, ": nothing to train: ",
         d.conversations == 0 ? "no conversations"
                              : "no conversation has an assistant token within the longest sequence");
  return d;
}

SftPlan plan_sft_steps(const std::vector<int64_t>& lengths, int64_t epochs, int64_t tokens_per_step, bool shuffle,
                       uint64_t seed) {
  if (epochs < 1) fail("SFT: --epochs must be at least 1, got ", epochs);
  if (tokens_per_step < 1) fail("SFT: --tokens-per-step must be at least 1, got ", tokens_per_step);
  const int64_t n = int64_t(lengths.size());
  SftPlan plan;
  plan.step_begin.push_back(0);
  for (int64_t e = 0; e < epochs; ++e) {
    std::vector<int64_t> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), int64_t(0));
    if (shuffle) {  // Fisher-Yates on counter-based draws: the same order on every platform
      const uint64_t key = splitmix64(seed * 0x100000001b3ULL ^ uint64_t(e));
      for (int64_t i = n - 1; i > 0; --i)
        std::swap(order[size_t(i)], order[size_t(splitmix64(key + uint64_t(i)) % uint64_t(i + 1))]);
    }
    int64_t in_step = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t len = lengths[size_t(order[size_t(i)])];
      if (in_step > 0 && in_step + len > tokens_per_step) {
        plan.step_begin.push_back(int64_t(plan.order.size()));
        in_step = 0;
      }
      plan.order.push_back(order[size_t(i)]);
      in_step += len;
    }
    if (in_step > 0) plan.step_begin.push_back(int64_t(plan.order.size()));
  }
  return plan;
}

}  // namespace k3::train
