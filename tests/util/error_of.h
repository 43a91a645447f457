// The message of the k3::Error that f throws; a test failure when it throws nothing or another type.
#pragma once
#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <string>

#include "core/error.h"

namespace k3test {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const k3::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-k3::Error exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

}  // namespace k3test
