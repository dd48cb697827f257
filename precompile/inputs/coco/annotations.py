"""One COCO image's annotations as compact arrays (:class:`CocoImage`), and what the worker does with them: the
annotation fields added beside the decoded image (boxes, box labels, keypoints, a mask drawn one object at a
time), moved by the image decoder's reduced scale and EXIF orientation. Also the checks of RLE counts and
polygons that both sides use, and an input refused at plan time failed before decoding (:func:`check_item`).
See :mod:`precompile.inputs.coco`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ... import errors
from ...errors import DecodeError, MissingDependencyError
from ...kinds import Kind
from ...sample import Tied
from ...storage.remote import is_url

#: the fields an ``inputs.coco`` adds (beside the image field)
BOXES, BOX_LABELS, KEYPOINTS, MASK = "boxes", "box_labels", "keypoints", "mask"
#: the index attribute holding the categories, keypoint names and skeleton (``Dataset.coco``)
ATTR = "coco"
#: bumped when the same file and options give other bytes (part of the recipe key, recipe.content_dict):
#: 2: coordinates scaled by reduced / source size per axis, masks sampled at the reduced pixels' centres,
#: EXIF orientations applied to boxes, keypoints and masks, RLE decoded here into cleared memory; 3: the boxes
#: are tied to the image they annotate (``of``), so a sibling field of another size no longer fails the input
OUTPUT_VERSION = 3
#: the stage named by an image's annotation errors
STAGE = "annotations"
#: the longest echo of a value from the file in a message
ECHO = 80
#: RLE counts are uint32 (pycocotools)
MAX_COUNT = (1 << 32) - 1


def echo(v: Any) -> str:
    """``repr(v)`` cut to :data:`ECHO` characters (:func:`precompile.errors.echo`: a message never carries a
    whole hostile value)."""
    return errors.echo(v, ECHO)


class BadImage(Exception):
    """One image's record or annotation is unusable: ``loc`` (``images[j]`` / ``annotations[j]``) and
    ``detail`` (naming the annotation and image ids and the file_name)."""

    def __init__(self, loc: str, detail: str):
        super().__init__(f"{loc}: {detail}")
        self.loc, self.detail = loc, detail


def pycocotools_mask() -> Any:
    """``pycocotools.mask``, or a :class:`MissingDependencyError` saying which extra to install."""
    try:
        from pycocotools import mask
    except ImportError as e:
        raise MissingDependencyError(f"COCO masks (inputs.coco.mask) need pycocotools: pip install "
                                     f"precompile[coco] ({e})") from None
    return mask


@dataclass(eq=False)
class CocoImage:
    """One image's annotations as compact arrays: what a worker needs, nothing more.

    ``boxes``/``labels``/``keypoints`` are the boxes in annotation order (crowd ones per the policy);
    ``segments`` the segmentation of each box (None without one), ``ignore`` the crowd regions of
    ``crowd: ignore``; both only when a mask is asked for. ``error``: ``(loc, detail)`` when the image's record
    or one of its annotations is unusable (the arrays are then empty and the input fails, :func:`check_item`).
    """

    image_id: int | str                 # COCO's are integers; some exports write strings
    height: int
    width: int
    boxes: np.ndarray                   # (N, 4) float32 x1 y1 x2 y2
    labels: np.ndarray                  # (N,) int64
    keypoints: Optional[np.ndarray]     # (N, K, 3) float32, or None
    segments: list = field(default_factory=list)
    ignore: list = field(default_factory=list)
    mask_dtype: str = "uint8"
    digest: str = ""
    error: tuple = ()

    def seal(self) -> "CocoImage":
        """Set :attr:`digest`: a hash of everything here that decides the sample's bytes (or its failure)."""
        h = hashlib.sha256(json.dumps([self.image_id, self.height, self.width]).encode())
        for a in (self.boxes, self.labels, self.keypoints):
            if a is not None:
                h.update(a.tobytes())
        for seg in self.segments + ["|"] + self.ignore:
            _hash_segment(h, seg)
        if self.error:
            h.update(json.dumps(list(self.error)).encode())
        self.digest = h.hexdigest()
        return self

    def failed(self, loc: str, detail: str) -> "CocoImage":
        """This image with no annotations and the error ``(loc, detail)``."""
        kp = None if self.keypoints is None else self.keypoints[:0]
        return dataclasses.replace(self, boxes=self.boxes[:0], labels=self.labels[:0], keypoints=kp, segments=[],
                                   ignore=[], error=(loc, detail)).seal()

    # -- worker side --------------------------------------------------------------------------------
    def add_fields(self, fields: dict[str, np.ndarray], kinds: dict[str, Kind], meta: dict[str, Any],
                   spec: Any, item: Any, budget: Optional[int] = None) -> None:
        """Add the annotation fields to a decoded sample (``spec``: the recipe's ``inputs.coco``; ``budget``:
        the bytes the input may take, ``limits.input_bytes``).

        The annotations describe the stored pixels at the JSON's size. The image decoder may have decoded a
        JPEG at 1/k (``meta[image]["reduce"]``: the image is then ceil(H/k) x ceil(W/k) and covers the whole
        source, so coordinates scale by that size over the source's, per axis) and turned it by its EXIF
        orientation (``meta[image]["orientation"]``, 2..8): boxes, keypoints and the mask are moved alike."""
        m = meta.get(spec.image) or {}
        path, key = item.paths[spec.image], item.key
        k, o = int(m.get("reduce", 1)), int(m.get("orientation", 1))
        hr, wr = self._check_size(fields[spec.image], k, o, path, key, spec.image)
        meta[ATTR] = {"image_id": self.image_id}
        sy, sx = hr / self.height, wr / self.width
        boxes = self.boxes if k == 1 else (self.boxes * np.array([sx, sy, sx, sy])).astype(np.float32)
        fields[BOXES] = orient_boxes(boxes, o, wr, hr)
        kinds[BOXES] = Tied(Kind.BOXES, spec.image)   # the grid they are on, where a sibling field differs
        fields[BOX_LABELS] = self.labels.copy()
        kinds[BOX_LABELS] = Kind.BOX_LABELS
        if spec.keypoints:
            kp = self.keypoints.copy()
            if k != 1:
                kp[..., :2] = (kp[..., :2] * np.array([sx, sy])).astype(np.float32)
            if o in MIRRORS and (kp[..., 2] > 0).any():
                raise DecodeError(f"image id {_id(self.image_id)} ({echo(key)}) has labelled keypoints and its EXIF "
                                  f"orientation {o} mirrors the image: which keypoints then swap sides (left and "
                                  f"right) is not known here; decode it with exif_transpose: false (the annotations "
                                  f"describe the stored pixels)", path=path, stage=STAGE, field=spec.image, key=key)
            fields[KEYPOINTS] = orient_keypoints(kp, o, wr, hr)
            kinds[KEYPOINTS] = Kind.KEYPOINTS
        if spec.mask != "none":
            grid = None if k == 1 else (sample_grid(self.height, hr), sample_grid(self.width, wr))
            held = sum(int(a.nbytes) for a in fields.values())
            need = self.raster_bytes(np.dtype(self.mask_dtype), grid)
            if budget is not None and need + held > budget:
                from ...decoders.base import fmt_bytes

                n = len([s for s in self.segments if s is not None]) + len(self.ignore)
                raise DecodeError(f"image id {_id(self.image_id)} ({echo(key)}): drawing its mask of "
                                  f"{self.height}x{self.width} pixels ({n} object{'s' if n != 1 else ''}) needs "
                                  f"{fmt_bytes(need)} beside the {fmt_bytes(held)} its decoded fields hold, over the "
                                  f"per-input budget of {fmt_bytes(budget)} (limits.input_bytes)", path=path,
                                  stage=STAGE, field=spec.image, key=key)
            mask = self.rasterise(spec.mask, np.dtype(self.mask_dtype), grid)
            fields[MASK] = np.ascontiguousarray(orient_array(mask, o)[..., None])
            kinds[MASK] = Tied(Kind.MASK, BOXES) if spec.mask == "instance" else Kind.MASK   # ids follow boxes

    def _check_size(self, image: np.ndarray, k: int, o: int, path: str, key: str, fname: str) -> tuple[int, int]:
        """The (height, width) of the stored pixels at the decode scale; the decoded image must be that, turned
        by its orientation."""
        from ...decoders.jpeg_reduce import reduced_size

        hr, wr = reduced_size(self.height, self.width, k)
        want = (wr, hr) if o in TURNS else (hr, wr)
        got = tuple(image.shape[:2])
        if got != want:
            how = [f"decoded at 1/{k} scale"] if k != 1 else []
            how += [f"turned by its EXIF orientation {o}"] if o in ORIENTATIONS else []
            how_s = f" ({', '.join(how)})" if how else ""
            exp = f", so it should be {want[0]}x{want[1]}" if how else ""
            raise DecodeError(f"the image is {got[0]}x{got[1]} (h x w){how_s} but the annotation file gives "
                              f"{self.height}x{self.width} for image id {_id(self.image_id)} ({echo(key)}){exp}",
                              path=path, stage="decode", field=fname, key=key)
        return hr, wr

    def raster_bytes(self, dtype: np.dtype, grid: Optional[tuple[np.ndarray, np.ndarray]] = None) -> int:
        """What :meth:`rasterise` holds at its peak: the output, one object's mask at the JSON's size and its
        comparison (and their sampled copies), pycocotools' working arrays for the longest polygon (about 20
        bytes for each of 5 points per pixel of its outline) and the largest decoded RLE."""
        h, w = self.height, self.width
        oh, ow = (h, w) if grid is None else (len(grid[0]), len(grid[1]))
        work = 0
        for seg in [*self.segments, *self.ignore]:
            if isinstance(seg, list):
                work = max(work, sum(20 * (5 * _outline(p) + p.size) for p in seg))
            elif isinstance(seg, dict):
                c = seg["counts"]
                work = max(work, 24 * len(c))
        return oh * ow * dtype.itemsize + 2 * h * w + (2 * oh * ow if grid is not None else 0) + work

    def rasterise(self, mode: str, dtype: np.dtype, grid: Optional[tuple[np.ndarray, np.ndarray]] = None) -> np.ndarray:
        """The (H, W) mask: ``semantic`` (label + 1) or ``instance`` (box index + 1); see the module doc.
        ``grid``: the source rows and columns to sample (a reduced decode, :func:`sample_grid`). Objects are
        decoded one at a time and drawn into the output; their order (largest first) comes from their RLE
        areas, so no two masks are held at once."""
        h, w = self.height, self.width
        out = np.zeros((h, w) if grid is None else (len(grid[0]), len(grid[1])), dtype=dtype)

        def draw(enc: Any, value: int) -> None:
            m = _decode(enc, h, w)
            if grid is not None:
                m = m[np.ix_(*grid)]
            out[m > 0] = value

        top = np.iinfo(dtype).max
        for seg in self.ignore:
            draw(_encode(seg, h, w), top)
        objs = [(i, _encode(s, h, w)) for i, s in enumerate(self.segments) if s is not None]
        objs.sort(key=lambda o: -_area(o[1]))   # stable: equal sizes keep annotation order (later on top)
        for i, enc in objs:
            draw(enc, (self.labels[i] + 1) if mode == "semantic" else (i + 1))
        return out


#: EXIF orientations that turn the image a quarter (height and width swap), and those that mirror it
ORIENTATIONS = (2, 3, 4, 5, 6, 7, 8)
TURNS = (5, 6, 7, 8)
MIRRORS = (2, 4, 5, 7)


def _id(iid: Any) -> str:
    return echo(iid) if isinstance(iid, str) else str(iid)


def sample_grid(n: int, m: int) -> np.ndarray:
    """The source indices (of ``n``) whose pixels a reduced axis of ``m`` pixels shows: each reduced pixel's
    centre mapped onto the source, ``floor((i + 0.5) * n / m)`` (the reduced image covers the whole source)."""
    return np.minimum((2 * np.arange(m, dtype=np.int64) + 1) * n // (2 * m), n - 1)


def orient_xy(x: np.ndarray, y: np.ndarray, o: int, w: int, h: int) -> tuple[np.ndarray, np.ndarray]:
    """Points of a ``w`` x ``h`` image where Pillow's ``exif_transpose`` puts them for EXIF orientation ``o``
    (pixel-edge coordinates: x in [0, w])."""
    return {1: (x, y), 2: (w - x, y), 3: (w - x, h - y), 4: (x, h - y), 5: (y, x), 6: (h - y, x),
            7: (h - y, w - x), 8: (y, w - x)}.get(o, (x, y))


def orient_boxes(b: np.ndarray, o: int, w: int, h: int) -> np.ndarray:
    """Boxes x1 y1 x2 y2 of a ``w`` x ``h`` image turned by orientation ``o`` (corners ordered again)."""
    if o not in ORIENTATIONS:
        return b.copy()
    x1, y1 = orient_xy(b[:, 0], b[:, 1], o, w, h)
    x2, y2 = orient_xy(b[:, 2], b[:, 3], o, w, h)
    return np.stack([np.minimum(x1, x2), np.minimum(y1, y2), np.maximum(x1, x2), np.maximum(y1, y2)],
                    axis=1).astype(np.float32)


def orient_keypoints(kp: np.ndarray, o: int, w: int, h: int) -> np.ndarray:
    """Keypoints (N, K, 3) of a ``w`` x ``h`` image turned by orientation ``o`` (visibility kept)."""
    if o not in ORIENTATIONS:
        return kp
    out = kp.copy()
    out[..., 0], out[..., 1] = orient_xy(kp[..., 0], kp[..., 1], o, w, h)
    return out


def orient_array(a: np.ndarray, o: int) -> np.ndarray:
    """An (H, W) array turned as Pillow's ``exif_transpose`` turns an image of EXIF orientation ``o``."""
    return {2: lambda: a[:, ::-1], 3: lambda: a[::-1, ::-1], 4: lambda: a[::-1], 5: lambda: a.T,
            6: lambda: a.T[:, ::-1], 7: lambda: a.T[::-1, ::-1], 8: lambda: a.T[::-1]}.get(o, lambda: a)()


def check_item(recipe: Any, item: Any) -> None:
    """Fail an input whose image record or annotations were refused at plan time (:attr:`CocoImage.error`),
    before anything is decoded: a :class:`DecodeError` at stage ``annotations`` naming the annotation file,
    the entry, the image and the input."""
    err = getattr(item.annotations, "error", None)
    if err:
        fname = recipe.model.inputs.coco.image
        raise DecodeError(f"{coco_path(recipe)}: {err[0]}: {err[1]}", path=item.paths.get(fname), stage=STAGE,
                          field=fname, key=item.key)


def mask_dtype(mode: str, num_classes: Optional[int]) -> np.dtype:
    """uint8 for a semantic mask of up to 254 categories (255 is left for ``crowd: ignore``), else uint16."""
    if mode == "semantic" and (num_classes is None or num_classes <= 254):
        return np.dtype(np.uint8)
    return np.dtype(np.uint16)


def rle_counts(counts: Any, h: int, w: int) -> np.ndarray:
    """An RLE's run lengths as uint32, checked: ``counts`` a list of whole numbers (uncompressed) or COCO's
    compressed text (:func:`_text_counts`), each from 0 to 2**32 - 1, summing to exactly ``h`` x ``w`` (what
    pycocotools assumes and does not check: a shorter RLE left memory unwritten, a longer one wrote past it).
    A ValueError says what is wrong."""
    if isinstance(counts, (str, bytes)):
        c = _text_counts(counts.decode("latin-1") if isinstance(counts, bytes) else counts)
    elif isinstance(counts, np.ndarray):
        c = counts.astype(np.int64)
    else:
        if not isinstance(counts, list) or not all(type(v) is int and 0 <= v <= MAX_COUNT for v in counts):
            raise ValueError(f"RLE counts must be whole numbers from 0 to {MAX_COUNT}")
        c = np.asarray(counts, dtype=np.int64)
    if c.size and (int(c.min()) < 0 or int(c.max()) > MAX_COUNT):
        raise ValueError(f"RLE counts must be whole numbers from 0 to {MAX_COUNT}")
    total = int(c.sum())
    if total != h * w:
        raise ValueError(f"RLE counts sum to {total}, not its image's {h} x {w} = {h * w} pixels")
    return c.astype(np.uint32)


def _text_counts(s: str) -> np.ndarray:
    """Decode COCO's compressed RLE text (pycocotools' ``rleFrString``), checked: each number is 5-bit groups
    in characters '0'..'o' (48 + value, bit 0x20: more groups follow), the last group's 0x10 the sign; from the
    fourth number on each is a difference from the number two before it. Vectorised (int64: exact)."""
    b = np.frombuffer(s.encode("utf-8"), np.uint8)
    bad = np.flatnonzero((b < 48) | (b > 111))
    if bad.size:
        raise ValueError(f"RLE counts text is not COCO's compressed RLE (a character outside '0'..'o' at "
                         f"{int(bad[0])})")
    c = b.astype(np.int64) - 48
    more = (c & 0x20) != 0
    if c.size and more[-1]:
        raise ValueError("RLE counts text is not COCO's compressed RLE (it ends inside a number)")
    ends = np.flatnonzero(~more)
    if not ends.size:
        return np.zeros(0, np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1])
    lens = ends - starts + 1
    if int(lens.max()) > 7:
        raise ValueError(f"RLE counts text is not COCO's compressed RLE (a number of more than 7 characters at "
                         f"{int(starts[np.argmax(lens > 7)])})")
    pos = np.arange(c.size) - np.repeat(starts, lens)
    x = np.add.reduceat((c & 0x1f) << (5 * pos), starts)
    x -= np.where((c[ends] & 0x10) != 0, np.left_shift(1, 5 * lens), 0)   # sign-extend negative numbers
    out = x.copy()
    out[1::2] = np.cumsum(x[1::2])      # numbers 3, 5, ... add the one two before: 1, 3, 5, ... cumulate
    out[2::2] = np.cumsum(x[2::2])      # and 4, 6, ... from number 2 on
    return out


def check_polygons(polys: list[np.ndarray], h: int, w: int) -> None:
    """Every coordinate within one image size of the image: x in [-w, 2w], y in [-h, 2h]. pycocotools draws a
    polygon through 5 points per pixel of its outline (in C ints): at 1e8 it crashed, at 2e7 it took gigabytes."""
    for p in polys:
        x, y = p[0::2], p[1::2]
        out = (x < -w) | (x > 2 * w) | (y < -h) | (y > 2 * h)
        if out.any():
            i = int(np.argmax(out))
            raise ValueError(f"a polygon coordinate ({x[i]:g}, {y[i]:g}) is outside the image's margin: x must lie "
                             f"in [{-w}, {2 * w}] and y in [{-h}, {2 * h}] (one image width and height beyond "
                             f"its edges)")


def _outline(p: np.ndarray) -> int:
    """A polygon's outline in pixels, as pycocotools walks it (the longer axis of each edge)."""
    x, y = p[0::2], p[1::2]
    return int(np.maximum(np.abs(x - np.roll(x, -1)), np.abs(y - np.roll(y, -1))).sum()) + 1


def _encode(seg: Any, h: int, w: int) -> Any:
    """One object's segmentation in a compact form to draw from: an RLE's checked counts (uint32), or the
    RLE pycocotools makes of its polygons (several polygons are one object: merged)."""
    if isinstance(seg, dict):
        return rle_counts(seg["counts"], h, w)
    mask = pycocotools_mask()
    return mask.merge(mask.frPyObjects([p.tolist() for p in seg], h, w))


def _area(enc: Any) -> int:
    """The pixel count of an object :func:`_encode` made."""
    if isinstance(enc, np.ndarray):
        return int(enc[1::2].sum(dtype=np.int64))
    return int(pycocotools_mask().area(enc))


def _decode(enc: Any, h: int, w: int) -> np.ndarray:
    """The (h, w) uint8 mask of an object :func:`_encode` made: checked counts expand into a new array (never
    memory left unwritten), pycocotools' own RLEs (whose counts sum to h x w) through its decoder."""
    if isinstance(enc, np.ndarray):
        vals = np.zeros(len(enc), np.uint8)
        vals[1::2] = 1
        return np.repeat(vals, enc).reshape(w, h).T   # counts run down the columns
    with warnings.catch_warnings():   # pycocotools' Cython decode calls np.array(copy=False) on its own class
        warnings.filterwarnings("ignore", r"__array__ implementation doesn't accept a copy keyword", DeprecationWarning)
        return pycocotools_mask().decode(enc)


def decode_segment(seg: Any, h: int, w: int) -> np.ndarray:
    """One object's (h, w) uint8 mask from its segmentation: polygons (a list of coordinate arrays) or an RLE
    dict (``counts`` a string, compressed, or a list, uncompressed; checked by :func:`rle_counts`)."""
    if not isinstance(seg, dict) and not seg:
        return np.zeros((h, w), dtype=np.uint8)
    return _decode(_encode(seg, h, w), h, w)


def _hash_segment(h: Any, seg: Any) -> None:
    """Feed one segmentation to ``h``: its form, then its numbers (lengths delimit the polygons)."""
    if seg is None or isinstance(seg, str):
        h.update(f"<{seg}>".encode())
    elif isinstance(seg, dict):
        counts = seg["counts"]
        h.update(f"<rle {seg['size']} {len(counts)}>".encode())
        h.update(counts.encode() if isinstance(counts, str) else counts.tobytes())
    else:
        for p in seg:
            h.update(f"<poly {p.size}>".encode())
            h.update(p.tobytes())


def coco_path(recipe: Any) -> str:
    """The annotation file's path (relative paths are relative to the recipe's folder, like ``inputs.root``)
    or URL."""
    file = recipe.model.inputs.coco.file
    if is_url(file):
        return file
    return os.path.normpath(os.path.join(recipe.base_dir, os.path.expanduser(file)))
