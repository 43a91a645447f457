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

FILES = ["png_P.png", "png_P4.png", "png_P_trns.png", "png_1bit.png", "png_L_trns.png", "png_RGB_trns.png",
         "png_RGBA_64x48.png", "jpeg_CMYK.jpg"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference-dir", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    Processor = load_processor(a.reference_dir)
    golden, cases = {}, []
    for name in FILES:
        for cfg_name, cfg in (("release", RELEASE), ("small", SMALL)):
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
