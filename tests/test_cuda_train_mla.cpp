// The training MLA attention core and output gate on the GPU (kernels/mla/mla_train_cuda.h) against
// their float64 CPU twins (kernels/mla/mla_f64.h), relative L2 <= 1e-5, on random fp32 inputs:
//   - packed sequences of lengths {1, 7, 64, 130} (the CPU twin runs each sequence alone), for
//     (H, Dn, Dr, Dv) = (3, 16, 8, 16), K3's (2, 128, 64, 128), (2, 40, 13, 24) (Dn + Dr = 53, not a
//     multiple of 32) and (1, 160, 96, 200) (the widest buckets); every strided operand has a row
//     stride wider than its columns (k_rot is a column slice of a wider buffer, as in the model);
//     input padding is NaN (so a read of it would show), output padding holds sentinels that must
//     survive, outputs start as garbage (so "overwritten" is checked, not "accumulated");
//   - a sequence's results are bitwise the same whether it runs alone or packed with others;
//   - one sequence of 65536 positions: sampled rows and keys against a float64 evaluation;
//   - the output gate forward/backward, and argument errors.
// Skips without a Hopper GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "core/cuda.h"                   // defines: cuda::DeviceBuffer, cuda::synchronize
#include "core/error.h"                  // defines: k3::Error
#include "kernels/mla/mla_f64.h"         // defines: mla::attention_forward_f64, mla::attention_backward_f64, ...
#include "kernels/mla/mla_train_cuda.h"  // defines: mla::cuda::attention_forward_train, ...
#include "util/cuda_test.h"              // defines: K3_REQUIRE_GPU
#include "util/mla_train_problem.h"      // defines: k3test::mla_train::check_against_f64, randf, ...

using namespace k3;
using namespace k3test::mla_train;
namespace mc = k3::mla::cuda;

namespace {

constexpr double kTol = 1e-5;
const Kernels kFp32{fp32_forward, no_forward_workspace, mc::attention_backward_workspace_bytes,
                    mc::attention_backward_train};

TEST(CudaTrainMla, SmallDims) {
  K3_REQUIRE_GPU();
  check_against_f64(kFp32, {3, 16, 8, 16, 0}, 11, 1.0, kTol);
}
TEST(CudaTrainMla, K3Dims) {
  K3_REQUIRE_GPU();
  check_against_f64(kFp32, {2, 128, 64, 128, 0}, 21, 1.0, kTol);
}
TEST(CudaTrainMla, OddDims) {  // Dn + Dr = 53, Dv = 24; peakier softmax
  K3_REQUIRE_GPU();
  check_against_f64(kFp32, {2, 40, 13, 24, 0}, 31, 3.0, kTol);
}
TEST(CudaTrainMla, WidestBuckets) {  // Dn + Dr = 256, Dv = 200
  K3_REQUIRE_GPU();
  check_against_f64(kFp32, {1, 160, 96, 200, 0}, 41, 1.5, kTol);
}

// A sequence's o, lse, dq, dkv, dk_rot are bitwise the same alone, packed with others (in two
// orders, one with an empty sequence among them), and on a second run.
TEST(CudaTrainMla, PackingIndependentAndDeterministic) {
  K3_REQUIRE_GPU();
  check_packing_independent(kFp32);
}

// One sequence of 65536 positions at K3's head dims (H = 1), peaky scores (q std 3): every output is
// finite, and sampled query rows (o, lse, dq) and keys near the end (dk_nope, dv, dk_rot, which only
// the last queries see) match a float64 evaluation of exactly those rows.
TEST(CudaTrainMla, LongSequence) {
  K3_REQUIRE_GPU();
  check_long_sequence(kFp32, kTol);
}

TEST(CudaTrainMla, OutputGate) {
  K3_REQUIRE_GPU();
  const int64_t n = 4099;
  std::vector<float> z = randf(n, 71, 4.0), o = randf(n, 72), dog = randf(n, 73);
  z[0] = 90.0f, z[1] = -90.0f, z[2] = 0.0f;  // saturated both ways, and the split point
  cuda::DeviceBuffer<float> z_d(z.data(), z.size()), o_d(o.data(), o.size()), dog_d(dog.data(), dog.size()), og_d(n),
      do_d(n), dz_d(n);
  mc::output_gate_forward_train(og_d.data(), z_d.data(), o_d.data(), n);
  mc::output_gate_backward_train(do_d.data(), dz_d.data(), dog_d.data(), o_d.data(), z_d.data(), n);
  std::vector<float> og(n), sig(n), d_o(n), dz(n);
  og_d.download(og.data(), n);
  z_d.download(sig.data(), n);
  do_d.download(d_o.data(), n);
  dz_d.download(dz.data(), n);

  std::vector<double> gate = widen(z), ogr(n), dor(n), dzr(n);
  const std::vector<double> o64 = widen(o), dog64 = widen(dog);
  mla::output_gate_forward_f64(ogr.data(), gate.data(), o64.data(), n);
  mla::output_gate_backward_f64(dor.data(), dzr.data(), dog64.data(), o64.data(), gate.data(), n);
  EXPECT_LE(rel_err(sig, gate), kTol) << "sigma stored in gate";
  EXPECT_LE(rel_err(og, ogr), kTol) << "og";
  EXPECT_LE(rel_err(d_o, dor), kTol) << "d_o";
  EXPECT_LE(rel_err(dz, dzr), kTol) << "dz";
  EXPECT_EQ(sig[0], 1.0f);
  EXPECT_GE(sig[1], 0.0f);
  EXPECT_LT(sig[1], 1e-38f);
  EXPECT_EQ(sig[2], 0.5f);
}

// Bad shapes are a k3::Error naming the function, before anything is launched (and in a build
// without CUDA, the stubs' error).
TEST(CudaTrainMla, ArgumentErrors) {
  const mla::Dims ok{2, 16, 8, 16, 0}, wide{1, 200, 57, 16, 0}, no_v{1, 16, 8, 0, 0};
  float* p = nullptr;
  const int32_t* cu = nullptr;
  EXPECT_THROW(mc::attention_forward_train(p, 32, p, p, 48, p, 64, p, 8, cu, 1, 4, 4, wide, 0.1f), Error);
  EXPECT_THROW(mc::attention_forward_train(p, 32, p, p, 48, p, 64, p, 8, cu, 1, 4, 4, no_v, 0.1f), Error);
  EXPECT_THROW(mc::attention_forward_train(p, 32, p, p, 47, p, 64, p, 8, cu, 1, 4, 4, ok, 0.1f), Error);  // ldq
  EXPECT_THROW(mc::attention_forward_train(p, 32, p, p, 48, p, 64, p, 7, cu, 1, 4, 4, ok, 0.1f), Error);  // ldr
  EXPECT_THROW(mc::attention_forward_train(p, 32, p, p, 48, p, 64, p, 8, cu, 1, 5, 4, ok, 0.1f), Error);  // max_len
  EXPECT_THROW(mc::attention_forward_train(p, 32, p, p, 48, p, 64, p, 8, cu, 1, 4, 4, ok, 0.1f), Error);  // nulls
  EXPECT_THROW(mc::attention_backward_train(p, 48, p, 63, p, 8, p, 32, p, p, 48, p, 64, p, 8, p, cu, 1, 4, 4, ok, 0.1f,
                                            nullptr),
               Error);  // lddkv
  EXPECT_THROW(mc::output_gate_forward_train(p, p, p, -1), Error);
}

}  // namespace
