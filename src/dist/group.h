// Process groups: the ranks of a multi-process run and the collectives between them.
//
// One process per device, started by a standard launcher. `world()` is the whole job: under OpenMPI's
// `mpirun` (Debian's openmpi-bin; the same command line on one node or across many, through its host
// file) the ranks are MPI_COMM_WORLD; a process started on its own is a group of one, and every
// collective on it is a no-op, so single-process code needs no second path.
//
// Two planes, as every serious stack splits them:
// * Group (this file): host memory, through MPI. It carries what the CPU computes (the float64
//   trainer's gradients, Quantile Balancing's statistics, Muon's orthogonalised updates), the
//   bootstrap of the device plane (dist/nccl_group.h: the NCCL unique id), and agreement checks.
// * NcclGroup (dist/nccl_group.h): device memory, through NCCL, for the GPU paths.
// Neither plane is a communication layer of k3cpp's own: both hand the bytes to the library.
//
// Failure: a k3::Error on one rank is reported by that rank (`error (rank r of n): ...`) and ends the
// job through abort_world(), which makes the launcher stop every other rank. A rank that dies outright
// (killed, out of memory) is seen by mpirun, which stops the rest and names the rank. Neither leaves
// ranks waiting in a collective.
//
// Collectives are called by every rank in the same order with matching sizes (MPI's rule); the sizes
// are int64 and split into pieces of at most 2^30 elements where MPI's int counts need it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace k3::dist {

class Group {
 public:
  virtual ~Group() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "solo" or "mpi (4 ranks)": for a run's first line.
  virtual std::string describe() const = 0;

  // x ← Σ over ranks of x, in place, on every rank.
  virtual void all_reduce_sum(double* x, int64_t n) = 0;
  virtual void all_reduce_sum(int64_t* x, int64_t n) = 0;
  // Several all-reduces in flight at once, each of at most bucket_elems values (the gradient buckets of
  // data parallelism): the same sum as all_reduce_sum, with the transfers pipelined.
  virtual void all_reduce_sum_buckets(double* x, int64_t n, int64_t bucket_elems) = 0;
  // root's `bytes` bytes at `data` to every rank.
  virtual void broadcast(void* data, int64_t bytes, int root) = 0;
  // Every rank's `bytes` bytes, concatenated in rank order, on every rank; `counts` (optional) receives
  // each rank's byte count.
  virtual std::vector<uint8_t> all_gather_bytes(const void* data, int64_t bytes, std::vector<int64_t>* counts) = 0;
  // Rank r sends send_bytes[q] bytes (at send + send_offset[q]) to every rank q and receives
  // recv_bytes[q] from it into recv + recv_offset[q]. Each rank's counts must match its peers'.
  virtual void all_to_all_bytes(const uint8_t* send, const std::vector<int64_t>& send_bytes,
                                const std::vector<int64_t>& send_offset, uint8_t* recv,
                                const std::vector<int64_t>& recv_bytes, const std::vector<int64_t>& recv_offset) = 0;
  virtual void barrier() = 0;
};

// The job's world group (created on first use; MPI is initialised only when a launcher started this
// process). Thread-compatible: collectives from one thread at a time.
Group& world();
// True when this process was started by an MPI launcher (so world() is a real group).
bool launched_by_mpi();
// True on the rank that writes the job's outputs: rank 0, or a process started on its own.
bool lead_rank();
// Ends the whole job with `status` after this rank's error: MPI_Abort under a launcher (every rank
// stops), else nothing (the caller returns its status). For main() only; the library never exits.
void abort_world(int status);

// Typed helpers over the byte collectives.
template <class T>
std::vector<T> all_gather(Group& g, const std::vector<T>& mine, std::vector<int64_t>* counts = nullptr);

// Every rank holds the same bytes (a config, a plan): throws k3::Error naming `what` and the first rank
// that differs from rank 0 otherwise.
void check_same_on_every_rank(Group& g, const std::string& bytes, const std::string& what);

}  // namespace k3::dist

#include "dist/group_inl.h"
