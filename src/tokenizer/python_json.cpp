#include "tokenizer/python_json.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <vector>

#include "core/error.h"
#include "core/json.h"

namespace k3 {

std::string python_float_repr(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";  // json.dumps spelling (allow_nan)
  if (v == 0) return std::signbit(v) ? "-0.0" : "0.0";
  // Shortest round-trip digits and their exponent, from to_chars' scientific form "d.ddde±X".
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  const std::string sci(buf, r.ptr);
  const bool neg = sci[0] == '-';
  const size_t epos = sci.find('e');
  std::string digits;
  for (size_t i = neg ? 1 : 0; i < epos; ++i)
    if (sci[i] != '.') digits += sci[i];
  const int exp10 = std::stoi(sci.substr(epos + 1));
  const int decpt = exp10 + 1;  // value = 0.DIGITS x 10^decpt
  std::string out = neg ? "-" : "";
  if (decpt <= -4 || decpt > 16) {  // CPython's float_repr_style 'short', mode 'r'
    out += digits[0];
    if (digits.size() > 1) {
      out += '.';
      out.append(digits, 1, std::string::npos);
    }
    char e[16];
    std::snprintf(e, sizeof e, "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
    out += e;
  } else if (decpt <= 0) {
    out += "0.";
    out.append(size_t(-decpt), '0');
    out += digits;
  } else if (size_t(decpt) >= digits.size()) {
    out += digits;
    out.append(size_t(decpt) - digits.size(), '0');
    out += ".0";
  } else {
    out.append(digits, 0, size_t(decpt));
    out += '.';
    out.append(digits, size_t(decpt), std::string::npos);
  }
  return out;
}

namespace {

void dump_string(const std::string& s, std::string& out) {
  out += '"';
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char u[8];
          std::snprintf(u, sizeof u, "\\u%04x", c);
          out += u;
        } else {
          out += ch;
        }
    }
  }
  out += '"';
}

void dump(const nlohmann::ordered_json& v, bool compact, std::string& out, int depth) {
  check_json_walk_depth(depth, "python_json_dumps");
  const char* item_sep = compact ? "," : ", ";
  const char* key_sep = compact ? ":" : ": ";
  switch (v.type()) {
    case nlohmann::ordered_json::value_t::null: out += "null"; break;
    case nlohmann::ordered_json::value_t::boolean: out += v.get<bool>() ? "true" : "false"; break;
    case nlohmann::ordered_json::value_t::number_integer: out += std::to_string(v.get<int64_t>()); break;
    case nlohmann::ordered_json::value_t::number_unsigned: out += std::to_string(v.get<uint64_t>()); break;
    case nlohmann::ordered_json::value_t::number_float: out += python_float_repr(v.get<double>()); break;
    case nlohmann::ordered_json::value_t::string: dump_string(v.get_ref<const std::string&>(), out); break;
    case nlohmann::ordered_json::value_t::array: {
      out += '[';
      bool first = true;
      for (const auto& e : v) {
        if (!first) out += item_sep;
        first = false;
        dump(e, compact, out, depth + 1);
      }
      out += ']';
      break;
    }
    case nlohmann::ordered_json::value_t::object: {
      out += '{';
      bool first = true;
      for (const auto& [k, e] : v.items()) {
        if (!first) out += item_sep;
        first = false;
        dump_string(k, out);
        out += key_sep;
        dump(e, compact, out, depth + 1);
      }
      out += '}';
      break;
    }
    default: fail("python_json_dumps: value of type ", v.type_name(), " has no JSON spelling");
  }
}

}  // namespace

std::string python_json_dumps(const nlohmann::ordered_json& value, bool compact) {
  std::string out;
  dump(value, compact, out, 0);
  return out;
}

namespace {

nlohmann::ordered_json deep_sorted_at(const nlohmann::ordered_json& value, int depth) {
  check_json_walk_depth(depth, "deep_sorted");
  if (value.is_array()) {
    nlohmann::ordered_json out = nlohmann::ordered_json::array();
    for (const auto& e : value) out.push_back(deep_sorted_at(e, depth + 1));
    return out;
  }
  if (!value.is_object()) return value;
  std::vector<std::string> keys;
  for (const auto& [k, e] : value.items()) keys.push_back(k);
  std::sort(keys.begin(), keys.end());
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (const std::string& k : keys) out[k] = deep_sorted_at(value.at(k), depth + 1);
  return out;
}

}  // namespace

nlohmann::ordered_json deep_sorted(const nlohmann::ordered_json& value) { return deep_sorted_at(value, 0); }

}  // namespace k3
