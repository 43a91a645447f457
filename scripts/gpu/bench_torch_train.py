#!/usr/bin/env python3
"""PyTorch beside bench_cuda_train: Moonshot's own K3 modeling code training the same config.

The model is `KimiLinearForCausalLM` of Moonshot's `modeling_kimi_k3_linear.py` (the text model of
`modeling_kimi_k3.py`, as published in vllm-project/llm-compressor at
bcbda0bf0a93e40bdfe177702c5a965a3a7bd534, src/llmcompressor/modeling/kimi_k3/), whose KDA layers
call fla's Triton `chunk_kda` and `ShortConvolution` / `FusedRMSNormGated`. None of that code is in
this repository: REF_SRC (a checkout of llm-compressor at that commit, git-ignored) and FLA_SRC (fla's
source) are brought to the GPU machine for the run only.

What it runs, per `--run TOKENS:SEQ_LEN[:mbN]` (bench_cuda_train's syntax): fresh random token ids
every step, TOKENS a step in sequences of SEQ_LEN, in passes of at most N tokens; a step is forward
+ backward of every pass (bf16 autocast over fp32 master weights, as `k3 train --device cuda` holds
them), gradient clipping at 1.0, and one fused AdamW step over every parameter. The first step is a warm-up
(Triton's autotuning, cuBLAS plans); the others are timed with CUDA events, the GPU waited for at
each step's end (the loss is read back, as our trainer reads its metrics).

Three choices the reference code leaves to its caller, and how this harness makes them:
- Attention: the reference falls back to an eager softmax(QKᵀ)V when flash-attn 2 is not installed
  (it is not on the GPU machine); this sets `sdpa` instead, PyTorch's fused attention, the faster one
  (the reference's attention dispatches to it by name; its model class only lacks the
  `_supports_sdpa` flag transformers checks, which the harness sets).
- Routed experts: the reference's `forward` always takes `moe_infer`, which runs under
  `torch.no_grad()` (its `if True:` in place of `if not self.training:`), so no gradient reaches the
  experts. The harness routes training through the reference's own `moe_train` (one masked call
  per expert and `index_add_`), the path the reference wrote for training.
- Initialisation: the reference's `_init_weights` returns at once, leaving `torch.empty` memory;
  the harness draws every matrix from N(0, initializer_range²), zeroes `dt_bias` and the router's
  bias, and keeps the norms' ones and `A_log`'s own draw.
Our trainer runs Per-Head Muon on the matrices and AdamW on the rest; this one AdamW on all, which
costs less, so the comparison does not flatter k3cpp.

Prints, per run: `| torch+fla (Moonshot's code) | TOKENS x SEQ | ms | tok/s | GiB |` and the losses.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time


def stage_reference(ref_src):
    """Makes the reference's kimi_k3 package importable without the rest of llm-compressor.

    The package's own __init__ imports the multimodal model (and through it flash-attn); the text
    model needs only configuration_kimi_k3 and modeling_kimi_k3_linear, plus llm-compressor's
    `modeling.moe.context` flag, which is copied as it is.
    """
    src = os.path.join(ref_src, "src", "llmcompressor", "modeling")
    for need in ("kimi_k3/modeling_kimi_k3_linear.py", "kimi_k3/configuration_kimi_k3.py", "moe/context.py"):
        if not os.path.isfile(os.path.join(src, need)):
            sys.exit(f"bench_torch_train: {os.path.join(src, need)} not found (REF_SRC={ref_src})")
    root = tempfile.mkdtemp(prefix="k3ref_")
    pkg = os.path.join(root, "llmcompressor", "modeling")
    os.makedirs(os.path.join(pkg, "kimi_k3"))
    os.makedirs(os.path.join(pkg, "moe"))
    for d in ("llmcompressor", "llmcompressor/modeling", "llmcompressor/modeling/kimi_k3",
              "llmcompressor/modeling/moe"):
        open(os.path.join(root, d, "__init__.py"), "w").close()
    for f in ("modeling_kimi_k3_linear.py", "configuration_kimi_k3.py"):
        shutil.copy(os.path.join(src, "kimi_k3", f), os.path.join(pkg, "kimi_k3", f))
    shutil.copy(os.path.join(src, "moe", "context.py"), os.path.join(pkg, "moe", "context.py"))
    return root


def build_model(config_path, torch):
    from llmcompressor.modeling.kimi_k3 import modeling_kimi_k3_linear as ref
    from llmcompressor.modeling.kimi_k3.configuration_kimi_k3 import KimiLinearConfig

    with open(config_path) as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    config = KimiLinearConfig(**text)
    config._attn_implementation = "sdpa"
    config.use_cache = False
    # The reference's attention calls transformers' attention table by name, sdpa included, but its
    # model class does not declare that, and transformers refuses sdpa without the declaration.
    ref.KimiPreTrainedModel._supports_sdpa = True

    def moe_infer_or_train(self, x, topk_ids, topk_weight):
        if torch.is_grad_enabled():
            return ref.KimiSparseMoeBlock.moe_train(self, x, topk_ids, topk_weight)
        return moe_infer(self, x, topk_ids, topk_weight)

    moe_infer = ref.KimiSparseMoeBlock.moe_infer
    ref.KimiSparseMoeBlock.moe_infer = moe_infer_or_train

    with torch.device("cuda"):
        model = ref.KimiLinearForCausalLM(config)
    std = float(getattr(config, "initializer_range", 0.02))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            elif name.endswith("dt_bias") or name.endswith("e_score_correction_bias"):
                p.zero_()
    model.train()
    return model, config


def parse_run(spec):
    parts = spec.split(":")
    tokens, seq = int(parts[0]), int(parts[1])
    mb = tokens
    for extra in parts[2:]:
        if extra.startswith("mb"):
            mb = int(extra[2:])
        else:
            sys.exit(f"bench_torch_train: unknown run option '{extra}' in '{spec}'")
    if tokens % seq or mb % seq or tokens % mb:
        sys.exit(f"bench_torch_train: '{spec}': tokens, passes and sequences must divide evenly")
    return tokens, seq, mb


def run_one(model, config, torch, tokens, seq, mb, steps, label):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    passes = tokens // mb
    torch.cuda.reset_peak_memory_stats()
    times = []
    for s in range(steps + 1):
        # fresh random tokens every step, as bench_cuda_train draws them (a repeated batch would be
        # memorised within a few steps and make the losses incomparable; the timing is the same)
        batches = [torch.randint(0, config.vocab_size, (mb // seq, seq), device="cuda", generator=gen)
                   for _ in range(passes)]
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        total = 0.0
        for i, ids in enumerate(batches):
            t0 = time.time()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=ids, labels=ids, use_cache=False)
            if s == 0 and i == 0:  # the warm-up's first pass compiles and tunes fla's Triton kernels
                torch.cuda.synchronize()
                print(f"  warm-up forward: {time.time() - t0:.1f} s", flush=True)
                t0 = time.time()
            (out.loss / passes).backward()
            if s == 0 and i == 0:
                torch.cuda.synchronize()
                print(f"  warm-up backward: {time.time() - t0:.1f} s", flush=True)
            total += out.loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(total) / passes
        b.record()
        b.synchronize()
        ms = a.elapsed_time(b)
        print(f"  step {s}: {ms:.1f} ms, loss {loss:.4f}{' (warm-up)' if s == 0 else ''}", flush=True)
        if s > 0:
            times.append(ms)
    ms = sum(times) / len(times)
    gib = torch.cuda.max_memory_allocated() / 2**30
    shape = f"{tokens // seq} x {seq}" + (f" in passes of {mb}" if passes > 1 else "")
    print(f"| {label} | {shape} | {ms:.1f} ms | {tokens / ms * 1e3:.0f} tok/s | {gib:.1f} GiB |", flush=True)
    del opt
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/k3-shaped-h200.json")
    ap.add_argument("--run", action="append", default=[], help="TOKENS:SEQ_LEN[:mbN] (default 8192:2048)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up")
    ap.add_argument("--ref-src", default=os.environ.get("REF_SRC", "third_party_ref/llm-compressor"))
    ap.add_argument("--fla-src", default=os.environ.get("FLA_SRC", "third_party_ref/fla_src"))
    args = ap.parse_args()

    sys.path.insert(0, os.path.abspath(args.fla_src))
    sys.path.insert(0, stage_reference(os.path.abspath(args.ref_src)))
    # PyTorch's own advice for steps whose passes free and reallocate large blocks: it keeps memory
    # that fragmentation would strand usable (docs/BENCHMARKS.md has the large steps it was set for).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    t0 = time.time()
    model, config = build_model(args.config, torch)
    torch.cuda.synchronize()
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.config}: {n / 1e9:.3g}B parameters in Moonshot's KimiLinearForCausalLM "
          f"(torch {torch.__version__}, attention {config._attn_implementation}), built in {time.time() - t0:.1f} s",
          flush=True)
    for spec in args.run or ["8192:2048"]:
        tokens, seq, mb = parse_run(spec)
        try:
            run_one(model, config, torch, tokens, seq, mb, args.steps, "torch + fla (Moonshot's code)")
        except torch.OutOfMemoryError as e:
            print(f"| torch + fla (Moonshot's code) | {spec} | out of memory: {str(e).splitlines()[0]} |")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
