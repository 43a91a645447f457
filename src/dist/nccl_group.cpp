// dist/nccl_group.h: NCCL communicators bootstrapped through the host group.
#include "dist/nccl_group.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "core/error.h"

#if K3_HAVE_CUDA
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace k3::dist {

#if K3_HAVE_CUDA

namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("NCCL group: ", what, ": ", cudaGetErrorString(e));
}

// NCCL counts are size_t, but one all-reduce call is kept to 2^31 elements so that every transport's int paths
// hold (the all-to-all and all-gather blocks of a dispatch are far smaller).
constexpr int64_t kMaxPiece = int64_t(1) << 31;

}  // namespace

bool nccl_built() { return true; }

struct NcclGroup::Impl {
  ncclComm_t comm = nullptr;
  int rank = 0, size = 1, device = 0;
  double timeout_s = 600.0;
  bool aborted = false;

  void check(ncclResult_t r, const std::string& what) {
    if (r == ncclSuccess || r == ncclInProgress) return;
    const std::string msg = ncclGetErrorString(r);
    const char* last = ncclGetLastError(comm);
    abort_comm();
    fail("NCCL ", what, " failed on rank ", rank, " of ", size, ": ", msg,
         last && *last ? std::string(" (") + last + ")" : "");
  }
  void abort_comm() {
    if (comm && !aborted) ncclCommAbort(comm);
    aborted = true;
  }
};

NcclGroup::NcclGroup(Group& host, double timeout_s) : impl_(std::make_unique<Impl>()) {
  impl_->rank = host.rank();
  impl_->size = host.size();
  impl_->timeout_s = timeout_s;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    fail("NCCL group: rank ", host.rank(), " sees no CUDA device");
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  impl_->device = (local ? std::atoi(local) : host.rank()) % devices;
  check_cuda(cudaSetDevice(impl_->device), "cudaSetDevice");
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  ncclUniqueId id{};
  if (host.rank() == 0) impl_->check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  host.broadcast(&id, sizeof(id), 0);
  impl_->check(ncclCommInitRank(&impl_->comm, host.size(), id, host.rank()), "communicator initialisation");
}

NcclGroup::~NcclGroup() {
  if (impl_->comm && !impl_->aborted) ncclCommDestroy(impl_->comm);
}

int NcclGroup::rank() const { return impl_->rank; }
int NcclGroup::size() const { return impl_->size; }
int NcclGroup::device() const { return impl_->device; }

void NcclGroup::all_reduce_sum(float* x, int64_t n, void* stream) {
  for (int64_t o = 0; o < n; o += kMaxPiece)
    impl_->check(ncclAllReduce(x + o, x + o, size_t(std::min(kMaxPiece, n - o)), ncclFloat32, ncclSum, impl_->comm,
                               cudaStream_t(stream)),
                 "all-reduce");
}

void NcclGroup::all_reduce_sum(double* x, int64_t n, void* stream) {
  for (int64_t o = 0; o < n; o += kMaxPiece)
    impl_->check(ncclAllReduce(x + o, x + o, size_t(std::min(kMaxPiece, n - o)), ncclFloat64, ncclSum, impl_->comm,
                               cudaStream_t(stream)),
                 "all-reduce");
}

void NcclGroup::all_to_all_bytes(const void* send, const std::vector<int64_t>& send_bytes,
                                 const std::vector<int64_t>& send_offset, void* recv,
                                 const std::vector<int64_t>& recv_bytes, const std::vector<int64_t>& recv_offset,
                                 void* stream) {
  const size_t R = size_t(impl_->size);
  K3_CHECK(send_bytes.size() == R && send_offset.size() == R && recv_bytes.size() == R && recv_offset.size() == R,
           "NCCL all-to-all: counts for ", send_bytes.size(), " ranks in a group of ", R);
  impl_->check(ncclGroupStart(), "all-to-all");
  for (size_t q = 0; q < R; ++q) {
    if (send_bytes[q] > 0)
      impl_->check(ncclSend(static_cast<const char*>(send) + send_offset[q], size_t(send_bytes[q]), ncclUint8, int(q),
                            impl_->comm, cudaStream_t(stream)),
                   "all-to-all send");
    if (recv_bytes[q] > 0)
      impl_->check(ncclRecv(static_cast<char*>(recv) + recv_offset[q], size_t(recv_bytes[q]), ncclUint8, int(q),
                            impl_->comm, cudaStream_t(stream)),
                   "all-to-all receive");
  }
  impl_->check(ncclGroupEnd(), "all-to-all");
}

void NcclGroup::all_gather_bytes(const void* in, void* out, int64_t bytes, void* stream) {
  impl_->check(ncclAllGather(in, out, size_t(bytes), ncclUint8, impl_->comm, cudaStream_t(stream)), "all-gather");
}

void NcclGroup::synchronize(void* stream, const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t q = cudaStreamQuery(cudaStream_t(stream));
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) check_cuda(q, what.c_str());
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(impl_->comm, &async);
    if (async != ncclSuccess && async != ncclInProgress) impl_->check(async, what);
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > impl_->timeout_s) {
      impl_->abort_comm();
      fail("NCCL ", what, ": rank ", impl_->rank, " of ", impl_->size, " waited ", int64_t(waited),
           " s for its peers (a rank died or stopped calling collectives); the communicator is aborted");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

#else  // no CUDA backend

bool nccl_built() { return false; }

struct NcclGroup::Impl {};

NcclGroup::NcclGroup(Group&, double) {
  fail("NCCL group: this build has no CUDA backend (configure with nvcc present)");
}
NcclGroup::~NcclGroup() = default;
int NcclGroup::rank() const { return 0; }
int NcclGroup::size() const { return 1; }
int NcclGroup::device() const { return -1; }
void NcclGroup::all_reduce_sum(float*, int64_t, void*) {}
void NcclGroup::all_reduce_sum(double*, int64_t, void*) {}
void NcclGroup::all_to_all_bytes(const void*, const std::vector<int64_t>&, const std::vector<int64_t>&, void*,
                                 const std::vector<int64_t>&, const std::vector<int64_t>&, void*) {}
void NcclGroup::all_gather_bytes(const void*, void*, int64_t, void*) {}
void NcclGroup::synchronize(void*, const std::string&) {}

#endif

}  // namespace k3::dist
