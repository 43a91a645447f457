// The bf16 tensor-core training MLA attention core on the GPU (kernels/mla/mla_train_tc_cuda.h)
// against its float64 CPU twins (kernels/mla/mla_f64.h), relative L2 <= 1e-2 (bf16 operands: q, k,
// v, dO rounded to 8 significant bits; fp32 accumulation), on random fp32 inputs:
//   - packed sequences of lengths {1, 7, 64, 130} (the CPU twin runs each sequence alone), for
//     (H, Dn, Dr, Dv) = (3, 16, 8, 16), K3's (2, 128, 64, 128), (2, 40, 13, 24) (Dn + Dr = 53, Dv = 24:
//     not multiples of 16, zero-padded in the kernels) and (1, 160, 96, 200) (the widest buckets);
//     every strided operand has a row stride wider than its columns (k_rot is a column slice of a
//     wider buffer, as in the model); input padding is NaN (so a read of it would show), output
//     padding holds sentinels that must survive, outputs start as garbage ("overwritten" checked);
//     K3's widths run on the Hopper (wgmma) kernels, also with Dn + Dr = 180 split 120 + 60;
//   - a sequence's results are bitwise the same whether it runs alone or packed with others, and
//     run to run;
//   - one sequence of 65536 positions: sampled rows and keys against a float64 evaluation;
//   - the bf16 backward given the fp32 kernel's forward (o, lse) agrees as well;
//   - argument errors.
// Skips without a Hopper GPU.
#include <gtest/gtest.h>

#include <cstdint>

#include "core/error.h"                     // defines: k3::Error
#include "kernels/mla/mla_train_cuda.h"     // defines: mla::cuda::attention_forward_train (fp32 forward)
#include "kernels/mla/mla_train_tc_cuda.h"  // defines: mla::cuda::attention_forward_train_bf16, ...
#include "util/cuda_test.h"                 // defines: K3_REQUIRE_GPU
#include "util/mla_train_problem.h"         // defines: k3test::mla_train::check_against_f64, ...

using namespace k3;
using namespace k3test::mla_train;
namespace mc = k3::mla::cuda;

namespace {

constexpr double kTol = 1e-2;  // bf16 operands (2^-9 relative rounding each), fp32 accumulation
const Kernels kBf16{mc::attention_forward_train_bf16, mc::attention_forward_workspace_bytes_bf16,
                    mc::attention_backward_workspace_bytes_bf16, mc::attention_backward_train_bf16};
// The fp32 SIMT kernel's o and lse feed the bf16 backward.
const Kernels kFp32Forward{fp32_forward, no_forward_workspace, mc::attention_backward_workspace_bytes_bf16,
                           mc::attention_backward_train_bf16};

TEST(CudaTrainMlaTc, SmallDims) {
  K3_REQUIRE_GPU();
  check_against_f64(kBf16, {3, 16, 8, 16, 0}, 11, 1.0, kTol);
}
TEST(CudaTrainMlaTc, K3Dims) {
  K3_REQUIRE_GPU();
  check_against_f64(kBf16, {2, 128, 64, 128, 0}, 21, 1.0, kTol);
}
// Dn + Dr = 180 padded to K3's 192 (so the Hopper kernels run, with zero columns), split unlike K3's.
TEST(CudaTrainMlaTc, K3WidthsOtherSplit) {
  K3_REQUIRE_GPU();
  check_against_f64(kBf16, {2, 120, 60, 128, 0}, 27, 1.0, kTol);
}
TEST(CudaTrainMlaTc, OddDims) {  // Dn + Dr = 53, Dv = 24; peakier softmax
  K3_REQUIRE_GPU();
  check_against_f64(kBf16, {2, 40, 13, 24, 0}, 31, 3.0, kTol);
}
TEST(CudaTrainMlaTc, WidestBuckets) {  // Dn + Dr = 256, Dv = 200
  K3_REQUIRE_GPU();
  check_against_f64(kBf16, {1, 160, 96, 200, 0}, 41, 1.5, kTol);
}
TEST(CudaTrainMlaTc, BackwardOfFp32Forward) {  // the bf16 backward fed the fp32 kernel's o and lse
  K3_REQUIRE_GPU();
  check_against_f64(kFp32Forward, {2, 128, 64, 128, 0}, 23, 1.0, kTol);
}

// A sequence's o, lse, dq, dkv, dk_rot are bitwise the same alone, packed with others (in two
// orders, one with an empty sequence among them), and on a second run.
TEST(CudaTrainMlaTc, PackingIndependentAndDeterministic) {
  K3_REQUIRE_GPU();
  check_packing_independent(kBf16);
}

// One sequence of 65536 positions at K3's head dims (H = 1), peaky scores (q std 3): every output is
// finite, and sampled query rows (o, lse, dq) and keys near the end (dk_nope, dv, dk_rot, which only
// the last queries see) match a float64 evaluation of exactly those rows.
TEST(CudaTrainMlaTc, LongSequence) {
  K3_REQUIRE_GPU();
  check_long_sequence(kBf16, kTol);
}

// Bad shapes are a k3::Error naming the function, before anything is launched (and in a build
// without CUDA, the stubs' error).
TEST(CudaTrainMlaTc, ArgumentErrors) {
  const mla::Dims ok{2, 16, 8, 16, 0}, wide{1, 200, 57, 16, 0}, no_v{1, 16, 8, 0, 0};
  float* p = nullptr;
  const int32_t* cu = nullptr;
  EXPECT_THROW(mc::attention_forward_train_bf16(p, 32, p, p, 48, p, 64, p, 8, cu, 1, 4, 4, wide, 0.1f, p), Error);
  EXPECT_THROW(mc::attention_forward_train_bf16(p, 32, p, p, 48, p, 64, p, 8, cu, 1, 4, 4, no_v, 0.1f, p), Error);
  EXPECT_THROW(mc::attention_forward_train_bf16(p, 32, p, p, 47, p, 64, p, 8, cu, 1, 4, 4, ok, 0.1f, p), Error);  // ldq
  EXPECT_THROW(mc::attention_forward_train_bf16(p, 32, p, p, 48, p, 64, p, 7, cu, 1, 4, 4, ok, 0.1f, p), Error);  // ldr
  EXPECT_THROW(mc::attention_forward_train_bf16(p, 32, p, p, 48, p, 64, p, 8, cu, 1, 5, 4, ok, 0.1f, p),
               Error);  // max_len
  EXPECT_THROW(mc::attention_forward_train_bf16(p, 32, p, p, 48, p, 64, p, 8, cu, 1, 4, 4, ok, 0.1f, p),
               Error);  // nulls
  {                     // every pointer set but the workspace (never dereferenced: the checks come first)
    float* f = reinterpret_cast<float*>(uintptr_t(256));
    const int32_t* cf = reinterpret_cast<const int32_t*>(uintptr_t(256));
    EXPECT_THROW(mc::attention_forward_train_bf16(f, 32, f, f, 48, f, 64, f, 8, cf, 1, 4, 4, ok, 0.1f, nullptr), Error);
  }
  EXPECT_THROW(mc::attention_backward_train_bf16(p, 48, p, 63, p, 8, p, 32, p, p, 48, p, 64, p, 8, p, cu, 1, 4, 4, ok,
                                                 0.1f, nullptr),
               Error);  // lddkv
  EXPECT_THROW(mc::attention_backward_train_bf16(p, 48, p, 64, p, 8, p, 32, p, p, 48, p, 64, p, 8, p, cu, 1, 4, 4, ok,
                                                 0.1f, nullptr),
               Error);  // nulls
}

}  // namespace
