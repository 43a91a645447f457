#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/fuzz_*.cpp) in build-fuzz with clang + ASan + UBSan, then runs
# each for SECONDS (default 600), one after the other, and prints one summary line per target.
#
#   scripts/fuzz.sh [SECONDS]
#
# Per target NAME: the corpus grows in build-fuzz/corpus/NAME (kept between runs, so later runs start
# from what earlier ones found), seeded by build-fuzz/seeds/NAME (written here: inputs that nest JSON
# 20,000 levels deep, which once overflowed the stack), fuzz/NAME.dict is used when present, inputs
# grow up to FUZZ_MAX_LEN bytes (default 262144, enough to reach that depth), crash/timeout/OOM inputs land in
# build-fuzz/artifacts/NAME/ and the full libFuzzer log in build-fuzz/NAME.log. Replay a crash with
# `build-fuzz/NAME build-fuzz/artifacts/NAME/crash-...`. A target stops at its first crash; the
# script exits non-zero when any target found one. FUZZ_TARGETS="fuzz_encode ..." runs only those;
# FUZZ_JOBS (default 2) sets the build's -j.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-600}
build="build-fuzz"
[[ "$secs" =~ ^[0-9]+$ ]] || { echo "error: SECONDS must be a whole number, got '$secs'" >&2; exit 1; }
command -v clang++ >/dev/null || { echo "error: clang++ not found (apt-get install clang libclang-rt-dev libomp-dev)" >&2; exit 1; }

CC=clang CXX=clang++ cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DK3_BUILD_FUZZ=ON \
  -DK3_BUILD_TESTS=OFF -DK3_BUILD_BENCH=OFF >/dev/null
targets=${FUZZ_TARGETS:-$(for f in fuzz/fuzz_*.cpp; do basename "$f" .cpp; done)}
for name in $targets; do
  [ -f "fuzz/$name.cpp" ] || { echo "error: no fuzz/$name.cpp" >&2; exit 1; }
done
# shellcheck disable=SC2086
cmake --build "$build" -j"${FUZZ_JOBS:-2}" --target $targets >"$build/build.log" 2>&1 ||
  { tail -20 "$build/build.log"; echo "error: build failed (full log: $build/build.log)" >&2; exit 1; }

# "stat::number_of_executed_units: 123" -> 123 (from libFuzzer's -print_final_stats=1 block)
final_stat() { sed -n "s/^stat::$1: *//p" "$2" | tail -1; }

# Seeds that reach the depth bound (core/json.h): a request whose tool schema, and one whose message
# content, nests 20,000 levels; generated text whose tool-call argument does. The first byte picks the
# fuzzer's mode (fuzz_chat_parse.cpp).
seeds=$build/seeds/fuzz_chat_parse
mkdir -p "$seeds" "$build/seeds/fuzz_encode"
python3 - "$seeds" <<'PY'
import sys, os
d, D = sys.argv[1], 20000
deep = "[" * D + "]" * D
req_tools = '{"tools":[{"type":"function","function":{"name":"f","parameters":{"x":' + deep + '}}}],"messages":[{"role":"user","content":"x"}]}'
req_content = '{"messages":[{"role":"user","content":' + deep + '}]}'
gen = ('<|open|>response<|sep|>ok<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
       '<|open|>argument key="x" type="array"<|sep|>' + deep + '<|close|>argument<|sep|><|close|>call<|sep|>'
       '<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')
for name, mode, text in [("deep_tools", b"\x06", req_tools), ("deep_content", b"\x06", req_content),
                         ("deep_generated_args", b"\x01", gen)]:
    with open(os.path.join(d, name), "wb") as f:
        f.write(mode + text.encode())
PY

# The image decoder starts from the fixture's PNGs and JPEGs.
mkdir -p "$build/seeds/fuzz_image_decode"
cp tests/fixtures/image-decode/*.png tests/fixtures/image-decode/*.jpg "$build/seeds/fuzz_image_decode/"

failed=0
summary=()
for name in $targets; do
  corpus=$build/corpus/$name
  artifacts=$build/artifacts/$name
  log=$build/$name.log
  mkdir -p "$corpus" "$artifacts"
  args=("$corpus" "$build/seeds/$name" -max_total_time="$secs" -max_len="${FUZZ_MAX_LEN:-262144}" -print_final_stats=1
        -artifact_prefix="$artifacts/")
  [ -f "fuzz/$name.dict" ] && args+=(-dict="fuzz/$name.dict")
  echo "== $name: ${secs}s, corpus $corpus ($(find "$corpus" -type f | wc -l) inputs), log $log"
  start=$(date +%s)
  rc=0
  "$build/$name" "${args[@]}" >"$log" 2>&1 || rc=$?
  elapsed=$(($(date +%s) - start))
  grep -E '^#[0-9]+[[:space:]]+DONE|^Done [0-9]+ runs|^==[0-9]+==ERROR|^SUMMARY|^fuzz_[a-z_]+: ' "$log" | tail -5 || true
  crashes=$(find "$artifacts" -newermt "@$start" -type f \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) | wc -l)
  [ "$rc" -ne 0 ] && [ "$crashes" -eq 0 ] && crashes="? (exit $rc, see $log)"
  [ "$rc" -ne 0 ] && failed=1
  summary+=("$(printf '%-20s execs %-10s time %4ss  exec/s %-7s corpus files %-6s crashes %s' "$name" \
    "$(final_stat number_of_executed_units "$log")" "$elapsed" "$(final_stat average_exec_per_sec "$log")" \
    "$(find "$corpus" -type f | wc -l)" "$crashes")")
done
echo
printf '%s\n' "${summary[@]}"
exit "$failed"
