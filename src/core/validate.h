// Range checks for numeric options, shared by the library (TrainOptions, SamplingParams, ...) and
// the CLI, so that a bad value is refused with one kind of message wherever it comes from:
//   "--lr must be a finite number > 0, got -1"
// `name` is what the user typed (a flag such as "--lr", or a config field). NaN fails every check.
#pragma once
#include <cstdint>

namespace k3 {

// lo <= v <= hi (or lo < v, v < hi when the bound is open). Infinite bounds are allowed: the value
// itself must be finite.
void require_number(const char* name, double v, double lo, double hi, bool lo_open = false, bool hi_open = false);
void require_integer(const char* name, int64_t v, int64_t lo, int64_t hi);

}  // namespace k3
