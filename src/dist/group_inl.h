// Template bodies of dist/group.h.
#pragma once
#include <cstring>
#include <type_traits>

#include "core/error.h"

namespace k3::dist {

template <class T>
std::vector<T> all_gather(Group& g, const std::vector<T>& mine, std::vector<int64_t>* counts) {
  static_assert(std::is_trivially_copyable_v<T>, "all_gather moves plain values");
  std::vector<int64_t> bytes;
  const std::vector<uint8_t> raw = g.all_gather_bytes(mine.data(), int64_t(mine.size() * sizeof(T)), &bytes);
  std::vector<T> out(raw.size() / sizeof(T));
  if (!raw.empty()) std::memcpy(out.data(), raw.data(), raw.size());
  if (counts) {
    counts->clear();
    for (int64_t b : bytes) counts->push_back(b / int64_t(sizeof(T)));
  }
  return out;
}

}  // namespace k3::dist
