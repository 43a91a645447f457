// k3::Error: the one exception type for bad input (files, configs, requests, shapes).
// Programmer errors (broken invariants) use K3_ASSERT, which also throws so a CLI can report them,
// but whose message says "internal error". Nothing in the library calls exit() or abort().
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace k3 {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// fail("tensor '", name, "' has shape ", s): concatenates with operator<< and throws k3::Error.
template <class... A>
[[noreturn]] void fail(const A&... a) {
  std::ostringstream s;
  (s << ... << a);
  throw Error(s.str());
}

}  // namespace k3

#define K3_CHECK(cond, ...)               \
  do {                                    \
    if (!(cond)) ::k3::fail(__VA_ARGS__); \
  } while (0)

#define K3_ASSERT(cond)                                                                         \
  do {                                                                                          \
    if (!(cond)) ::k3::fail("internal error: ", #cond, " failed at ", __FILE__, ":", __LINE__); \
  } while (0)
