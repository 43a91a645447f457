#!/usr/bin/python3
"""An independent float64 numpy twin of the vision pathway, written from K3-ARCHITECTURE.md section 8 (not from
the reference code), checked against a fixture that make_vision_goldens.py wrote from Moonshot's code:

  /usr/bin/python3 tests/tools/vision_goldens/check_vision_goldens.py tests/fixtures/vision-tiny

Prints the relative L2 error of every golden tensor and exits 1 if any exceeds 1e-7: both sides are computed in
float64, and the golden is stored in float32 (a rounding of at most 2^-24 relative per value). It pins down the reading of the spec the C++ port follows: the
patch embedding as a matrix product over (C, 14, 14), the bilinear position table (align_corners = False),
the sin-cos time embedding, 2D RoPE with the column first, bidirectional attention per item, the sd2_tpool
merge and the projector.
"""
import json, math, os, sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "reference_grads"))
import numpy as np
import st

BF16_EPS = 2.0 ** -7


def rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def gelu_erf(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def bilinear(table, h, w):
    """table [H0, W0, D] resized to [h, w, D]: PyTorch's bilinear with align_corners = False."""
    H0, W0, _ = table.shape

    def axis(n_out, n_in):
        src = np.maximum((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0.0)
        i0 = np.floor(src).astype(int)
        i1 = np.minimum(i0 + 1, n_in - 1)
        return i0, i1, src - i0

    r0, r1, fr = axis(h, H0)
    c0, c1, fc = axis(w, W0)
    top = table[r0][:, c0] * (1 - fc)[None, :, None] + table[r0][:, c1] * fc[None, :, None]
    bot = table[r1][:, c0] * (1 - fc)[None, :, None] + table[r1][:, c1] * fc[None, :, None]
    return top * (1 - fr)[:, None, None] + bot * fr[:, None, None]


def time_embedding(t, D):
    omega = 1.0 / 10000.0 ** (np.arange(D // 2) / (D / 2.0))
    ang = np.arange(t)[:, None] * omega[None, :]
    return np.concatenate([np.sin(ang), np.cos(ang)], axis=1)  # [t, D]


def rope(x, rows, cols):
    """x [n, heads, hd]; pair 2i turns by col * f_i, pair 2i + 1 by row * f_i, f_i = 10000^(-4i / hd)."""
    hd = x.shape[-1]
    f = 1.0 / 10000.0 ** (np.arange(0, hd, 4)[: hd // 4] / hd)
    ang = np.empty((x.shape[0], hd // 2))
    ang[:, 0::2] = cols[:, None] * f[None, :]
    ang[:, 1::2] = rows[:, None] * f[None, :]
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * ang)[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def main():
    fx = sys.argv[1]
    cfg = json.load(open(os.path.join(fx, "config.json")))
    vc = cfg["vision_config"]
    W = {k: v.astype(np.float64) for k, v in st.load(os.path.join(fx, "model.safetensors")).items()}
    px = st.load(os.path.join(fx, "pixels.safetensors"))
    gold = st.load(os.path.join(fx, "golden.safetensors"))
    pixels, grids = px["pixel_patches"].astype(np.float64), px["grid_thws"]
    D, heads, qkv = vc["vt_hidden_size"], vc["vt_num_attention_heads"], vc["qkv_hidden_size"]
    hd = qkv // heads
    T = "vision_tower."
    ours = {}

    # Patch embedding and position embedding.
    x = pixels.reshape(len(pixels), -1) @ W[T + "patch_embed.proj.weight"].reshape(D, -1).T
    table = W[T + "patch_embed.pos_emb.weight"]
    pos, rows, cols, items = [], [], [], []
    for i, (t, h, w) in enumerate(grids):
        p2 = table if (h, w) == table.shape[:2] else bilinear(table, h, w)
        p3 = p2.reshape(1, h * w, D) + (time_embedding(t, D)[:, None, :] if t > 1 else 0.0)
        pos.append(p3.reshape(-1, D))
        r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        rows.append(np.tile(r.reshape(-1), t))
        cols.append(np.tile(c.reshape(-1), t))
        items += [i] * (t * h * w)
    x = x + np.concatenate(pos)
    rows, cols, items = np.concatenate(rows), np.concatenate(cols), np.array(items)
    ours["embed"] = x

    for b in range(vc["vt_num_hidden_layers"]):
        B = f"{T}encoder.blocks.{b}."
        y = rmsnorm(x, W[B + "norm0.weight"], BF16_EPS) @ W[B + "wqkv.weight"].T
        q, k, v = (y[:, j * qkv:(j + 1) * qkv].reshape(-1, heads, hd) for j in range(3))
        q, k = rope(q, rows, cols), rope(k, rows, cols)
        o = np.zeros_like(q)
        for i in range(len(grids)):
            s = items == i
            sc = np.einsum("qhd,khd->hqk", q[s], k[s]) / math.sqrt(hd)
            sc = np.exp(sc - sc.max(-1, keepdims=True))
            sc /= sc.sum(-1, keepdims=True)
            o[s] = np.einsum("hqk,khd->qhd", sc, v[s])
        x = x + o.reshape(-1, qkv) @ W[B + "wo.weight"].T
        y = rmsnorm(x, W[B + "norm1.weight"], BF16_EPS)
        x = x + gelu_tanh(y @ W[B + "mlp.fc0.weight"].T) @ W[B + "mlp.fc1.weight"].T
        ours[f"block.{b}"] = x
    x = rmsnorm(x, W[T + "encoder.final_layernorm.weight"], BF16_EPS)
    ours["final"] = x

    # sd2_tpool merge, then the projector.
    P = "mm_projector."
    off = 0
    for i, (t, h, w) in enumerate(grids):
        seq = x[off:off + t * h * w].reshape(t, h // 2, 2, w // 2, 2, D).transpose(0, 1, 3, 2, 4, 5).mean(0)
        merged = seq.reshape(-1, 4, D)
        ours[f"merged.{i}"] = merged
        y = gelu_erf(merged.reshape(len(merged), -1) @ W[P + "proj.0.weight"].T) @ W[P + "proj.2.weight"].T
        ours[f"projected.{i}"] = rmsnorm(y, W[P + "post_norm.weight"], vc["projector_ln_eps"])
        off += t * h * w

    worst = 0.0
    for name in sorted(gold):
        g = gold[name].astype(np.float64)
        err = float(np.linalg.norm(ours[name] - g) / np.linalg.norm(g))
        worst = max(worst, err)
        print(f"{name:14s} {str(g.shape):16s} rel L2 {err:.2e}")
    print(f"worst {worst:.2e}")
    sys.exit(0 if worst <= 1e-7 else 1)


if __name__ == "__main__":
    main()
