#include "io/input_registry.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

namespace k3 {

namespace {

struct Entry {
  dev_t dev;
  ino_t ino;
  struct timespec ctime;
  InputInfo info;
};

std::mutex g_mu;
std::vector<Entry>& entries() {
  static std::vector<Entry> e;
  return e;
}

// Whether `st` is the registered file. Device and inode alone would also match a new file that reuses
// the inode of an input deleted since; so when the input's own path no longer leads to that inode, the
// ctime taken at registration must match too (a chmod or a new hard link changes the ctime of a file
// that is still there, which the first rule catches).
bool same_file(const Entry& e, const struct stat& st) {
  if (e.dev != st.st_dev || e.ino != st.st_ino) return false;
  struct stat now;
  if (::stat(e.info.path.c_str(), &now) == 0 && now.st_dev == e.dev && now.st_ino == e.ino) return true;
  return e.ctime.tv_sec == st.st_ctim.tv_sec && e.ctime.tv_nsec == st.st_ctim.tv_nsec;
}

// Mapped ranges for the signal handler: a fixed table of lock-free slots (a handler may not lock).
// A slot is live while `begin` is non-null; writers publish len and path before begin.
struct MappingSlot {
  std::atomic<const char*> begin{nullptr};
  std::atomic<size_t> len{0};
  std::atomic<const char*> path{nullptr};
};
constexpr size_t kMappingSlots = 4096;  // a sharded release checkpoint has a few hundred files
MappingSlot g_mappings[kMappingSlots];
struct sigaction g_previous;  // the SIGBUS action before ours

void write_stderr(const char* s) {
  size_t n = std::strlen(s);
  while (n > 0) {
    const ssize_t w = ::write(2, s, n);
    if (w <= 0) return;
    s += w;
    n -= size_t(w);
  }
}

void on_sigbus(int sig, siginfo_t* info, void*) {
  const char* addr = static_cast<const char*>(info->si_addr);
  for (MappingSlot& s : g_mappings) {
    const char* b = s.begin.load(std::memory_order_acquire);
    if (b && addr >= b && addr < b + s.len.load(std::memory_order_relaxed)) {
      write_stderr("error: ");
      write_stderr(s.path.load(std::memory_order_relaxed));
      write_stderr(
          ": the file was truncated or overwritten while k3 had it memory-mapped (its bytes are read on "
          "demand, so it must not change while in use; replace such a file by writing a new one and renaming "
          "it over the old)\n");
      _exit(1);
    }
  }
  // Not one of our mappings: give the signal back to whoever handled it before us (the default
  // action, or a sanitizer's report). A fault re-executes the faulting instruction on return; a
  // SIGBUS sent by kill() or raise() (si_code <= 0) is raised again.
  sigaction(sig, &g_previous, nullptr);
  if (info->si_code <= 0) raise(sig);
}

void install_sigbus_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_previous);
  });
}

}  // namespace

void register_input(int fd, const std::string& path, const std::string& what) {
  struct stat st;
  if (fstat(fd, &st) != 0) return;
  std::lock_guard<std::mutex> lock(g_mu);
  for (const Entry& e : entries())
    if (same_file(e, st)) return;
  entries().push_back({st.st_dev, st.st_ino, st.st_ctim, {path, what}});
}

void unregister_input(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) return;
  std::lock_guard<std::mutex> lock(g_mu);
  auto& v = entries();
  for (size_t i = 0; i < v.size(); ++i)
    if (v[i].dev == st.st_dev && v[i].ino == st.st_ino) {
      v.erase(v.begin() + std::ptrdiff_t(i));
      return;
    }
}

std::optional<InputInfo> find_input(const struct stat& st) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (const Entry& e : entries())
    if (same_file(e, st)) return e.info;
  return std::nullopt;
}

void register_mapping(const void* begin, size_t len, const char* path) {
  install_sigbus_handler();
  std::lock_guard<std::mutex> lock(g_mu);  // writers serialise; the handler only reads
  for (MappingSlot& s : g_mappings)
    if (s.begin.load(std::memory_order_relaxed) == nullptr) {
      s.len.store(len, std::memory_order_relaxed);
      s.path.store(path, std::memory_order_relaxed);
      s.begin.store(static_cast<const char*>(begin), std::memory_order_release);
      return;
    }
  // Table full: this mapping's SIGBUS falls through to the default action.
}

void unregister_mapping(const void* begin) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (MappingSlot& s : g_mappings)
    if (s.begin.load(std::memory_order_relaxed) == begin) {
      s.begin.store(nullptr, std::memory_order_release);
      return;
    }
}

}  // namespace k3
