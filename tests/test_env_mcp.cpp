// The MCP environment (train/env_mcp.h) against a real MCP server written with the official SDK
// (tests/mcp/calc_server.mjs, npm @modelcontextprotocol/sdk):
//   - the server's tools, every page of tools/list, become the task request's "tools" (the reward tool hidden), and
//     are listed again after notifications/tools/list_changed or a relaunch;
//   - a call's text content, its dense reward and the episode state it carries; isError results and bad calls are
//     content the policy sees, not failures; server pings are answered and other server requests refused;
//   - the reward tool scores the final answer, and its failures are k3::Errors;
//   - a server that crashes, hangs, writes garbage or is killed under us gives ToolOutcome::error naming the tool
//     and the command; it is killed and reaped (no zombie, no pipe left open), SIGPIPE does not take the process
//     down, and the next call relaunches it;
//   - bad options, a missing or malformed tasks file and a program that is not an MCP server are k3::Errors naming
//     what is wrong.
// Tests that need node and the SDK skip where they are missing (scripts/setup.sh installs them into .deps/npm).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "train/env_mcp.h"
#include "util/error_of.h"
#include "util/temp_dir.h"

using namespace k3::train;
using json = nlohmann::json;
using ojson = nlohmann::ordered_json;
using k3test::error_of;
using ::testing::HasSubstr;

namespace {

const std::string kServer = std::string(K3_SOURCE_DIR) + "/tests/mcp/calc_server.mjs";

// Why the server cannot run here ("" when it can).
std::string node_missing() {
  if (std::system("node --version > /dev/null 2>&1") != 0) return "no node on PATH (scripts/setup.sh installs it)";
  for (const char* pkg : {"@modelcontextprotocol/sdk", "zod"})
    if (!std::filesystem::exists(std::string(K3_SOURCE_DIR) + "/.deps/npm/node_modules/" + pkg + "/package.json"))
      return std::string("npm package ") + pkg + " is not in .deps/npm (scripts/setup.sh installs it)";
  return "";
}

void write_file(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// Task 0 uses the server's tools; task 1 (after a blank line) names its own.
const char* const kTasks =
    R"({"messages": [{"role": "user", "content": "What is 2 + 3?"}], "answer": 5, )"
    R"("reference": [{"role": "assistant", "content": "5"}]})"
    "\n\n"
    R"({"messages": [{"role": "user", "content": "Say x."}], "answer": "x", )"
    R"("tools": [{"type": "function", "function": {"name": "own", "parameters": {"type": "object"}}}]})"
    "\n";

// How many files this process has open.
int64_t open_fds() {
  int64_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// True once `pid` is gone: no such process (killed and reaped). A zombie still answers kill(pid, 0).
bool gone(int pid) { return kill(pid, 0) != 0 && errno == ESRCH; }

// Waits up to 10 s for `pid` (not our child to reap: the environment's) to be dead and unreaped, with its files
// closed. The leader shows 'Z' before the process's other threads (node has several) have exited, and until the
// last of them has, the file table and so the pipes are still open: wait for the leader to be the only task left.
bool dead_with_files_closed(int pid) {
  const std::string proc = "/proc/" + std::to_string(pid);
  for (int i = 0; i < 1000; ++i) {
    std::ifstream stat(proc + "/stat");
    std::string line;
    std::getline(stat, line);
    const size_t paren = line.rfind(')');
    std::error_code ec;
    int64_t tasks = 0;
    for (auto it = std::filesystem::directory_iterator(proc + "/task", ec);
         !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
      ++tasks;
    if (paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z' && tasks == 1) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

class Mcp : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = node_missing(); !why.empty()) GTEST_SKIP() << why;
    write_file(dir.file("tasks.jsonl"), kTasks);
  }
  json options(int timeout_ms = 10000) const {
    return {{"command", {"node", kServer}}, {"tasks", dir.file("tasks.jsonl")}, {"timeout_ms", timeout_ms}};
  }
  // The server's process id, from its own "pid" tool.
  static int server_pid(Environment& env) {
    json state;
    const ToolOutcome o = env.call(env.task(0, 0), "pid", ojson::object(), state);
    EXPECT_EQ(o.error, "");
    return std::atoi(o.content.c_str());
  }
  // A call of "add" works: the sum comes back.
  static void add_works(Environment& env) {
    json state;
    const ToolOutcome o = env.call(env.task(0, 0), "add", {{"a", 2}, {"b", 3}}, state);
    EXPECT_EQ(o.error, "");
    EXPECT_EQ(o.content, "5");
  }
  k3test::TempDir dir{"mcp"};
};

TEST_F(Mcp, ServerToolsAreListedIntoTheRequest) {
  auto env = make_mcp_environment(options());
  EXPECT_EQ(env->name(), "mcp");
  const Task t = env->task(0, 0);
  EXPECT_EQ(t.answer, json(5));
  EXPECT_EQ(t.reference, ojson::parse(R"([{"role": "assistant", "content": "5"}])"));
  EXPECT_FALSE(t.request.contains("answer"));
  EXPECT_FALSE(t.request.contains("reference"));
  EXPECT_EQ(t.request["messages"][0]["content"], "What is 2 + 3?");
  // The server pages tools/list 3 at a time: all 10 visible tools need every page; "reward" is hidden.
  std::vector<std::string> names;
  for (const ojson& tool : t.request["tools"]) {
    EXPECT_EQ(tool["type"], "function");
    names.push_back(tool["function"]["name"].get<std::string>());
  }
  EXPECT_EQ(names, (std::vector<std::string>{"add", "fail", "pid", "ask_client", "crash", "hang", "garbage", "wrong_id",
                                             "no_result", "grow"}));
  const ojson& add = t.request["tools"][0]["function"];
  EXPECT_EQ(add["description"], "Adds two numbers.");
  EXPECT_EQ(add["parameters"]["type"], "object");
  EXPECT_EQ(add["parameters"]["properties"]["a"]["type"], "number");
  EXPECT_EQ(add["parameters"]["required"], ojson::parse(R"(["a", "b"])"));

  // A line's own tools are kept; indices wrap (the blank line is no task); the seed does not matter.
  const Task own = env->task(0, 1);
  ASSERT_EQ(own.request["tools"].size(), 1u);
  EXPECT_EQ(own.request["tools"][0]["function"]["name"], "own");
  EXPECT_TRUE(own.reference.is_null());
  EXPECT_EQ(env->task(0, 2).request, t.request);
  EXPECT_EQ(env->task(0, -1).request, own.request);
  EXPECT_EQ(env->task(12345, 0).request, t.request);
}

TEST_F(Mcp, CallGivesContentDenseRewardAndState) {
  auto env = make_mcp_environment(options());
  const Task t = env->task(0, 0);
  json state;  // null at the start of an episode
  ToolOutcome o = env->call(t, "add", {{"a", 2}, {"b", 3}}, state);
  EXPECT_EQ(o.error, "");
  EXPECT_EQ(o.content, "5");
  EXPECT_EQ(o.reward, 0.5);  // the episode's first add
  EXPECT_EQ(state, json({{"adds", 1}}));
  o = env->call(t, "add", {{"a", 1.5}, {"b", 2}}, state);
  EXPECT_EQ(o.content, "3.5");
  EXPECT_EQ(o.reward, 0.0);  // the server saw the state: not the first add
  EXPECT_EQ(state, json({{"adds", 2}}));
  json other;  // another episode's state is its own
  EXPECT_EQ(env->call(t, "add", {{"a", 0}, {"b", 0}}, other).reward, 0.5);

  // What the policy did wrong is content for it to read, not an episode failure.
  o = env->call(t, "fail", ojson::object(), state);
  EXPECT_EQ(o.error, "");
  EXPECT_EQ(o.content, "fail: this tool always fails");
  o = env->call(t, "add", {{"a", "two"}, {"b", 3}}, state);
  EXPECT_EQ(o.error, "");
  EXPECT_THAT(o.content, HasSubstr("Invalid arguments for tool add"));
  o = env->call(t, "nope", ojson::object(), state);
  EXPECT_EQ(o.error, "");
  EXPECT_THAT(o.content, HasSubstr("Tool nope not found"));
  o = env->call(t, "add", ojson::array({1, 2}), state);
  EXPECT_EQ(o.error, "");
  EXPECT_THAT(o.content, HasSubstr("must be a JSON object"));
  // The reward tool is not the policy's to call.
  o = env->call(t, "reward", {{"answer", 5}, {"response", "5"}}, state);
  EXPECT_EQ(o.error, "");
  EXPECT_EQ(o.content, "unknown tool 'reward'");
  EXPECT_EQ(state, json({{"adds", 2}}));
}

// The tools the tasks carry, by name.
std::vector<std::string> tool_names(const Task& t) {
  std::vector<std::string> names;
  for (const ojson& tool : t.request["tools"]) names.push_back(tool["function"]["name"].get<std::string>());
  return names;
}

// notifications/tools/list_changed (the SDK sends it when "grow" registers "double"): tasks drawn after it carry
// the new tool, a task drawn before keeps its list, and a line's own tools stay. A relaunched server is a new
// session with its own tools: once a call has relaunched it after a crash, the tasks lose "double" again.
TEST_F(Mcp, ToolListChangesReachLaterTasks) {
  auto env = make_mcp_environment(options());
  const Task before = env->task(0, 0);
  const std::vector<std::string> listed = tool_names(before);
  ASSERT_EQ(std::count(listed.begin(), listed.end(), "double"), 0);
  json state;
  EXPECT_EQ(env->call(before, "grow", ojson::object(), state).content, "grown");
  const Task after = env->task(0, 0);
  std::vector<std::string> grown = listed;
  grown.push_back("double");
  EXPECT_EQ(tool_names(after), grown);
  EXPECT_EQ(after.request["tools"].back()["function"]["parameters"]["properties"]["x"]["type"], "number");
  EXPECT_EQ(tool_names(before), listed);
  EXPECT_EQ(tool_names(env->task(0, 1)), std::vector<std::string>{"own"});
  EXPECT_EQ(env->call(after, "double", {{"x", 4}}, state).content, "8");
  EXPECT_EQ(tool_names(env->task(0, 0)), grown);  // listed once per change

  EXPECT_NE(env->call(after, "crash", ojson::object(), state).error, "");
  EXPECT_EQ(tool_names(env->task(0, 0)), grown);  // down: task() does not relaunch it
  add_works(*env);                                // the call relaunches it
  EXPECT_EQ(tool_names(env->task(0, 0)), listed);
}

// While a call is pending the server pings us (answered {}), logs (skipped) and asks roots/list (refused).
TEST_F(Mcp, ServerRequestsAreAnswered) {
  auto env = make_mcp_environment(options());
  json state;
  const ToolOutcome o = env->call(env->task(0, 0), "ask_client", ojson::object(), state);
  EXPECT_EQ(o.error, "");
  EXPECT_EQ(o.content, "ping ok\nroots/list refused: MCP error -32601: Method not found");
}

TEST_F(Mcp, RewardToolScoresTheAnswer) {
  auto env = make_mcp_environment(options());
  const Task t = env->task(0, 0);
  k3::XtmlAssistantMessage m;
  m.response = "2 + 3 = 5.";
  EXPECT_EQ(env->score(t, m, json()), 1.0);
  EXPECT_EQ(env->score(t, m, json({{"adds", 1}})), 1.25);  // the state reached the reward tool
  m.response = "It is 6.";
  EXPECT_EQ(env->score(t, m, json()), 0.0);
}

TEST_F(Mcp, RewardToolFailuresAreErrors) {
  k3::XtmlAssistantMessage m;
  m.response = "5";
  struct Case {
    const char* tool;
    const char* says;
  };
  for (const Case& c : {Case{"crash", "exited with status 3"}, Case{"fail", "fail: this tool always fails"},
                        Case{"ask_client", "not a number"}}) {
    SCOPED_TRACE(c.tool);
    json o = options();
    o["reward_tool"] = c.tool;
    auto env = make_mcp_environment(o);
    const std::string e = error_of([&] { env->score(env->task(0, 0), m, json()); });
    EXPECT_THAT(e, HasSubstr(std::string("tool '") + c.tool + "'"));
    EXPECT_THAT(e, HasSubstr(c.says));
    EXPECT_THAT(e, HasSubstr(kServer));
    add_works(*env);  // the server is (re)started for the next call
  }
  json o = options();
  o["reward_tool"] = nullptr;  // no outcome reward
  EXPECT_EQ(make_mcp_environment(o)->score(Task{}, m, json()), 0.0);
}

struct Misbehaviour {
  const char* tool;
  const char* says;
};
// gtest (and so ctest's test names) print the parameter as its tool, not as raw bytes.
void PrintTo(const Misbehaviour& m, std::ostream* os) { *os << m.tool; }

class McpFailure : public Mcp, public ::testing::WithParamInterface<Misbehaviour> {};

// The misbehaving call fails the episode with an error naming the tool, what happened and the command; the server is
// killed and reaped; the next call starts a new one that works.
TEST_P(McpFailure, KillsAndRelaunchesTheServer) {
  const int timeout_ms = 1000;
  const int64_t fds = open_fds();
  auto env = make_mcp_environment(options(timeout_ms));
  const int before = server_pid(*env);
  ASSERT_GT(before, 0);
  json state = {{"adds", 1}};
  const auto start = std::chrono::steady_clock::now();
  const ToolOutcome o = env->call(env->task(0, 0), GetParam().tool, ojson::object(), state);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  EXPECT_THAT(o.error, HasSubstr(std::string("tool '") + GetParam().tool + "'"));
  EXPECT_THAT(o.error, HasSubstr("node " + kServer));
  EXPECT_THAT(o.error, HasSubstr(GetParam().says));
  EXPECT_EQ(o.content, "");
  EXPECT_EQ(o.reward, 0.0);
  EXPECT_EQ(state, json({{"adds", 1}}));  // a failed call leaves the state alone
  if (std::string(GetParam().tool) == "hang") {
    EXPECT_GE(ms, timeout_ms);
    EXPECT_LT(ms, timeout_ms + 5000);
  }
  EXPECT_TRUE(gone(before)) << "the old server " << before << " is still there (alive or a zombie)";
  EXPECT_LE(waitpid(-1, nullptr, WNOHANG), 0) << "an unreaped child";
  add_works(*env);
  const int after = server_pid(*env);
  EXPECT_NE(after, before);
  EXPECT_FALSE(gone(after));
  env.reset();
  EXPECT_EQ(open_fds(), fds) << "pipes left open";
}

INSTANTIATE_TEST_SUITE_P(Misbehaving, McpFailure,
                         ::testing::Values(Misbehaviour{"crash", "closed its stdout (exited with status 3)"},
                                           Misbehaviour{"hang", "did not answer tools/call within 1000 ms (killed)"},
                                           Misbehaviour{"garbage", "wrote a line that is not JSON: 'this is not JSON'"},
                                           Misbehaviour{"wrong_id", "answered id 987654321"},
                                           Misbehaviour{"no_result", "with neither a result nor an error"}),
                         [](const auto& info) { return std::string(info.param.tool); });

// A server killed between calls (say by the OOM killer): writing to it fails with EPIPE, whose SIGPIPE would kill
// this process if it were not blocked. The call fails, no SIGPIPE is left pending, and the next call relaunches.
TEST_F(Mcp, ServerKilledBetweenCallsIsNoSigpipe) {
  auto env = make_mcp_environment(options());
  const int pid = server_pid(*env);
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  ASSERT_TRUE(dead_with_files_closed(pid));
  json state;
  const ToolOutcome o = env->call(env->task(0, 0), "add", {{"a", 1}, {"b", 1}}, state);
  EXPECT_THAT(o.error, HasSubstr("tool 'add'"));
  EXPECT_THAT(o.error, HasSubstr("no longer reads its stdin (EPIPE) (killed by signal 9)"));
  sigset_t pending;
  sigpending(&pending);
  EXPECT_EQ(sigismember(&pending, SIGPIPE), 0);
  EXPECT_TRUE(gone(pid));
  add_works(*env);
}

TEST_F(Mcp, DestructorStopsTheServer) {
  auto env = make_mcp_environment(options());
  const int pid = server_pid(*env);
  ASSERT_FALSE(gone(pid));
  env.reset();
  EXPECT_TRUE(gone(pid));
  EXPECT_LE(waitpid(-1, nullptr, WNOHANG), 0) << "an unreaped child";
}

// Checked before anything is launched: no node needed.
TEST(McpOptions, BadOptionsAreNamed) {
  k3test::TempDir dir("mcp-options");
  const std::string tasks = dir.file("tasks.jsonl");
  write_file(tasks, kTasks);
  const json command = {"node", kServer};
  auto error = [](const json& o) { return error_of([&] { make_mcp_environment(o); }); };
  EXPECT_THAT(error({{"tasks", tasks}}), HasSubstr("option \"command\" is required"));
  EXPECT_THAT(error({{"command", json::array()}, {"tasks", tasks}}), HasSubstr("option \"command\" must be"));
  EXPECT_THAT(error({{"command", "node server.mjs"}, {"tasks", tasks}}), HasSubstr("option \"command\" must be"));
  EXPECT_THAT(error({{"command", {"node", 3}}, {"tasks", tasks}}), HasSubstr("option \"command\""));
  EXPECT_THAT(error({{"command", command}}), HasSubstr("option \"tasks\" is required"));
  EXPECT_THAT(error({{"command", command}, {"tasks", tasks}, {"timeout", 5}}), HasSubstr("unknown option \"timeout\""));
  EXPECT_THAT(error({{"command", command}, {"tasks", tasks}, {"timeout_ms", 0}}), HasSubstr("\"timeout_ms\""));
  EXPECT_THAT(error({{"command", command}, {"tasks", tasks}, {"timeout_ms", 1.5}}), HasSubstr("\"timeout_ms\""));
  EXPECT_THAT(error({{"command", command}, {"tasks", tasks}, {"reward_tool", 7}}), HasSubstr("\"reward_tool\""));
  EXPECT_THAT(error(json::array()), HasSubstr("options must be a JSON object"));

  const std::string missing = dir.file("no-such-tasks.jsonl");
  std::string e = error({{"command", command}, {"tasks", missing}});
  EXPECT_THAT(e, HasSubstr("cannot read the tasks file '" + missing + "'"));
  EXPECT_THAT(e, HasSubstr("No such file"));

  struct Bad {
    const char* text;
    const char* says;
  };
  for (const Bad& b :
       {Bad{"{\"messages\": [], \"answer\": 1}\n{not json\n", "line 2: not JSON"},
        Bad{"[1, 2]\n", "line 1: not a JSON object"}, Bad{"{\"answer\": 1}\n", "line 1: needs \"messages\""},
        Bad{"\n{\"messages\": []}\n", "line 2: needs \"answer\""},
        Bad{"{\"messages\": [], \"answer\": 1, \"reference\": 3}\n", "line 1: \"reference\" must be"},
        Bad{"{\"messages\": [], \"answer\": 1, \"tools\": {}}\n", "line 1: \"tools\" must be"},
        Bad{"\n\n", "has no tasks"}}) {
    SCOPED_TRACE(b.text);
    const std::string bad = dir.file("bad.jsonl");
    write_file(bad, b.text);
    e = error({{"command", command}, {"tasks", bad}});
    EXPECT_THAT(e, HasSubstr(bad));
    EXPECT_THAT(e, HasSubstr(b.says));
  }
}

// A command that cannot start, or that is not an MCP server, is a k3::Error naming it; nothing is left running.
TEST(McpOptions, NotAnMcpServerIsNamed) {
  k3test::TempDir dir("mcp-options");
  const std::string tasks = dir.file("tasks.jsonl");
  write_file(tasks, kTasks);
  auto error = [&](const json& command) {
    return error_of([&] { make_mcp_environment({{"command", command}, {"tasks", tasks}, {"timeout_ms", 2000}}); });
  };
  std::string e = error({"/nonexistent/k3-no-such-server"});
  EXPECT_THAT(e, HasSubstr("`/nonexistent/k3-no-such-server`"));
  EXPECT_THAT(e, HasSubstr("cannot start: No such file or directory"));
  e = error({"/bin/sh", "-c", "echo hello; sleep 60"});
  EXPECT_THAT(e, HasSubstr("`/bin/sh -c echo hello; sleep 60`"));
  EXPECT_THAT(e, HasSubstr("initialize: wrote a line that is not JSON: 'hello' (killed)"));
  // Seen as its stdout closing, or as EPIPE when it is gone before the request is written: either way, how it ended.
  e = error({"/bin/sh", "-c", "exit 7"});
  EXPECT_THAT(e, HasSubstr("initialize: "));
  EXPECT_THAT(e, HasSubstr("(exited with status 7)"));
  // Reads its input and never answers: the startup deadline ends it.
  e = error_of([&] {
    make_mcp_environment(
        {{"command", {"/bin/sh", "-c", "cat > /dev/null"}}, {"tasks", tasks}, {"startup_timeout_ms", 300}});
  });
  EXPECT_THAT(e, HasSubstr("initialize: did not answer initialize within 300 ms (killed)"));
  EXPECT_LE(waitpid(-1, nullptr, WNOHANG), 0) << "an unreaped child";
  if (const std::string why = node_missing(); !why.empty()) GTEST_SKIP() << why;
  e = error_of([&] {
    make_mcp_environment({{"command", {"node", kServer}}, {"tasks", tasks}, {"reward_tool", "score"}});
  });
  EXPECT_THAT(e, HasSubstr("lists no tool 'score' (option \"reward_tool\""));
}

}  // namespace
