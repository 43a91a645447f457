// Device-memory collectives through NCCL: the data plane of multi-GPU runs (dist/group.h is the host
// plane that bootstraps it).
//
// One communicator per process, one GPU per process: rank r uses the GPU of its node-local rank
// (OMPI_COMM_WORLD_LOCAL_RANK, modulo the visible devices). Rank 0 creates the ncclUniqueId and the host
// group broadcasts it; ncclCommInitRank does the rest, on one node (NVLink) or many (InfiniBand/RoCE,
// whatever NCCL finds). NVLink SHARP multicast is switched off (NCCL_NVLS_ENABLE=0, unless the user set
// it): it reserves device memory per communicator and the lent machines do not support it.
//
// A peer that dies leaves NCCL kernels waiting forever, so every wait goes through synchronize(): it polls
// the stream and ncclCommGetAsyncError, and on an error or after `timeout_s` aborts the communicator and
// throws a k3::Error naming the collective. (Under mpirun the launcher also stops this process once a
// peer is gone; the timeout covers launchers that do not.)
//
// Pointers are device memory; `stream` is a cudaStream_t (void* so that the header needs no CUDA).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dist/group.h"

namespace k3::dist {

// True when this build has NCCL (the CUDA backend).
bool nccl_built();

class NcclGroup {
 public:
  // Collective over `host`: selects this rank's GPU and joins the communicator. Throws k3::Error when the
  // build has no CUDA or no GPU is visible.
  explicit NcclGroup(Group& host, double timeout_s = 600.0);
  ~NcclGroup();
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int rank() const;
  int size() const;
  int device() const;  // the CUDA device this rank uses

  void all_reduce_sum(float* x, int64_t n, void* stream);
  void all_reduce_sum(double* x, int64_t n, void* stream);
  // Grouped point-to-point sends and receives of bytes: send_bytes[q] to rank q from send + send_offset[q],
  // recv_bytes[q] from rank q into recv + recv_offset[q] (expert parallelism's dispatch and combine).
  void all_to_all_bytes(const void* send, const std::vector<int64_t>& send_bytes,
                        const std::vector<int64_t>& send_offset, void* recv, const std::vector<int64_t>& recv_bytes,
                        const std::vector<int64_t>& recv_offset, void* stream);
  // Every rank's `bytes` bytes in rank order into out (size() * bytes bytes).
  void all_gather_bytes(const void* in, void* out, int64_t bytes, void* stream);
  // Waits for `stream`; throws k3::Error (after aborting the communicator) if NCCL reports an error or the
  // wait passes the timeout. `what` names the step for the message.
  void synchronize(void* stream, const std::string& what);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace k3::dist
