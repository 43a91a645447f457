#!/usr/bin/python3
"""Golden pixel values of Moonshot's image processor on image FILES in the modes Pillow converts by its own rules,
for tests/fixtures/vision-preprocess-files.

  /usr/bin/python3 tests/tools/vision_goldens/make_file_preprocess_goldens.py \
      --reference-dir third_party_ref/kimi_k3 --images tests/fixtures/image-decode \
      --out tests/fixtures/vision-preprocess-files

The processor (as make_preprocess_goldens.py loads it; the reference stays out of the repository) gets each file
as Image.open gives it: palettes (8- and 4-bit, one with a tRNS alpha table; Pillow resizes mode P by NEAREST and
converts it to RGB or RGBA only after), 1-bit grey (mode 1, also NEAREST), grey with a tRNS colour key (alpha
from the key after the bicubic resize), RGB with one (the processor passes RGB as it is) and a CMYK JPEG (resized as CMYK,
converted by Pillow's cmyk2rgb after), under the release's
media_proc_cfg (no resize, padding only) and the small one (in_patch_limit 24, 8 patches a side: a resize).
And the modes of files Pillow cannot save: 16-bit grey (mode I: resized in 32-bit integers, then clipped to 8 bits
by convert("RGB") or, with a key, convert("RGBA")), 16-bit grey + alpha (opened as RGBA), RGB (a key ignored) and
RGBA (the high byte), 2- and 4-bit grey (L, with and without keys) and YCCK JPEGs (CMYK): tiny and odd files
under the release's config (no resize), 151 x 5 and 120 x 30 ones under the small one (resized).
Writes cases.json and golden.safetensors: pixel_values.NAME.CONFIG (F32 [L, 3, 14, 14]), grid_thws.NAME.CONFIG.
"""
import argparse, json, os, sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "reference_grads"))
import numpy as np
from PIL import Image
import st
from make_preprocess_goldens import RELEASE, SMALL, load_processor

BOTH = ("release", "small")
FILES = [(name, BOTH) for name in ["png_P.png", "png_P4.png", "png_P_trns.png", "png_1bit.png", "png_L_trns.png",
                                   "png_RGB_trns.png", "png_RGBA_64x48.png", "jpeg_CMYK.jpg"]]
FILES += [(name, ("release",)) for name in [
    "png_I16_1x1.png", "png_I16_5x3.png", "png_I16_trns_5x3.png", "png_LA16_5x3.png", "png_RGB16_5x3.png",
    "png_RGB16_trns_5x3.png", "png_RGBA16_5x3.png", "png_L2_5x3.png", "png_L2_trns_5x3.png", "png_L4_5x3.png",
    "png_L4_trns_5x3.png", "jpeg_YCCK_17x9.jpg"]]
FILES += [(name, ("small",)) for name in [
    "png_I16_151x5.png", "png_I16_120x30.png", "png_I16_trns_151x5.png", "png_LA16_151x5.png", "png_RGB16_151x5.png",
    "png_RGBA16_151x5.png", "png_L2_151x5.png", "png_L2_trns_151x5.png", "png_L4_151x5.png",
    "png_L4_trns_151x5.png", "jpeg_YCCK_151x5.jpg"]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference-dir", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    Processor = load_processor(a.reference_dir)
    golden, cases = {}, []
    for name, configs in FILES:
        for cfg_name in configs:
            cfg = {"release": RELEASE, "small": SMALL}[cfg_name]
            im = Image.open(os.path.join(a.images, name))
            out = Processor(media_proc_cfg=cfg).preprocess([{"type": "image", "image": im}])
            pv, grid = out["pixel_values"].numpy(), out["grid_thws"].numpy()
            golden[f"pixel_values.{name}.{cfg_name}"] = pv.astype(np.float32)
            golden[f"grid_thws.{name}.{cfg_name}"] = grid.astype(np.int64)
            cases.append({"file": name, "config": cfg_name, "pillow_mode": im.mode})
            print(f"{name} ({im.mode}, {cfg_name}) -> grid {grid.tolist()}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "cases.json"), "w") as f:
        json.dump({"configs": {"release": RELEASE, "small": SMALL}, "cases": cases}, f, indent=2)
        f.write("\n")
    st.save(os.path.join(a.out, "golden.safetensors"), golden)


if __name__ == "__main__":
    main()
