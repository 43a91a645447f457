// The GPU's step arena (model/cuda/cuda_model_impl.h: DeviceArena), the stack every training step and
// forward takes its buffers from. What a long training step needs of it: a backward that takes a new
// working set per layer and rewinds after each must hold about the largest of them, not their sum,
// and what was taken before a mark must survive rewinds to it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "util/cuda_test.h"
#ifdef K3_HAVE_CUDA
#include "model/cuda/cuda_model_impl.h"
#endif

TEST(CudaArena, RewoundChunksAreNotHeldAcrossLayers) {
  K3_REQUIRE_GPU();
#ifdef K3_HAVE_CUDA
  constexpr size_t MiB = size_t(1) << 20;
  k3::gpu::DeviceArena a;
  a.reset();
  // A "forward": tapes kept for the whole step.
  std::vector<int32_t> want(size_t(4) << 20);
  for (size_t i = 0; i < want.size(); ++i) want[i] = int32_t(i * 2654435761u);
  int32_t* tape = a.take<int32_t>(int64_t(want.size()));
  k3::cuda::copy_to_device(tape, want.data(), want.size() * sizeof(int32_t));
  // A "backward" of 21 layers, each taking buffers larger than the current chunk, then rewinding.
  // Held at most: the tape's chunk (64 MiB, the smallest chunk), one layer's working set and the
  // chunk kept from the previous layer's (at most one more working set); the same from layer to
  // layer. Holding the rewound chunks until reset would grow by 290 MiB a layer.
  std::vector<size_t> held;
  for (int layer = 0; layer < 21; ++layer) {
    const k3::gpu::DeviceArena::Mark m = a.mark();
    for (size_t mb : {100, 120, 70}) k3::cuda::zero_on_device(a.take_bytes(mb * MiB), mb * MiB);
    held.push_back(a.reserved_bytes());
    a.rewind(m);
  }
  const size_t peak = a.peak_bytes();
  EXPECT_EQ(peak, 16 * MiB + 290 * MiB);
  for (size_t r : held) EXPECT_LE(r, 64 * MiB + 2 * 290 * MiB) << "rewound chunks held: " << r / MiB << " MiB";
  EXPECT_EQ(held.back(), held[1]) << "the arena grew from layer to layer";
  std::vector<int32_t> got(want.size());
  k3::cuda::copy_to_host(got.data(), tape, got.size() * sizeof(int32_t));
  EXPECT_EQ(got, want);
  // The next step: one chunk of the high-water size holds it all.
  a.reset();
  EXPECT_EQ(a.reserved_bytes(), peak);
  const k3::gpu::DeviceArena::Mark m = a.mark();
  a.take_bytes(16 * MiB);
  for (int layer = 0; layer < 3; ++layer) {
    const k3::gpu::DeviceArena::Mark l = a.mark();
    a.take_bytes(290 * MiB);
    a.rewind(l);
  }
  a.rewind(m);
  EXPECT_EQ(a.reserved_bytes(), peak);
#endif
}
