#!/usr/bin/env bash
# Where a training step's GPU time goes, kernel by kernel: bench_cuda_train under Nsight Compute with
# one metric (gpu__time_duration of every launch; clocks left alone, as the device notes ask), then
# scripts/gpu/kernel_times.py's tables by module and by kernel for the last complete step.
# Usage: bash scripts/gpu/train_kernel_times.sh CONFIG RUN   (RUN as bench_cuda_train's --run, e.g.
# 8192:2048 or 65536:2048:mb8192). Runs $BENCH (default build-gpu/bench_cuda_train, which
# scripts/gpu/run_all.sh builds). Writes $OUT/kernel_times.csv (or out/gpu/); under ncu every launch
# is serialised and a step of k3-1b (~5,000 launches) takes ~45 s.
set -uo pipefail
cd "$(dirname "$0")/../.."
[ $# -eq 2 ] || { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
LOGDIR=${OUT:-out/gpu}
mkdir -p "$LOGDIR"
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
"$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$LOGDIR/kernel_times.csv" \
  "${BENCH:-build-gpu/bench_cuda_train}" --config "$1" --steps 1 --run "$2"
python3 scripts/gpu/kernel_times.py "$LOGDIR/kernel_times.csv"
