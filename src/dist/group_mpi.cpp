// dist/group.h over MPI (OpenMPI from Debian), and the group of one.
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "core/error.h"
#include "dist/group.h"

namespace k3::dist {

namespace {

// MPI counts are int: every transfer is cut into pieces of at most this many elements.
constexpr int64_t kMaxPiece = int64_t(1) << 30;

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  fail("MPI ", what, " failed: ", std::string(msg, size_t(len)));
}

// The group of one: a process started without a launcher.
class SoloGroup final : public Group {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string describe() const override { return "solo"; }
  void all_reduce_sum(double*, int64_t) override {}
  void all_reduce_sum(int64_t*, int64_t) override {}
  void all_reduce_sum_buckets(double*, int64_t, int64_t) override {}
  void broadcast(void*, int64_t, int root) override {
    K3_CHECK(root == 0, "broadcast: no rank ", root, " in a group of one");
  }
  std::vector<uint8_t> all_gather_bytes(const void* data, int64_t bytes, std::vector<int64_t>* counts) override {
    if (counts) *counts = {bytes};
    const auto* p = static_cast<const uint8_t*>(data);
    return std::vector<uint8_t>(p, p + bytes);
  }
  void all_to_all_bytes(const uint8_t* send, const std::vector<int64_t>& send_bytes,
                        const std::vector<int64_t>& send_offset, uint8_t* recv, const std::vector<int64_t>& recv_bytes,
                        const std::vector<int64_t>& recv_offset) override {
    K3_CHECK(send_bytes.size() == 1 && recv_bytes.size() == 1 && send_bytes[0] == recv_bytes[0],
             "all_to_all: a group of one sends to itself only");
    if (send_bytes[0] > 0) std::memmove(recv + recv_offset[0], send + send_offset[0], size_t(send_bytes[0]));
  }
  void barrier() override {}
};

class MpiGroup final : public Group {
 public:
  MpiGroup() {
    int provided = 0;
    check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "initialisation");
    // Errors come back as return codes and become k3::Errors naming the collective.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  ~MpiGroup() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string describe() const override {
    return "mpi (" + std::to_string(size_) + " rank" + (size_ == 1 ? "" : "s") + ")";
  }

  void all_reduce_sum(double* x, int64_t n) override { reduce(x, n, MPI_DOUBLE); }
  void all_reduce_sum(int64_t* x, int64_t n) override { reduce(x, n, MPI_INT64_T); }

  void all_reduce_sum_buckets(double* x, int64_t n, int64_t bucket_elems) override {
    K3_CHECK(bucket_elems > 0, "all_reduce: bucket size must be positive");
    bucket_elems = std::min(bucket_elems, kMaxPiece);
    std::vector<MPI_Request> req;
    for (int64_t b = 0; b < n; b += bucket_elems) {
      req.emplace_back();
      check_mpi(MPI_Iallreduce(MPI_IN_PLACE, x + b, int(std::min(bucket_elems, n - b)), MPI_DOUBLE, MPI_SUM,
                               MPI_COMM_WORLD, &req.back()),
                "all-reduce");
    }
    if (!req.empty()) check_mpi(MPI_Waitall(int(req.size()), req.data(), MPI_STATUSES_IGNORE), "all-reduce");
  }

  void broadcast(void* data, int64_t bytes, int root) override {
    K3_CHECK(root >= 0 && root < size_, "broadcast: no rank ", root, " in a group of ", size_);
    auto* p = static_cast<uint8_t*>(data);
    for (int64_t o = 0; o < bytes; o += kMaxPiece)
      check_mpi(MPI_Bcast(p + o, int(std::min(kMaxPiece, bytes - o)), MPI_BYTE, root, MPI_COMM_WORLD), "broadcast");
  }

  std::vector<uint8_t> all_gather_bytes(const void* data, int64_t bytes, std::vector<int64_t>* counts) override {
    std::vector<int64_t> n(size_t(size_), 0);
    check_mpi(MPI_Allgather(&bytes, 1, MPI_INT64_T, n.data(), 1, MPI_INT64_T, MPI_COMM_WORLD), "all-gather");
    std::vector<int64_t> at(size_t(size_) + 1, 0);
    for (int r = 0; r < size_; ++r) at[size_t(r) + 1] = at[size_t(r)] + n[size_t(r)];
    std::vector<uint8_t> out(size_t(at.back()));
    // Each rank's bytes go out in rounds of at most `piece`, so one round's counts and displacements fit an int.
    const int64_t piece = std::max<int64_t>(1, (INT_MAX / size_) & ~int64_t(7));
    const int64_t longest = *std::max_element(n.begin(), n.end());
    std::vector<uint8_t> round;
    std::vector<int> cnt(static_cast<size_t>(size_)), disp(static_cast<size_t>(size_));
    for (int64_t o = 0; o < longest; o += piece) {
      int total = 0;
      for (int r = 0; r < size_; ++r) {
        cnt[size_t(r)] = int(std::clamp<int64_t>(n[size_t(r)] - o, 0, piece));
        disp[size_t(r)] = total;
        total += cnt[size_t(r)];
      }
      round.resize(size_t(total));
      check_mpi(MPI_Allgatherv(static_cast<const uint8_t*>(data) + std::min(o, bytes), cnt[size_t(rank_)], MPI_BYTE,
                               round.data(), cnt.data(), disp.data(), MPI_BYTE, MPI_COMM_WORLD),
                "all-gather");
      for (int r = 0; r < size_; ++r)
        if (cnt[size_t(r)] > 0)
          std::memcpy(out.data() + at[size_t(r)] + o, round.data() + disp[size_t(r)], size_t(cnt[size_t(r)]));
    }
    if (counts) *counts = n;
    return out;
  }

  void all_to_all_bytes(const uint8_t* send, const std::vector<int64_t>& send_bytes,
                        const std::vector<int64_t>& send_offset, uint8_t* recv, const std::vector<int64_t>& recv_bytes,
                        const std::vector<int64_t>& recv_offset) override {
    const size_t R = size_t(size_);
    K3_CHECK(send_bytes.size() == R && send_offset.size() == R && recv_bytes.size() == R && recv_offset.size() == R,
             "all_to_all: counts for ", send_bytes.size(), " ranks in a group of ", R);
    // Point-to-point pairs (what MPI_Alltoallv does inside), in pieces that keep counts in an int.
    std::vector<MPI_Request> req;
    for (size_t q = 0; q < R; ++q)
      for (int64_t o = 0; o < recv_bytes[q]; o += kMaxPiece) {
        req.emplace_back();
        check_mpi(MPI_Irecv(recv + recv_offset[q] + o, int(std::min(kMaxPiece, recv_bytes[q] - o)), MPI_BYTE, int(q), 0,
                            MPI_COMM_WORLD, &req.back()),
                  "all-to-all");
      }
    for (size_t q = 0; q < R; ++q)
      for (int64_t o = 0; o < send_bytes[q]; o += kMaxPiece) {
        req.emplace_back();
        check_mpi(MPI_Isend(send + send_offset[q] + o, int(std::min(kMaxPiece, send_bytes[q] - o)), MPI_BYTE, int(q), 0,
                            MPI_COMM_WORLD, &req.back()),
                  "all-to-all");
      }
    if (!req.empty()) check_mpi(MPI_Waitall(int(req.size()), req.data(), MPI_STATUSES_IGNORE), "all-to-all");
  }

  void barrier() override { check_mpi(MPI_Barrier(MPI_COMM_WORLD), "barrier"); }

 private:
  template <class T>
  void reduce(T* x, int64_t n, MPI_Datatype type) {
    for (int64_t o = 0; o < n; o += kMaxPiece)
      check_mpi(MPI_Allreduce(MPI_IN_PLACE, x + o, int(std::min(kMaxPiece, n - o)), type, MPI_SUM, MPI_COMM_WORLD),
                "all-reduce");
  }
  int rank_ = 0, size_ = 1;
};

}  // namespace

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"})
    if (std::getenv(v)) return true;
  return false;
}

Group& world() {
  static const std::unique_ptr<Group> g =
      launched_by_mpi() ? std::unique_ptr<Group>(new MpiGroup()) : std::unique_ptr<Group>(new SoloGroup());
  return *g;
}

bool lead_rank() { return !launched_by_mpi() || world().rank() == 0; }

void abort_world(int status) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized && world().size() > 1) MPI_Abort(MPI_COMM_WORLD, status);
}

void check_same_on_every_rank(Group& g, const std::string& bytes, const std::string& what) {
  if (g.size() == 1) return;
  std::vector<int64_t> counts;
  const std::vector<uint8_t> all = g.all_gather_bytes(bytes.data(), int64_t(bytes.size()), &counts);
  int64_t at = 0;
  for (int r = 0; r < g.size(); ++r) {
    const int64_t n = counts[size_t(r)];
    if (n != counts[0] || !std::equal(all.begin() + at, all.begin() + at + n, all.begin()))
      fail(what, " differs between rank 0 and rank ", r, " (every rank must be started with the same one)");
    at += n;
  }
}

}  // namespace k3::dist
