// The reference side of bench/compare_tokenizer.sh: encode throughput of npm `tiktoken` (the
// WebAssembly build of OpenAI's tiktoken) with the same ranks, pattern, text and repetitions as
// bench/bench_tokenizer.cpp, and a check that its ids equal ours.
//
//   node bench/tiktoken_encode_bench.mjs --text FILE [--ranks tests/fixtures/tokenizer/o200k.tiktoken]
//        [--reps 5] [--ids ours.bin]
//
// Ranks: our rank file (`<base64> <rank>` per line), turned into tiktoken/lite's format, so both
// sides load the same bytes. Pattern: tests/tools/k3_pattern.mjs, the one the goldens were made with
// (test_tokenizer checks that goldens.json's pattern is kK3Pattern character for character).
// Timed: `encode_ordinary(text)` on the whole text as a JS string (the UTF-8 transfer into WASM
// included: it is part of what a caller pays); one untimed warm-up, then --reps runs; median, min
// and max wall time, and the median process CPU time. With --ids (little-endian int32, as
// bench_tokenizer --ids-out writes them) every id is compared and the first difference reported;
// exit status 2 on a mismatch. The last line, `RESULT impl=tiktoken ...`, is what
// compare_tokenizer.sh reads; fnv1a is FNV-1a 32 over the ids as little-endian uint32, as in
// bench_tokenizer.
//
// tiktoken is looked up under $TIKTOKEN_DIR, tests/tools and bench (each: a directory whose
// node_modules holds tiktoken); install it with `cd tests/tools && npm install tiktoken@1`.
import { createRequire } from "module";
import { fileURLToPath } from "url";
import path from "path";
import fs from "fs";
import { performance } from "perf_hooks";
import { K3_PATTERN } from "../tests/tools/k3_pattern.mjs";

const here = path.dirname(fileURLToPath(import.meta.url));
const repo = path.resolve(here, "..");

function parseArgs(argv) {
  const a = { ranks: path.join(repo, "tests/fixtures/tokenizer/o200k.tiktoken"), reps: 5, text: null, ids: null };
  for (let i = 0; i < argv.length; ++i) {
    const k = argv[i], v = argv[i + 1];
    if (k === "--text") a.text = v, ++i;
    else if (k === "--ranks") a.ranks = v, ++i;
    else if (k === "--reps") a.reps = parseInt(v, 10), ++i;
    else if (k === "--ids") a.ids = v, ++i;
    else throw new Error(`unknown argument '${k}'`);
  }
  if (!a.text) throw new Error("--text FILE is required");
  if (!(a.reps >= 1)) throw new Error(`--reps must be >= 1, got ${a.reps}`);
  return a;
}

function loadTiktoken() {
  const dirs = [process.env.TIKTOKEN_DIR, path.join(repo, "tests/tools"), here].filter(Boolean);
  const require = createRequire(import.meta.url);
  for (const d of dirs) {
    try {
      const main = require.resolve("tiktoken/lite", { paths: [d] });
      const pkg = JSON.parse(fs.readFileSync(path.join(path.dirname(main), "..", "package.json"), "utf8"));
      return { ...require(main), version: pkg.version };
    } catch (e) {
      if (e.code !== "MODULE_NOT_FOUND") throw e;
    }
  }
  throw new Error(`npm tiktoken not found under ${dirs.join(", ")}: cd tests/tools && npm install tiktoken@1 ` +
                  "(or set TIKTOKEN_DIR to a directory whose node_modules holds it)");
}

// Our rank file -> tiktoken/lite's bpe_ranks: "<label> <first rank> <base64> <base64> ..." with
// consecutive ranks from the first.
function liteRanks(file) {
  const toks = [];
  for (const line of fs.readFileSync(file, "utf8").split("\n")) {
    if (!line) continue;
    const [b64, r] = line.split(" ");
    if (parseInt(r, 10) !== toks.length) throw new Error(`${file}: ranks must be consecutive from 0 (line ${toks.length + 1})`);
    toks.push(b64);
  }
  return { text: `! 0 ${toks.join(" ")}`, count: toks.length };
}

function fnv1a(ids) {
  let h = 0x811c9dc5;
  for (const id of ids)
    for (let k = 0; k < 4; ++k) {
      h ^= (id >>> (8 * k)) & 0xff;
      h = Math.imul(h, 16777619) >>> 0;
    }
  return h >>> 0;
}

const args = parseArgs(process.argv.slice(2));
const { Tiktoken, version } = loadTiktoken();
const bytes = fs.readFileSync(args.text);
const text = bytes.toString("utf8");
if (Buffer.byteLength(text, "utf8") !== bytes.length)
  throw new Error(`${args.text} is not valid UTF-8: a JS string cannot carry its bytes, so the ids could not match`);
const ranks = liteRanks(args.ranks);
const enc = new Tiktoken(ranks.text, {}, K3_PATTERN);
console.log(`npm tiktoken ${version} benchmark: ${args.text}, ${bytes.length} bytes, ranks ${args.ranks} (${ranks.count}), ` +
            `K3 pattern, 1 thread, ${args.reps} reps`);

let ids = enc.encode_ordinary(text);  // warm-up
const times = [], cpu = [];
for (let r = 0; r < args.reps; ++r) {
  const c0 = process.cpuUsage();
  const t0 = performance.now();
  ids = enc.encode_ordinary(text);
  times.push((performance.now() - t0) / 1e3);
  const c = process.cpuUsage(c0);
  cpu.push((c.user + c.system) / 1e6);
}
enc.free();
times.sort((x, y) => x - y);
const n = times.length;
const medianOf = (v) => (v.length % 2 ? v[(v.length - 1) / 2] : 0.5 * (v[v.length / 2 - 1] + v[v.length / 2]));
const median = medianOf(times);
const cpuMedian = medianOf(cpu.sort((x, y) => x - y));
const hash = fnv1a(ids).toString(16).padStart(8, "0");
console.log(`${"encode".padEnd(12)} ${median.toFixed(3).padStart(9)} s  ${(bytes.length / median / 1e6).toFixed(2).padStart(8)} MB/s  ` +
            `${(ids.length / median).toFixed(0).padStart(10)} tokens/s   (min ${times[0].toFixed(3)} s, max ${times[n - 1].toFixed(3)} s; cpu ${cpuMedian.toFixed(3)} s)`);
console.log(`${ids.length} tokens, fnv1a 0x${hash}`);

let status = 0;
if (args.ids) {
  const buf = fs.readFileSync(args.ids);
  const ours = new Int32Array(buf.buffer, buf.byteOffset, buf.length / 4);
  let first = -1;
  const m = Math.min(ours.length, ids.length);
  for (let i = 0; i < m && first < 0; ++i) if (ours[i] !== ids[i]) first = i;
  if (first < 0 && ours.length !== ids.length) first = m;
  if (first < 0) {
    console.log(`ids: identical to ${args.ids} (${ids.length} ids)`);
  } else {
    console.log(`ids: DIFFER from ${args.ids} at index ${first}: ours ${ours[first]}, tiktoken ${ids[first]} ` +
                `(${ours.length} vs ${ids.length} ids)`);
    status = 2;
  }
}
console.log(`RESULT impl=tiktoken bytes=${bytes.length} tokens=${ids.length} fnv1a=${hash} median_s=${median.toFixed(6)} ` +
            `min_s=${times[0].toFixed(6)} max_s=${times[n - 1].toFixed(6)} cpu_s=${cpuMedian.toFixed(6)} reps=${args.reps} version=${version}`);
process.exit(status);
