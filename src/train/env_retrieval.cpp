// The long-context retrieval tasks of `k3 corpus retrieval` (data/retrieval_tasks.h) as an RL environment: the user
// message is a passkey or multi-key document with its question, and the answer scores 1 when the last integer of
// the response is the key. No tools: one turn.
//
// Options: "filler" (required: a text file or a directory of *.txt documents, e.g. `k3 corpus brown`'s OUT/train),
// "tokenizer" (required: the directory whose tokenizer measures the prompt lengths, the policy's), "task" (passkey
// or multikey, default passkey), "max_tokens" (the document's length in tokens, default 512), "keys" (multikey's
// pairs, default 4).
#include <string>

#include "core/error.h"
#include "core/splitmix.h"
#include "data/retrieval_tasks.h"
#include "train/environment.h"

namespace k3::train {

namespace {

using ojson = nlohmann::ordered_json;

std::string string_option(const nlohmann::json& o, const char* key, const std::string& fallback, bool required) {
  if (!o.contains(key)) {
    if (required) fail("retrieval environment: option '", key, "' is required");
    return fallback;
  }
  if (!o[key].is_string()) fail("retrieval environment: option '", key, "' must be a string");
  return o[key].get<std::string>();
}

class RetrievalEnvironment final : public Environment {
 public:
  explicit RetrievalEnvironment(const nlohmann::json& o)
      : tok_(Tokenizer::load_dir(string_option(o, "tokenizer", "", true))),
        gen_(tok_, data::read_filler_documents(string_option(o, "filler", "", true), "option 'filler'")),
        task_(data::parse_retrieval_task(string_option(o, "task", "passkey", false))),
        max_tokens_(integer_option(o, "retrieval", "max_tokens", 512, 16, int64_t(1) << 24)),
        keys_(int(integer_option(o, "retrieval", "keys", 4, 1, 64))) {
    if (max_tokens_ < gen_.min_tokens(task_, keys_))
      fail("retrieval environment: option 'max_tokens' ", max_tokens_, " cannot hold the task (at least ",
           gen_.min_tokens(task_, keys_), ")");
  }

  std::string name() const override { return "retrieval"; }

  Task task(uint64_t seed, int64_t index) override {
    const data::RetrievalExample ex =
        gen_.make(task_, splitmix64(seed ^ splitmix64(uint64_t(index) + 0x2f)), max_tokens_, keys_);
    const std::string answer = ex.answer.substr(ex.answer.find_first_not_of(' '));
    Task t;
    t.request = {{"messages", {{{"role", "user"}, {"content", ex.prompt}}}}};
    t.answer = answer;
    t.reference = {{{"role", "assistant"}, {"reasoning_content", "It is stated in the text."}, {"content", answer}}};
    return t;
  }

  ToolOutcome call(const Task&, const std::string& tool, const ojson&, nlohmann::json&) override {
    ToolOutcome out;
    out.content = "error: there is no tool '" + tool + "' in this task";
    return out;
  }

  double score(const Task& task, const XtmlAssistantMessage& answer, const nlohmann::json&) override {
    std::string got;
    return last_integer(answer.response, &got) && got == task.answer.get<std::string>() ? 1.0 : 0.0;
  }

 private:
  Tokenizer tok_;
  data::RetrievalTaskGenerator gen_;
  data::RetrievalTask task_;
  int64_t max_tokens_;
  int keys_;
};

}  // namespace

std::unique_ptr<Environment> make_retrieval_environment(const nlohmann::json& options) {
  // Before the tokenizer and the filler are read.
  check_option_names(options, "retrieval", {"filler", "tokenizer", "task", "max_tokens", "keys"});
  return std::make_unique<RetrievalEnvironment>(options);
}

}  // namespace k3::train
