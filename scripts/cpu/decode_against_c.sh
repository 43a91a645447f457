#!/usr/bin/env bash
# k3cpp's CPU decode against the C engine kimi-k3-in-c, side by side on one thread, on the same MXFP4 model
# (k3-tiny-a's, ../shared/fixtures). Its source is not ours and is never committed: pass a checkout of it.
#
#   scripts/cpu/decode_against_c.sh PEER_DIR [K3_BINARY] [TOKENS] [RUNS]
#
# Builds the peer with its own Makefile, gives it the model with each A_log padded to the KDA head dim (its
# loader reads a head-dim array and keeps the front), checks that both greedy decodes give the same ids, then
# alternates RUNS decodes of TOKENS tokens each and prints the decode rates (tokens after the first, prefill
# excluded; the peer's from its per-step table) and their ratio.
set -euo pipefail
peer=${1:?usage: decode_against_c.sh PEER_DIR [K3_BINARY] [TOKENS] [RUNS]}
k3=${2:-build/k3}
tokens=${3:-256}
runs=${4:-3}
root="$(cd "$(dirname "$0")/../.." && pwd)"
fixture="$root/../shared/fixtures/k3-tiny-a"
ids=768,5,6,7,8
[ -x "$k3" ] || { echo "error: no k3 binary at $k3 (build first, or pass its path)" >&2; exit 1; }
[ -f "$fixture/model-mxfp4.safetensors" ] || { echo "error: $fixture/model-mxfp4.safetensors not found" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "building the peer in $peer ..." >&2
make -C "$peer" -j"$(nproc)" >"$work/peer-build.log" 2>&1 || { tail -20 "$work/peer-build.log" >&2; exit 1; }
mkdir -p "$work/ours" "$work/peer"
cp "$fixture/config-mxfp4.json" "$work/ours/config.json"
cp "$fixture/model-mxfp4.safetensors" "$work/ours/model.safetensors"
cp "$fixture/config-mxfp4.json" "$work/peer/config.json"
head_dim=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['text_config']['linear_attn_config']['head_dim'])" \
  "$fixture/config-mxfp4.json")
python3 - "$fixture/model-mxfp4.safetensors" "$work/peer/model.safetensors" "$head_dim" <<'PY'
import json, struct, sys
src, dst, head_dim = sys.argv[1], sys.argv[2], int(sys.argv[3])
b = open(src, 'rb').read()
n = struct.unpack('<Q', b[:8])[0]
header = json.loads(b[8:8 + n])
meta = header.pop('__metadata__', None)
out, blobs, off = {}, [], 0
for name, t in sorted(header.items(), key=lambda kv: kv[1]['data_offsets'][0]):
    s, e = t['data_offsets']
    data = b[8 + n + s:8 + n + e]
    if name.endswith('A_log'):
        data += b'\0' * (4 * head_dim - len(data))
        t = dict(t, shape=[head_dim])
    out[name] = dict(t, data_offsets=[off, off + len(data)])
    blobs.append(data)
    off += len(data)
if meta is not None:
    out['__metadata__'] = meta
h = json.dumps(out).encode()
h += b' ' * (-len(h) % 8)
with open(dst, 'wb') as f:
    f.write(struct.pack('<Q', len(h)) + h + b''.join(blobs))
PY

ours_once() {
  OMP_NUM_THREADS=1 "$k3" generate --model "$work/ours" --ids "$ids" --max-new-tokens "$tokens" >"$work/ours.out" 2>&1
}
peer_once() {
  (cd "$work" && OMP_NUM_THREADS=1 "$peer/bin/k3" "$work/peer" --ids "$ids" --gen "$tokens" --incremental --threads 1 \
     --cache-gb 0.1 --out "$work/peer.json" >"$work/peer.out" 2>&1)
}
ours_once
peer_once
python3 - "$work/ours.out" "$work/peer.json" <<'PY'
import json, sys
ours = [l for l in open(sys.argv[1]).read().split('\n') if l.startswith('ids: ')][-1].split()[1:]
peer = [str(i) for i in json.load(open(sys.argv[2]))['generated_ids']]
if ours != peer:
    sys.exit(f"error: the greedy decodes differ (k3cpp {' '.join(ours[:8])} ..., peer {' '.join(peer[:8])} ...)")
print(f"same greedy ids from both ({len(ours)} tokens)")
PY
printf '%-6s %14s %14s %8s\n' run "k3cpp tok/s" "peer tok/s" ratio
for r in $(seq 1 "$runs"); do
  ours_once
  o=$(grep -oE 'decode [0-9.]+ s \([0-9.]+ tok/s' "$work/ours.out" | grep -oE '[0-9.]+ tok/s' | grep -oE '^[0-9.]+')
  peer_once
  p=$(awk '/^----/{f++} f==1 && $1 ~ /^[0-9]+$/ && NF>=6 && $1>0 {n++; t+=1/$NF} END{printf "%.1f", n/t}' "$work/peer.out")
  printf '%-6s %14s %14s %7.2fx\n' "$r" "$o" "$p" "$(python3 -c "print($o/$p)")"
done
