// Judging a failed `k3` run (tests/util/cli.h): a clean k3::Error ends with exit status 1 and one
// last line "error: ...", with no crash, sanitizer report or internal error on the way.
#pragma once
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "cli.h"

namespace k3test {

inline std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) out.push_back(l);
  return out;
}

// Asserts a clean failure and returns its "error: ..." line (the last line of the output).
inline std::string error_line(const Outcome& r) {
  using ::testing::HasSubstr;
  EXPECT_EQ(r.status, 1) << "expected the clean k3::Error exit status 1 from: " << r.command << "\n" << r.output;
  for (const char* bad : {"Sanitizer", "runtime error", "terminate called", "internal error", "Segmentation"})
    EXPECT_THAT(r.output, ::testing::Not(HasSubstr(bad))) << r.command;
  const std::vector<std::string> lines = lines_of(r.output);
  if (lines.empty()) {
    ADD_FAILURE() << "no output from: " << r.command;
    return "";
  }
  std::printf("  %s\n", lines.back().c_str());
  EXPECT_THAT(lines.back(), ::testing::StartsWith("error: ")) << r.command << "\n" << r.output;
  EXPECT_EQ(std::count_if(lines.begin(), lines.end(), [](const std::string& l) { return l.rfind("error:", 0) == 0; }),
            1)
      << r.output;
  return lines.back();
}

}  // namespace k3test
