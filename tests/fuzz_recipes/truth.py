"""Inputs that carry their own truth, written into a folder from a JSON-able description.

Everything here is a pure function of its arguments (numpy generators seeded from them), so a case rebuilt
from its description writes the same bytes.

2D scenes. Objects are convex polygons, one per cell of a grid, so they never overlap. Each polygon is
rasterised once with pycocotools (the reference COCO rasteriser); that raster is painted into the image in the
object's palette colour, into the instance-id mask (``ids``: object i is i + 1, the crowd region
:data:`CROWD_ID`) and decides the COCO ``bbox`` (the raster's pixel extent, so the box is the tight extent of
the colour's pixels) while the polygon itself is the COCO segmentation. Keypoints sit at the centres of marker
pixels of their object; the marker mask (``marks``) holds ``3 i + j + 1`` at keypoint j of object i.
"""
from __future__ import annotations

import json
import math
import os
import struct
import warnings
import wave
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

#: object colours: well apart in RGB (>= 167) and in ITU-R 601 luma (60, 95, ..., 235), so a blend of one
#: with the black background is never near another (>= 127 in RGB); the last one is the crowd region's
PALETTE = np.array([[196, 0, 0], [69, 76, 250], [4, 217, 0], [252, 102, 255], [231, 222, 0], [185, 255, 255]],
                   np.uint8)
LUMA = PALETTE.astype(np.float64) @ np.array([0.299, 0.587, 0.114])
MAX_OBJECTS = 5
CROWD_ID = 200          # the crowd region's value in the ids mask
K = 3                   # keypoints per object
FLIP_PAIRS = [[0, 1]]   # keypoints 0 and 1 swap in a mirror (named left/right in the COCO file)
CATEGORIES = [          # file order is not id order: labels follow id order (3 -> 0, 7 -> 1, 12 -> 2)
    {"id": 7, "name": "b\u00f1and\u00fa", "supercategory": "x", "keypoints": ["left", "right", "mid"],
     "skeleton": [[1, 3], [2, 3]]},
    {"id": 3, "name": "a", "supercategory": "x", "keypoints": ["left", "right", "mid"], "skeleton": [[1, 3], [2, 3]]},
    {"id": 12, "name": "\u732b", "supercategory": "y"},   # no keypoints: its boxes get all-zero keypoint rows
]
CATEGORY_LABEL = {c["id"]: i for i, c in enumerate(sorted(CATEGORIES, key=lambda c: c["id"]))}
LABEL_NAMES = [c["name"] for c in sorted(CATEGORIES, key=lambda c: c["id"])]
WITH_KEYPOINTS = {c["id"] for c in CATEGORIES if c.get("keypoints")}


def rng_of(*parts: Any) -> np.random.Generator:
    """A generator seeded by integers and strings (no hash randomisation: strings by their bytes)."""
    seed = []
    for p in parts:
        if isinstance(p, str):
            seed.extend(p.encode())
        else:
            seed.append(int(p) & 0xFFFFFFFF)
    return np.random.default_rng(seed)


# -- 2D scenes ------------------------------------------------------------------------------------------------
@dataclass
class Obj:
    index: int                      # 1-based id in the ids mask (non-crowd), CROWD_ID for the crowd region
    raster: np.ndarray              # (H, W) bool, pycocotools' raster of the segmentation
    box: tuple[int, int, int, int]  # x1, y1, x2, y2: the raster's pixel extent
    colour: int                     # PALETTE index
    category: int                   # COCO category id
    polygon: Optional[list]         # the polygon (COCO list of lists), or None for an RLE region
    seg: str                        # poly | rle | rle_list | none
    crowd: bool = False
    keypoints: Optional[np.ndarray] = None   # (K, 3) x, y, v in stored pixels (None: category without them)
    markers: list = field(default_factory=list)   # per keypoint (px, py) or None


@dataclass
class Scene:
    H: int
    W: int
    image: np.ndarray               # (H, W, 3) uint8, stored orientation
    ids: np.ndarray                 # (H, W) uint8
    marks: np.ndarray               # (H, W) uint8
    objects: list                   # non-crowd objects in annotation (file) order
    crowd: Optional[Obj]


def _raster(poly: list, H: int, W: int) -> np.ndarray:
    from pycocotools import mask as M

    rle = M.merge(M.frPyObjects(poly, H, W))
    with warnings.catch_warnings():   # pycocotools' Cython decode calls np.array(copy=False) on its own class
        warnings.filterwarnings("ignore", r"__array__ implementation doesn't accept a copy keyword", DeprecationWarning)
        return M.decode(rle).astype(bool)


def _extent(r: np.ndarray) -> tuple[int, int, int, int]:
    ys, xs = np.nonzero(r)
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


def _shape(rng: np.random.Generator, x0: int, y0: int, x1: int, y1: int, at_left: bool) -> list[float]:
    """A convex polygon inside the cell [x0, x1) x [y0, y1)."""
    kind = rng.choice(["rect", "frac", "tri", "quad"], p=[0.4, 0.2, 0.2, 0.2])
    w, h = x1 - x0, y1 - y0
    if kind == "rect" or at_left:
        a = x0 if at_left else int(rng.integers(x0, x1 - 2))
        b = int(rng.integers(a + 2, x1 + 1))
        c = int(rng.integers(y0, y1 - 2))
        d = int(rng.integers(c + 2, y1 + 1))
        return [a, c, b, c, b, d, a, d]
    if kind == "frac":
        a, b = sorted(rng.uniform(x0, x1, 2))
        c, d = sorted(rng.uniform(y0, y1, 2))
        b, d = max(b, a + 2.2), max(d, c + 2.2)
        return [round(v, 2) for v in (a, c, min(b, x1), c, min(b, x1), min(d, y1), a, min(d, y1))]
    cx, cy = x0 + w / 2, y0 + h / 2
    n = 3 if kind == "tri" else 4
    ang = np.sort(rng.uniform(0, 2 * math.pi, n))
    rx, ry = w / 2 * rng.uniform(0.6, 1.0), h / 2 * rng.uniform(0.6, 1.0)
    pts = []
    for t in ang:
        pts += [round(float(np.clip(cx + rx * math.cos(t), x0, x1)), 2), round(float(np.clip(cy + ry * math.sin(t), y0, y1)), 2)]
    return pts


def _markers(rng: np.random.Generator, r: np.ndarray, at_left: bool) -> tuple[np.ndarray, list]:
    ys, xs = np.nonzero(r)
    order = np.lexsort((xs, ys))
    picks = [order[0]]                                        # top-most, then left-most pixel
    picks.append(int(np.argmax(xs * 10000 - ys)))             # right-most pixel
    rest = [i for i in range(len(xs)) if i not in picks]
    picks.append(int(rng.choice(rest)) if rest else picks[0])
    if len(set(picks)) < 3:
        return None, []
    kp = np.zeros((K, 3), np.float32)
    marks = []
    for j, i in enumerate(picks):
        px, py = int(xs[i]), int(ys[i])
        v = int(rng.choice([2, 2, 2, 2, 2, 1, 1, 0]))
        if at_left and j == 0:          # a keypoint exactly on the image's left edge (x = 0)
            left = np.nonzero(xs == 0)[0]
            px, py, v = 0, int(ys[left[0]]), 2
            kp[j] = (0.0, py + 0.5, v)
        elif v == 0:
            kp[j] = (0, 0, 0)
            marks.append(None)
            continue
        else:
            kp[j] = (px + 0.5, py + 0.5, v)
        marks.append((px, py))
    if len({m for m in marks if m is not None}) < sum(m is not None for m in marks):
        return None, []
    return kp, marks


def make_scene(seed: int, H: int, W: int, n_obj: int, crowd: bool, edge_kp: bool, segs: list[str]) -> Scene:
    """A scene of ``n_obj`` objects (+ a crowd region) on a black H x W background."""
    rng = rng_of(seed, H, W, n_obj, int(crowd))
    rows, cols = max(1, min(3, H // 9)), max(1, min(3, W // 9))
    cells = [(r, c) for r in range(rows) for c in range(cols)]
    order = list(rng.permutation(len(cells)))
    if edge_kp:   # the first object in a cell on the left edge
        left = [i for i in order if cells[i][1] == 0]
        order = left[:1] + [i for i in order if i != left[0]]
    n_obj = min(n_obj, len(cells) - int(crowd))
    ch, cw = H / rows, W / cols
    image = np.zeros((H, W, 3), np.uint8)
    ids = np.zeros((H, W), np.uint8)
    marks = np.zeros((H, W), np.uint8)
    colours = list(rng.permutation(MAX_OBJECTS))
    objects: list[Obj] = []
    crowd_obj = None
    for slot, ci in enumerate(order[:n_obj + int(crowd)]):
        r, c = cells[ci]
        x0, x1 = int(round(c * cw)) + (0 if c == 0 else 1), int(round((c + 1) * cw)) - 1
        y0, y1 = int(round(r * ch)) + (0 if r == 0 else 1), int(round((r + 1) * ch)) - 1
        is_crowd = crowd and slot == n_obj
        at_left = edge_kp and slot == 0 and c == 0
        for _ in range(20):
            poly = _shape(rng, x0, y0, x1, y1, at_left)
            ras = _raster([poly], H, W)
            if ras.sum() >= 4:
                break
        else:
            poly = [x0, y0, x1, y0, x1, y1, x0, y1]
            ras = _raster([poly], H, W)
        cat = int(rng.choice([c_["id"] for c_ in CATEGORIES]))
        if is_crowd:
            crowd_obj = Obj(CROWD_ID, ras, _extent(ras), MAX_OBJECTS, cat, None, "rle_list" if rng.random() < 0.5 else "rle",
                            crowd=True)
            image[ras] = PALETTE[MAX_OBJECTS]
            ids[ras] = CROWD_ID
            continue
        i = len(objects)
        o = Obj(i + 1, ras, _extent(ras), int(colours[i]), cat, [poly], segs[i % len(segs)] if segs else "poly")
        if cat in WITH_KEYPOINTS:
            kp, mk = _markers(rng, ras, at_left)
            if kp is None:   # too few pixels for 3 distinct markers: a category without keypoints
                o.category = 12
            else:
                o.keypoints, o.markers = kp, mk
                for j, m in enumerate(mk):
                    if m is not None:
                        marks[m[1], m[0]] = 3 * i + j + 1
        image[ras] = PALETTE[o.colour]
        ids[ras] = i + 1
        objects.append(o)
    return Scene(H, W, image, ids, marks, objects, crowd_obj)


def _exif(orientation: int):
    from PIL import Image

    ex = Image.Exif()
    ex[0x0112] = orientation
    return ex


def save_image(arr: np.ndarray, path: str, fmt: str, orientation: int = 1, quality: int = 95,
               subsampling: int = 0, palette: bool = False) -> None:
    """``arr`` (stored orientation) as PNG or JPEG with an EXIF orientation tag when not 1."""
    from PIL import Image

    os.makedirs(os.path.dirname(path), exist_ok=True)
    img = Image.fromarray(arr)
    kw: dict[str, Any] = {}
    if orientation != 1:
        kw["exif"] = _exif(orientation).tobytes()
    if fmt == "jpg":
        img.save(path, "JPEG", quality=quality, subsampling=subsampling, **kw)
    else:
        if palette and arr.ndim == 3:
            img = img.quantize(colors=len(PALETTE) + 1, method=Image.Quantize.MEDIANCUT)
        img.save(path, "PNG", **kw)


def exif_transpose(arr: np.ndarray, orientation: int) -> np.ndarray:
    """The displayed pixels of ``arr`` under an EXIF orientation, by Pillow (the reference library)."""
    from PIL import Image, ImageOps

    if orientation == 1:
        return arr
    img = Image.fromarray(arr)
    img.getexif()[0x0112] = orientation
    ex = img.getexif()
    ex[0x0112] = orientation
    img.info["exif"] = ex.tobytes()
    return np.asarray(ImageOps.exif_transpose(img))


# -- COCO -----------------------------------------------------------------------------------------------------
def _rle(obj: Obj, short: bool) -> dict:
    from pycocotools import mask as M

    h, w = obj.raster.shape
    if obj.seg == "rle" and not short:
        enc = M.encode(np.asfortranarray(obj.raster.astype(np.uint8)))
        return {"counts": enc["counts"].decode("ascii"), "size": [h, w]}
    flat = obj.raster.T.reshape(-1).astype(np.uint8)   # column-major, as COCO's RLE
    counts, cur, run = [], 0, 0
    for v in flat:
        if v == cur:
            run += 1
        else:
            counts.append(run)
            cur, run = v, 1
    counts.append(run)
    if short and cur == 0 and len(counts) > 1:
        counts = counts[:-1]          # the trailing background run left out: the counts sum to less than h*w
    return {"counts": [int(c) for c in counts], "size": [h, w]}


def coco_annotations(scene: Scene, image_id: Any, first_id: int, short_rle: bool, bad: Optional[str]) -> list[dict]:
    out = []
    objs = list(scene.objects) + ([scene.crowd] if scene.crowd is not None else [])
    for n, o in enumerate(objs):
        x1, y1, x2, y2 = o.box
        a: dict[str, Any] = {"id": first_id + n, "image_id": image_id, "category_id": o.category,
                             "bbox": [x1, y1, x2 - x1, y2 - y1], "area": int(o.raster.sum()), "iscrowd": int(o.crowd)}
        if o.crowd:
            a["segmentation"] = _rle(o, short_rle)
        elif o.seg == "poly":
            a["segmentation"] = o.polygon
        elif o.seg in ("rle", "rle_list"):
            a["segmentation"] = _rle(o, False)
        if o.keypoints is not None:
            a["keypoints"] = [float(v) if v != int(v) else int(v) for v in o.keypoints.reshape(-1)]
            a["num_keypoints"] = int((o.keypoints[:, 2] > 0).sum())
        if bad == "nan_keypoint" and o.keypoints is not None and n == 0:
            a["keypoints"][3] = float("nan")
        out.append(a)
    return out


def write_coco(path: str, images: list[dict], per_image: list[list[dict]], rng: np.random.Generator) -> None:
    """The annotation file: images in the given order, each image's annotations in its own order, the
    images' annotations interleaved at random (file order per image is kept)."""
    queues = [list(a) for a in per_image]
    anns = []
    while any(queues):
        live = [i for i, q in enumerate(queues) if q]
        anns.append(queues[int(rng.choice(live))].pop(0))
    data = {"info": {"description": "fuzz"}, "images": images, "annotations": anns, "categories": CATEGORIES}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=bool(rng.random() < 0.5), allow_nan=True)


# -- flow ------------------------------------------------------------------------------------------------------
def write_flo(path: str, flow: np.ndarray) -> None:
    h, w = flow.shape[:2]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<fii", 202021.25, w, h))
        f.write(np.ascontiguousarray(flow, "<f4").tobytes())


def flow_pair(scene: Scene, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """img2, ids2 and the flow of a known warp: object i moves by its own integer translation (dx, dy), the
    background stays; ``flow`` holds (dx, dy) on object i's pixels of img1, 0 on the background and NaN on a
    block of unknown vectors away from the objects. Returns (img2, ids2, flow, moves); an object whose moved
    pixels another one covers, or that left the image in part, has moves[i] = (99, 99): not judged."""
    rng = rng_of(seed, "flow")
    H, W = scene.H, scene.W
    img2 = np.zeros_like(scene.image)
    ids2 = np.zeros_like(scene.ids)
    flow = np.zeros((H, W, 2), np.float32)
    moves = np.zeros((len(scene.objects) + 1, 2), np.int64)
    for o in scene.objects:
        dx, dy = (int(v) for v in rng.integers(-2, 3, 2))
        moves[o.index] = (dx, dy)
        ys, xs = np.nonzero(o.raster)
        ok = (ys + dy >= 0) & (ys + dy < H) & (xs + dx >= 0) & (xs + dx < W)
        img2[ys[ok] + dy, xs[ok] + dx] = PALETTE[o.colour]
        ids2[ys[ok] + dy, xs[ok] + dx] = o.index
        flow[ys, xs] = (dx, dy)
    for o in scene.objects:
        ys, xs = np.nonzero(o.raster)
        dx, dy = moves[o.index]
        inside = ((ys + dy >= 0) & (ys + dy < H) & (xs + dx >= 0) & (xs + dx < W)).all()
        if not inside or int((ids2 == o.index).sum()) != len(ys):
            moves[o.index] = (99, 99)
    free = scene.ids == 0
    if free.any() and rng.random() < 0.7:
        y, x = int(rng.integers(0, max(1, H - 3))), int(rng.integers(0, max(1, W - 3)))
        blk = np.zeros((H, W), bool)
        blk[y:y + 3, x:x + 3] = True
        flow[blk & free] = np.nan
    return img2, ids2, flow, moves


# -- tables ------------------------------------------------------------------------------------------------------
ODD_TEXT = ['"quoted', "comma, inside", "tab\there", "new\nline", "\u00e9t\u00e9 \u732b", "  spaced  ", "2020-01-01",
            "2021-03-04T10:11:12+02:00", "", "x'y", 'say "hi"', "-1", "0012"]


def caption(rng: np.random.Generator, file: str, row: int, kinds: list[str]) -> str:
    """A cell naming its file and row, with one odd piece from ``kinds``'s choices."""
    piece = str(rng.choice(kinds)) if kinds else ""
    body = f"{file} row {row}"
    return piece + " " + body if piece.startswith('"') else body + " " + piece


# -- audio -------------------------------------------------------------------------------------------------------
def audio_ramp(n: int, channels: int, offset: float = -0.8, slope: Optional[float] = None) -> tuple[np.ndarray, float]:
    """(C, n) float32 samples whose value encodes their own index: channel c holds offset + 0.05 c + slope * i."""
    slope = slope if slope is not None else 1.5 / max(n, 1)
    i = np.arange(n, dtype=np.float64)
    out = np.stack([offset + 0.05 * c + slope * i for c in range(channels)]).astype(np.float32)
    return out, slope


def write_wav_int16(path: str, data: np.ndarray, rate: int) -> None:
    """(C, N) float in [-1, 1) as a PCM_16 WAV with Python's wave module (an independent writer)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pcm = np.clip(np.round(data * 32768), -32768, 32767).astype("<i2")
    with wave.open(path, "wb") as w:
        w.setnchannels(data.shape[0])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.ascontiguousarray(pcm.T).tobytes())


def read_wav(path: str) -> tuple[np.ndarray, int, int]:
    """A WAV read with Python's wave module (PCM) or by hand (IEEE float): ((C, N) float64, rate, sampwidth)."""
    with open(path, "rb") as f:
        raw = f.read()
    fmt_at = raw.find(b"fmt ")
    tag, ch, rate = struct.unpack_from("<HHI", raw, fmt_at + 8)
    bits = struct.unpack_from("<H", raw, fmt_at + 22)[0]
    data_at = raw.find(b"data")
    size = struct.unpack_from("<I", raw, data_at + 4)[0]
    body = raw[data_at + 8:data_at + 8 + size]
    if tag == 3 or (tag == 0xFFFE and bits == 32 and False):
        a = np.frombuffer(body, "<f4").astype(np.float64)
    elif bits == 16:
        a = np.frombuffer(body, "<i2").astype(np.float64) / 32768
    else:
        a = np.frombuffer(body, "<f4").astype(np.float64)
    return a.reshape(-1, ch).T, rate, bits


# -- video -------------------------------------------------------------------------------------------------------
BLOCK_BITS = 6


def frame_colour(i: int) -> tuple[int, int, int]:
    """Frame i shows its index as a flat colour: R and G carry i's digits in base 8 (steps of 28), B = 128."""
    return 20 + 28 * (i % 8), 20 + 28 * ((i // 8) % 8), 128


def frame_index(frame: np.ndarray, gray: bool = False) -> int:
    """The index a stored frame shows (the median colour of its pixels that are neither the white object nor
    black padding or fill), -1 for a black frame."""
    a = frame.reshape(-1, frame.shape[-1]).astype(np.float64)
    keep = (a[:, :3].max(axis=1) < 240) & (a[:, :3].max(axis=1) > 12)
    if not gray:
        keep &= np.abs(a[:, 2] - 128) < 40     # the frame's own colour has B = 128 (padding, fill, object do not)
    if keep.sum() == 0:
        return -1
    med = np.median(a[keep], axis=0)
    if med.max() < 10:
        return -1
    if gray:
        return int(round(med[0]))
    r, g = int(round((med[0] - 20) / 28)), int(round((med[1] - 20) / 28))
    return r + 8 * g


def gray_level(i: int) -> int:
    """Frame i's luma in gray mode."""
    return 20 + 12 * i


def write_video(path: str, n: int, H: int, W: int, fps: Any, codec: str, audio: Optional[dict], gray_steps: bool,
                rotation: int = 0) -> dict:
    """A video of n frames whose frame i is flat :func:`frame_colour(i)` (or, with ``gray_steps``, luma
    20 + 12 i) with a white square object at a fixed place; an audio track (pcm_s16le) whose sample m holds
    ``offset + slope * m``. Returns what was written (pts of each frame, the audio's rate/slope)."""
    import av
    from fractions import Fraction

    os.makedirs(os.path.dirname(path), exist_ok=True)
    out = av.open(path, "w")
    st = out.add_stream(codec, rate=Fraction(fps).limit_denominator(1000))
    st.width, st.height = W, H
    st.pix_fmt = {"ffv1": "yuv444p", "mjpeg": "yuvj444p", "png": "rgb24"}.get(codec, "yuv420p")
    if rotation:
        st.set_display_rotation(rotation)   # (counter-clockwise, as players turn it: a phone's portrait video)
    if codec == "libx264":
        st.options = {"crf": "12", "bf": "2", "g": "4"}
    elif codec == "mpeg4":
        st.options = {"qscale": "2", "g": "5"}
        st.codec_context.qscale = 2
    ast = None
    if audio is not None:
        ast = out.add_stream("pcm_s16le", rate=audio["rate"])
        ast.layout = "mono" if audio["channels"] == 1 else "stereo"
    y0, x0 = H // 8, W // 8
    for i in range(n):
        if gray_steps:
            v = gray_level(i)
            a = np.full((H, W, 3), v, np.uint8)
        else:
            a = np.empty((H, W, 3), np.uint8)
            a[:] = frame_colour(i)
        a[y0:y0 + H // 5, x0:x0 + W // 5] = 255
        fr = av.VideoFrame.from_ndarray(a, format="rgb24")
        for p in st.encode(fr):
            out.mux(p)
    for p in st.encode():
        out.mux(p)
    if ast is not None:
        rate, chans = audio["rate"], audio["channels"]
        total = int(round(n / float(Fraction(fps)) * rate))
        samples, slope = audio_ramp(total, chans, offset=-0.5, slope=1.0 / max(total, 1))
        pcm = np.clip(np.round(samples * 32767), -32768, 32767).astype(np.int16)
        step = 1024
        for s in range(0, total, step):
            chunk = np.ascontiguousarray(pcm[:, s:s + step].T.reshape(1, -1))
            af = av.AudioFrame.from_ndarray(chunk, format="s16", layout=ast.layout.name)
            af.sample_rate = rate
            af.pts = s
            for p in ast.encode(af):
                out.mux(p)
        for p in ast.encode():
            out.mux(p)
    out.close()
    return {"object": [y0, x0, H // 5, W // 5]}


def pyav_frames(path: str, gray: bool = False) -> tuple[list[int], list[float]]:
    """The reference decode (PyAV, presentation order): each frame's shown index and its pts in seconds."""
    import av

    idx, pts = [], []
    with av.open(path) as c:
        s = c.streams.video[0]
        frames = sorted(c.decode(s), key=lambda f: f.pts)
        for f in frames:
            a = f.to_ndarray(format="rgb24")
            idx.append(frame_index(a, gray))
            pts.append(float(f.pts * s.time_base))
    return idx, pts


# -- volumes -----------------------------------------------------------------------------------------------------
def linear_volume(shape: tuple[int, int, int], coef: tuple[float, float, float], base: float) -> np.ndarray:
    """v[i, j, k] = base + a i + b j + c k over the stored (i, j, k) NIfTI axes: each voxel holds its place."""
    i, j, k = np.meshgrid(*(np.arange(n, dtype=np.float64) for n in shape), indexing="ij")
    return base + coef[0] * i + coef[1] * j + coef[2] * k


def label_of_volume(v: np.ndarray, t1: float, t2: float) -> np.ndarray:
    """A label volume that is a function of the (linear) intensity: 0 below t1, 3 in [t1, t2), 9 above."""
    return np.where(v >= t2, 9, np.where(v >= t1, 3, 0)).astype(np.uint8)
