// The MCP environment (train/env_mcp.h): a child process spoken to in newline-delimited JSON-RPC over two pipes.
#include "train/env_mcp.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.h"

extern char** environ;

namespace k3::train {
namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr size_t kMaxLine = size_t(64) << 20;  // a line past this is garbage (it only stops runaway memory)
constexpr int kMaxListPages = 10000;           // a tools/list cursor that never ends is garbage
constexpr int kEofGraceMs = 200;      // after EOF on stdout, how long the server gets to exit by itself (its status)
constexpr int kShutdownStepMs = 500;  // the destructor's waits: after closing stdin, and after SIGTERM

// JSON for the wire: strings that are not UTF-8 (they cannot come from parsed JSON, but a caller may build one)
// are repaired rather than thrown on.
std::string dump(const ojson& j) { return j.dump(-1, ' ', false, ojson::error_handler_t::replace); }

// The first 200 bytes of `s`, for messages about what a server wrote.
std::string excerpt(const std::string& s) {
  constexpr size_t kMax = 200;
  return s.size() <= kMax ? s : s.substr(0, kMax) + "...";
}

std::string join(const std::vector<std::string>& argv) {
  std::string s;
  for (const std::string& a : argv) s += (s.empty() ? "" : " ") + a;
  return s;
}

// Milliseconds left until `deadline`, rounded up (so a poll never spins at 0), at least 0.
int ms_left(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now()).count();
  return int(std::clamp<int64_t>(left, 0, 1 << 30));
}

// Blocks SIGPIPE in this thread for the object's lifetime. A write to a pipe whose reader has gone then fails with
// EPIPE instead of killing the process; note_epipe() marks that the write raised one, and the destructor takes it
// off the pending set (unless one was pending before) and restores the thread's mask. The process-wide disposition
// is never touched.
class SigpipeBlock {
 public:
  SigpipeBlock() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
  }
  ~SigpipeBlock() {
    if (raised_ && !was_pending_) {
      const timespec zero{0, 0};
      while (sigtimedwait(&pipe_, nullptr, &zero) < 0 && errno == EINTR) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeBlock(const SigpipeBlock&) = delete;
  SigpipeBlock& operator=(const SigpipeBlock&) = delete;
  void note_epipe() { raised_ = true; }

 private:
  sigset_t pipe_, old_;
  bool was_pending_ = false, raised_ = false;
};

// A response to one request: result or error, or why none came (the server has then been killed and reaped).
struct Reply {
  ojson result;         // the response's result (when it has one)
  ojson error;          // the response's error object (null: none)
  std::string failure;  // non-empty: no usable response; says what happened and how the process ended
};

// One MCP server process. Not thread-safe (the environment serializes on its mutex).
class Server {
 public:
  Server(std::vector<std::string> argv, int64_t startup_timeout_ms)
      : argv_(std::move(argv)), command_(join(argv_)), startup_timeout_ms_(startup_timeout_ms) {}
  ~Server() { shutdown(); }
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  const std::string& command() const { return command_; }
  int64_t startup_timeout_ms() const { return startup_timeout_ms_; }
  bool running() const { return pid_ > 0; }

  // Launches the server and runs the initialize handshake. Returns "" or why it failed (the process, if any, is
  // then gone).
  std::string start();

  // Sends request `method` (params omitted when null) and waits up to `timeout_ms` for its response.
  Reply request(const std::string& method, const ojson& params, int64_t timeout_ms);

  // Whether the tools may differ from the last listing: the server said notifications/tools/list_changed, or it
  // ended (the next launch is a new session, whose tools are its own). Set here, cleared by the environment when it
  // lists them.
  bool tools_changed() const { return tools_changed_; }
  void set_tools_changed(bool changed) { tools_changed_ = changed; }

  // Kills the server because of `what` (something it did) and returns the failure message.
  std::string abandon(const std::string& what) { return what + " (" + end(0) + ")"; }

  // The MCP spec's shutdown: close its stdin, wait, SIGTERM, wait, SIGKILL; reaped in every case.
  void shutdown();

 private:
  enum class Read { kLine, kEof, kTimeout, kTooLong, kError };
  Read read_line(std::string& line, Clock::time_point deadline);
  // Writes `message` and a newline; returns "" or why it could not.
  std::string send(const ojson& message, Clock::time_point deadline);
  // Waits up to `ms` for the server to exit, without reaping it. True when it has.
  bool wait_exit(int ms) const;
  // Closes the pipes, gives the server `grace_ms` to exit by itself, then SIGKILLs its process group and reaps it.
  // Returns how it ended ("exited with status 3", "killed by signal 11", "killed": by us).
  std::string end(int grace_ms, bool term_first = false);
  void close_pipes();

  std::vector<std::string> argv_;
  std::string command_;
  int64_t startup_timeout_ms_;
  pid_t pid_ = -1;
  int to_server_ = -1;    // our end of the server's stdin
  int from_server_ = -1;  // our end of the server's stdout
  std::string buffer_;    // bytes read from the server, not yet split into lines
  size_t scanned_ = 0;    // buffer_[0, scanned_) holds no newline
  int64_t next_id_ = 0;
  bool tools_changed_ = false;
};

std::string Server::start() {
  K3_ASSERT(pid_ < 0);
  int in[2], out[2];  // [0]: read end, [1]: write end; close-on-exec, so no other child inherits them
  if (pipe2(in, O_CLOEXEC) != 0) return std::string("cannot make a pipe: ") + std::strerror(errno);
  if (pipe2(out, O_CLOEXEC) != 0) {
    const int e = errno;
    close(in[0]), close(in[1]);
    return std::string("cannot make a pipe: ") + std::strerror(e);
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[0], STDIN_FILENO);  // dup2 clears close-on-exec on the copy
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setpgroup(&attr, 0);  // a group of its own, led by the server
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  std::vector<char*> args;
  for (std::string& a : argv_) args.push_back(a.data());
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  close(in[0]), close(out[1]);
  if (rc != 0) {
    close(in[1]), close(out[0]);
    return std::string("cannot start: ") + std::strerror(rc);
  }
  pid_ = pid, to_server_ = in[1], from_server_ = out[0];
  fcntl(to_server_, F_SETFL, fcntl(to_server_, F_GETFL) | O_NONBLOCK);
  fcntl(from_server_, F_SETFL, fcntl(from_server_, F_GETFL) | O_NONBLOCK);
  buffer_.clear(), scanned_ = 0;

  // clientInfo: the spec's Implementation needs a version too (the SDK rejects an initialize without one); k3cpp
  // has no release number, hence "0".
  const ojson params = {{"protocolVersion", "2025-06-18"},
                        {"capabilities", ojson::object()},
                        {"clientInfo", {{"name", "k3cpp"}, {"version", "0"}}}};
  const Reply r = request("initialize", params, startup_timeout_ms_);
  if (!r.failure.empty()) return "initialize: " + r.failure;
  if (!r.error.is_null()) return abandon("answered initialize with the error " + excerpt(dump(r.error)));
  if (!r.result.is_object()) return abandon("answered initialize with a result that is not an object");
  const std::string why = send({{"jsonrpc", "2.0"}, {"method", "notifications/initialized"}},
                               Clock::now() + milliseconds(startup_timeout_ms_));
  if (!why.empty()) return "notifications/initialized: " + why;
  return "";
}

Server::Read Server::read_line(std::string& line, Clock::time_point deadline) {
  for (;;) {
    const size_t nl = buffer_.find('\n', scanned_);
    if (nl != std::string::npos) {
      line.assign(buffer_, 0, nl);
      buffer_.erase(0, nl + 1);
      scanned_ = 0;
      return Read::kLine;
    }
    scanned_ = buffer_.size();
    if (buffer_.size() > kMaxLine) return Read::kTooLong;
    const int left = ms_left(deadline);
    if (left == 0) return Read::kTimeout;
    pollfd p{from_server_, POLLIN, 0};
    const int n = poll(&p, 1, left);
    if (n < 0 && errno != EINTR) return Read::kError;
    if (n <= 0) continue;
    char chunk[65536];
    const ssize_t got = read(from_server_, chunk, sizeof chunk);
    if (got > 0) buffer_.append(chunk, size_t(got));
    if (got == 0) return Read::kEof;
    if (got < 0 && errno != EAGAIN && errno != EINTR) return Read::kError;
  }
}

std::string Server::send(const ojson& message, Clock::time_point deadline) {
  const std::string data = dump(message) + "\n";
  SigpipeBlock block;
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = write(to_server_, data.data() + done, data.size() - done);
    if (n > 0) {
      done += size_t(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EPIPE) {
      block.note_epipe();
      return abandon("no longer reads its stdin (EPIPE)");
    }
    if (n < 0 && errno != EAGAIN) return abandon(std::string("could not be written to: ") + std::strerror(errno));
    // The pipe is full: the server is not reading. Wait for room (or for the reader to go: POLLERR, then EPIPE).
    const int left = ms_left(deadline);
    if (left == 0) return abandon("did not read its stdin before the deadline");
    pollfd p{to_server_, POLLOUT, 0};
    if (poll(&p, 1, left) < 0 && errno != EINTR) return abandon(std::string("poll failed: ") + std::strerror(errno));
  }
  return "";
}

Reply Server::request(const std::string& method, const ojson& params, int64_t timeout_ms) {
  const Clock::time_point deadline = Clock::now() + milliseconds(timeout_ms);
  const int64_t id = ++next_id_;
  ojson message = {{"jsonrpc", "2.0"}, {"id", id}, {"method", method}};
  if (!params.is_null()) message["params"] = params;
  Reply reply;
  reply.failure = send(message, deadline);
  if (!reply.failure.empty()) return reply;
  for (;;) {
    std::string line;
    switch (read_line(line, deadline)) {
      case Read::kLine: break;
      case Read::kEof: reply.failure = "closed its stdout (" + end(kEofGraceMs) + ")"; return reply;
      case Read::kTimeout:
        reply.failure = abandon("did not answer " + method + " within " + std::to_string(timeout_ms) + " ms");
        return reply;
      case Read::kTooLong: reply.failure = abandon("wrote a line over 64 MiB"); return reply;
      case Read::kError:
        reply.failure = abandon(std::string("could not be read from: ") + std::strerror(errno));
        return reply;
    }
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;  // a blank line carries no message
    ojson m = ojson::parse(line, nullptr, /*allow_exceptions=*/false);
    if (m.is_discarded()) {
      reply.failure = abandon("wrote a line that is not JSON: '" + excerpt(line) + "'");
      return reply;
    }
    if (!m.is_object()) {
      reply.failure = abandon("wrote a line that is not a JSON-RPC message: '" + excerpt(line) + "'");
      return reply;
    }
    if (m.contains("method")) {  // the server's own request or notification
      if (m["method"] == "notifications/tools/list_changed") tools_changed_ = true;
      if (!m.contains("id")) continue;
      ojson answer = {{"jsonrpc", "2.0"}, {"id", m["id"]}};
      if (m["method"] == "ping") {
        answer["result"] = ojson::object();
      } else {
        answer["error"] = {{"code", -32601}, {"message", "Method not found"}};
      }
      reply.failure = send(answer, deadline);
      if (!reply.failure.empty()) return reply;
      continue;
    }
    if (!m.contains("id") || m["id"] != ojson(id)) {
      reply.failure = abandon("answered id " + (m.contains("id") ? dump(m["id"]) : std::string("(none)")) +
                              ", not the id " + std::to_string(id) + " of its one pending request (" + method + ")");
      return reply;
    }
    if (m.contains("error") && m["error"].is_object()) {
      reply.error = std::move(m["error"]);
    } else if (m.contains("result") && !m.contains("error")) {
      reply.result = std::move(m["result"]);
    } else {
      reply.failure =
          abandon("answered " + method + " with neither a result nor an error object: '" + excerpt(line) + "'");
    }
    return reply;
  }
}

bool Server::wait_exit(int ms) const {
  const Clock::time_point deadline = Clock::now() + milliseconds(ms);
  for (;;) {
    siginfo_t info{};
    // WNOWAIT: leave it a zombie, so that its id (the group's id) cannot be reused before the group is killed.
    if (waitid(P_PID, id_t(pid_), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid_) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(milliseconds(5));
  }
}

void Server::close_pipes() {
  if (to_server_ >= 0) close(to_server_);
  if (from_server_ >= 0) close(from_server_);
  to_server_ = from_server_ = -1;
  buffer_.clear(), scanned_ = 0;
}

std::string Server::end(int grace_ms, bool term_first) {
  close_pipes();
  if (pid_ <= 0) return "not running";
  tools_changed_ = true;  // whatever runs next is a new session
  bool by_itself = wait_exit(grace_ms);
  if (!by_itself && term_first) {
    kill(-pid_, SIGTERM);
    by_itself = wait_exit(kShutdownStepMs);
  }
  kill(-pid_, SIGKILL);  // the group: whatever the server started goes with it
  int status = 0;
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
  if (!by_itself) return "killed";
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  return "ended";
}

void Server::shutdown() {
  if (pid_ > 0) end(kShutdownStepMs, /*term_first=*/true);
}

// A tools/call result taken apart: the text of its content and its structuredContent (null: none).
struct CallResult {
  std::string text;
  bool is_error = false;
  ojson structured;
};

// Parses `result` into `out`; returns "" or what is wrong with it.
std::string parse_call_result(const ojson& result, CallResult& out) {
  if (!result.is_object()) return "a result that is not an object";
  const auto content = result.find("content");
  if (content == result.end() || !content->is_array()) return "a result without a content array";
  bool first = true;
  for (const ojson& part : *content) {
    if (!part.is_object()) return "a content part that is not an object";
    if (part.value("type", "") != "text") continue;
    const auto text = part.find("text");
    if (text == part.end() || !text->is_string()) return "a text content part without a text string";
    if (!first) out.text += "\n";
    out.text += text->get<std::string>();
    first = false;
  }
  const auto is_error = result.find("isError");
  out.is_error = is_error != result.end() && is_error->is_boolean() && is_error->get<bool>();
  const auto structured = result.find("structuredContent");
  if (structured != result.end() && !structured->is_null()) {
    if (!structured->is_object()) return "a structuredContent that is not an object";
    out.structured = *structured;
  }
  return "";
}

std::string error_text(const ojson& error) {
  const auto code = error.find("code");
  const auto message = error.find("message");
  return "MCP error " + (code != error.end() ? dump(*code) : std::string("?")) + ": " +
         (message != error.end() && message->is_string() ? message->get<std::string>() : dump(error));
}

class McpEnvironment final : public Environment {
 public:
  explicit McpEnvironment(const json& options);
  std::string name() const override { return "mcp"; }
  Task task(uint64_t seed, int64_t index) override;
  ToolOutcome call(const Task& task, const std::string& tool, const ojson& arguments, json& state) override;
  double score(const Task& task, const XtmlAssistantMessage& answer, const json& state) override;

 private:
  // "tool 'add' of the MCP server `node calc_server.mjs`": how errors name where they happened.
  std::string where(const std::string& tool) const {
    return "tool '" + tool + "' of the MCP server `" + server_->command() + "`";
  }
  // tools/call of `tool` (relaunching the server first if it is down); a non-null `state` goes in params._meta.
  Reply call_tool(const std::string& tool, const ojson& arguments, const json& state);
  void read_tasks(const std::string& path);
  ojson list_tools();  // every page of tools/list, as the policy's "tools" entries
  void set_tools(const ojson& tools);  // into every task that does not name its own
  void refresh_tools();

  std::unique_ptr<Server> server_;
  int64_t timeout_ms_ = 10000;
  std::optional<std::string> reward_tool_;
  std::vector<Task> tasks_;
  std::vector<bool> own_tools_;  // [task]: the line named its own "tools"
  std::mutex mutex_;
};

int64_t positive_ms(const json& options, const char* key, int64_t fallback) {
  const auto it = options.find(key);
  if (it == options.end()) return fallback;
  // At most a day: a deadline is a guard against a stuck server, and this keeps the clock arithmetic far from overflow.
  if (!it->is_number_integer() || it->get<int64_t>() <= 0 || it->get<int64_t>() > 86400000)
    fail("mcp environment: option \"", key, "\" must be a whole number of milliseconds in [1, 86400000], not ",
         it->dump());
  return it->get<int64_t>();
}

McpEnvironment::McpEnvironment(const json& options) {
  if (!options.is_object()) fail("mcp environment: options must be a JSON object, not ", options.dump());
  static const char* const kKnown[] = {"command", "tasks", "timeout_ms", "startup_timeout_ms", "reward_tool"};
  for (const auto& [key, value] : options.items())
    if (std::find(std::begin(kKnown), std::end(kKnown), key) == std::end(kKnown))
      fail("mcp environment: unknown option \"", key,
           "\" (the options: command, tasks, timeout_ms, startup_timeout_ms, reward_tool)");

  const auto command = options.find("command");
  if (command == options.end())
    fail("mcp environment: option \"command\" is required: the MCP server's argv, e.g. [\"node\", \"server.mjs\"]");
  if (!command->is_array() || command->empty())
    fail("mcp environment: option \"command\" must be a non-empty array of strings, not ", command->dump());
  std::vector<std::string> argv;
  for (const json& a : *command) {
    if (!a.is_string() || a.get<std::string>().empty())
      fail("mcp environment: option \"command\" must be a non-empty array of strings; ", a.dump(), " is not one");
    argv.push_back(a.get<std::string>());
  }
  const auto tasks = options.find("tasks");
  if (tasks == options.end()) fail("mcp environment: option \"tasks\" is required: the path of a JSONL tasks file");
  if (!tasks->is_string()) fail("mcp environment: option \"tasks\" must be a path, not ", tasks->dump());
  timeout_ms_ = positive_ms(options, "timeout_ms", 10000);
  const int64_t startup_ms = positive_ms(options, "startup_timeout_ms", 30000);
  const auto reward = options.find("reward_tool");
  if (reward == options.end()) {
    reward_tool_ = "reward";
  } else if (reward->is_string() && !reward->get<std::string>().empty()) {
    reward_tool_ = reward->get<std::string>();
  } else if (!reward->is_null()) {
    fail("mcp environment: option \"reward_tool\" must be a tool's name or null, not ", reward->dump());
  }

  read_tasks(tasks->get<std::string>());  // before the launch: a bad file is the cheaper error to find
  server_ = std::make_unique<Server>(std::move(argv), startup_ms);
  const std::string why = server_->start();
  if (!why.empty()) fail("mcp environment: the MCP server `", server_->command(), "` (option \"command\"): ", why);
  set_tools(list_tools());
}

void McpEnvironment::set_tools(const ojson& tools) {
  for (size_t i = 0; i < tasks_.size(); ++i)
    if (!own_tools_[i]) tasks_[i].request["tools"] = tools;
}

// After notifications/tools/list_changed or a relaunch: the tasks drawn from now on carry the server's new list
// (an episode under way keeps the one its prompt was rendered with). A server that is down is left to the next call
// to relaunch (so a broken one cannot stall every task() on its startup deadline), and its tools are listed at the
// task() after that. A listing that fails keeps the old list, says so on stderr, and is tried again at the next one.
void McpEnvironment::refresh_tools() {
  if (!server_->tools_changed() || !server_->running()) return;
  try {
    server_->set_tools_changed(false);  // before listing: a change announced during the listing stays pending
    set_tools(list_tools());
  } catch (const Error& e) {
    server_->set_tools_changed(true);
    std::fprintf(stderr, "mcp environment: listing the changed tools failed (%s); tasks keep the earlier list\n",
                 e.what());
  }
}

void McpEnvironment::read_tasks(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("mcp environment: cannot read the tasks file '", path, "' (option \"tasks\"): ", std::strerror(errno));
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto bad = [&](const std::string& why) { fail("mcp environment: tasks file '", path, "' line ", n, ": ", why); };
    ojson j = ojson::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) bad("not JSON");
    if (!j.is_object()) bad("not a JSON object");
    if (!j.contains("messages") || !j["messages"].is_array()) bad("needs \"messages\", an array");
    if (!j.contains("answer")) bad("needs \"answer\" (what the reward tool checks)");
    if (j.contains("reference") && !j["reference"].is_array() && !j["reference"].is_null())
      bad("\"reference\" must be an array of messages");
    if (j.contains("tools") && !j["tools"].is_array()) bad("\"tools\" must be an array");
    Task t;
    t.answer = json(j["answer"]);
    if (j.contains("reference")) t.reference = j["reference"];
    j.erase("answer");
    j.erase("reference");
    own_tools_.push_back(j.contains("tools"));
    t.request = std::move(j);
    tasks_.push_back(std::move(t));
  }
  if (in.bad()) fail("mcp environment: reading the tasks file '", path, "' failed: ", std::strerror(errno));
  if (tasks_.empty()) fail("mcp environment: the tasks file '", path, "' has no tasks");
}

ojson McpEnvironment::list_tools() {
  const std::string server = "mcp environment: the MCP server `" + server_->command() + "`";
  ojson tools = ojson::array();
  bool reward_seen = false;
  ojson cursor;
  for (int page = 0;; ++page) {
    if (page == kMaxListPages) fail(server, ": tools/list gave more than ", kMaxListPages, " pages");
    ojson params = cursor.is_null() ? ojson() : ojson{{"cursor", cursor}};
    // A listing is part of starting up (the first answers of a fresh process), so it gets the startup deadline.
    const Reply r = server_->request("tools/list", params, server_->startup_timeout_ms());
    if (!r.failure.empty()) fail(server, ": tools/list: ", r.failure);
    if (!r.error.is_null()) fail(server, ": tools/list: ", error_text(r.error));
    if (!r.result.is_object() || !r.result.contains("tools") || !r.result["tools"].is_array())
      fail(server, ": tools/list answered without a tools array: ", excerpt(dump(r.result)));
    for (const ojson& t : r.result["tools"]) {
      if (!t.is_object() || !t.contains("name") || !t["name"].is_string())
        fail(server, ": tools/list gave a tool without a name: ", excerpt(dump(t)));
      const std::string name = t["name"].get<std::string>();
      if (reward_tool_ && name == *reward_tool_) {
        reward_seen = true;
        continue;
      }
      ojson fn = {{"name", name}};
      if (t.contains("description") && t["description"].is_string()) fn["description"] = t["description"];
      // inputSchema is required by the spec; a server that leaves it out takes no arguments.
      fn["parameters"] = t.contains("inputSchema") && t["inputSchema"].is_object()
                             ? t["inputSchema"]
                             : ojson{{"type", "object"}, {"properties", ojson::object()}};
      tools.push_back({{"type", "function"}, {"function", std::move(fn)}});
    }
    const auto next = r.result.find("nextCursor");
    if (next == r.result.end() || next->is_null()) break;
    cursor = *next;
  }
  if (reward_tool_ && !reward_seen)
    fail(server, " lists no tool '", *reward_tool_, "' (option \"reward_tool\"; null for no outcome reward)");
  return tools;
}

Task McpEnvironment::task(uint64_t /*seed*/, int64_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  refresh_tools();
  const int64_t n = int64_t(tasks_.size());
  return tasks_[size_t(((index % n) + n) % n)];
}

Reply McpEnvironment::call_tool(const std::string& tool, const ojson& arguments, const json& state) {
  if (!server_->running()) {
    const std::string why = server_->start();
    if (!why.empty()) {
      Reply r;
      r.failure = "could not be relaunched: " + why;
      return r;
    }
  }
  ojson params = {{"name", tool}, {"arguments", arguments}};
  if (!state.is_null()) params["_meta"] = {{"k3cpp/state", ojson(state)}};
  return server_->request("tools/call", params, timeout_ms_);
}

ToolOutcome McpEnvironment::call(const Task& /*task*/, const std::string& tool, const ojson& arguments, json& state) {
  std::lock_guard<std::mutex> lock(mutex_);
  ToolOutcome out;
  if (reward_tool_ && tool == *reward_tool_) {  // hidden: to the policy it does not exist
    out.content = "unknown tool '" + tool + "'";
    return out;
  }
  if (!arguments.is_null() && !arguments.is_object()) {
    out.content = "tool '" + tool + "': the arguments must be a JSON object, not " + excerpt(dump(arguments));
    return out;
  }
  const Reply r = call_tool(tool, arguments.is_null() ? ojson::object() : arguments, state);
  const std::string restart = "; it is relaunched at the next call";
  if (!r.failure.empty()) {
    out.error = where(tool) + " " + r.failure + restart;
    return out;
  }
  if (!r.error.is_null()) {  // the server rejected the call (unknown tool, bad arguments): the policy's to see
    out.content = error_text(r.error);
    return out;
  }
  CallResult c;
  std::string bad = parse_call_result(r.result, c);
  if (bad.empty() && c.structured.contains("reward") && !c.structured["reward"].is_number())
    bad = "a structuredContent.reward that is not a number";
  if (!bad.empty()) {
    out.error = where(tool) + " " + server_->abandon("answered tools/call with " + bad) + restart;
    return out;
  }
  out.content = std::move(c.text);
  if (c.structured.contains("reward")) out.reward = c.structured["reward"].get<double>();
  if (c.structured.contains("state")) state = json(c.structured["state"]);
  return out;
}

double McpEnvironment::score(const Task& task, const XtmlAssistantMessage& answer, const json& state) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!reward_tool_) return 0.0;
  const std::string& tool = *reward_tool_;
  const ojson arguments = {{"answer", ojson(task.answer)}, {"response", answer.response}, {"state", ojson(state)}};
  const Reply r = call_tool(tool, arguments, json());
  if (!r.failure.empty()) fail("mcp environment: ", where(tool), " (the outcome reward) ", r.failure);
  if (!r.error.is_null()) fail("mcp environment: ", where(tool), " (the outcome reward) failed: ", error_text(r.error));
  CallResult c;
  const std::string bad = parse_call_result(r.result, c);
  if (!bad.empty())
    fail("mcp environment: ", where(tool), " (the outcome reward) ",
         server_->abandon("answered tools/call with " + bad));
  if (c.is_error) fail("mcp environment: ", where(tool), " (the outcome reward) failed: ", excerpt(c.text));
  // The whole text, blanks around it aside, must be one finite number (from_chars: no locale, no partial parse).
  const size_t b = c.text.find_first_not_of(" \t\r\n"), e = c.text.find_last_not_of(" \t\r\n");
  double v = 0;
  const char* first = b == std::string::npos ? c.text.data() : c.text.data() + b;
  const char* last = b == std::string::npos ? first : c.text.data() + e + 1;
  const auto [end, ec] = std::from_chars(first, last, v);
  if (first == last || ec != std::errc() || end != last || !std::isfinite(v))
    fail("mcp environment: ", where(tool), " (the outcome reward) answered '", excerpt(c.text), "', not a number");
  return v;
}

}  // namespace

std::unique_ptr<Environment> make_mcp_environment(const nlohmann::json& options) {
  return std::make_unique<McpEnvironment>(options);
}

}  // namespace k3::train
