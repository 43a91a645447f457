"""Tiny safetensors reader/writer (numpy)."""
import json, struct
import numpy as np

_DT = {"F32": np.float32, "F64": np.float64, "I64": np.int64, "U8": np.uint8, "I32": np.int32, "F16": np.float16}


def load(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    base = 8 + n
    out = {}
    for k, m in h.items():
        if k == "__metadata__":
            continue
        s, e = m["data_offsets"]
        raw = b[base + s: base + e]
        if m["dtype"] == "BF16":
            a = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            a = np.frombuffer(raw, _DT[m["dtype"]])
        out[k] = a.reshape(m["shape"]).copy()
    return out


def save(path, tensors):
    h, off, blobs = {}, 0, []
    for k, a in tensors.items():
        a = np.ascontiguousarray(a)
        dt = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.int64): "I64",
              np.dtype(np.uint8): "U8"}[a.dtype]
        raw = a.tobytes()
        h[k] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    hj = json.dumps(h).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for r in blobs:
            f.write(r)
