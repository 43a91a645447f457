// Token ids for the XTML chat goldens, from the reference tokenizer: the npm package `tiktoken`
// (WebAssembly build of OpenAI's tiktoken, which Kimi's tokenizer wraps) with the o200k_base ranks,
// Kimi K3's pre-tokenizer pattern, and the 256 K3 special tokens placed after the ranks. Each
// segment is encoded on its own (specials allowed only in control segments), as Kimi's
// _encode_chat_segments does, and the ids concatenated.
//
//   cd tests/tools && npm install tiktoken@1 && node add_xtml_ids.mjs
//
// Reads ../fixtures/xtml/moonshot_goldens.json (a copy of ../shared/fixtures/xtml-chat/goldens.json) and ../fixtures/xtml/goldens.json; writes
// ../fixtures/xtml/ids.json ({"<file>:<case>": [ids]}).
import { Tiktoken } from "tiktoken/lite";
import { createRequire } from "module";
import fs from "fs";
import { K3_PATTERN } from "./k3_pattern.mjs";

const require = createRequire(import.meta.url);
const o200k = require("tiktoken/encoders/o200k_base.json");

let numRanks = 0;
for (const line of o200k.bpe_ranks.split("\n")) {
  if (!line) continue;
  const [, offset, ...toks] = line.split(" ");
  numRanks = Math.max(numRanks, parseInt(offset, 10) + toks.length);
}
// The K3 table (K3-ARCHITECTURE.md §9): offsets from the first special id.
const named = { 0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
  6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]", 18: "<|media_begin|>", 19: "<|media_content|>",
  20: "<|media_end|>", 21: "<|media_pad|>", 65: "<osagent_mode>", 254: "[UNK]", 255: "[PAD]" };
const specials = {};
for (let off = 0; off < 256; ++off) specials[named[off] ?? `<|reserved_token_${numRanks + off}|>`] = numRanks + off;

const enc = new Tiktoken(o200k.bpe_ranks, specials, K3_PATTERN);
const out = { note: `o200k_base ranks (${numRanks}) + K3 specials from ${numRanks}; made by tests/tools/add_xtml_ids.mjs`,
  num_ranks: numRanks, ids: {} };
for (const [tag, path] of [["shared", "../fixtures/xtml/moonshot_goldens.json"], ["extra", "../fixtures/xtml/goldens.json"]]) {
  const g = JSON.parse(fs.readFileSync(path, "utf8"));
  for (const [name, c] of Object.entries(g.cases)) {
    const ids = [];
    for (const s of c.segments) ids.push(...(s.special ? enc.encode(s.text, "all") : enc.encode_ordinary(s.text)));
    out.ids[`${tag}:${name}`] = ids;
  }
}
fs.writeFileSync("../fixtures/xtml/ids.json", JSON.stringify(out) + "\n");
console.log(Object.keys(out.ids).length, "cases,", numRanks, "ranks");
