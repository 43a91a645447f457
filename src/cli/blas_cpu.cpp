#include "cli/blas_cpu.h"

#include <cblas.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace k3::cli {

void reexec_with_fast_blas_kernels(char** argv) {
#if defined(__x86_64__) && defined(__linux__)
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  const char* core = openblas_get_corename();
  if (core == nullptr || std::strcmp(core, "Prescott") != 0) return;
  const char* better = nullptr;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    better = "SkylakeX";
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) better = "Haswell";
  if (better == nullptr) return;
  if (setenv("OPENBLAS_CORETYPE", better, 1) != 0) return;
  execv("/proc/self/exe", argv);
  // exec failed (no /proc?): carry on with the kernels already loaded.
  unsetenv("OPENBLAS_CORETYPE");
#else
  (void)argv;
#endif
}

}  // namespace k3::cli
