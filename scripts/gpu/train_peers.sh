#!/usr/bin/env bash
# k3cpp's GPU trainer beside PyTorch running Moonshot's own modeling code, in one run on one GPU:
# bench_cuda_train with Per-Head Muon (what `k3 train` runs) and with AdamW only (what the PyTorch
# peer runs), then scripts/gpu/bench_torch_train.py on the same config and batches.
# Usage: bash scripts/gpu/train_peers.sh [CONFIG] [RUN ...]   (default configs/k3-shaped-h200.json
# 8192:2048; RUN as bench_cuda_train's --run). Runs $BENCH (default build-gpu/bench_cuda_train, which
# scripts/gpu/run_all.sh builds). Needs REF_SRC (llm-compressor at bcbda0bf, default
# third_party_ref/llm-compressor) and FLA_SRC (fla's source, default third_party_ref/fla_src) carried
# to the machine. PyTorch's first step of each new batch shape compiles and tunes fla's Triton kernels
# (about 5 minutes for the K3-shaped config), so give it the time. Writes $OUT/train_peers.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
CONFIG=${1:-configs/k3-shaped-h200.json}
shift || true
RUNS=("$@")
[ ${#RUNS[@]} -gt 0 ] || RUNS=(8192:2048)
LOGDIR=${OUT:-out/gpu}
mkdir -p "$LOGDIR"
exec > >(tee "$LOGDIR/train_peers.log") 2>&1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ARGS=()
for r in "${RUNS[@]}"; do ARGS+=(--run "$r"); done
FAILED=0
for opt in muon adamw; do
  echo "== k3cpp, --optimizer $opt"
  "${BENCH:-build-gpu/bench_cuda_train}" --config "$CONFIG" --steps 2 --optimizer "$opt" "${ARGS[@]}" || FAILED=1
done
echo "== PyTorch: Moonshot's KimiLinearForCausalLM + fla, AdamW"
python3 scripts/gpu/bench_torch_train.py --config "$CONFIG" --steps 2 "${ARGS[@]}" || FAILED=1
exit $FAILED
