#!/usr/bin/env bash
# The GPU check-and-benchmark run, on a machine with an H100/H200 (sm_90a) and CUDA 13:
#   1. builds k3cpp with the CUDA backend (build-gpu/),
#   2. runs every CUDA test (each kernel against its CPU twin; skipped tests would mean no GPU),
#   3. runs the benchmark binaries bench_cuda_* (our kernels, with cuBLAS baselines in-process),
#   4. runs the peer baselines in the same session: flash-linear-attention's chunk_kda (source from
#      FLA_SRC, default third_party_ref/fla_src, never part of the repository) and PyTorch SDPA; and
#      Moonshot's vision tower in bf16 (tests/tools/vision_goldens/bench_reference_vision.py) when
#      VISION_REF (default third_party_ref/kimi_k3/modeling_kimi_k3.py) is there.
# Everything is printed and also written to $OUT (or out/gpu) as gpu_run.log.
# Usage: bash scripts/gpu/run_all.sh [--no-peers] [--no-bench] [--only REGEX]   (REGEX filters test/bench names)
# bench_cuda_model writes random k3-small and k3-1b checkpoints under models/ first (k3 init) and
# takes extra arguments from $MODEL_BENCH_ARGS; bench_cuda_train its arguments from $TRAIN_BENCH_ARGS.
# Before it, here: bash scripts/gpu/fetch_deps.sh (the Debian packages the GPU image lacks), and carry
# .gpudeps and third_party_ref/fla_src to the GPU machine.
set -uo pipefail
cd "$(dirname "$0")/../.."
PEERS=1
BENCH=1
ONLY=.
while [ $# -gt 0 ]; do
  case "$1" in
    --no-peers) PEERS=0 ;;
    --no-bench) BENCH=0; PEERS=0 ;;
    --only) ONLY="$2"; shift ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
LOGDIR=${OUT:-out/gpu}
mkdir -p "$LOGDIR"
exec > >(tee "$LOGDIR/gpu_run.log") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
START=$(date +%s)
DEPS=()
if ! pkg-config --exists libpcre2-8 2>/dev/null && ls .gpudeps/*.deb >/dev/null 2>&1; then
  # The GPU image lacks our -dev packages: unpack the ones scripts/gpu/fetch_deps.sh downloaded.
  rm -rf .gpudeps/root && mkdir -p .gpudeps/root
  for f in .gpudeps/*.deb; do dpkg -x "$f" .gpudeps/root; done
  DEPS=(-DK3_DEPS_ROOT="$PWD/.gpudeps/root")
  # OpenBLAS's own dependencies (libgfortran) are found through the loader path, not our rpath.
  export LD_LIBRARY_PATH="$PWD/.gpudeps/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DK3_BUILD_TESTS=ON -DK3_BUILD_BENCH=ON "${DEPS[@]}" >"$LOGDIR/cmake.log" 2>&1 \
  || { tail -30 "$LOGDIR/cmake.log"; exit 1; }
TARGETS=$(cd tests && ls test_cuda_*.cpp 2>/dev/null | sed 's/\.cpp$//' | grep -E "$ONLY")
BENCHES=""
[ $BENCH = 1 ] && BENCHES=$(cd bench && ls bench_cuda_*.cpp 2>/dev/null | sed 's/\.cpp$//' | grep -E "$ONLY")
cmake --build build-gpu -j"$(nproc)" --target k3 $TARGETS $BENCHES 2>&1 | grep -E "error|warning: |Error" ; true
echo "== build: $(( $(date +%s) - START )) s"
FAILED=0
for t in $TARGETS; do
  echo "== test $t"
  ./build-gpu/$t --gtest_brief=1 || FAILED=1
done
for b in $BENCHES; do
  echo "== bench $b"
  if [ "$b" = bench_cuda_model ]; then
    # End to end on random k3-small and k3-1b checkpoints (written once, kept while the machine is warm).
    for m in k3-small k3-1b; do
      [ -f "models/$m/config.json" ] || ./build-gpu/k3 init --config "configs/$m.json" --out "models/$m" --seed 1 >/dev/null \
        || FAILED=1
    done
    ./build-gpu/$b --model models/k3-small --model models/k3-1b ${MODEL_BENCH_ARGS:-} || FAILED=1
  elif [ "$b" = bench_cuda_train ]; then
    ./build-gpu/$b ${TRAIN_BENCH_ARGS:---config configs/k3-1b.json --config configs/k3-shaped-h200.json} || FAILED=1
  else
    ./build-gpu/$b || FAILED=1
  fi
done
if [ $PEERS = 1 ]; then
  echo "== peers (flash-linear-attention chunk_kda, PyTorch SDPA)"
  PYTHONUNBUFFERED=1 python3 scripts/gpu/bench_peers.py || FAILED=1
  # Moonshot's vision tower in bf16 beside bench_cuda_vision, when its modeling code was carried here.
  VISION_REF=${VISION_REF:-third_party_ref/kimi_k3/modeling_kimi_k3.py}
  if [ -f "$VISION_REF" ] && echo bench_cuda_vision | grep -qE "$ONLY"; then
    echo "== peer: Moonshot's vision tower (PyTorch, bf16)"
    PYTHONUNBUFFERED=1 python3 tests/tools/vision_goldens/bench_reference_vision.py --reference "$VISION_REF" || FAILED=1
  fi
fi
echo "== done in $(( $(date +%s) - START )) s, failures: $FAILED"
exit $FAILED
