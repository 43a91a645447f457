// Runs the k3 binary (K3_BINARY) from tests and captures its exit status and output.
#pragma once
#include <sys/wait.h>

#include <cstdio>
#include <string>
#include <vector>

namespace k3test {

inline std::string shell_quote(const std::string& s) {  // for /bin/sh
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

struct Outcome {
  int status = -1;     // exit status; -1 when the process did not exit normally
  std::string output;  // what the command printed on the captured stream(s)
  std::string command;
};

// Runs a shell command line; `redirect` says what the pipe captures ("2>&1": stdout and stderr).
inline Outcome run_shell(const std::string& command, const std::string& redirect = "2>&1") {
  Outcome r;
  r.command = command + " " + redirect;
  std::fflush(nullptr);
  FILE* p = ::popen(r.command.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int st = ::pclose(p);
  if (st != -1 && WIFEXITED(st)) r.status = WEXITSTATUS(st);
  return r;
}

// K3_BINARY with each argument quoted.
inline Outcome run_k3(const std::vector<std::string>& args, const std::string& redirect = "2>&1") {
  std::string cmd = shell_quote(K3_BINARY);
  for (const auto& a : args) cmd.append(" ").append(shell_quote(a));
  return run_shell(cmd, redirect);
}

}  // namespace k3test
