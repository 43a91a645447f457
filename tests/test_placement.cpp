// The stored-bytes model behind the placement plan (model/placement.h) against the release's documented inventory
// (K3-ARCHITECTURE.md §4: 497,220 tensors, 1,560,936,091,448 bytes in 96 shards; one MXFP4 expert 17,547,264 bytes), and the plan's
// arithmetic on the release config.
#include <gtest/gtest.h>

#include "model/config.h"
#include "model/placement.h"

namespace {
const std::string kRelease = std::string(K3_SOURCE_DIR) + "/configs/kimi-k3.json";
}

TEST(Placement, StoredBytesAreTheReleaseInventory) {
  const k3::K3Config c = k3::load_config(kRelease);
  ASSERT_TRUE(c.experts_mxfp4);
  const k3::StoredBytes b = k3::stored_bytes(c, kRelease);
  EXPECT_EQ(b.expert, 17547264u);
  EXPECT_EQ(b.experts, 92 * 896);
  // The inventory's 497,220 tensors in 1,560,936,091,448 bytes of files: the tensors' own bytes plus the 96
  // shards' JSON headers, which name, type and place each tensor in ~150 bytes.
  EXPECT_EQ(b.tensors, 497220);
  ASSERT_LT(b.total(), 1560936091448u);
  const double header_per_tensor = double(1560936091448u - b.total()) / double(b.tensors);
  EXPECT_GT(header_per_tensor, 100.0);
  EXPECT_LT(header_per_tensor, 200.0);
  EXPECT_EQ(b.embedding, uint64_t(163840) * 7168 * 2);
}

TEST(Placement, EightH200sHoldTheTrunkAndPartOfTheExperts) {
  const k3::K3Config c = k3::load_config(kRelease);
  k3::PlacementOptions o;  // 8 x 139 GiB, 16 GiB reserved
  const k3::Placement p = k3::plan_placement(c, kRelease, o);
  EXPECT_EQ(p.experts_per_rank, 92 * 112);
  EXPECT_GT(p.experts_on_gpu, 0);
  EXPECT_LT(p.experts_on_gpu, p.experts_per_rank);  // 1.45 TB of experts do not fit in 8 x 139 GiB
  // Everything is somewhere: HBM experts + host experts = the rank's own.
  EXPECT_EQ(p.host_bytes_per_rank, uint64_t(p.experts_per_rank - p.experts_on_gpu) * p.bytes.expert);
  // The trunk and reserve and resident experts fit in one GPU.
  EXPECT_LE(p.trunk_per_gpu + o.reserve_bytes + uint64_t(p.experts_on_gpu) * p.bytes.expert, o.gpu_bytes);
  EXPECT_GT(p.trunk_per_gpu + o.reserve_bytes + uint64_t(p.experts_on_gpu + 1) * p.bytes.expert, o.gpu_bytes);
  // A copy of the ~110 GB trunk on every GPU leaves room for far fewer experts.
  EXPECT_LT(p.experts_on_gpu_replicated, p.experts_on_gpu / 4);
  // 16 GPUs (SGLang's recipe) hold every expert.
  o.gpus = 16;
  const k3::Placement q = k3::plan_placement(c, kRelease, o);
  EXPECT_EQ(q.experts_on_gpu, q.experts_per_rank);
  EXPECT_EQ(q.host_bytes_per_rank, 0u);
}
