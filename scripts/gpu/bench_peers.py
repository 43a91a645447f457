#!/usr/bin/env python3
"""Peer baselines for the GPU benchmark table (run on the GPU machine by scripts/gpu/run_all.sh).

- flash-linear-attention's Triton `chunk_kda` forward, and forward+backward, with K3's gate options
  (use_gate_in_kernel, safe_gate, lower_bound -5, A_log and dt_bias, in-kernel q/k L2 norm), at every
  shape of ../shared/docs/ANCHORS.md.
- PyTorch SDPA (flash backend) causal attention forward, and forward+backward, at K3's MLA head dims
  (H 64, qk 192, v 128; V zero-padded to 192, which the flash backend needs).

fla is not a dependency of k3cpp and none of its code is in this repository: the source is brought
to the GPU machine for the run only (FLA_SRC, default third_party_ref/fla_src, git-ignored).
Timing: median of CUDA-event timings over `--reps` runs after warm-up, the same method as our
bench_cuda_* binaries. Prints one line per shape and pass: `peer <name>[_fwdbwd] <shape> <ms>`;
a forward+backward run is one forward and one backward from a fixed upstream gradient.
"""
import argparse
import os
import sys

import torch


def median_ms(fn, reps):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


KDA_SHAPES = [(1, 8192, 64), (1, 8192, 96), (4, 4096, 32), (1, 32768, 32), (1, 65536, 16)]


def bench_fla(reps, shapes):
    sys.path.insert(0, os.environ.get("FLA_SRC", "third_party_ref/fla_src"))
    from fla.ops.kda import chunk_kda

    D = 128
    for B, T, H in shapes:
        torch.manual_seed(0)
        dev, bf = "cuda", torch.bfloat16
        q = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=dev, dtype=torch.float32), dim=-1).to(bf)
        k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=dev, dtype=torch.float32), dim=-1).to(bf)
        v = torch.randn(B, T, H, D, device=dev, dtype=bf)
        g = torch.randn(B, T, H, D, device=dev, dtype=bf)
        beta = torch.rand(B, T, H, device=dev, dtype=bf)
        A_log = torch.log(torch.rand(H, device=dev, dtype=torch.float32) * 15 + 1)
        dt_bias = torch.randn(H * D, device=dev, dtype=torch.float32) * 0.1

        def fwd():
            return chunk_kda(q, k, v, g, beta, scale=D ** -0.5, A_log=A_log, dt_bias=dt_bias,
                             use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, safe_gate=True,
                             lower_bound=-5.0)[0]

        with torch.inference_mode():
            ms = median_ms(fwd, reps)
        print(f"peer fla_chunk_kda B={B} T={T} H={H} D={D} {ms:.4f}", flush=True)

        for t in (q, k, v, g, beta):
            t.requires_grad_(True)
        do = torch.randn(B, T, H, D, device=dev, dtype=bf)

        def fwd_bwd():
            fwd().backward(do)
            for t in (q, k, v, g, beta):
                t.grad = None

        ms = median_ms(fwd_bwd, reps)
        print(f"peer fla_chunk_kda_fwdbwd B={B} T={T} H={H} D={D} {ms:.4f}", flush=True)
        del q, k, v, g, beta, do
        torch.cuda.empty_cache()


def bench_sdpa(reps):
    # PyTorch's flash backend needs one head dim for q, k and v (torch 2.11 refuses qk 192 with v 128),
    # so V is zero-padded to 192 outside the timed region, as MLA trainers on PyTorch do, and the output
    # read as its first 128 columns (a view). The padded columns' work is timed: that is SDPA's cost.
    H, Dqk, Dv = 64, 192, 128
    for T in (4096, 8192, 32768):
        q = torch.randn(1, H, T, Dqk, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, H, T, Dqk, device="cuda", dtype=torch.bfloat16)
        v = torch.nn.functional.pad(torch.randn(1, H, T, Dv, device="cuda", dtype=torch.bfloat16), (0, Dqk - Dv))

        def fwd():
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=Dqk ** -0.5)
            return o[..., :Dv]

        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            with torch.inference_mode():
                ms = median_ms(fwd, reps)
            print(f"peer torch_sdpa B=1 T={T} H={H} Dqk={Dqk} Dv={Dv}(padded to {Dqk}) {ms:.4f}", flush=True)
            for t in (q, k, v):
                t.requires_grad_(True)
            do = torch.randn(1, H, T, Dv, device="cuda", dtype=torch.bfloat16)

            def fwd_bwd():
                fwd().backward(do)
                for t in (q, k, v):
                    t.grad = None

            ms = median_ms(fwd_bwd, reps)
            print(f"peer torch_sdpa_fwdbwd B=1 T={T} H={H} Dqk={Dqk} Dv={Dv}(padded to {Dqk}) {ms:.4f}", flush=True)
        del q, k, v, do
        torch.cuda.empty_cache()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", choices=["fla", "sdpa"], default=None)
    ap.add_argument("--kda-shapes", default=None,
                    help="fla shapes as BxTxH,... (default: every shape of ANCHORS.md; Triton's first call per "
                         "shape compiles and tunes for a minute or more)")
    a = ap.parse_args()
    shapes = KDA_SHAPES
    if a.kda_shapes:
        shapes = [tuple(int(x) for x in sh.split("x")) for sh in a.kda_shapes.split(",")]
        if any(len(sh) != 3 for sh in shapes):
            ap.error("--kda-shapes: each shape is BxTxH, e.g. 1x8192x64")
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    if a.only in (None, "fla"):
        bench_fla(a.reps, shapes)
    if a.only in (None, "sdpa"):
        bench_sdpa(a.reps)
