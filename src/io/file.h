// Opening and reading input files: configs, requests, prompts, rank files, and (through MappedFile)
// weights and token shards.
//
// Inputs must be regular files. A FIFO, a device or a socket is refused with an error naming it
// (opening a FIFO for reading would block until a writer appears; /dev/zero would never end), and a
// file larger than the memory available is refused before it is read. Every input is registered
// (io/input_registry.h) so that no output of the same command can replace it.
#pragma once
#include <sys/stat.h>

#include <string>

namespace k3 {

// kInput: a file the command was given; no output of this process may replace it.
// kOwnState: a file of a directory this process owns and rewrites (a run's `latest` pointer and
// metrics.jsonl, under the run's DirectoryLock); it is not registered as an input.
enum class InputRole { kInput, kOwnState };

// Opens path read-only (O_CLOEXEC), checks that it is a regular file and (kInput) registers it as
// an input in the role `what`. Returns the descriptor, and its fstat in *st when given; throws
// k3::Error naming path and `what`.
int open_input(const std::string& path, const std::string& what, InputRole role = InputRole::kInput,
               struct stat* st = nullptr);

// What a file of this st_mode is, for messages: "a directory", "a FIFO", "a character device"...
const char* file_kind(mode_t mode);

// The bytes of path. Throws k3::Error "<path>: cannot open <what>" (with the OS reason) when it
// cannot be read; `what` names the role, e.g. "config".
std::string read_file(const std::string& path, const std::string& what = "file", InputRole role = InputRole::kInput);

}  // namespace k3
