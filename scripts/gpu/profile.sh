#!/usr/bin/env bash
# Nsight Compute profiles of single kernel launches, on the GPU machine (ncu from CUDA 13; the driver
# must allow profiling): builds the benchmarks, then for each NAME=regex:kernel|launches-to-skip|command
# below it profiles one launch with the full section set and writes, under $OUT (or out/gpu):
#   NAME.txt          the details page (speed of light, occupancy, warp stall reasons, memory tables)
#   NAME.sass.csv     per-SASS-instruction source page (executed instructions, stall samples); summarise
#                     it with scripts/gpu/sass_summary.py
# The reports themselves (NAME.ncu-rep, for ncu-ui) stay in $REPDIR (default /tmp/k3-ncu).
# Usage: bash scripts/gpu/profile.sh [kda|moe|kda+moe|all]   (default all)
set -uo pipefail
cd "$(dirname "$0")/../.."
WHAT=${1:-all}
LOGDIR=${OUT:-out/gpu}
REPDIR=${REPDIR:-/tmp/k3-ncu}
mkdir -p "$LOGDIR" "$REPDIR"
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
OUT=$REPDIR bash scripts/gpu/run_all.sh --no-bench --only '^$' >/dev/null 2>&1  # configure build-gpu (deps), build k3
cmake --build build-gpu -j"$(nproc)" --target bench_cuda_kda bench_cuda_moe 2>&1 | grep -E "error|warning: " ; true
if [ ! -x build-gpu/bench_cuda_kda ]; then
  echo "build failed: see $LOGDIR/cmake.log"; exit 1
fi
[ -f .gpudeps/root/usr/lib/x86_64-linux-gnu/libgfortran.so.5 ] && \
  export LD_LIBRARY_PATH="$PWD/.gpudeps/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
profile() {  # name kernel-regex skip command...
  local name=$1 kernel=$2 skip=$3
  shift 3
  echo "== profile $name: $kernel (skip $skip): $*"
  "$NCU" --kernel-name-base "${KBASE:-function}" --kernel-name "regex:$kernel" --launch-skip "$skip" --launch-count 1 \
    --set full --import-source yes \
    -f -o "$REPDIR/$name" "$@" >"$REPDIR/$name.run.log" 2>&1 || { tail -20 "$REPDIR/$name.run.log"; return; }
  "$NCU" --import "$REPDIR/$name.ncu-rep" --page details >"$LOGDIR/$name.txt" 2>&1
  "$NCU" --import "$REPDIR/$name.ncu-rep" --page source --csv --print-source sass >"$LOGDIR/$name.sass.csv" 2>&1
  grep -E "Duration|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Issued Ipc|Compute \(SM\) Throughput|Memory Throughput" \
    "$LOGDIR/$name.txt" | head -12
}
if [ "$WHAT" = kda ] || [ "$WHAT" = kda+moe ] || [ "$WHAT" = all ]; then
  # The recurrence at B1 T65536 H16 (launch 0 is bench_cuda_kda's CPU check); the prepare kernel at
  # B1 T8192 H64 with "all" only.
  profile kda_rec kda_recurrence 1 build-gpu/bench_cuda_kda --shapes 1x65536x16 --reps 1 --warmup 0
  [ "$WHAT" = all ] && profile kda_prep kda_prepare 1 build-gpu/bench_cuda_kda --shapes 1x8192x64 --reps 1 --warmup 0
fi
if [ "$WHAT" = moe ] || [ "$WHAT" = kda+moe ] || [ "$WHAT" = all ]; then
  # The Hopper expert GEMM, 16,384 tokens at K3's sizes: gate/up (the Glu instance) and down (matched by
  # mangled name: the template argument false is ILb0E).
  B=(build-gpu/bench_cuda_moe --tokens 16384 --reps 1 --formats bf16 --tm 128 --variants default)
  KBASE=mangled profile moe_gate_up 'grouped_gemm_sm90_kernelILb1E' 0 "${B[@]}"
  KBASE=mangled profile moe_down 'grouped_gemm_sm90_kernelILb0E' 0 "${B[@]}"
fi
