// Builds the tokenizer goldens with the reference implementation: the npm package `tiktoken`
// (the WebAssembly build of OpenAI's tiktoken, which Kimi's tokenizer wraps), given the o200k_base
// ranks it ships and Kimi K3's pre-tokenizer pattern (K3-ARCHITECTURE.md §9).
//
//   cd tests/tools && npm install tiktoken@1 && node make_tokenizer_goldens.mjs
//
// Writes ../fixtures/tokenizer/o200k.tiktoken (rank file, `<base64> <rank>` per line) and
// ../fixtures/tokenizer/goldens.json ({pattern, cases: [{text, ids}]}).
import { Tiktoken } from "tiktoken/lite";
import { createRequire } from "module";
import fs from "fs";
import { K3_PATTERN } from "./k3_pattern.mjs";

const require = createRequire(import.meta.url);
const o200k = require("tiktoken/encoders/o200k_base.json");


// The lite rank format: each line is "<label> <first rank> <base64> <base64> ..." with consecutive ranks.
const lines = [];
for (const line of o200k.bpe_ranks.split("\n")) {
  if (!line) continue;
  const [, offset, ...toks] = line.split(" ");
  let r = parseInt(offset, 10);
  for (const t of toks) lines.push(`${t} ${r++}`);
}
fs.mkdirSync("../fixtures/tokenizer", { recursive: true });
fs.writeFileSync("../fixtures/tokenizer/o200k.tiktoken", lines.join("\n") + "\n");

const enc = new Tiktoken(o200k.bpe_ranks, {}, K3_PATTERN);
const texts = [
  "Hello world", "The capital of France is", "你好世界", "我喜欢机器学习。深度学习很有趣！",
  "日本語のテキストとカタカナ、ひらがな。", "한국어 텍스트도 있습니다.", "Ελληνικά και Русский текст",
  "Mixed 中文 and English 混合 text123", "café naïve résumé coöperate", "e\u0301 a\u0300 combining marks",
  "👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵 emoji", "I'm, you're, he's, we'll, they'd, I've", "I'M YOU'RE HE'S WE'LL THEY'D I'VE",
  "don't DON'T Don'T", "  leading and trailing spaces  ", "tabs\tand\ttabs\t\t", "line1\r\nline2\r\n\r\nline3\n\n\n",
  "   \n   \n", "12345678901234567890", "3.14159 2,718 1e-9 0x1F", "x = foo(bar[0], {\"k\": 'v'}); // comment",
  "def f(x):\n    return x**2  # square\n", "<|open|>message role=\"user\"<|sep|>hi<|close|>", "[BOS] [EOS] <|end_of_msg|>",
  "https://example.com/path?q=1&r=2#frag", "SHOUTING WORDS and lowercase and MiXeD CaSe",
  "ŁÓDŹ łódź ÆØÅ æøå ß ẞ", "a\u00a0b\u2003c\u3000d", "----====____****", "...!!!???", "",
  "αβγ ΔΕΖ ηθι", "Ǆǅǆ titlecase Ǳǲǳ", "ǅungla ǈudi", "ーカタカナー長音", "中文，标点。「引号」",
];
// Random strings over a mix of scripts, marks, digits, whitespace and punctuation (seeded, so the
// goldens are reproducible): they probe the pattern's character classes far beyond the list above.
let seed = 12345;
const rnd = (n) => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed % n; };
const pools = [
  " ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "'", "'s", "'LL", ".", ",", "!", "?", "-", "_", "(", ")", "{", "}",
  "0", "7", "42", "9999", "²", "٣", "Ⅻ", "a", "Z", "é", "ß", "ǅ", "ʰ", "\u0301", "\u0308", "ا", "ب", "ש", "अ", "ि", "ก", "ั",
  "中", "国", "〇", "々", "あ", "ア", "ー", "한", "🙂", "👍🏽", "‍", "️", "🇯", "🇵", "€", "∑", "→", "\u200b", "\u2028",
];
for (let i = 0; i < 200; ++i) {
  let t = "";
  const len = 1 + rnd(24);
  for (let k = 0; k < len; ++k) t += pools[rnd(pools.length)];
  texts.push(t);
}
const cases = texts.map((text) => ({ text, ids: Array.from(enc.encode_ordinary(text)) }));
fs.writeFileSync("../fixtures/tokenizer/goldens.json", JSON.stringify({ pattern: K3_PATTERN, cases }, null, 1) + "\n");
enc.free();
console.log(`wrote ${lines.length} ranks and ${cases.length} cases`);
