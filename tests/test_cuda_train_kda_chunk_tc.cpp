// The bf16 tensor-core training KDA recurrence (src/kernels/kda/kda_chunk_train_tc_cuda.h) against its float64 twin
// (kda_chunk_forward_f64 / kda_chunk_backward_f64, kda_chunk_f64.h, chunk 16) run sequence by sequence, on packed
// batches of awkward lengths {1, 16, 17, 50, 300}, at every head dim (128, 64, 32), with the gate drawn from (-5, 0),
// at its lower bound (g = -5 everywhere: e^-80 decays inside a chunk, the re-referenced pair factors at e^+-40) and
// near 0 (|g| <= 2e-4: nothing decays, the whole 300-token history contributes). Inputs as the model makes them:
// q, k L2-normalised per head, beta in (0, 1), v and the upstream gradient N(0, 1). Both sides see the same inputs:
// q, k, v and the upstream gradient are rounded to bf16 on the host (the kernels take them as bf16), g and beta stay
// fp32; the kernels' dq, dk, dv (bf16) are widened exactly for the comparison. The GPU backward uses the GPU
// forward's tape.
//
// Tolerance: relative L2 <= 1e-2 over each whole output (o, the saved states, dq, dk, dv, dg, dbeta), non-finite
// values failing first (util/compare.h): the products take bf16 operands (8 significant bits, 2^-9 relative
// rounding per operand) with fp32 accumulation and an fp32 state, so the expected error is a few 1e-3 at most.
// The fp32 SIMT kernels (kda_chunk_train_cuda.h) run on the same (rounded) batches, fp32 in and out, as a
// cross-check at their own bar (1e-5).
// Every output buffer starts as NaN with a NaN guard after its end: every element must be written, none past.
// Determinism: a sequence's outputs are bitwise the same alone and packed among others (at another row and
// chunk offset, beside an empty sequence), and a batch run twice gives bitwise the same outputs.
// The GPU tests skip without a Hopper GPU; the argument checks run anywhere the CUDA backend is built.
#include <gtest/gtest.h>

#include "util/cuda_test.h"

#if defined(K3_HAVE_CUDA)

#include "kernels/kda/kda_chunk_train_cuda.h"
#include "kernels/kda/kda_chunk_train_tc_cuda.h"
#include "util/kda_train_problem.h"

namespace {

namespace kc = k3::kda::cuda;
using namespace k3test::kda_train;

constexpr double kTol = 1e-2;

}  // namespace

// Every output against the f64 twin, at every head dim and gate regime.
TEST(CudaTrainKdaChunkTc, MatchesF64Twin) {
  K3_REQUIRE_GPU();
  // The fp32 SIMT kernels on the same batches as a cross-check, at their own bar (1e-5).
  check_against_f64(kBf16Kernels, kTol, &kFp32Kernels, 1e-5);
}

// A sequence's outputs do not depend on what is packed with it, and a batch gives the same bits run to run.
TEST(CudaTrainKdaChunkTc, DeterministicAndIndependentOfPacking) {
  K3_REQUIRE_GPU();
  check_packing_independent(kBf16Kernels, kTol);
}

// Bad arguments are k3::Errors raised on the host before anything is launched (no GPU needed).
TEST(CudaTrainKdaChunkTc, RejectsBadArguments) { check_rejects_bad_arguments(kBf16Kernels); }

#endif  // K3_HAVE_CUDA
