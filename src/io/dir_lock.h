// An exclusive lock on a directory that one process owns while it works in it (a training run's
// OUT). Two `k3 train --out R` at once would delete each other's temporary checkpoints, claim the
// same step and interleave metrics.jsonl; the second one is refused instead, naming the first.
//
// The lock is flock(2) on DIR/.lock, a file that also holds the owner's pid for the message. The
// kernel drops it when the owner exits, however it exits (kill -9 included), so a crashed run
// never leaves a stale lock and its resume is not blocked. On a filesystem that cannot lock (some NFS
// mounts) it warns and goes on unlocked.
#pragma once
#include <string>

namespace k3 {

class DirectoryLock {
 public:
  // Creates dir if needed and takes its lock, or throws k3::Error naming dir and the pid that holds
  // it. `purpose` says what the directory is, e.g. "run directory".
  DirectoryLock(const std::string& dir, const std::string& purpose);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace k3
