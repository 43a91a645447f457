#!/usr/bin/env bash
# Training dynamics, GPU against CPU: k3-tiny for 300 steps on the main job's shards, in float64 on the
# CPU and in bf16 mixed precision on the GPU, side by side (the CPU run on the host's cores while the
# GPU trains), then per 50-step window the mean training loss and MaxVio of both, and the held-out
# loss of both after every 50 steps (--eval-every 50).
# Usage: bash scripts/gpu/train_dynamics.sh DATA_DIR [STEPS]
#   DATA_DIR holds train.bin and heldout.bin (scripts/run.sh steps 1-6 write them to $K3_DEMO_DIR);
#   needs build-gpu/k3 (scripts/gpu/run_all.sh builds it). Output under $OUT (default out/gpu).
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=${1:?usage: train_dynamics.sh DATA_DIR [STEPS]}
STEPS=${2:-300}
OUTDIR=${OUT:-out/gpu}
mkdir -p "$OUTDIR"
K3=./build-gpu/k3
ARGS=(--config configs/k3-tiny.json --data "$DATA/train.bin" --eval-data "$DATA/heldout.bin"
      --stages "256:$(( STEPS * 1024 ))" --tokens-per-step 1024 --lr 6e-3 --balance qb-exact --save-every 100000
      --eval-every 50)
rm -rf "$OUTDIR/dyn-cpu" "$OUTDIR/dyn-gpu"
T0=$(date +%s)
"$K3" train "${ARGS[@]}" --out "$OUTDIR/dyn-cpu" > "$OUTDIR/dyn-cpu.log" 2>&1 &
CPU=$!
"$K3" train "${ARGS[@]}" --out "$OUTDIR/dyn-gpu" --device cuda > "$OUTDIR/dyn-gpu.log" 2>&1
echo "gpu run: $(( $(date +%s) - T0 )) s"
wait $CPU
echo "cpu run: $(( $(date +%s) - T0 )) s"
tail -n 2 "$OUTDIR/dyn-cpu.log" "$OUTDIR/dyn-gpu.log"
python3 - "$OUTDIR/dyn-cpu/metrics.jsonl" "$OUTDIR/dyn-gpu/metrics.jsonl" <<'EOF'
import json, sys
def read(p):
    steps, ev = [], {}
    for line in open(p):
        r = json.loads(line)
        if "eval_loss" in r: ev[r["step"]] = r["eval_loss"]
        elif "loss" in r: steps.append(r)
    return steps, ev
cpu, cev = read(sys.argv[1]); gpu, gev = read(sys.argv[2])
print("| steps | CPU f64 loss | GPU bf16 loss | diff | CPU MaxVio | GPU MaxVio |")
print("|---|---|---|---|---|---|")
worst = 0.0
for a in range(0, len(cpu), 50):
    c = cpu[a:a + 50]; g = gpu[a:a + 50]
    cl = sum(r["loss"] for r in c) / len(c); gl = sum(r["loss"] for r in g) / len(g)
    cm = sum(max(r["max_vio"]) for r in c) / len(c); gm = sum(max(r["max_vio"]) for r in g) / len(g)
    worst = max(worst, abs(gl - cl) / cl)
    print(f"| {a + 1}-{a + len(c)} | {cl:.4f} | {gl:.4f} | {100 * (gl - cl) / cl:+.2f}% | {cm:.3f} | {gm:.3f} |")
print("| after step | CPU f64 held-out | GPU bf16 held-out | diff |")
print("|---|---|---|---|")
worst_ev = 0.0
for s in sorted(cev):
    c, g = cev[s], gev.get(s, float("nan"))
    worst_ev = max(worst_ev, abs(g - c) / c) if g == g else float("inf")
    print(f"| {s} | {c:.4f} | {g:.4f} | {100 * (g - c) / c:+.2f}% |")
print(f"worst training-loss window {100 * worst:.2f}%, worst held-out {100 * worst_ev:.2f}% (bar: 2%)")
print("tokens/s: CPU %.0f, GPU %.0f" % (cpu[-1]["tokens_per_s"], gpu[-1]["tokens_per_s"]))
EOF
