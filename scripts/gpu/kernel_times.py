#!/usr/bin/env python3
"""Where a training step's GPU time goes: an Nsight Compute log of every kernel launch of
bench_cuda_train (ncu --metrics gpu__time_duration.sum --csv, as scripts/gpu/train_kernel_times.sh
writes it) summed by kernel and by module, for one step.

Steps are told apart by the optimizer: a step starts at the first embedding forward after an AdamW
launch (a step with micro-batches runs the embedding once per pass). The default is the last complete
step (the first is the warm-up, with cuBLAS's first-call planning).

Usage: python3 scripts/gpu/kernel_times.py LOG.csv [--step -1] [--top 40]
"""
import argparse
import collections
import csv
import re
import sys


def short(name):
    name = re.sub(r"^void ", "", name)
    name = name.split("(")[0]
    name = name.replace("<unnamed>::", "")
    return name[:90]


def module(name):
    """cuBLAS's kernels as one module, ours (and cub's) by namespace: kda::, mla::, moe::, train::
    (optimizers, clipping, balancing), elementwise:: (conversions, adds), ..."""
    n = short(name)
    if n.startswith(("nvjet", "sm90_", "cutlass", "cublas")):
        return "cuBLAS"
    return n.split("::")[0] + "::" if "::" in n else n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--step", type=int, default=-1, help="which step (0 = the warm-up; -1 = the last complete)")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    rows = list(csv.reader(lines))
    if not rows or rows[0][:1] != ["ID"]:
        sys.exit(f"{args.csv}: no ncu CSV table (was the run cut off before its first kernel?)")
    ix = {c: i for i, c in enumerate(rows[0])}
    scale = {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "nsecond": 1e-6}
    launches = []
    for r in rows[1:]:
        if r[ix["Metric Name"]] != "gpu__time_duration.sum":
            continue
        ms = float(r[ix["Metric Value"]].replace(",", "")) * scale[r[ix["Metric Unit"]]]
        launches.append((r[ix["Kernel Name"]], ms))
    steps, cur, seen_adam = [], [], False
    for name, ms in launches:
        if "embedding_forward_kernel" in name and (seen_adam or not cur):
            if cur:
                steps.append(cur)
            cur, seen_adam = [], False
        if "adamw_kernel" in name:
            seen_adam = True
        cur.append((name, ms))
    complete = steps + ([cur] if seen_adam else [])  # the last one counts if its update ran
    if not complete:
        sys.exit(f"{args.csv}: no complete step ({len(launches)} launches, no optimizer update among them)")
    step = complete[args.step]
    total = sum(ms for _, ms in step)
    print(f"{args.csv}: {len(complete)} complete step(s); step {args.step % len(complete)}: "
          f"{len(step)} launches, {total:.2f} ms of kernel time")
    by_mod = collections.defaultdict(lambda: [0.0, 0])
    by_ker = collections.defaultdict(lambda: [0.0, 0])
    for name, ms in step:
        by_mod[module(name)][0] += ms
        by_mod[module(name)][1] += 1
        by_ker[short(name)][0] += ms
        by_ker[short(name)][1] += 1
    print("\n| module | ms | share | launches |\n|---|---|---|---|")
    for m, (ms, n) in sorted(by_mod.items(), key=lambda kv: -kv[1][0]):
        print(f"| {m} | {ms:.2f} | {100 * ms / total:.1f}% | {n} |")
    print("\n| kernel | ms | share | launches | mean us |\n|---|---|---|---|---|")
    for k, (ms, n) in sorted(by_ker.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"| `{k}` | {ms:.2f} | {100 * ms / total:.1f}% | {n} | {1e3 * ms / n:.1f} |")


if __name__ == "__main__":
    main()
