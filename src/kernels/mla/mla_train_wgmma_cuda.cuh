// Internal to kernels/mla (.cu files): the Hopper (wgmma) forward and backward of the training attention
// at K3's head dims, which attention_forward_train_bf16 / attention_backward_train_bf16
// (mla_train_tc_cuda.cu) run in place of their mma.sync kernels when the dims fit. Same inputs (the
// packed bf16 operands), same outputs, same semantics (mla_train_tc_cuda.h); mla_train_wgmma_cuda.cu
// and mla_train_wgmma_bwd_cuda.cu have the designs.
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

// Whether the wgmma kernels take these padded head dims (qk 192, v 128: K3's).
inline bool dims_fit(int dqp, int dvp, int Dv) { return dqp == 192 && dvp == 128 && Dv == 128; }

// o [rows, ldo] (head h at columns h·Dv) and lse [H, rows] OVERWRITTEN, as attention_forward_train.
void attention_forward(const PackedQkv& a, float* o, int64_t ldo, float* lse, int B, int64_t max_len);

// What the backward needs beside the packed q, k, v: the packed bf16(dO) [H][rows][dvp], log2(e)·lse
// and Delta [H, rows] fp32 (mla_train_tc_cuda.cu's attn_delta_tc_kernel writes all three), and how the
// padded qk width splits into k_nope and k_rot.
struct PackedGrad {
  const uint16_t* d_o;
  const float* lse2;
  const float* delta;
  int Dn, Dr;
  float scale;
};

// dq [rows, lddq], dkv [rows, lddkv] ([dk_nope | dv] per head) and the per-head dk_rot_h [H, rows, Dr]
// OVERWRITTEN, as attention_backward_train's kernels (the caller sums dk_rot_h over the heads).
void attention_backward(const PackedQkv& a, const PackedGrad& g, float* dq, int64_t lddq, float* dkv, int64_t lddkv,
                        float* dk_rot_h, int B, int64_t max_len);

}  // namespace k3::mla::cuda::wgmma
