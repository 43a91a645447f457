// JSON text exactly as Python's json.dumps(value, ensure_ascii=False) writes it.
//
// Kimi's XTML encoder embeds JSON in prompts (the tools declaration, response schemas, non-string
// tool-call arguments) by calling json.dumps, so the model was trained on Python's spelling:
// ", " and ": " separators by default (",", ":" when compact), key order as given, non-ASCII
// characters raw, control characters as lowercase \u00XX, and floats as repr() does (shortest
// round-trip digits, ".0" on integral values, an exponent below 1e-4 and from 1e16 on).
// nlohmann's dump() differs on separators and float spelling, hence this writer.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

namespace k3 {

// compact: separators (",", ":"); otherwise Python's default (", ", ": "). Like every walk over a JSON
// value, this one and deep_sorted throw k3::Error past kMaxJsonDepth levels (core/json.h).
std::string python_json_dumps(const nlohmann::ordered_json& value, bool compact);

// repr() of a Python float.
std::string python_float_repr(double v);

// A copy with every object's keys in sorted order, recursively (Kimi's deep_sort_dict). Keys sort
// by code point, which for UTF-8 is byte order.
nlohmann::ordered_json deep_sorted(const nlohmann::ordered_json& value);

}  // namespace k3
