#!/usr/bin/env bash
# Encode throughput of our BPE tokenizer against the reference (npm tiktoken, WASM build of OpenAI's
# tiktoken) on the same text, ranks (tests/fixtures/tokenizer/o200k.tiktoken) and K3 pattern, one
# thread each, and a check that both give the same ids. Prints a table and the ratio ours / tiktoken.
#
#   bench/compare_tokenizer.sh [TEXT_FILE]        (REPS=5 and BUILD_DIR=build-bench by default)
#
# When TEXT_FILE does not exist it is made, deterministically: the vim documentation
# (/usr/share/vim/vim90/doc/*.txt, Debian package vim-runtime; English, 9.5 MB) concatenated in byte
# order of the file names, cut to its first 4 MiB and then back to a UTF-8 character boundary.
# TEXT_FILE defaults to $BUILD_DIR/vimdoc-4MiB.txt. Needs node and the tiktoken npm package
# (`cd tests/tools && npm install tiktoken@1`, or TIKTOKEN_DIR=dir whose node_modules holds it).
# bench_tokenizer is built in $BUILD_DIR when it is missing there.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-bench}
REPS=${REPS:-5}
TEXT=${1:-$BUILD_DIR/vimdoc-4MiB.txt}
VIMDOC=/usr/share/vim/vim90/doc
BYTES=$((4 * 1024 * 1024))

if [ ! -f "$TEXT" ]; then
  [ -d "$VIMDOC" ] || { echo "error: $VIMDOC missing (apt-get install vim-runtime), or pass a TEXT_FILE" >&2; exit 1; }
  mkdir -p "$(dirname "$TEXT")"
  files=$(printf '%s\n' "$VIMDOC"/*.txt | LC_ALL=C sort)
  # shellcheck disable=SC2086
  { cat $files || true; } | head -c "$BYTES" | node -e '
    const b = require("fs").readFileSync(0);
    let n = b.length;
    let i = n - 1;
    while (i > 0 && (b[i] & 0xc0) === 0x80) --i;  // start of the last character
    if (i >= 0 && b[i] >= 0x80) {                 // keep it only if all of its bytes are there
      const need = b[i] >= 0xf0 ? 4 : b[i] >= 0xe0 ? 3 : 2;
      if (n - i < need) n = i;
    }
    process.stdout.write(b.subarray(0, n));' > "$TEXT.tmp"
  mv "$TEXT.tmp" "$TEXT"
  echo "made $TEXT from $(echo "$files" | wc -l) files of $VIMDOC ($(dpkg-query -W -f '${Package} ${Version}' vim-runtime 2>/dev/null || echo 'vim-runtime'))"
fi

if [ ! -x "$BUILD_DIR/bench_tokenizer" ]; then
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DK3_BUILD_BENCH=ON >/dev/null
  cmake --build "$BUILD_DIR" --target bench_tokenizer -j2 >/dev/null
fi

echo "text: $TEXT, $(wc -c <"$TEXT") bytes, sha256 $(sha256sum "$TEXT" | cut -c1-16)..., $REPS reps"
ids=$(mktemp --suffix=.k3ids)
trap 'rm -f "$ids"' EXIT
ours=$("$BUILD_DIR/bench_tokenizer" --text "$TEXT" --reps "$REPS" --ids-out "$ids")
echo "$ours" | sed 's/^/  k3cpp | /'
status=0
ref=$(node bench/tiktoken_encode_bench.mjs --text "$TEXT" --reps "$REPS" --ids "$ids") || status=$?
echo "$ref" | sed 's/^/  tiktoken | /'
[ "$status" -eq 0 ] || [ "$status" -eq 2 ] || { echo "error: tiktoken bench failed ($status)" >&2; exit "$status"; }

field() { echo "$1" | grep '^RESULT' | tr ' ' '\n' | sed -n "s/^$2=//p"; }
echo
printf '| %-22s | %9s | %8s | %11s | %9s | %8s |\n' encoder "median s" "MB/s" "tokens/s" tokens fnv1a
printf '|%s|%s|%s|%s|%s|%s|\n' ------------------------ ----------- ---------- ------------- ----------- ----------
for r in "k3cpp BpeTokenizer|$ours" "npm tiktoken $(field "$ref" version)|$ref"; do
  name=${r%%|*}
  out=${r#*|}
  awk -v n="$name" -v b="$(field "$out" bytes)" -v s="$(field "$out" median_s)" -v t="$(field "$out" tokens)" \
      -v h="$(field "$out" fnv1a)" 'BEGIN { printf "| %-22s | %9.3f | %8.2f | %11.0f | %9d | %8s |\n", n, s, b / s / 1e6, t / s, t, h }'
done
awk -v a="$(field "$ref" median_s)" -v b="$(field "$ours" median_s)" 'BEGIN { printf "\nratio ours / tiktoken (throughput): %.2fx\n", a / b }'
if [ "$status" -eq 0 ]; then echo "ids: identical"; else echo "ids: DIFFER (see above)"; fi
exit "$status"
