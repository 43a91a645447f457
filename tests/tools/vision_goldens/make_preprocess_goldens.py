#!/usr/bin/python3
"""Golden pixel values of Moonshot's image processor (KimiK3VisionProcessor.preprocess) on synthetic 8-bit images,
for tests/fixtures/vision-preprocess.

  /usr/bin/python3 tests/tools/vision_goldens/make_preprocess_goldens.py \
      --reference-dir third_party_ref/kimi_k3 --out tests/fixtures/vision-preprocess

The reference is `kimi_k3_vision_processing.py` and `media_utils.py` of vllm-project/llm-compressor at
bcbda0bf0a93e40bdfe177702c5a965a3a7bd534 (src/llmcompressor/modeling/kimi_k3/), not part of this repository:
they are imported from --reference-dir (third_party_ref/ is ignored), the processor's one transformers base class
and its BatchFeature replaced by stand-ins. Needs Debian's python3-pil (Pillow 9.4: the resize is Pillow's own
fixed-point bicubic), numpy and torch.

Each case is an image (L, LA, RGB or RGBA, 8 bits) and a media_proc_cfg: the release's (in_patch_limit 65536,
patch_limit_on_one_side 512; these images fit, so only the padding acts) or a small one (in_patch_limit 24,
8 patches a side) under which the images are shrunk, which exercises the resampler, the premultiplied alpha
and the chessboard. The transparent background is the release's: an 8-pixel chessboard of 255 and 180, white
at the top left, composited after resizing.

Writes cases.json (the configs, the images' modes, and navit_resize_image's sizes for images from 1 x 1 to
65536 x 65536 under the release's limits) and golden.safetensors: image.i (U8 [h, w, c]),
pixel_values.i (F32 [L, 3, 14, 14]), grid_thws.i (I64 [1, 3]).
"""
import argparse, json, os, sys, types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "reference_grads"))
import numpy as np
from PIL import Image
import st

BG = {"pattern": "chessboard", "chessboard_square_size": 8, "chessboard_square_on_top_left": True,
      "chessboard_white_value": 255, "chessboard_gray_value": 180}
RELEASE = {"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 65536, "patch_limit_on_one_side": 512,
           "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "fixed_output_tokens": None,
           "transparent_bg_config": BG, "transparent_bg_fill_stage": "after_resize"}
SMALL = dict(RELEASE, in_patch_limit=24, patch_limit_on_one_side=8)
MODES = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}


def install_stand_ins():
    tf = types.ModuleType("transformers")
    ipu = types.ModuleType("transformers.image_processing_utils")

    class BaseImageProcessor:
        def __init__(self, **kw):
            pass

    ipu.BaseImageProcessor = BaseImageProcessor
    ipu.BatchFeature = lambda data, tensor_type=None: data
    tu = types.ModuleType("transformers.utils")
    tu.TensorType = str
    sys.modules.update({"transformers": tf, "transformers.image_processing_utils": ipu, "transformers.utils": tu})


def load_processor(ref_dir):
    install_stand_ins()
    pkg = types.ModuleType("kimi_k3_ref")
    pkg.__path__ = [os.path.abspath(ref_dir)]
    sys.modules["kimi_k3_ref"] = pkg
    import importlib
    return importlib.import_module("kimi_k3_ref.kimi_k3_vision_processing").KimiK3VisionProcessor


def image(rng, w, h, c):
    """Smooth gradients plus noise (a resampler's rounding shows on both), alpha with 0, 255 and partial runs."""
    y, x = np.mgrid[0:h, 0:w]
    chans = []
    for k in range(min(c, 3) if c != 2 else 1):
        base = 127.5 + 100 * np.sin(x / (7.0 + 3 * k) + y / (11.0 + k)) + rng.normal(0, 20, (h, w))
        chans.append(base)
    if c in (2, 4):
        a = np.where((x // 9 + y // 7) % 3 == 0, 0.0, np.where((x // 9 + y // 7) % 3 == 1, 255.0, 40 + 180 * (x / w)))
        chans.append(a)
    return np.clip(np.rint(np.stack(chans, -1)), 0, 255).astype(np.uint8)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference-dir", required=True, help="the directory holding the two reference files")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    Processor = load_processor(a.reference_dir)
    rng = np.random.default_rng(7)
    # (width, height, channels, config)
    cases = [(300, 200, 3, "small"), (257, 131, 4, "small"), (90, 400, 1, "small"), (120, 120, 2, "small"),
             (40, 1000, 3, "small"), (1000, 37, 4, "small"), (53, 29, 3, "small"), (5, 3, 3, "release"),
             (61, 45, 4, "release"), (30, 30, 1, "release")]
    golden, meta = {}, []
    for i, (w, h, c, cfg_name) in enumerate(cases):
        arr = image(rng, w, h, c)
        pil = Image.fromarray(arr[..., 0] if c == 1 else arr, MODES[c])
        proc = Processor(media_proc_cfg=SMALL if cfg_name == "small" else RELEASE)
        out = proc.preprocess([{"type": "image", "image": pil}])
        pv, grid = out["pixel_values"].numpy(), out["grid_thws"].numpy()
        golden[f"image.{i}"] = arr.reshape(h, w, c)
        golden[f"pixel_values.{i}"] = pv.astype(np.float32)
        golden[f"grid_thws.{i}"] = grid.astype(np.int64)
        meta.append({"width": w, "height": h, "channels": c, "mode": MODES[c], "config": cfg_name})
        print(f"case {i}: {MODES[c]} {w}x{h} ({cfg_name}) -> grid {grid.tolist()}, {pv.shape[0]} patches", flush=True)
    # The sizes alone (navit_resize_image) at the release's limits, where floating point decides: a side at the
    # one-side limit, huge and tiny images, the square that just fits and one just over.
    navit = sys.modules["kimi_k3_ref.media_utils"].navit_resize_image
    plans = []
    for w, h in [(3584, 3584), (3585, 3584), (4000, 3000), (100000, 20), (20, 100000), (7169, 14), (1, 1),
                 (10000, 10000), (7168, 7168), (7181, 100), (65536, 65536), (27, 29), (1000, 1)]:
        r = navit(w, h, 14, 2, 65536, 512, None)
        plans.append({"width": w, "height": h, **{k: r[k] for k in ("new_width", "new_height", "pad_width",
                                                                     "pad_height", "num_tokens")}})
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "cases.json"), "w") as f:
        json.dump({"configs": {"release": RELEASE, "small": SMALL}, "cases": meta, "plans": plans}, f, indent=2)
        f.write("\n")
    st.save(os.path.join(a.out, "golden.safetensors"), golden)


if __name__ == "__main__":
    main()
