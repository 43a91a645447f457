// The calculator task: "What is 37 * 12?" with a `calculator` tool that evaluates an arithmetic expression. The
// answer scores 1 when the last integer of the response is the exact result, else 0. A tiny model cannot multiply,
// so it succeeds only by calling the tool with the right expression and copying the result: the skill RL is to
// sharpen after supervised fine-tuning on the reference transcripts.
//
// Options: "digits" (operands have 1..digits digits, default 2), "ops" (the operators drawn from, default "+-*"),
// "by_hand" (the fraction of reference solutions that answer at once, without the tool, default 0). The reference
// transcript thinks in one of several phrasings of different lengths, so that a budget on the policy's tokens (the
// effort reward) has something to shorten. Transcripts with by_hand > 0 teach a policy two ways to answer, one of
// which a tiny model gets wrong for most operands: RL, rewarded by the outcome alone, is to find the tool.
#include <cctype>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/splitmix.h"
#include "train/environment.h"

namespace k3::train {

namespace {

using ojson = nlohmann::ordered_json;

// Integer arithmetic: + - * / (exact division only), parentheses, unary minus; |values| < 10^15.
class Expression {
 public:
  explicit Expression(const std::string& s) : s_(s) {}
  // The value, or "" and *error set.
  bool eval(long long* out, std::string* error) {
    try {
      const long long v = sum();
      skip();
      if (i_ != s_.size()) throw std::runtime_error("unexpected '" + s_.substr(i_, 1) + "'");
      *out = v;
      return true;
    } catch (const std::exception& e) {
      *error = e.what();
      return false;
    }
  }

 private:
  static long long checked(long double v) {
    if (v > 1e15L || v < -1e15L) throw std::runtime_error("number too large");
    return static_cast<long long>(v);
  }
  void skip() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  long long sum() {
    long long v = product();
    for (skip(); i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-'); skip()) {
      const char op = s_[i_++];
      const long long r = product();
      v = checked(op == '+' ? (long double)v + r : (long double)v - r);
    }
    return v;
  }
  long long product() {
    long long v = factor();
    for (skip(); i_ < s_.size() && (s_[i_] == '*' || s_[i_] == '/'); skip()) {
      const char op = s_[i_++];
      const long long r = factor();
      if (op == '*') {
        v = checked((long double)v * r);
      } else {
        if (r == 0) throw std::runtime_error("division by zero");
        if (v % r != 0) throw std::runtime_error("the quotient is not an integer");
        v /= r;
      }
    }
    return v;
  }
  long long factor() {
    skip();
    if (++depth_ > 64) throw std::runtime_error("nested too deeply");
    long long v = 0;
    if (i_ < s_.size() && s_[i_] == '-') {
      ++i_;
      v = -factor();
    } else if (i_ < s_.size() && s_[i_] == '(') {
      ++i_;
      v = sum();
      skip();
      if (i_ >= s_.size() || s_[i_] != ')') throw std::runtime_error("missing ')'");
      ++i_;
    } else {
      const size_t b = i_;
      while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) ++i_;
      if (i_ == b)
        throw std::runtime_error(i_ < s_.size() ? "unexpected '" + s_.substr(i_, 1) + "'" : "missing number");
      if (i_ - b > 15) throw std::runtime_error("number too large");
      v = std::stoll(s_.substr(b, i_ - b));
    }
    --depth_;
    return v;
  }
  const std::string& s_;
  size_t i_ = 0;
  int depth_ = 0;
};

const char* const kThoughts[] = {
    "Use the calculator.",
    "I should use the calculator tool for this.",
    "The exact value matters, so I will ask the calculator instead of working it out.",
    "This needs arithmetic. Rather than compute it by hand and risk a mistake, I will call the calculator tool with "
    "the expression and report what it returns.",
};

const char* const kByHandThoughts[] = {
    "I can do this in my head.",
    "This is simple enough to work out without a tool.",
};

class CalculatorEnvironment final : public Environment {
 public:
  explicit CalculatorEnvironment(const nlohmann::json& o) {
    check_option_names(o, "calculator", {"digits", "ops", "by_hand"});
    digits_ = int(integer_option(o, "calculator", "digits", digits_, 1, 6));
    if (o.contains("by_hand")) {
      const nlohmann::json& f = o["by_hand"];
      if (!f.is_number() || !(f.get<double>() >= 0.0 && f.get<double>() <= 1.0))
        fail("calculator environment: option 'by_hand' must be a number in [0, 1], got ", f.dump());
      by_hand_ = f.get<double>();
    }
    if (o.contains("ops")) {
      if (!o["ops"].is_string()) fail("calculator environment: option 'ops' must be a string such as \"+-*\"");
      ops_ = o["ops"].get<std::string>();
      if (ops_.empty() || ops_.find_first_not_of("+-*") != std::string::npos)
        fail("calculator environment: option 'ops' must be made of + - *, got \"", ops_, "\"");
    }
  }

  std::string name() const override { return "calculator"; }

  Task task(uint64_t seed, int64_t index) override {
    SplitMixUniform rng{splitmix64(seed ^ splitmix64(uint64_t(index) * 0x2545F4914F6CDD1DULL + 1))};
    long long limit = 1;
    for (int d = 0; d < digits_; ++d) limit *= 10;
    const long long a = (long long)(rng.next() * double(limit)), b = (long long)(rng.next() * double(limit));
    const char op = ops_[size_t(rng.next() * double(ops_.size()))];
    const std::string expr = std::to_string(a) + " " + op + " " + std::to_string(b);
    const long long value = op == '+' ? a + b : op == '-' ? a - b : a * b;
    const std::string thought = kThoughts[size_t(rng.next() * double(std::size(kThoughts)))];
    const double by_hand_draw = rng.next();  // drawn last: the tasks of by_hand = 0 are those of no option
    Task t;
    t.request = {{"messages", {{{"role", "user"}, {"content", "What is " + expr + "?"}}}}, {"tools", tools()}};
    t.answer = std::to_string(value);
    if (by_hand_draw < by_hand_) {
      const char* by_hand_thought =
          kByHandThoughts[size_t(by_hand_draw / by_hand_ * double(std::size(kByHandThoughts)))];
      t.reference = {{{"role", "assistant"}, {"reasoning_content", by_hand_thought}, {"content", t.answer}}};
      return t;
    }
    const ojson call = {{"type", "function"},
                        {"function", {{"name", "calculator"}, {"arguments", ojson{{"expression", expr}}.dump()}}}};
    t.reference = {{{"role", "assistant"}, {"reasoning_content", thought}, {"content", ""}, {"tool_calls", {call}}},
                   {{"role", "tool"}, {"tool", "calculator"}, {"content", std::to_string(value)}},
                   {{"role", "assistant"},
                    {"reasoning_content", "The calculator returned the result."},
                    {"content", std::to_string(value)}}};
    return t;
  }

  ToolOutcome call(const Task&, const std::string& tool, const ojson& arguments, nlohmann::json&) override {
    ToolOutcome out;
    if (tool != "calculator") {
      out.content = "error: there is no tool '" + tool + "' (the one tool is 'calculator')";
      return out;
    }
    if (!arguments.is_object() || !arguments.contains("expression") || !arguments["expression"].is_string()) {
      out.content = "error: give the expression as a string argument 'expression'";
      return out;
    }
    const std::string expr = arguments["expression"].get<std::string>();
    long long v = 0;
    std::string error;
    out.content = Expression(expr).eval(&v, &error) ? std::to_string(v) : "error: " + error;
    return out;
  }

  double score(const Task& task, const XtmlAssistantMessage& answer, const nlohmann::json&) override {
    std::string got;
    return last_integer(answer.response, &got) && got == task.answer.get<std::string>() ? 1.0 : 0.0;
  }

 private:
  static ojson tools() {
    return ojson::array({{{"type", "function"},
                          {"function",
                           {{"name", "calculator"},
                            {"description", "Integer arithmetic."},
                            {"parameters",
                             {{"type", "object"},
                              {"properties", {{"expression", {{"type", "string"}}}}},
                              {"required", {"expression"}}}}}}}});
  }
  int digits_ = 2;
  std::string ops_ = "+-*";
  double by_hand_ = 0.0;
};

}  // namespace

std::unique_ptr<Environment> make_calculator_environment(const nlohmann::json& options) {
  return std::make_unique<CalculatorEnvironment>(options);
}

}  // namespace k3::train
