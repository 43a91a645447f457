#include "cli/library_env.h"

#include <cblas.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace k3::cli {

namespace {
// The faster OpenBLAS kernel set for this CPU, or null when OpenBLAS's own choice stands.
const char* better_blas_kernels() {
#if defined(__x86_64__)
  const char* core = openblas_get_corename();
  if (core == nullptr || std::strcmp(core, "Prescott") != 0) return nullptr;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
#endif
  return nullptr;
}
}  // namespace

void reexec_with_library_settings(int argc, char** argv) {
#if defined(__linux__)
  bool set_blas = false, set_wait = false;
  if (std::getenv("OPENBLAS_CORETYPE") == nullptr)
    if (const char* better = better_blas_kernels()) set_blas = setenv("OPENBLAS_CORETYPE", better, 1) == 0;
  const bool decodes = argc > 1 && std::strcmp(argv[1], "generate") == 0;
  if (decodes && std::getenv("OMP_WAIT_POLICY") == nullptr) set_wait = setenv("OMP_WAIT_POLICY", "PASSIVE", 1) == 0;
  if (!set_blas && !set_wait) return;
  execv("/proc/self/exe", argv);
  // exec failed (no /proc?): carry on with what the libraries already chose.
  if (set_blas) unsetenv("OPENBLAS_CORETYPE");
  if (set_wait) unsetenv("OMP_WAIT_POLICY");
#else
  (void)argc, (void)argv;
#endif
}

}  // namespace k3::cli
