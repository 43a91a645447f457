// The fp32 training KDA recurrence on the GPU (src/kernels/kda/kda_chunk_train_cuda.h) against its float64 twin
// (kda_chunk_forward_f64 / kda_chunk_backward_f64, kda_chunk_f64.h, chunk 16) run sequence by sequence, on
// packed batches of awkward lengths {1, 16, 17, 50, 300}, at every head dim (128, 64, 32), with the gate drawn
// from (-5, 0), at its lower bound (g = -5 everywhere: e^-80 decays inside a chunk) and near 0 (|g| <= 2e-4).
// Inputs as the model makes them: q, k L2-normalised per head, beta in (0, 1), v and the upstream gradient
// N(0, 1). Both sides see the same fp32 inputs; the GPU backward uses the GPU forward's states.
//
// Tolerance: relative L2 <= 1e-5 over each whole output (o, the saved states, dq, dk, dv, dg, dbeta), non-finite
// values failing first (util/compare.h). fp32 rounding is 6e-8 per operation; the chunked form's sums are
// FMA chains of length <= D, the decays are running products of <= 16 factors, and the recurrence is
// contractive, so the expected error is ~1e-7 .. 1e-6 and 1e-5 leaves room for the 300-token chain.
// Every output buffer starts as NaN with a NaN guard after its end: every element must be written, none past.
// Determinism: a sequence's outputs are bitwise the same alone and packed among others (at another row and
// chunk offset, beside an empty sequence), and a batch run twice gives bitwise the same outputs.
// The GPU tests skip without a Hopper GPU; the argument checks run anywhere the CUDA backend is built.
#include <gtest/gtest.h>

#include "util/cuda_test.h"

#if defined(K3_HAVE_CUDA)

#include "kernels/kda/kda_chunk_train_cuda.h"
#include "util/kda_train_problem.h"

namespace {

namespace kc = k3::kda::cuda;
using namespace k3test::kda_train;

constexpr double kTol = 1e-5;

}  // namespace

// Every output against the f64 twin, at every head dim and gate regime.
TEST(CudaTrainKdaChunk, MatchesF64Twin) {
  K3_REQUIRE_GPU();
  check_against_f64(kFp32Kernels, kTol);
}

// A sequence's outputs do not depend on what is packed with it, and a batch gives the same bits run to run.
TEST(CudaTrainKdaChunk, DeterministicAndIndependentOfPacking) {
  K3_REQUIRE_GPU();
  check_packing_independent(kFp32Kernels, kTol);
}

// Bad arguments are k3::Errors raised on the host before anything is launched (no GPU needed).
TEST(CudaTrainKdaChunk, RejectsBadArguments) { check_rejects_bad_arguments(kFp32Kernels); }

#endif  // K3_HAVE_CUDA
