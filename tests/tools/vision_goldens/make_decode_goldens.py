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
What Pillow cannot save is written here: PNGs of 16 bits (grey, which Pillow opens as mode I; grey + alpha, which
it opens as RGBA; RGB; RGBA; grey and RGB keys) and of 2 and 4 bits grey (mode L, the samples scaled; with keys,
one out of the depth's range), some interlaced, by write_png; a YCCK JPEG (Adobe transform 2) by setting the
transform byte of a CMYK JPEG Pillow saved (ycck_jpeg). Mode I's pixels are np.array(im.convert("L")), which clips,
and its samples are kept too.
Writes the files, cases.json (each file's format, Pillow's mode, rawmode where it differs, and size, or what the
decoder must refuse and why) and golden.safetensors: pixels.NAME (U8 [h, w, c]) for each accepted file, and
samples.NAME (I64 [h, w, 1]) for mode I.
"""
import argparse, io, json, os, struct, sys, zlib

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


def picture16(w, h, channels, seed):
    """16-bit samples: picture()'s as the high byte (alpha runs of 0 and 255 stay so), a low byte running through
    all values (so taking the high byte and rounding differ)."""
    hi = picture(w, h, channels, seed).astype(np.int64).reshape(h, w, channels)
    y, x, c = np.mgrid[0:h, 0:w, 0:channels]
    return hi * 256 + (x * 37 + y * 11 + c * 71 + seed) % 256


def grey16(w, h, seed):
    """Mode I samples in bands of 0..510, 0..65535 and 0..255: Pillow clips them to 8 bits, so what survives is
    the low band and the overshoot of a resize at the bands' edges (negative next to the high band)."""
    g = picture(w, h, 1, seed).astype(np.int64)
    y, x = np.mgrid[0:h, 0:w]
    band = (x // 6 + y // 4) % 3
    return np.where(band == 0, g * 2, np.where(band == 1, g * 257 + x % 256, g))


def png_chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


ADAM7 = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]


def write_png(samples, depth, color, trns=None, interlace=False):
    """A PNG of `samples` (ints [h, w, c] below 2**depth) as the specification has it, for what Pillow cannot save.
    Rows are filtered None, Sub and Up in turn; with `interlace`, Adam7's seven passes."""
    h, w, c = samples.shape
    bpp = max(1, c * depth // 8)

    def row_bytes(row):  # [n, c] samples, packed big-endian
        flat = row.reshape(-1)
        if depth == 16:
            return flat.astype(">u2").tobytes()
        if depth == 8:
            return flat.astype(np.uint8).tobytes()
        per = 8 // depth
        flat = np.concatenate([flat, np.zeros((-len(flat)) % per, flat.dtype)]).reshape(-1, per)
        shifts = 8 - depth * (np.arange(per) + 1)
        return (flat << shifts).sum(1).astype(np.uint8).tobytes()

    def filtered(image):
        out, prior = [], None
        for y in range(image.shape[0]):
            raw = np.frombuffer(row_bytes(image[y]), np.uint8).astype(np.int64)
            kind = y % 3 if prior is not None else y % 2
            if kind == 1:
                line = (raw - np.concatenate([np.zeros(bpp, np.int64), raw[:-bpp]])) % 256
            elif kind == 2:
                line = (raw - prior) % 256
            else:
                line = raw
            out.append(bytes([kind]) + line.astype(np.uint8).tobytes())
            prior = raw
        return b"".join(out)

    if interlace:
        data = b"".join(filtered(samples[y0::dy, x0::dx]) for x0, y0, dx, dy in ADAM7 if x0 < w and y0 < h)
    else:
        data = filtered(samples)
    ihdr = struct.pack(">IIBBBBB", w, h, depth, color, 0, 0, 1 if interlace else 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + (png_chunk(b"tRNS", trns) if trns else b"") +
            png_chunk(b"IDAT", zlib.compress(data, 9)) + png_chunk(b"IEND", b""))


def ycck_jpeg(rgb, quality):
    """A YCCK JPEG, which Pillow cannot save: its CMYK JPEG of the image's Y, Cb and Cr and a K ramp (inverted, as
    Pillow stores CMYK), the Adobe marker's transform byte then set from 0 (CMYK) to 2 (YCCK)."""
    ycc = np.array(rgb.convert("YCbCr"))
    h, w = ycc.shape[:2]
    k = ((np.arange(w)[None, :] * 19 + np.arange(h)[:, None] * 5) % 256).astype(np.uint8)
    b = io.BytesIO()
    Image.fromarray(255 - np.dstack([ycc, k]), "CMYK").save(b, "JPEG", quality=quality)
    data = bytearray(b.getvalue())
    at = data.find(b"Adobe")
    assert at > 0 and data[at + 11] == 0, "Pillow's CMYK JPEG has no Adobe marker of transform 0"
    data[at + 11] = 2
    return bytes(data)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    cases, tensors = [], {}

    def accept(name, data):
        open(os.path.join(a.out, name), "wb").write(data)
        im = Image.open(io.BytesIO(data))
        args = im.tile[0][3]
        rawmode = args[0] if isinstance(args, tuple) else args
        im.load()
        case = {"file": name, "format": im.format, "mode": im.mode, "width": im.width, "height": im.height}
        if rawmode != im.mode:
            case["rawmode"] = rawmode
        if im.mode in ("L", "I") and "transparency" in im.info:
            case["transparency"] = im.info["transparency"]  # as Pillow reads it, unscaled
        px = np.array(im.convert("L") if im.mode == "I" else im)  # mode I: clipped to 8 bits
        if px.ndim == 2:
            px = px[..., None]
        cases.append(case)
        tensors["pixels." + name] = px.astype(np.uint8)
        if im.mode == "I":
            tensors["samples." + name] = np.array(im).astype(np.int64)[..., None]

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

    def refuse(name, data, why, pillow_raises=False):
        open(os.path.join(a.out, name), "wb").write(data)
        if pillow_raises:  # what Pillow cannot open, the decoder must refuse
            try:
                Image.open(io.BytesIO(data)).load()
                raise SystemExit(f"{name}: Pillow opens it")
            except (OSError, SyntaxError, ValueError):
                pass
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
    accept("png_I16.png", save(Image.fromarray((picture(20, 10, 1, 5).astype(np.uint16) * 257), "I;16"), "PNG"))
    accept("jpeg_CMYK.jpg", save(rgb.convert("CMYK"), "JPEG", quality=90))

    # What Pillow cannot save. 16 bits: grey (mode I, with a key whose low byte, 7, is what Pillow compares), grey +
    # alpha (opened as RGBA), RGB (a key, ignored) and RGBA; 2 and 4 bits grey (mode L; keys unscaled, one out of
    # the 2-bit range whose low byte is a scaled sample). Tiny and odd sizes; 151 x 5 and 120 x 30 for a resize.
    def keyed(v, key, low):  # runs of the key and of its low byte
        y, x = np.mgrid[0:v.shape[0], 0:v.shape[1]]
        v = v.copy()
        v[(x + 2 * y) % 5 == 0] = key
        v[(x + 2 * y) % 5 == 2] = low
        return v
    for (w, h) in [(1, 1), (5, 3), (151, 5), (120, 30)]:
        accept(f"png_I16_{w}x{h}.png", write_png(grey16(w, h, seed)[..., None], 16, 0))
        seed += 1
    for (w, h) in [(5, 3), (151, 5)]:
        accept(f"png_I16_trns_{w}x{h}.png",
               write_png(keyed(grey16(w, h, seed), 263, 7)[..., None], 16, 0, trns=struct.pack(">H", 263)))
        accept(f"png_LA16_{w}x{h}.png", write_png(picture16(w, h, 2, seed + 1), 16, 4))
        accept(f"png_RGB16_{w}x{h}.png", write_png(picture16(w, h, 3, seed + 2), 16, 2))
        accept(f"png_RGBA16_{w}x{h}.png", write_png(picture16(w, h, 4, seed + 3), 16, 6, interlace=w > 100))
        for bits in (2, 4):
            g = picture(w, h, 1, seed + bits).astype(np.int64) >> (8 - bits)
            accept(f"png_L{bits}_{w}x{h}.png", write_png(g[..., None], bits, 0, interlace=w > 100))
            key = 0x155 if bits == 2 else 3  # 0x155: libpng warns, Pillow keeps it; its low byte 0x55 = 1 scaled
            accept(f"png_L{bits}_trns_{w}x{h}.png",
                   write_png(keyed(g, key & ((1 << bits) - 1), 1)[..., None], bits, 0, trns=struct.pack(">H", key)))
        seed += 10
    accept("png_RGB16_trns_5x3.png", write_png(picture16(5, 3, 3, 60), 16, 2, trns=struct.pack(">HHH", 1, 2, 3)))
    accept("png_RGBA16_1x1.png", write_png(picture16(1, 1, 4, 61), 16, 6, interlace=True))
    accept("jpeg_YCCK_17x9.jpg", ycck_jpeg(Image.fromarray(picture(17, 9, 3, 62), "RGB"), 90))
    ycck = ycck_jpeg(Image.fromarray(picture(151, 5, 3, 63), "RGB"), 85)
    accept("jpeg_YCCK_151x5.jpg", ycck)
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
    # The new formats broken: cut short, and a flipped byte in the image data.
    for name, data in [("png_I16_truncated.png", write_png(grey16(40, 30, 70)[..., None], 16, 0)),
                       ("png_L2_truncated.png", write_png(picture(40, 30, 1, 71)[..., None] >> 6, 2, 0, interlace=True)),
                       ("jpeg_YCCK_truncated.jpg", ycck)]:
        refuse(name, data[: len(data) // 2], "truncated", pillow_raises=True)
    rgba16 = bytearray(write_png(picture16(20, 15, 4, 72), 16, 6))
    rgba16[rgba16.find(b"IDAT") + 40] ^= 0xFF
    refuse("png_RGBA16_corrupt.png", bytes(rgba16), "corrupt", pillow_raises=True)

    json.dump({"pillow": Image.__version__, "cases": cases}, open(os.path.join(a.out, "cases.json"), "w"), indent=1)
    st.save(os.path.join(a.out, "golden.safetensors"), tensors)


if __name__ == "__main__":
    main()
