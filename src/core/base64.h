// Base64 decoding for tiktoken rank files and data URLs: the standard alphabet, and the URL-safe one's '-' and '_'.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace k3 {

// Decodes `in` up to its first '=' (or its end) into `out`. False at a character of neither alphabet, with *bad
// (when given) its position. A trailing group of one character (six bits, no whole byte) adds nothing.
bool base64_decode(std::string_view in, std::string& out, size_t* bad = nullptr);

}  // namespace k3
