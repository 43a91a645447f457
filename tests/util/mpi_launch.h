// Runs the k3 binary on several ranks under OpenMPI's mpirun (Debian's openmpi-bin), as a user would.
#pragma once
#include <string>
#include <vector>

#include "cli.h"

namespace k3test {

// `mpirun` for `ranks` processes on this machine: more ranks than cores allowed (CI has 2), no binding (each
// rank runs one OpenMP thread), root allowed (containers), MPI's errors printed.
inline std::string mpirun_prefix(int ranks) {
  return "mpirun --allow-run-as-root --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 -np " + std::to_string(ranks) +
         " ";
}

inline Outcome run_k3_ranks(int ranks, const std::vector<std::string>& args) {
  return run_shell(mpirun_prefix(ranks) + k3_command(args));
}

}  // namespace k3test
