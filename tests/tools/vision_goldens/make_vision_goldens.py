#!/usr/bin/python3
"""Golden outputs of MoonViT-V2 and the PatchMergerMLPV2 projector, from Moonshot's own modeling code, for a
tiny random vision config (tests/fixtures/vision-tiny).

  OMP_NUM_THREADS=1 /usr/bin/python3 tests/tools/vision_goldens/make_vision_goldens.py \
      --reference third_party_ref/kimi_k3/modeling_kimi_k3.py --out tests/fixtures/vision-tiny

The reference is `modeling_kimi_k3.py` of vllm-project/llm-compressor at bcbda0bf0a93e40bdfe177702c5a965a3a7bd534
(src/llmcompressor/modeling/kimi_k3/). It is not part of this repository (third_party_ref/ is ignored): it is
patched in memory, and the patched copy is written to a temporary directory only. Needs torch (Debian:
python3-torch, 1.13) and numpy. The textual changes, each asserted to apply:
  * the transformers imports, `.configuration_kimi_k3` and `.modeling_kimi_linear` -> stand-ins
    (tests/tools/reference_grads/stubs.py and below); `@torch.compile` (torch 2) is dropped;
  * the float32 islands -> float64, so the golden is the exact arithmetic of the model: every `.float()`,
    `torch.float32` (the attention softmax), `torch.complex64` (the 2D RoPE), and `np.float32` (the time
    embedding's sin-cos table);
  * attention through the reference's own `eager_attention` (its flash-attn path computes the same).
torch 1.13 has no nn.RMSNorm: the stand-in below computes torch 2's formula, x * rsqrt(mean(x^2) + eps) * w,
with eps = None meaning the machine epsilon of the *checkpoint's* dtype, bf16 (2^-7): the tower's three norms
are built without eps, and the released model runs them in bf16 (K3-ARCHITECTURE.md, section 6). The
projector's post_norm has its own eps (projector_ln_eps).

Writes into --out:
  config.json           {"vision_config": {...}, "text_hidden_size": N}, the released config's field names
  model.safetensors     the tower's and projector's weights under the release's names (F32)
  pixels.safetensors    pixel_patches F32 [L, 3, 14, 14] (normalised, patchified), grid_thws I64 [n, 3]:
                        the input of `k3 vision-encode`
  golden.safetensors    merged.i [tokens, 4, width] and projected.i [tokens, text hidden] per item i (the
                        output of `k3 vision-encode`), and the tower's states for layer-by-layer checks:
                        embed (after the position embedding), block.B (after block B), final (after the final
                        norm), each [L, width] over all items; computed in float64, stored as F32 (k3 reads
                        no F64) like the text fixture's goldens
"""
import argparse, importlib, json, os, sys, tempfile, types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "reference_grads"))
import numpy as np
import torch
import torch.nn as nn
import stubs  # noqa: F401  (installs the transformers stand-ins)
import st

BF16_EPS = 2.0 ** -7  # torch.finfo(torch.bfloat16).eps


class RMSNorm(nn.Module):
    """torch 2's nn.RMSNorm (elementwise affine): x * rsqrt(mean(x^2, -1) + eps) * weight."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True):
        super().__init__()
        self.eps = BF16_EPS if eps is None else eps
        self.weight = nn.Parameter(torch.ones(normalized_shape))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class GELUTanh(nn.Module):
    def forward(self, x):
        return nn.functional.gelu(x, approximate="tanh")


def install_stand_ins():
    nn.RMSNorm = RMSNorm
    acts = sys.modules["transformers.activations"]
    acts.PytorchGELUTanh = GELUTanh
    sys.modules["transformers"].activations = acts
    stubs._mod("transformers.configuration_utils", PretrainedConfig=object)
    stubs._mod("transformers.models")
    stubs._mod("transformers.models.llava")
    stubs._mod("transformers.models.llava.modeling_llava", LlavaCausalLMOutputWithPast=dict)


def patched_module(src):
    s = open(src).read()

    def sub(old, new, count=None):
        nonlocal s
        n = s.count(old)
        assert n > 0 and (count is None or n == count), f"{old!r}: found {n} times"
        s = s.replace(old, new)
        return n

    sub("from .configuration_kimi_k3 import KimiK3Config", "KimiK3Config = object", 1)
    sub("from .modeling_kimi_linear import KimiLinearForCausalLM", "KimiLinearForCausalLM = None", 1)
    sub("@torch.compile(dynamic=True)\n", "", 1)
    n = sub(".float()", ".to(torch.float64)")
    n += sub("torch.float32", "torch.float64")
    n += sub("torch.complex64", "torch.complex128")
    n += sub("np.float32", "np.float64")
    d = tempfile.mkdtemp(prefix="k3vis-")
    with open(os.path.join(d, "k3_vision_reference_patched.py"), "w") as f:
        f.write(s)
    sys.path.insert(0, d)
    print(f"reference: {n} float32 sites -> float64", flush=True)
    return importlib.import_module("k3_vision_reference_patched")


# The tiny config: the released field names and kinds (K3-ARCHITECTURE.md 2.3), small widths. The head dim (24)
# differs from width / heads and the position table is not square, so a port that mixes them up fails.
VISION_CONFIG = {
    "patch_size": 14,
    "vt_hidden_size": 32,
    "vt_intermediate_size": 64,
    "vt_num_attention_heads": 2,
    "vt_num_hidden_layers": 2,
    "qkv_hidden_size": 48,
    "norm_type": "rmsnorm",
    "attn_bias": False,
    "linear_bias": False,
    "patch_embed_proj_bias": False,
    "mlp_type": "mlp2",
    "activation_func": "gelu_pytorch_tanh",
    "pos_emb_type": "divided_fixed",
    "init_pos_emb_height": 4,
    "init_pos_emb_width": 6,
    "init_pos_emb_time": 4,
    "pos_emb_interpolation_mode": "bilinear",
    "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2",
    "mm_hidden_size": 32,
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5,
    "text_hidden_size": 40,
    "_attn_implementation": "eager",
}
# (t, h, w): the position table's own grid; interpolated up, down, and to other aspect ratios; a 2-frame clip
# at the table's grid (time embedding, temporal pooling) and one that needs interpolation.
GRIDS = [(1, 4, 6), (1, 6, 8), (1, 2, 2), (1, 8, 4), (2, 4, 6), (3, 2, 4)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference", required=True, help="Moonshot's modeling_kimi_k3.py")
    ap.add_argument("--out", required=True, help="the fixture directory to write")
    ap.add_argument("--seed", type=int, default=20261203)
    a = ap.parse_args()
    torch.set_num_threads(1)
    install_stand_ins()
    M = patched_module(a.reference)

    vc = types.SimpleNamespace(**VISION_CONFIG)
    tower = M.MoonViT3dPretrainedModel(M.VisionTowerConfig(vc))
    projector = M.PatchMergerMLPV2(M.ProjectorConfig(vc))
    rng = np.random.default_rng(a.seed)

    # Weights drawn in float32 (what the fixture stores), O(1) activations: fan-in scaled matrices, norms near 1.
    weights = {}
    for prefix, module in (("vision_tower.", tower), ("mm_projector.", projector)):
        for name, p in module.named_parameters():
            shape = tuple(p.shape)
            if name.endswith("norm0.weight") or name.endswith("norm1.weight") or "final_layernorm" in name \
                    or "post_norm" in name:
                w = 1.0 + 0.2 * rng.standard_normal(shape)
            elif name.endswith("pos_emb.weight"):
                w = rng.standard_normal(shape)
            else:
                fan_in = int(np.prod(shape[1:]))
                w = rng.standard_normal(shape) / np.sqrt(fan_in)
            w = w.astype(np.float32)
            weights[prefix + name] = w
            with torch.no_grad():
                p.copy_(torch.from_numpy(w.astype(np.float64)))
    tower.double()
    projector.double()

    L = sum(t * h * w for t, h, w in GRIDS)
    pixels = rng.uniform(-1.0, 1.0, (L, 3, 14, 14)).astype(np.float32)
    grid = np.array(GRIDS, dtype=np.int64)

    states = {}
    blocks = tower.encoder.blocks
    for i, b in enumerate(blocks):
        b.register_forward_hook(lambda m, inp, out, i=i: states.__setitem__(f"block.{i}", out.detach().clone()))
    tower.patch_embed.register_forward_hook(lambda m, inp, out: states.__setitem__("embed", out.detach().clone()))
    tower.encoder.final_layernorm.register_forward_hook(
        lambda m, inp, out: states.__setitem__("final", out.detach().clone()))
    with torch.no_grad():
        x = torch.from_numpy(pixels.astype(np.float64))
        g = torch.from_numpy(grid)
        merged = tower(x, g)
        projected = projector(merged)

    golden = {k: v.numpy().astype(np.float32) for k, v in states.items()}
    for i, (m, p) in enumerate(zip(merged, projected)):
        golden[f"merged.{i}"] = m.numpy().astype(np.float32)
        golden[f"projected.{i}"] = p.numpy().astype(np.float32)
        print(f"item {i}: grid {GRIDS[i]} -> merged {tuple(m.shape)}, projected {tuple(p.shape)}, "
              f"|projected| rms {float(p.pow(2).mean().sqrt()):.3f}", flush=True)

    os.makedirs(a.out, exist_ok=True)
    cfg = {"vision_config": {k: v for k, v in VISION_CONFIG.items() if k != "_attn_implementation"},
           "text_hidden_size": VISION_CONFIG["text_hidden_size"]}
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    st.save(os.path.join(a.out, "model.safetensors"), weights)
    st.save(os.path.join(a.out, "pixels.safetensors"), {"pixel_patches": pixels, "grid_thws": grid})
    st.save(os.path.join(a.out, "golden.safetensors"), golden)
    print(f"wrote {a.out}: {len(weights)} weights, {L} patches in {len(GRIDS)} items", flush=True)


if __name__ == "__main__":
    main()
