#!/usr/bin/env bash
# Before/after on the GPU machine: builds the end-to-end model benchmark (bench_cuda_model) from a
# baseline source tree and from this tree, then runs both on the same random checkpoints, one after
# the other, alternating twice, so that a change's speed is judged on one machine in one session.
# Usage: bash scripts/gpu/bench_against.sh BASELINE_SRC [bench_cuda_model arguments...]
#   BASELINE_SRC: a copy of the tree to compare with, e.g. `git archive REV | tar -x -C third_party_ref/base`
#   (third_party_ref/ is ignored by git; carry it and .gpudeps to the GPU machine).
# Models: random k3-small and k3-1b under models/ (k3 init, kept while the machine is warm).
set -uo pipefail
cd "$(dirname "$0")/../.."
BASE=${1:?usage: bench_against.sh BASELINE_SRC [bench_cuda_model args...]}
shift
[ -f "$BASE/CMakeLists.txt" ] || { echo "$BASE: not a k3cpp source tree" >&2; exit 2; }
DEPS=()
if ! pkg-config --exists libpcre2-8 2>/dev/null && ls .gpudeps/*.deb >/dev/null 2>&1; then
  [ -d .gpudeps/root ] || { mkdir -p .gpudeps/root && for f in .gpudeps/*.deb; do dpkg -x "$f" .gpudeps/root; done; }
  DEPS=(-DK3_DEPS_ROOT="$PWD/.gpudeps/root")
  export LD_LIBRARY_PATH="$PWD/.gpudeps/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
build() {  # build(SRC, DIR)
  cmake -S "$1" -B "$2" -DCMAKE_BUILD_TYPE=Release -DK3_BUILD_TESTS=OFF -DK3_BUILD_BENCH=ON "${DEPS[@]}" >/dev/null \
    && cmake --build "$2" -j"$(nproc)" --target k3 bench_cuda_model 2>&1 | grep -E "error|Error"
  test -x "$2/bench_cuda_model" || { echo "build of $1 failed" >&2; exit 1; }
}
build "$BASE" build-gpu-base
build . build-gpu
for m in k3-small k3-1b; do
  [ -f "models/$m/config.json" ] || ./build-gpu/k3 init --config "configs/$m.json" --out "models/$m" --seed 1 >/dev/null
done
for round in 1 2; do
  for side in base new; do
    dir=build-gpu; [ $side = base ] && dir=build-gpu-base
    echo "== round $round: $side ($dir/bench_cuda_model)"
    ./$dir/bench_cuda_model --model models/k3-small --model models/k3-1b --cpu-tokens 0 "$@"
  done
done
