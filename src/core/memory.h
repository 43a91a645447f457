// Memory a command may still allocate, and the up-front refusal of work that would not fit.
//
// Allocating first and failing later costs minutes of swapping, an OOM kill, or a bare
// std::bad_alloc that names nothing. Anything whose size the input decides (a rank file's largest
// rank, --grad-lanes, a config's parameter count, a file read whole) is estimated and checked
// here before it is allocated.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace k3 {

// Bytes this process can still allocate without swapping: /proc/meminfo's MemAvailable, lowered to
// the room left under a cgroup memory limit when there is one. UINT64_MAX when neither can be read.
uint64_t available_memory_bytes();

// "1.5 GiB", "12.0 MiB", "512 B".
std::string format_bytes(uint64_t bytes);

// A byte count computed in double (a product of sizes that may pass 2^64), saturated at UINT64_MAX.
inline uint64_t saturated_bytes(double bytes) { return bytes >= 0x1p64 ? UINT64_MAX : uint64_t(bytes); }

// Throws k3::Error "<what> needs N of memory, but only M is available" when bytes exceed
// available_memory_bytes().
void require_memory(uint64_t bytes, const std::string& what);

// Asks the kernel to back [p, p + bytes) with transparent huge pages (madvise MADV_HUGEPAGE, on the
// 2 MiB-aligned part; a no-op where unsupported). For buffers of gigabytes written once: with 4 KiB
// pages the first touch of each page is a fault, and at billions of parameters those faults cost
// more than the writes themselves.
void advise_huge_pages(void* p, size_t bytes);

}  // namespace k3
