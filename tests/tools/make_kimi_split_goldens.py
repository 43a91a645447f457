"""Builds tests/fixtures/tokenizer/kimi_split.json: where Kimi's tokenizer cuts long inputs before
BPE (runs of more than N consecutive whitespace / non-whitespace characters, by Python's
str.isspace). The cuts come from the reference function itself, read out of Moonshot's
tokenization_kimi.py (not part of this repository: fetch it into the ignored third_party_ref/) and
run alone, so neither tiktoken nor transformers is needed.

    python3 tests/tools/make_kimi_split_goldens.py third_party_ref/kimi_k3/tokenization_kimi.py

Each case is a text given as runs [[string, repeat], ...], the run limit, and the lengths (in code
points) of the parts the reference yields.
"""
import ast
import json
import sys

tree = ast.parse(open(sys.argv[1]).read())
fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_split_whitespaces_or_nonwhitespaces")
fn.decorator_list = []
from typing import Iterator
ns = {"Iterator": Iterator}
exec(compile(ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[])), sys.argv[1], "exec"), ns)
split = ns["_split_whitespaces_or_nonwhitespaces"]

SPACES = "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2005\u200a\u2028\u2029\u202f\u205f\u3000"
NOT_SPACES = "a\u200b\u180e\ufeff中é👍\x00\x7f"
cases = [
    {"runs": [["a", 30000]], "max_run": 25000},
    {"runs": [[" ", 25000]], "max_run": 25000},
    {"runs": [[" ", 25001]], "max_run": 25000},
    {"runs": [["ab", 20000], [" ", 3], ["中", 60000], ["\n", 50001], ["x", 1]], "max_run": 25000},
    {"runs": [[SPACES, 3]], "max_run": 5},
    {"runs": [[NOT_SPACES, 4]], "max_run": 5},
    {"runs": [["a b  c   d    e     f      g", 3]], "max_run": 3},
    {"runs": [["\u3000", 7], ["\u200b", 7], ["\x85", 2], ["x", 12]], "max_run": 4},
    {"runs": [["", 1]], "max_run": 5},
]
for c in cases:
    text = "".join(s * n for s, n in c["runs"])
    parts = list(split(text, c["max_run"]))
    assert "".join(parts) == text
    c["part_lengths"] = [len(p) for p in parts]
json.dump({"note": "Cuts of Kimi's _split_whitespaces_or_nonwhitespaces (tokenization_kimi.py); made by "
                   "tests/tools/make_kimi_split_goldens.py.", "cases": cases},
          open("tests/fixtures/tokenizer/kimi_split.json", "w"), ensure_ascii=False, indent=1)
print(len(cases), "cases:", [c["part_lengths"][:6] for c in cases])
