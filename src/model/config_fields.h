// The field reader of config.json parsers (model/config.cpp, model/vision_config.cpp): every message names
// "<file>: field 'text_config.hidden_size'", and sizes are bounded so that products of them cannot overflow.
#pragma once
#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/validate.h"

namespace k3::config_fields {

using json = nlohmann::json;

struct Fields {
  const json& j;
  std::string prefix;
  const std::string& src;

  std::string where(const std::string& k) const { return src + ": field '" + prefix + k + "'"; }
  bool has(const std::string& k) const { return j.contains(k) && !j[k].is_null(); }
  int64_t integer(const std::string& k) const {
    if (!has(k)) fail(where(k), " is missing");
    const json& v = j[k];
    if (v.is_number_integer()) return v.get<int64_t>();
    // A float that is a whole number inside int64's range (the cast of anything else is undefined).
    if (v.is_number_float() && std::fabs(v.get<double>()) < 9.2e18 && v.get<double>() == std::trunc(v.get<double>()))
      return int64_t(v.get<double>());
    fail(where(k), " must be an integer, got ", v.dump());
  }
  int64_t integer(const std::string& k, int64_t def) const { return has(k) ? integer(k) : def; }
  // Sizes are bounded so that products of them (tensor sizes, parameter counts) cannot overflow
  // int64 and a hostile config cannot make per-layer arrays allocate gigabytes.
  int64_t positive(const std::string& k, int64_t max = int64_t(1) << 24) const {
    int64_t v = integer(k);
    if (v <= 0) fail(where(k), " must be positive, got ", v);
    if (v > max) fail(where(k), " = ", v, " exceeds the supported maximum ", max);
    return v;
  }
  double number(const std::string& k) const {
    if (!has(k)) fail(where(k), " is missing");
    if (!j[k].is_number()) fail(where(k), " must be a number, got ", j[k].dump());
    return j[k].get<double>();
  }
  double number(const std::string& k, double def) const { return has(k) ? number(k) : def; }
  // A float field within [lo, hi] ((lo, hi] when lo_open): a value such as 1e300 or -1e300, finite in
  // the JSON, would overflow the float32 the model keeps it in and poison every logit downstream.
  double number_in(const std::string& k, double def, double lo, double hi, bool lo_open, bool hi_open = false) const {
    const double v = number(k, def);
    require_number(where(k).c_str(), v, lo, hi, lo_open, hi_open);
    return v;
  }
  // A token id field: absent (-1) or inside the vocabulary.
  int64_t token_id(const std::string& k, int64_t def, int64_t vocab) const {
    const int64_t v = integer(k, def);
    if (v != -1 && (v < 0 || v >= vocab))
      fail(where(k), " = ", v, " is outside the vocabulary [0, ", vocab, ") (vocab_size)");
    return v;
  }
  bool boolean(const std::string& k, bool def) const {
    if (!has(k)) return def;
    if (!j[k].is_boolean()) fail(where(k), " must be true or false, got ", j[k].dump());
    return j[k].get<bool>();
  }
  std::string string(const std::string& k, const std::string& def) const {
    if (!has(k)) return def;
    if (!j[k].is_string()) fail(where(k), " must be a string, got ", j[k].dump());
    return j[k].get<std::string>();
  }
  std::vector<int64_t> int_list(const std::string& k) const {
    if (!has(k)) fail(where(k), " is missing");
    if (!j[k].is_array()) fail(where(k), " must be a list of layer numbers, got ", j[k].dump());
    std::vector<int64_t> out;
    for (auto& v : j[k]) {
      if (!v.is_number_integer()) fail(where(k), " must hold integers, got ", v.dump());
      out.push_back(v.get<int64_t>());
    }
    return out;
  }
};

}  // namespace k3::config_fields
