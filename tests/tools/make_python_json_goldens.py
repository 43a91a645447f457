"""Builds tests/fixtures/tokenizer/python_json.json: how Python's json.dumps(ensure_ascii=False)
spells values, which Kimi's XTML encoder embeds in prompts (k3::python_json_dumps must match).

    python3 tests/tools/make_python_json_goldens.py

floats: [hex of the IEEE bits, repr]; documents: [JSON text as parsed, dumps compact, dumps default].
"""
import json
import random
import struct

rng = random.Random(7)
vals = [0.1, 0.5, 1.0, 2.5, 100.0, 1e15, 1e16, 1e17, 9999999999999998.0, 1234567890123456.7, 0.0001, 0.00012,
        1e-5, 1.5e-7, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 123456789.125, -0.0, -1.25e-10,
        3.141592653589793, 1e22, 1e21, 1e-4, 9.999999999999999e-5, 0.30000000000000004, 4.35, 1e100]
for _ in range(1500):
    vals.append(struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0])
for _ in range(500):
    vals.append(rng.uniform(-1, 1) * 10 ** rng.randint(-8, 20))
for _ in range(200):
    vals.append(float(rng.randint(-10**17, 10**17)))
floats = [[struct.pack(">d", v).hex(), repr(v)] for v in vals if v == v and abs(v) != float("inf")]

docs = [
    {"b": 1, "a": [1, 2.0, -3.5e-9, True, False, None, "x"], "c": {"nested": {"k": "v"}}},
    ["tab\t nl\n cr\r bs\b ff\f quote\" back\\ ctrl\u0001\u001f del\u007f", "ünï 中 👍", "slash/ <|open|>", ""],
    {"": {}, "e": [], "big": 12345678901234567890, "neg": -9223372036854775808},
    1e16, 0.1, "just a string", None, True, [[[]]], {"z": {"y": {"x": [1e-7, 1e300]}}},
]
documents = []
for d in docs:
    text = json.dumps(d, ensure_ascii=False)
    documents.append([text, json.dumps(d, ensure_ascii=False, separators=(",", ":")), json.dumps(d, ensure_ascii=False)])
# bytes.decode("utf-8", "replace"): [input hex, output hex]; biased towards lead bytes and cut sequences.
alphabet = [0x41, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc1, 0xc2, 0xdf, 0xe0, 0xe1, 0xed, 0xef, 0xf0, 0xf4,
             0xf5, 0xff, 0xe4, 0xb8, 0xad]
utf8 = []
for _ in range(3000):
    b = bytes(rng.choice(alphabet) if rng.random() < 0.8 else rng.getrandbits(8) for _ in range(rng.randint(0, 12)))
    utf8.append([b.hex(), b.decode("utf-8", "replace").encode("utf-8").hex()])
json.dump({"note": "Python json.dumps / repr / decode('utf-8', 'replace'); made by tests/tools/make_python_json_goldens.py",
           "floats": floats, "documents": documents, "utf8_replace": utf8}, open("tests/fixtures/tokenizer/python_json.json", "w"),
          ensure_ascii=False, indent=0)
print(len(floats), "floats,", len(documents), "documents")
