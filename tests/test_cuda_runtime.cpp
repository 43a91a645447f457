// The CUDA runtime wrapper (core/cuda.h): buffers round-trip, errors are k3::Errors. Skips without a GPU.
#include <gtest/gtest.h>

#include <vector>

#include "core/error.h"
#include "util/cuda_test.h"

TEST(CudaRuntime, BufferRoundTripAndZeroInit) {
  K3_REQUIRE_GPU();
  std::vector<float> h = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f};
  k3::cuda::DeviceBuffer<float> d(h.data(), h.size());
  std::vector<float> back(h.size(), -1.0f);
  d.download(back.data(), back.size());
  EXPECT_EQ(back, h);
  k3::cuda::DeviceBuffer<int> z(17);
  std::vector<int> zb(17, 5);
  z.download(zb.data(), zb.size());
  EXPECT_EQ(zb, std::vector<int>(17, 0));
}

TEST(CudaRuntime, ImpossibleAllocationIsAClearError) {
  K3_REQUIRE_GPU();
  try {
    k3::cuda::DeviceBuffer<char> huge(size_t(1) << 50);
    FAIL() << "a 1 PiB allocation succeeded";
  } catch (const k3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot allocate"), std::string::npos) << e.what();
  }
}
