// Internal to kernels/mla (.cu files): the Hopper (wgmma) forward of the training attention at K3's
// head dims, which attention_forward_train_bf16 (mla_train_tc_cuda.cu) runs in place of its mma.sync
// kernel when the dims fit. Same inputs (the packed bf16 operands), same outputs, same semantics
// (mla_train_tc_cuda.h); mla_train_wgmma_cuda.cu has the design.
#pragma once
#include <cstdint>

namespace k3::mla::cuda::wgmma {

// The packed operands (mla_train_tc_cuda.cu's packing: bf16, head-major [H][rows][W], W = the head
// dim rounded up to 16 and zero-filled) and what the forward needs beside them.
struct PackedQkv {
  const uint16_t* q;  // [H][rows][dqp]
  const uint16_t* k;  // [H][rows][dqp]: [k_nope | k_rot] per head
  const uint16_t* v;  // [H][rows][dvp]
  const int32_t* cu;  // cu_seqlens [B + 1]
  int64_t rows;
  int H, Dv;
  float scale_log2;  // log2(e) · scale
};

// Whether the wgmma forward takes these padded head dims (qk 192, v 128: K3's).
inline bool forward_fits(int dqp, int dvp, int Dv) { return dqp == 192 && dvp == 128 && Dv == 128; }

// o [rows, ldo] (head h at columns h·Dv) and lse [H, rows] OVERWRITTEN, as attention_forward_train.
void attention_forward(const PackedQkv& a, float* o, int64_t ldo, float* lse, int B, int64_t max_len);

}  // namespace k3::mla::cuda::wgmma
