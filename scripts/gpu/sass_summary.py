#!/usr/bin/env python3
"""Summarise an Nsight Compute source page (ncu --page source --csv --print-source sass, as
scripts/gpu/profile.sh writes it): executed warp instructions by opcode, warp-stall samples by reason,
and the instructions with the most stall samples (with their neighbours' opcodes for context).

Usage: python3 scripts/gpu/sass_summary.py NAME.sass.csv [--top 25]
"""
import argparse
import csv
import collections
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    cols = rows[head]
    body = [r for r in rows[head + 1:] if len(r) == len(cols)]
    ix = {c: i for i, c in enumerate(cols)}

    def num(r, c):
        try:
            return float(r[ix[c]])
        except (KeyError, ValueError):
            return 0.0

    stall_cols = [c for c in cols if c.startswith("stall_") and "Not Issued" not in c]
    by_op = collections.Counter()
    stalls = collections.Counter()
    total_inst = 0.0
    total_samples = 0.0
    for r in body:
        words = r[ix["Source"]].split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "?")
        n = num(r, "Instructions Executed")
        by_op[op.split(".")[0]] += n
        total_inst += n
        total_samples += num(r, "Warp Stall Sampling (All Samples)")
        for c in stall_cols:
            stalls[c] += num(r, c)
    print(f"{rows[0][1] if len(rows[0]) > 1 else ''}")
    print(f"executed warp instructions: {total_inst:,.0f}; stall samples: {total_samples:,.0f}")
    print("by opcode (share of executed instructions):")
    for op, n in by_op.most_common(20):
        print(f"  {op:10s} {n / max(total_inst, 1) * 100:6.2f}%  {n:,.0f}")
    print("stall samples by reason:")
    tot = sum(stalls.values()) or 1
    for c, n in stalls.most_common(12):
        print(f"  {c[6:]:18s} {n / tot * 100:6.2f}%")
    print(f"top {args.top} instructions by stall samples (address, samples, top reasons, source):")
    ranked = sorted(range(len(body)), key=lambda i: -num(body[i], "Warp Stall Sampling (All Samples)"))
    for i in ranked[: args.top]:
        r = body[i]
        reasons = sorted(((num(r, c), c[6:]) for c in stall_cols), reverse=True)[:2]
        rs = ", ".join(f"{name} {v:.0f}" for v, name in reasons if v > 0)
        print(f"  {i:5d} {num(r, 'Warp Stall Sampling (All Samples)'):7.0f}  [{rs}]  {r[ix['Source']].strip()[:90]}")


if __name__ == "__main__":
    sys.exit(main())
