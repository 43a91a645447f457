// Runs the k3 binary (K3_BINARY) from tests and captures its exit status and output.
#pragma once
#include <cblas.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
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

// The shell command line that runs K3_BINARY with `args`, each quoted. The binary runs with this test
// process's OpenBLAS kernels (OPENBLAS_CORETYPE): on a CPU OpenBLAS does not recognise, k3 would
// otherwise re-execute itself with faster kernels (src/cli/library_env.h), which round differently, and
// tests that compare numbers bit for bit across processes would see that, not a bug. For the same
// reason it runs without the caller's K3_GEMM, which k3 applies to its linears and the library (so
// this test process) does not read. `env` ("NAME=value ...", values quoted) sets variables for the
// child alone, after that. K3_TEST_BINARY=path runs another build instead (e.g. one from before a fix,
// to see a test fail there).
inline std::string k3_command(const std::vector<std::string>& args, const std::string& env = "") {
  const char* other = std::getenv("K3_TEST_BINARY");
  std::string cmd = "env -u K3_GEMM " + (env.empty() ? "" : env + " ") +
                    "OPENBLAS_CORETYPE=" + shell_quote(openblas_get_corename()) + " " +
                    shell_quote(other && *other ? other : K3_BINARY);
  for (const auto& a : args) cmd.append(" ").append(shell_quote(a));
  return cmd;
}

inline Outcome run_k3(const std::vector<std::string>& args, const std::string& redirect = "2>&1") {
  return run_shell(k3_command(args), redirect);
}

}  // namespace k3test
