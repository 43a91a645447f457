#!/usr/bin/python3
"""Image files and the pixels Pillow decodes from them, for tests/fixtures/image-decode.

  /usr/bin/python3 tests/tools/vision_goldens/make_decode_goldens.py --out tests/fixtures/image-decode

Needs Debian's python3-pil (Pillow 9.4: PNG through its own decoder over zlib, JPEG through libjpeg-turbo with its
defaults, the islow DCT and fancy upsampling) and numpy. The images are synthetic (gradients, noise, edges), saved
by Pillow itself in the modes Moonshot's processor meets: PNG in L, LA, RGB and RGBA; JPEG in L and RGB at three
chroma subsamplings, baseline and progressive, at sizes that are not multiples of the 8 x 8 or 16 x 16 blocks;
PNG palettes (8- and 4-bit, with a tRNS alpha table), 1-bit, and grey and RGB colour keys, whose pixels are
Pillow's conversion of them (RGB, RGBA, L) with the mode Pillow opened them in; a CMYK JPEG (Pillow's CMYK values,
read as Adobe's inverted samples).
Writes the files, cases.json (each file's format, Pillow's mode and size, or what the decoder must refuse and
why) and golden.safetensors: pixels.NAME (U8 [h, w, c]) for each accepted file.
"""
import argparse, io, json, os, sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "reference_grads"))
import numpy as np
from PIL import Image
import st


def picture(w, h, channels, seed):
    r = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * 255 // max(1, w - 1)), (y * 255 // max(1, h - 1)), ((x + y) * 7) % 256, (x * y) % 256], -1)
    img = (base + r.integers(0, 40, size=base.shape)) % 256
    img[(x // 5 + y // 3) % 7 == 0] = 255 - img[(x // 5 + y // 3) % 7 == 0]  # sharp edges: ringing in JPEG
    img = img.astype(np.uint8)
    if channels in (2, 4):  # alpha runs of 0, 255 and partial values
        a = img[..., 3].copy()
        a[:, : w // 3] = 0
        a[:, w // 3: 2 * w // 3] = 255
        img[..., 3] = a
    if channels == 1:
        return img[..., 0]
    if channels == 2:
        return img[..., [0, 3]]
    return img[..., :channels]


MODE = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    cases, tensors = [], {}

    def accept(name, data):
        open(os.path.join(a.out, name), "wb").write(data)
        im = Image.open(io.BytesIO(data))
        im.load()
        px = np.array(im)
        if px.ndim == 2:
            px = px[..., None]
        cases.append({"file": name, "format": im.format, "mode": im.mode, "width": im.width, "height": im.height})
        tensors["pixels." + name] = px.astype(np.uint8)

    def accept_as(name, data, to_mode):
        # Modes the decoder gives as Pillow converts them before the processor sees pixels: P to RGB (RGBA with a
        # tRNS table) and 1 to L, both resized by NEAREST (nearest: true); L with a tRNS key stays L, the key
        # (Pillow's info["transparency"]) applied after the resize; RGB's key is ignored by the processor.
        open(os.path.join(a.out, name), "wb").write(data)
        im = Image.open(io.BytesIO(data))
        im.load()
        case = {"file": name, "format": im.format, "mode": to_mode, "pillow_mode": im.mode, "width": im.width,
                "height": im.height, "nearest": im.mode in ("P", "1")}
        if im.mode == "L" and "transparency" in im.info:
            case["transparency"] = im.info["transparency"]
        px = np.array(im.convert(to_mode) if im.mode != to_mode else im)
        if px.ndim == 2:
            px = px[..., None]
        cases.append(case)
        tensors["pixels." + name] = px.astype(np.uint8)

    def refuse(name, data, why):
        open(os.path.join(a.out, name), "wb").write(data)
        cases.append({"file": name, "refuse": why})

    def save(img, fmt, **kw):
        b = io.BytesIO()
        img.save(b, fmt, **kw)
        return b.getvalue()

    seed = 1
    for (w, h) in [(1, 1), (5, 3), (64, 48), (300, 7), (7, 300)]:
        for c in (1, 2, 3, 4):
            im = Image.fromarray(picture(w, h, c, seed), MODE[c])
            seed += 1
            accept(f"png_{MODE[c]}_{w}x{h}.png", save(im, "PNG"))
    rgb = Image.fromarray(picture(333, 77, 3, 99), "RGB")
    grey = Image.fromarray(picture(333, 77, 1, 98), "L")
    accept("png_RGB_333x77_level9.png", save(rgb, "PNG", compress_level=9))
    for sub in (0, 1, 2):  # 4:4:4, 4:2:2, 4:2:0
        for q in (95, 50):
            accept(f"jpeg_RGB_333x77_s{sub}_q{q}.jpg", save(rgb, "JPEG", quality=q, subsampling=sub))
    accept("jpeg_RGB_333x77_progressive.jpg", save(rgb, "JPEG", quality=85, progressive=True))
    accept("jpeg_RGB_1x1.jpg", save(Image.fromarray(picture(1, 1, 3, 97), "RGB"), "JPEG", quality=90))
    accept("jpeg_RGB_17x9.jpg", save(Image.fromarray(picture(17, 9, 3, 96), "RGB"), "JPEG", quality=90, subsampling=2))
    accept("jpeg_L_333x77.jpg", save(grey, "JPEG", quality=90))
    accept("jpeg_L_333x77_progressive.jpg", save(grey, "JPEG", quality=70, progressive=True))
    accept("jpeg_RGB_333x77_restart.jpg", save(rgb, "JPEG", quality=80, restart_marker_blocks=3))

    # Modes Pillow converts: palettes (8-bit, 4-bit, with a tRNS alpha table), 1-bit, grey and RGB colour keys.
    accept_as("png_P.png", save(rgb.convert("P"), "PNG"), "RGB")
    quant = rgb.quantize(16)
    accept_as("png_P4.png", save(quant, "PNG", bits=4), "RGB")
    alphas = bytes((i * 37) % 256 for i in range(200))
    accept_as("png_P_trns.png", save(rgb.quantize(200), "PNG", transparency=alphas), "RGBA")
    accept_as("png_1bit.png", save(grey.convert("1"), "PNG"), "L")
    keyed = np.array(grey)
    keyed[(np.arange(77)[:, None] // 10 + np.arange(333)[None, :] // 25) % 3 == 0] = 7  # flat runs of the key
    accept_as("png_L_trns.png", save(Image.fromarray(keyed, "L"), "PNG", transparency=7), "L")
    accept_as("png_RGB_trns.png", save(rgb, "PNG", transparency=(10, 20, 30)), "RGB")
    # Refused: what the processor would convert by Pillow's own rules, not done here yet.
    refuse("png_I16.png", save(Image.fromarray((picture(20, 10, 1, 5).astype(np.uint16) * 257), "I;16"), "PNG"),
           "16-bit")
    accept("jpeg_CMYK.jpg", save(rgb.convert("CMYK"), "JPEG", quality=90))
    png = save(rgb, "PNG")
    refuse("png_truncated.png", png[: len(png) // 2], "truncated")
    jpg = save(rgb, "JPEG", quality=90)
    refuse("jpeg_truncated.jpg", jpg[: len(jpg) // 2], "truncated")
    refuse("gif.gif", save(rgb.convert("P"), "GIF"), "format")
    refuse("empty.png", b"", "format")
    refuse("garbage.jpg", bytes(np.random.default_rng(3).integers(0, 256, 1000, dtype=np.uint8)), "format")
    bad_crc = bytearray(png)
    bad_crc[40] ^= 0xFF  # inside the first IDAT or IHDR-adjacent data: zlib or CRC fails
    refuse("png_corrupt.png", bytes(bad_crc), "corrupt")

    json.dump({"pillow": Image.__version__, "cases": cases}, open(os.path.join(a.out, "cases.json"), "w"), indent=1)
    st.save(os.path.join(a.out, "golden.safetensors"), tensors)


if __name__ == "__main__":
    main()
