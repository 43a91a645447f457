// Central finite differences, the independent truth for every backward pass in the training tests.
#pragma once
#include <functional>

namespace k3test {

// (f(v + eps) - f(v - eps)) / (2 eps), evaluated by perturbing *v in place and restoring it.
// eps = 1e-6 in float64 leaves ~1e-10 relative truncation error for smooth f and ~1e-10/eps
// rounding error, well inside the 1e-5 relative bars the tests use.
inline double central_difference(double* v, const std::function<double()>& f, double eps = 1e-6) {
  const double keep = *v;
  *v = keep + eps;
  const double up = f();
  *v = keep - eps;
  const double down = f();
  *v = keep;
  return (up - down) / (2 * eps);
}

}  // namespace k3test
