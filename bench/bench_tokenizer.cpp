// Encode throughput of BpeTokenizer::encode_ordinary on one thread (MB/s, tokens/s), with the
// pre-tokenizer alone and the first BPE loop (v0) as baselines timed in the same run.
//
//   build-bench/bench_tokenizer --text FILE [--ranks tests/fixtures/tokenizer/o200k.tiktoken]
//                               [--reps 5] [--ids-out ids.bin] [--baseline]
//
// Rows (each: one untimed warm-up, then --reps timed runs; the median wall time is reported, min and
// max too, and the median of this thread's CPU time, which a busy machine disturbs less):
//   pretokenize   PreTokenizer::for_each_piece alone (the regex share of the encoder's time; its
//                 tokens/s counts the encoder's tokens, for comparison with the next row).
//   encode        BpeTokenizer::encode_ordinary, the shipped encoder.
//   v0 (--baseline) the encoder up to 1a7d28f: per pass, every adjacent pair's bytes are copied into
//                 a std::string and looked up in an unordered_map<std::string, int>; O(n^2) per piece.
//                 Its ids are checked against the shipped encoder's.
// MB is 10^6 bytes. The last line, `RESULT impl=k3cpp ...`, is what bench/compare_tokenizer.sh reads;
// `fnv1a` is FNV-1a 32 over the ids as little-endian uint32 (bench/tiktoken_encode_bench.mjs prints the
// same hash for tiktoken's ids). --ids-out writes the ids as little-endian int32 for an exact comparison.
// bench/compare_tokenizer.sh runs this and the npm tiktoken reference on the same text.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "tokenizer/bpe.h"
#include "tokenizer/pretokenizer.h"

using namespace k3;
using clock_type = std::chrono::steady_clock;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

uint32_t fnv1a_ids(const std::vector<int32_t>& ids) {
  uint32_t h = 2166136261u;
  for (int32_t id : ids)
    for (int k = 0; k < 4; ++k) {
      h ^= (uint32_t(id) >> (8 * k)) & 0xffu;
      h *= 16777619u;
    }
  return h;
}

double thread_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

double median_of(std::vector<double> s) {
  std::sort(s.begin(), s.end());
  const size_t n = s.size();
  return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

struct Timing {
  double median = 0, min = 0, max = 0;  // wall seconds
  double cpu_median = 0;                // this thread's CPU seconds (less sensitive to a busy machine)
};

// One untimed warm-up call, then reps timed calls.
Timing time_reps(int reps, const std::function<void()>& fn) {
  fn();
  std::vector<double> wall, cpu;
  for (int r = 0; r < reps; ++r) {
    const double c0 = thread_cpu_seconds();
    const auto t0 = clock_type::now();
    fn();
    wall.push_back(std::chrono::duration<double>(clock_type::now() - t0).count());
    cpu.push_back(thread_cpu_seconds() - c0);
  }
  return {median_of(wall), *std::min_element(wall.begin(), wall.end()), *std::max_element(wall.begin(), wall.end()),
          median_of(cpu)};
}

void print_row(const char* name, size_t bytes, size_t tokens, const Timing& t) {
  std::printf("%-12s %9.3f s  %8.2f MB/s  %10.0f tokens/s   (min %.3f s, max %.3f s; cpu %.3f s)\n", name, t.median,
              double(bytes) / t.median / 1e6, double(tokens) / t.median, t.min, t.max, t.cpu_median);
}

// The v0 encoder (bpe.cpp up to commit 1a7d28f), for the baseline row. It parses the rank file
// itself, so it shares only the pre-tokenizer with the shipped code.
class V0Bpe {
 public:
  explicit V0Bpe(const std::string& path) {
    std::ifstream in(path);
    std::string tok;
    long long rank;
    while (in >> tok >> rank) ranks_.emplace(b64(tok), int32_t(rank));
  }
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
    if (auto it = ranks_.find(std::string(piece)); it != ranks_.end()) {
      out.push_back(it->second);
      return;
    }
    std::vector<size_t> parts(piece.size() + 1);
    for (size_t i = 0; i <= piece.size(); ++i) parts[i] = i;
    std::string key;
    while (parts.size() > 2) {
      int32_t best = INT32_MAX;
      size_t at = 0;
      for (size_t i = 0; i + 2 < parts.size(); ++i) {
        key.assign(piece.substr(parts[i], parts[i + 2] - parts[i]));
        auto it = ranks_.find(key);
        if (it != ranks_.end() && it->second < best) {
          best = it->second;
          at = i;
        }
      }
      if (best == INT32_MAX) break;
      parts.erase(parts.begin() + int64_t(at) + 1);
    }
    for (size_t i = 0; i + 1 < parts.size(); ++i)
      out.push_back(ranks_.at(std::string(piece.substr(parts[i], parts[i + 1] - parts[i]))));
  }

 private:
  static std::string b64(const std::string& s) {
    std::string out;
    uint32_t acc = 0;
    int bits = 0;
    for (char c : s) {
      if (c == '=') break;
      const char* tab = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
      acc = (acc << 6) | uint32_t(std::strchr(tab, c) - tab);
      if ((bits += 6) >= 8) out.push_back(char((acc >> (bits -= 8)) & 0xff));
    }
    return out;
  }
  std::unordered_map<std::string, int32_t> ranks_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Single-thread encode throughput of the BPE tokenizer (see the header of bench/bench_tokenizer.cpp)"};
  std::string text_path, ranks = "tests/fixtures/tokenizer/o200k.tiktoken", ids_out;
  int reps = 5;
  bool baseline = false;
  app.add_option("--text", text_path, "text file to encode (its bytes, as they are)")->required();
  app.add_option("--ranks", ranks, "tiktoken rank file")->capture_default_str();
  app.add_option("--reps", reps, "timed repetitions (median reported)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_option("--ids-out", ids_out, "write the encoder's ids here (little-endian int32)");
  app.add_flag("--baseline", baseline, "also time the v0 encoder and check its ids");
  CLI11_PARSE(app, argc, argv);
  try {
    const std::string text = read_file(text_path);
    const auto t_load = clock_type::now();
    const BpeTokenizer tok = BpeTokenizer::load(ranks);
    const double load_s = std::chrono::duration<double>(clock_type::now() - t_load).count();
    const PreTokenizer pre(kK3Pattern);
    std::printf(
        "k3cpp tokenizer benchmark: %s, %zu bytes, ranks %s (%lld, loaded in %.3f s), K3 pattern, 1 thread, %d reps\n",
        text_path.c_str(), text.size(), ranks.c_str(), (long long)tok.num_ranks(), load_s, reps);

    size_t pieces = 0;
    const Timing tp = time_reps(reps, [&] {
      pieces = 0;
      pre.for_each_piece(text, [&](std::string_view) { ++pieces; });
    });
    std::vector<int32_t> ids;
    const Timing te = time_reps(reps, [&] { ids = tok.encode_ordinary(text); });
    print_row("pretokenize", text.size(), ids.size(), tp);
    print_row("encode", text.size(), ids.size(), te);
    std::printf("%zu pieces, %zu tokens (%.2f bytes/token), fnv1a 0x%08x\n", pieces, ids.size(),
                double(text.size()) / double(ids.size()), fnv1a_ids(ids));

    if (baseline) {
      const V0Bpe v0(ranks);
      std::vector<int32_t> ids0;
      const Timing t0 = time_reps(reps, [&] {
        ids0.clear();
        pre.for_each_piece(text, [&](std::string_view p) { v0.encode_piece(p, ids0); });
      });
      print_row("v0", text.size(), ids0.size(), t0);
      std::printf("v0 / encode: %.2fx the time; ids %s\n", t0.median / te.median, ids0 == ids ? "identical" : "DIFFER");
      if (ids0 != ids) return 1;
    }
    if (!ids_out.empty()) {
      std::ofstream out(ids_out, std::ios::binary);
      for (int32_t id : ids) {
        const uint32_t u = uint32_t(id);
        const char b[4] = {char(u & 0xff), char((u >> 8) & 0xff), char((u >> 16) & 0xff), char(u >> 24)};
        out.write(b, 4);
      }
      if (!out) fail(ids_out, ": cannot write");
    }
    std::printf(
        "RESULT impl=k3cpp bytes=%zu tokens=%zu fnv1a=%08x median_s=%.6f min_s=%.6f max_s=%.6f cpu_s=%.6f reps=%d\n",
        text.size(), ids.size(), fnv1a_ids(ids), te.median, te.min, te.max, te.cpu_median, reps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
