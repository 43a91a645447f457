// Runs a shell command (the k3 binary, usually) and captures its exit status and output.
#pragma once
#include <sys/wait.h>

#include <cstdio>
#include <string>
#include <utility>

namespace k3test {

// {exit status, stdout (+ stderr with the default redirect)}.
inline std::pair<int, std::string> run_command(const std::string& cmd, const std::string& redirect = "2>&1") {
  std::string out;
  FILE* p = ::popen((cmd + " " + redirect).c_str(), "r");
  if (!p) return {-1, "popen failed"};
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// K3_BINARY followed by args (already shell-quoted by the caller where needed).
inline std::pair<int, std::string> run_k3_command(const std::string& args, const std::string& redirect = "2>&1") {
  return run_command(std::string(K3_BINARY) + " " + args, redirect);
}

}  // namespace k3test
