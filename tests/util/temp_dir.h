// A fresh, uniquely named directory under the system temp dir, removed with its contents when the
// object goes out of scope (also when an assertion ends the test early).
#pragma once
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>

namespace k3test {

class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("k3-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + "-" + tag);
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace k3test
