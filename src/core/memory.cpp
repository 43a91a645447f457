#include "core/memory.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include <sys/mman.h>

#include "core/error.h"

namespace k3 {

namespace {

// The first number in a file ("max" or absent: UINT64_MAX).
uint64_t read_number(const char* path) {
  std::ifstream in(path);
  std::string s;
  if (!(in >> s) || s == "max") return UINT64_MAX;
  try {
    return std::stoull(s);
  } catch (...) {
    return UINT64_MAX;
  }
}

}  // namespace

uint64_t available_memory_bytes() {
  uint64_t avail = UINT64_MAX;
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);)
    if (line.rfind("MemAvailable:", 0) == 0) {
      std::istringstream ls(line.substr(13));
      uint64_t kb = 0;
      if (ls >> kb) avail = kb * 1024;
      break;
    }
  // cgroup v2, then v1: the limit less what the group already uses.
  const uint64_t limit2 = read_number("/sys/fs/cgroup/memory.max"),
                 used2 = read_number("/sys/fs/cgroup/memory.current");
  if (limit2 != UINT64_MAX && used2 != UINT64_MAX) avail = std::min(avail, limit2 > used2 ? limit2 - used2 : 0);
  const uint64_t limit1 = read_number("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                 used1 = read_number("/sys/fs/cgroup/memory/memory.usage_in_bytes");
  if (limit1 < (uint64_t(1) << 60) && used1 != UINT64_MAX) avail = std::min(avail, limit1 > used1 ? limit1 - used1 : 0);
  return avail;
}

std::string format_bytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = double(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 6) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  if (u == 0) std::snprintf(buf, sizeof buf, "%llu B", (unsigned long long)bytes);
  else std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
}

void require_memory(uint64_t bytes, const std::string& what) {
  const uint64_t avail = available_memory_bytes();
  if (bytes > avail)
    fail(what, " needs ", format_bytes(bytes), " of memory, but only ", format_bytes(avail), " is available");
}

void advise_huge_pages(void* p, size_t bytes) {
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
#ifdef MADV_HUGEPAGE
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // advice only
#endif
}

}  // namespace k3
