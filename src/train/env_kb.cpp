// Multi-turn lookup over a synthetic knowledge base: "What is the city of the employer of Mara Velk?" needs one
// `lookup` call per hop (Mara Velk's employer, then that company's city), each from the answer of the last. Every correct hop looked up earns a dense reward (once per hop), and the answer scores 1 when it names the
// last hop's value. Each task carries its own small knowledge base (the chain, plus distractor facts about other
// entities of the same kinds), generated from (seed, index) and never shown to the policy.
//
// Options: "hops" (1..3, default 2), "hop_reward" (the dense reward per correct hop, default 0.5).
#include <string>
#include <vector>

#include "core/error.h"
#include "core/splitmix.h"
#include "train/environment.h"

namespace k3::train {

namespace {

using ojson = nlohmann::ordered_json;

const char* const kSyllables[] = {"ka", "ve", "lo", "mi", "ra", "tu", "sen", "dor", "bi", "na", "quo", "lin"};
// The relations of a chain, in order: person -> company -> city -> country.
struct Relation {
  const char* name;      // the lookup's relation argument
  const char* question;  // how the question names the hop: "What is the city of the employer of X?"
};
const Relation kRelations[] = {{"employer", "the employer"}, {"city", "the city"}, {"country", "the country"}};

std::string word(SplitMixUniform& rng, int syllables) {
  std::string w;
  for (int i = 0; i < syllables; ++i) w += kSyllables[size_t(rng.next() * double(std::size(kSyllables)))];
  w[0] = char(w[0] - 'a' + 'A');
  return w;
}

class KbEnvironment final : public Environment {
 public:
  explicit KbEnvironment(const nlohmann::json& o) {
    check_option_names(o, "kb", {"hops", "hop_reward"});
    hops_ = int(integer_option(o, "kb", "hops", hops_, 1, 3));
    if (o.contains("hop_reward")) {
      if (!o["hop_reward"].is_number()) fail("kb environment: option 'hop_reward' must be a number");
      hop_reward_ = o["hop_reward"].get<double>();
    }
  }

  std::string name() const override { return "kb"; }

  Task task(uint64_t seed, int64_t index) override {
    SplitMixUniform rng{splitmix64(seed ^ splitmix64(uint64_t(index) * 0x9E3779B97F4A7C15ULL + 7))};
    // The chain's entities, and as many distractors of each kind, with facts of their own.
    nlohmann::json facts = nlohmann::json::object(), chain = nlohmann::json::array();
    std::vector<std::string> kinds[4];
    for (int k = 0; k <= hops_; ++k)
      for (int j = 0; j < 3; ++j) kinds[k].push_back(k == 0 ? word(rng, 2) + " " + word(rng, 2) : word(rng, 3));
    for (int k = 0; k < hops_; ++k)
      for (size_t j = 0; j < kinds[k].size(); ++j)
        facts[kinds[k][j]][kRelations[k].name] = kinds[k + 1][(j + size_t(rng.next() * 3)) % kinds[k + 1].size()];
    std::string entity = kinds[0][0], question = "Use lookup to answer. What is ";
    for (int k = hops_ - 1; k >= 0; --k) question += std::string(kRelations[k].question) + " of ";
    question += entity + "?";
    ojson reference = ojson::array();
    for (int k = 0; k < hops_; ++k) {
      const std::string value = facts[entity][kRelations[k].name].get<std::string>();
      chain.push_back({entity, kRelations[k].name, value});
      const ojson call = {{"type", "function"},
                          {"function",
                           {{"name", "lookup"},
                            {"arguments", ojson{{"entity", entity}, {"relation", kRelations[k].name}}.dump()}}}};
      reference.push_back(
          {{"role", "assistant"},
           {"reasoning_content", "Look up the " + std::string(kRelations[k].name) + " of " + entity + "."},
           {"content", ""},
           {"tool_calls", {call}}});
      reference.push_back({{"role", "tool"}, {"tool", "lookup"}, {"content", value}});
      entity = value;
    }
    reference.push_back({{"role", "assistant"}, {"reasoning_content", "Found it."}, {"content", entity}});
    Task t;
    t.request = {{"messages", {{{"role", "user"}, {"content", question}}}}, {"tools", tools()}};
    t.answer = {{"answer", entity}, {"chain", chain}, {"facts", facts}};
    t.reference = reference;
    return t;
  }

  ToolOutcome call(const Task& task, const std::string& tool, const ojson& arguments, nlohmann::json& state) override {
    ToolOutcome out;
    if (tool != "lookup") {
      out.content = "error: there is no tool '" + tool + "' (the one tool is 'lookup')";
      return out;
    }
    if (!arguments.is_object() || !arguments.contains("entity") || !arguments["entity"].is_string() ||
        !arguments.contains("relation") || !arguments["relation"].is_string()) {
      out.content = "error: give 'entity' and 'relation' as strings";
      return out;
    }
    const std::string entity = arguments["entity"].get<std::string>(), rel = arguments["relation"].get<std::string>();
    const nlohmann::json& facts = task.answer.at("facts");
    out.content =
        facts.contains(entity) && facts[entity].contains(rel) ? facts[entity][rel].get<std::string>() : "unknown";
    // A dense reward for each hop of the chain, the first time it is looked up.
    if (!state.is_object()) state = {{"hops_found", nlohmann::json::array()}};
    const nlohmann::json& chain = task.answer.at("chain");
    for (size_t k = 0; k < chain.size(); ++k) {
      if (chain[k][0] != entity || chain[k][1] != rel) continue;
      bool seen = false;
      for (const auto& h : state["hops_found"]) seen = seen || h.get<size_t>() == k;
      if (!seen) state["hops_found"].push_back(k), out.reward = hop_reward_;
    }
    return out;
  }

  double score(const Task& task, const XtmlAssistantMessage& answer, const nlohmann::json&) override {
    return answer.response.find(task.answer.at("answer").get<std::string>()) != std::string::npos ? 1.0 : 0.0;
  }

 private:
  static ojson tools() {
    return ojson::array({{{"type", "function"},
                          {"function",
                           {{"name", "lookup"},
                            {"description", "A fact about an entity."},
                            {"parameters",
                             {{"type", "object"},
                              {"properties", {{"entity", {{"type", "string"}}}, {"relation", {{"type", "string"}}}}},
                              {"required", {"entity", "relation"}}}}}}}});
  }
  int hops_ = 2;
  double hop_reward_ = 0.5;
};

}  // namespace

std::unique_ptr<Environment> make_kb_environment(const nlohmann::json& options) {
  return std::make_unique<KbEnvironment>(options);
}

}  // namespace k3::train
