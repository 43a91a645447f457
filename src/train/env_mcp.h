// An RL environment (train/environment.h) whose tools are a user's own MCP server (Model Context Protocol,
// revision 2025-06-18), launched as a child process and spoken to over stdio: the policy's tool calls become the
// server's `tools/call` requests, and one more tool of the server, hidden from the policy, scores the final answer.
//
// Options (a JSON object):
//   "command"      argv of the server, required: a non-empty array of strings, e.g. ["node", "server.mjs"]. The
//                  first is looked up on PATH; the server inherits this process's environment and working directory.
//   "tasks"        path of a JSONL file, required: one task per line, {"messages": [...], "answer": ...,
//                  "reference"?: [...]}. Blank lines are skipped. The request given to the policy is the line without
//                  "answer" and "reference", plus "tools": the server's tools (all but the reward tool) as OpenAI-style
//                  entries {"type": "function", "function": {"name", "description", "parameters": inputSchema}},
//                  unless the line names "tools" of its own (then those are kept as written).
//   "timeout_ms"   the most one request may take, from writing it to reading its response (default 10000).
//   "startup_timeout_ms"  the most a launch may take, from starting the process to the answer to `initialize`
//                  (default 30000; also each tools/list page at construction). Separate from timeout_ms because
//                  starting an interpreter and loading an SDK takes seconds on a busy machine (node with the MCP SDK:
//                  ~0.3 s idle), unrelated to how fast a tool answers: a short timeout_ms must not fail every
//                  relaunch. 30 s is generous because it is paid only when a server is (re)started.
//   "reward_tool"  the server's tool that gives the outcome reward (default "reward"; null: none, score() gives 0).
//                  Never shown to the policy, and a policy's call of it is refused (it would be an answer oracle).
//                  score() calls it with {"answer": task answer, "response": the final message's response text,
//                  "state": the episode's state}; its text content, parsed as a number, is the reward.
//
// task(seed, index) is line `index` mod the number of tasks, whatever the seed: a tasks file is a fixed list, and an
// RL loop that wants another order shuffles indices itself. The reference (if any) is the line's "reference", else
// null.
//
// A tool call: `tools/call` {name, arguments}. ToolOutcome::content is the result's text content parts joined by
// "\n" (other part types, images and resources, are left out: the policy reads text); a numeric
// structuredContent.reward is ToolOutcome::reward. A result with isError: true is ordinary content (the model sees
// the tool's error message and may try again), and so is a JSON-RPC error response (e.g. "invalid arguments"): in
// both the server is healthy and it is the call that was wrong, which is the policy's to learn, not an episode
// failure.
//
// Episode state: one server serves every episode, interleaved, and may be relaunched at any call, so it cannot keep
// per-episode state itself. The state travels instead: a non-null state is sent with each call as
// params._meta["k3cpp/state"] (MCP's place for request metadata), and a result's structuredContent.state, when
// present, replaces it. The reward tool gets it as its "state" argument. So a server can count lookups per episode,
// and the count is checkpointed with the run.
//
// Protocol: newline-delimited JSON-RPC 2.0 messages on the server's stdin and stdout, as MCP's stdio transport
// specifies. Each launch sends `initialize` {protocolVersion "2025-06-18", capabilities {}, clientInfo {name
// "k3cpp"}}, then the `notifications/initialized` notification; the first launch then reads `tools/list`, following
// nextCursor to the last page. Whatever protocol version the server answers is accepted: this client uses only
// tools/list and tools/call, which every revision since 2024-11-05 has. The tool list is read again, at the next
// task() while the server runs, after it sends `notifications/tools/list_changed` and after a relaunch (a new
// session's tools are its own; task() itself never launches one): tasks drawn from then on carry the new list,
// episodes under way keep theirs, and a listing that fails keeps the old list (said on stderr) and is retried at the
// next task(). While waiting for a response, other server
// notifications (logs, progress) are skipped, a server `ping` is answered {} (the spec says a ping must be answered), and any other server request gets the JSON-RPC error -32601
// "method not found" (this client declares no capabilities, so a well-behaved server sends none). Blank lines are
// skipped. One request is in flight at a time, so any response whose id is not that request's is garbage.
//
// Failures (what environment.h asks of call()): the server crashing (its stdout closes, or writing its stdin fails
// with EPIPE), hanging past the deadline (poll() on both pipes against one deadline, so a server that stops reading
// its stdin is caught too), or writing garbage (a line that is not a JSON object, a response to another id, one
// with neither result nor error, a result that is not an object or lacks a content array, a line over 64 MiB) make
// call() return ToolOutcome::error naming the tool, what happened and the server command. A server that broke the
// protocol is killed and reaped (SIGKILL to its process group, then waitpid: no zombies), and the next call
// relaunches it (and re-initializes); if that relaunch fails, that call's error says so. score() has no error
// channel in environment.h, so the same failures of the reward tool (and a non-numeric or isError result) throw
// k3::Error instead of guessing a reward.
//
// Process handling:
//   - posix_spawnp, with the server's stdin and stdout on pipes (close-on-exec on our ends, so a server never
//     inherits another server's pipes) and stderr inherited: a user's server logs and stack traces are what one
//     needs when it crashes, and an inherited stderr cannot fill up and block the server as an unread pipe would.
//     The child gets the default signal mask and SIGPIPE's default action whatever this process uses.
//   - The server leads a process group of its own, and kills go to the group, so a server started through a wrapper
//     (npx, a shell script) does not leave its real process behind holding the pipes.
//   - SIGPIPE: a write to a server that has exited would raise it and kill the whole training run. Writes block
//     SIGPIPE in the writing thread (pthread_sigmask), and one raised by an EPIPE write is taken off the pending set
//     (sigtimedwait, zero timeout) before the mask is restored, so the process-wide disposition is never touched
//     (the rest of the program, and its other threads, keep theirs) and the pipes stay plain pipes (a socketpair
//     with MSG_NOSIGNAL would change what the server sees as its stdin).
//   - Shutdown (the destructor), as the MCP spec describes: close the server's stdin, wait up to 500 ms for it to
//     exit, SIGTERM, wait 500 ms more, then SIGKILL; always reaped. An SDK server exits on stdin's EOF in a few ms.
//
// Threads: call() and score() take a mutex (one server, one request in flight), so several threads may call
// them, but they run one at a time: a slow tool holds up every other episode's calls. An RL loop that wants calls
// in parallel makes one environment per worker (each with its own server).
#pragma once
#include <memory>
#include <nlohmann/json.hpp>

#include "train/environment.h"

namespace k3::train {

// The environment (name "mcp") from `options` (above). Launches the server, initializes it and lists its tools
// before returning. Throws k3::Error naming the option, the tasks file and line, or the server command (one that
// cannot start, breaks the protocol or lacks the reward tool).
std::unique_ptr<Environment> make_mcp_environment(const nlohmann::json& options);

}  // namespace k3::train
