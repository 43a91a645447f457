// Settings that libraries read once, when they load (before main), and that k3 wants different from
// their defaults: so k3 sets the ones the user left unset and re-executes itself once.
//
// OpenBLAS kernel selection on CPUs it does not recognise. Debian's OpenBLAS (0.3.21, DYNAMIC_ARCH)
// picks its kernels from the CPU model when the library loads. Virtual machines often report a
// generic model ("Intel(R) Xeon(R) Processor"); OpenBLAS then falls back to its Prescott (SSE3)
// kernels even on an AVX-512 machine, and dgemm runs at a fraction of the core's rate (measured:
// docs/BENCHMARKS.md). The choice comes from the OPENBLAS_CORETYPE environment variable.
//
// OpenMP's wait policy. libgomp's default lets a thread that waits at a barrier spin before it
// sleeps. On a machine whose cores other processes also use, the thread the others wait for is often
// descheduled, and the spinners burn the very core it needs: `k3 generate` on 2 busy cores decoded at
// a fraction of its one-thread speed (docs/BENCHMARKS.md, "CPU decoding on a busy machine").
// OMP_WAIT_POLICY=PASSIVE makes waiting threads sleep at once. `k3 generate`, the interactive
// decoder, gets it (with core/parallel.h keeping small loops on one thread, decoding a tiny model
// then runs no parallel region at all). The batch commands do not: their barriers are many, they own
// the machine, and passive waiting slowed CPU training and `k3 eval` on an idle one (the same entry).
// libgomp reads the variable only when it loads.
#pragma once

namespace k3::cli {

// Sets what is unset of: OPENBLAS_CORETYPE, when OpenBLAS chose Prescott and the CPU supports
// AVX-512 (SkylakeX kernels) or AVX2+FMA (Haswell kernels); OMP_WAIT_POLICY=PASSIVE, when the
// subcommand (argv[1]) is `generate`. If it set anything, re-executes /proc/self/exe with
// the same arguments. Returns normally in every other case (including a failed exec, after undoing
// its settings). A variable that is already set, to anything, is respected: that is also how the
// re-executed process stops.
void reexec_with_library_settings(int argc, char** argv);

}  // namespace k3::cli
