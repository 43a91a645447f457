#include "core/validate.h"

#include <cmath>
#include <limits>
#include <sstream>
#include <string>

#include "core/error.h"

namespace k3 {

namespace {

std::string bounds_text(double lo, double hi, bool lo_open, bool hi_open) {
  std::ostringstream s;
  s.precision(17);
  const bool has_lo = std::isfinite(lo), has_hi = std::isfinite(hi);
  if (has_lo && has_hi) s << "in " << (lo_open ? "(" : "[") << lo << ", " << hi << (hi_open ? ")" : "]");
  else if (has_lo) s << (lo_open ? "> " : ">= ") << lo;
  else if (has_hi) s << (hi_open ? "< " : "<= ") << hi;
  return s.str();
}

}  // namespace

void require_number(const char* name, double v, double lo, double hi, bool lo_open, bool hi_open) {
  const bool ok = std::isfinite(v) && (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
  if (!ok) {
    const std::string b = bounds_text(lo, hi, lo_open, hi_open);
    fail(name, " must be a finite number", b.empty() ? "" : " ", b, ", got ", v);
  }
}

void require_integer(const char* name, int64_t v, int64_t lo, int64_t hi) {
  if (v >= lo && v <= hi) return;
  if (hi == std::numeric_limits<int64_t>::max()) fail(name, " must be an integer >= ", lo, ", got ", v);
  fail(name, " must be an integer in [", lo, ", ", hi, "], got ", v);
}

}  // namespace k3
