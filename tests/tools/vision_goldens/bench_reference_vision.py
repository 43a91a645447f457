#!/usr/bin/env python3
"""PyTorch beside bench_cuda_vision: Moonshot's own MoonViT-V2 + PatchMergerMLPV2 in bf16 on the GPU.

  python3 tests/tools/vision_goldens/bench_reference_vision.py \
      --reference third_party_ref/kimi_k3/modeling_kimi_k3.py [--attn auto|sdpa|flash_attention_2|eager] \
      [--rows 32x32:1,32x32:16,74x74:1,74x74:4,256x256:1] [--reps 10] [--layers 27]

The reference is `modeling_kimi_k3.py` of vllm-project/llm-compressor at bcbda0bf0a93e40bdfe177702c5a965a3a7bd534
(src/llmcompressor/modeling/kimi_k3/). It is not part of this repository (third_party_ref/ is ignored) and nothing
of it is copied here: the file named by --reference is read, its two relative imports of the text model's modules
(which the vision classes never use) are replaced by stand-ins, and the result is imported from a temporary
directory. transformers' names come from the stand-ins of tests/tools/reference_grads/stubs.py (plus the few the
vision file adds), so any transformers version, or none, works; they hold no computation.

What runs: MoonViT3dPretrainedModel and PatchMergerMLPV2 built from the release's vision_config
(K3-ARCHITECTURE.md 2.3: 27 blocks 1024 wide, 12 heads of 128, MLP 4096, a 64 x 64 position table, projector
4096 -> 4096 -> 7168), every parameter in bf16 (the release's dtype; nn.RMSNorm without eps then uses bf16's 2^-7,
as the release does), matrices and the position table N(0, 0.02), norm gains 1 (the rules of k3's init; other
values, the same work). The reference's forward as it is: the conv patch embedding, the interpolated position
table (its torch.compile'd resize runs in the warm-up), the complex-number RoPE in fp32, its attention, the
temporal-pool merge, the projector.

Attention: the release's `flash_attention_2` (flash-attn's varlen kernel) when flash-attn is installed; otherwise
(`--attn auto`) PyTorch's SDPA, registered under "sdpa" in the reference's own table VL_VISION_ATTENTION_FUNCTIONS:
per item, non-causal, the same function. `eager` is the reference's own fallback, which materialises every item's
L x L scores (at 256 x 256 patches, 200 GB): small grids only.

Timing, as bench_cuda_vision: pixels and grid_thws already on the GPU, one call of tower + projector on `images`
images of one grid, the median of CUDA-event timings over --reps calls after warm-up. Prints the same table
(ms/call, ms/image, images/s, TFLOP/s with the same FLOP count), then SDPA alone on one image's q, k, v.
"""
import argparse
import importlib
import importlib.util
import math
import os
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.abspath(__file__))

import torch
import torch.nn as nn
import torch.nn.functional as F

VISION_CONFIG = {
    "patch_size": 14,
    "vt_hidden_size": 1024,
    "vt_intermediate_size": 4096,
    "vt_num_attention_heads": 12,
    "vt_num_hidden_layers": 27,
    "qkv_hidden_size": 1536,
    "norm_type": "rmsnorm",
    "attn_bias": False,
    "linear_bias": False,
    "patch_embed_proj_bias": False,
    "mlp_type": "mlp2",
    "activation_func": "gelu_pytorch_tanh",
    "pos_emb_type": "divided_fixed",
    "init_pos_emb_height": 64,
    "init_pos_emb_width": 64,
    "init_pos_emb_time": 4,
    "pos_emb_interpolation_mode": "bilinear",
    "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2",
    "mm_hidden_size": 1024,
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5,
    "text_hidden_size": 7168,
}


def install_stand_ins():
    sys.path.insert(0, os.path.join(HERE, "..", "reference_grads"))
    import stubs  # noqa: F401  (installs transformers stand-ins: names only)

    class GELUTanh(nn.Module):
        def forward(self, x):
            return F.gelu(x, approximate="tanh")

    if not hasattr(nn, "RMSNorm"):  # torch < 2.4: torch 2's formula; eps None = the input dtype's machine epsilon
        class RMSNorm(nn.Module):
            def __init__(self, normalized_shape, eps=None, elementwise_affine=True):
                super().__init__()
                self.eps = eps
                self.weight = nn.Parameter(torch.ones(normalized_shape))

            def forward(self, x):
                eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
                return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.weight

        nn.RMSNorm = RMSNorm
    acts = sys.modules["transformers.activations"]
    acts.PytorchGELUTanh = GELUTanh
    sys.modules["transformers"].activations = acts
    stubs._mod("transformers.configuration_utils", PretrainedConfig=object)
    stubs._mod("transformers.models")
    stubs._mod("transformers.models.llava")
    stubs._mod("transformers.models.llava.modeling_llava", LlavaCausalLMOutputWithPast=dict)
    has_flash = importlib.util.find_spec("flash_attn") is not None
    sys.modules["transformers.utils"].is_flash_attn_2_available = lambda: has_flash
    return has_flash


def load_reference(path):
    src = open(path).read()
    for old, new in (("from .configuration_kimi_k3 import KimiK3Config", "KimiK3Config = object"),
                     ("from .modeling_kimi_linear import KimiLinearForCausalLM", "KimiLinearForCausalLM = None")):
        if src.count(old) != 1:
            sys.exit(f"bench_reference_vision: {path}: expected one '{old}' (is this modeling_kimi_k3.py at bcbda0bf?)")
        src = src.replace(old, new)
    d = tempfile.mkdtemp(prefix="k3visbench-")
    with open(os.path.join(d, "k3_vision_reference_bench.py"), "w") as f:
        f.write(src)
    sys.path.insert(0, d)
    return importlib.import_module("k3_vision_reference_bench")


def sdpa_attention(q, k, v, q_cu_seqlens=None, k_cu_seqlens=None, **kwargs):
    """The reference's attention contract (q, k, v [L, heads, hd], cu_seqlens) by PyTorch's SDPA per item,
    non-causal; returns [L, heads * hd] like its flash-attn and eager forms."""
    out = torch.empty_like(q)
    cu = q_cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):  # [1, heads, n, hd]: the layout SDPA's flash backend takes
        o = F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)))
        out[a:b] = o[0].transpose(0, 1)
    return out.flatten(start_dim=-2)


def median_ms(fn, reps, warmup=2):
    for _ in range(warmup):
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


def parse_rows(text):
    rows = []
    for item in text.split(","):
        hw, _, n = item.partition(":")
        h, _, w = hw.partition("x")
        rows.append((int(h), int(w), int(n or 1)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference", required=True, help="Moonshot's modeling_kimi_k3.py")
    ap.add_argument("--attn", default="auto", choices=["auto", "sdpa", "flash_attention_2", "eager"])
    ap.add_argument("--rows", default="32x32:1,32x32:16,74x74:1,74x74:4,256x256:1",
                    help="H x W patch grids : images per call (bench_cuda_vision's)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_reference_vision: no GPU; nothing measured")
        return
    has_flash = install_stand_ins()
    # The reference compiles its position-table resize (torch.compile): where inductor cannot run here, that
    # function runs eagerly instead of failing (the same arithmetic).
    importlib.import_module("torch._dynamo")  # (a plain `import torch._dynamo` here would make torch local)
    torch._dynamo.config.suppress_errors = True
    M = load_reference(a.reference)
    M.VL_VISION_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention
    attn = a.attn if a.attn != "auto" else ("flash_attention_2" if has_flash else "sdpa")
    if attn == "flash_attention_2" and not has_flash:
        sys.exit("bench_reference_vision: --attn flash_attention_2 needs flash-attn installed")

    cfg = dict(VISION_CONFIG, vt_num_hidden_layers=a.layers, _attn_implementation=attn)
    vc = types.SimpleNamespace(**cfg)
    torch.manual_seed(a.seed)
    with torch.device("cuda"):
        tower = M.MoonViT3dPretrainedModel(M.VisionTowerConfig(vc))
        projector = M.PatchMergerMLPV2(M.ProjectorConfig(vc))
    with torch.no_grad():
        for module in (tower, projector):
            for name, p in module.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)
    tower = tower.to(device="cuda", dtype=torch.bfloat16).eval()
    projector = projector.to(device="cuda", dtype=torch.bfloat16).eval()

    D, Q, I = cfg["vt_hidden_size"], cfg["qkv_hidden_size"], cfg["vt_intermediate_size"]
    P, Mw, text = 3 * cfg["patch_size"] ** 2, 4 * cfg["mm_hidden_size"], cfg["text_hidden_size"]
    heads, hd = cfg["vt_num_attention_heads"], Q // cfg["vt_num_attention_heads"]
    print(f"reference: {a.reference}; attention {attn}; torch {torch.__version__}; "
          f"{torch.cuda.get_device_name()}", flush=True)
    print(f"\ntower + projector ({a.layers} blocks, width {D}, {heads} heads x {hd}, MLP {I}, projector -> {text}), "
          f"bf16 (Moonshot's PyTorch code)")
    print(f"| {'grid':<9} | {'images':>6} | {'patches':>8} | {'ms/call':>10} | {'ms/image':>10} | {'images/s':>9} | "
          f"{'TFLOP/s':>8} |")
    rows = parse_rows(a.rows)
    for h, w, n_img in rows:
        n = h * w
        L = n * n_img
        x = (torch.rand(L, 3, cfg["patch_size"], cfg["patch_size"], device="cuda") * 2 - 1).to(torch.bfloat16)
        grid = torch.tensor([[1, h, w]] * n_img, dtype=torch.int64, device="cuda")

        def run():
            with torch.no_grad():
                return projector(tower(x, grid))

        try:
            ms = median_ms(run, max(3, a.reps // 4) if n >= 256 * 256 else a.reps)
        except torch.cuda.OutOfMemoryError as e:
            print(f"| {h:>4}x{w:<4} | {n_img:>6} | {L:>8} | out of memory ({str(e).splitlines()[0][:60]})")
            torch.cuda.empty_cache()
            continue
        T = n / 4
        flops = (2.0 * n * P * D + a.layers * (2.0 * n * (D * 3 * Q + Q * D + 2 * D * I) + 4.0 * n * n * Q)
                 + 2.0 * T * (Mw * Mw + Mw * text)) * n_img
        per = ms / n_img
        print(f"| {h:>4}x{w:<4} | {n_img:>6} | {L:>8} | {ms:>10.3f} | {per:>10.3f} | {1e3 / per:>9.2f} | "
              f"{flops / (ms * 1e-3) / 1e12:>8.1f} |")
        print(f"reference_vision_tower grid={h}x{w} images={n_img} attn={attn} ms={ms:.4f} ms_per_image={per:.4f} "
              f"images_per_s={1e3 / per:.3f} tflops={flops / (ms * 1e-3) / 1e12:.2f}", flush=True)
        del x
        torch.cuda.empty_cache()

    print(f"\nattention alone, one image ({heads} heads x {hd}, bidirectional, bf16): PyTorch SDPA")
    print(f"| {'grid':<9} | {'ms':>10} | {'TFLOP/s':>8} | {'x blocks (ms)':>16} |")
    seen = set()
    for h, w, _ in rows:
        if (h, w) in seen:
            continue
        seen.add((h, w))
        n = h * w
        q, k, v = (torch.randn(1, heads, n, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v), max(3, a.reps // 4) if n >= 65536 else a.reps)
        flops = 4.0 * n * n * Q
        print(f"| {h:>4}x{w:<4} | {ms:>10.4f} | {flops / (ms * 1e-3) / 1e12:>8.1f} | {ms * a.layers:>16.2f} |")
        print(f"reference_sdpa grid={h}x{w} ms={ms:.4f} tflops={flops / (ms * 1e-3) / 1e12:.2f}", flush=True)


if __name__ == "__main__":
    main()
