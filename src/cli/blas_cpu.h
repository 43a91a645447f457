// OpenBLAS kernel selection on CPUs it does not recognise.
//
// Debian's OpenBLAS (0.3.21, DYNAMIC_ARCH) picks its kernels from the CPU model when the library
// loads. Virtual machines often report a generic model ("Intel(R) Xeon(R) Processor"); OpenBLAS then
// falls back to its Prescott (SSE3) kernels even on an AVX-512 machine, and dgemm runs at a fraction
// of the core's rate (measured: docs/BENCHMARKS.md). The choice is made in a library constructor,
// before main, from the OPENBLAS_CORETYPE environment variable, so the only fix from inside the
// program is to set that variable and re-execute itself once.
#pragma once

namespace k3::cli {

// If OPENBLAS_CORETYPE is unset, OpenBLAS chose Prescott and the CPU supports AVX-512 (SkylakeX
// kernels) or AVX2+FMA (Haswell kernels): sets OPENBLAS_CORETYPE and re-executes /proc/self/exe with
// the same arguments. Returns normally in every other case (including a failed exec). A variable
// that is already set, to anything, is respected: that is also how the re-executed process stops.
void reexec_with_fast_blas_kernels(char** argv);

}  // namespace k3::cli
