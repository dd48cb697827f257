"""COCO annotation files as inputs (``inputs.coco``): one sample per image, with its boxes, box labels and,
on request, keypoints and a mask.

The JSON is read once, in the parent at plan time (:func:`load_coco`): categories are numbered in id order
(COCO's ids have gaps: 1..90 for 80 classes), annotations are checked and grouped by image in one pass, and
each image becomes an :class:`~precompile.compiler.plan.Item` carrying a :class:`CocoImage`: its
annotations as compact arrays (never the whole JSON). In the worker, :meth:`CocoImage.add_fields` adds the
annotation fields beside the decoded image:

- ``boxes`` (N, 4) float32, x1 y1 x2 y2 from COCO's ``bbox`` [x, y, w, h], in pixels of the decoded image;
- ``box_labels`` (N,) int64, the category's position in id order (its name is ``label_names[id]``);
- ``keypoints`` (N, K, 3) float32 (``keypoints: true``): x, y, v; zeros for a box of a category without
  keypoints;
- ``mask`` (H, W, 1) (``mask: semantic | instance``), rasterised with pycocotools from polygons (several per
  object) and RLE (compressed or not): ``semantic`` holds box label + 1 (0 = background), ``instance`` the
  box's index + 1. Where objects overlap the smaller one (fewer pixels) is drawn last, so it stays visible;
  equal sizes: the later annotation is on top. ``crowd: ignore`` regions are drawn first, with the dtype's
  largest value.

and the sample's meta gets ``{"coco": {"image_id": ...}}``. The categories, keypoint names and skeleton go
to the index attribute ``coco`` (``Dataset.coco``); the category names are the build's ``label_names``.

Every value is checked at plan time before it reaches pycocotools or a stored array: boxes and keypoints finite
as float32, RLE counts that sum to the image's height x width (compressed texts decoded here,
:func:`rle_counts`), polygon coordinates within one image size of the image (:func:`check_polygons`). A problem
with the file as a whole (not JSON, nested too deeply, bad categories, an annotation naming no listed image,
duplicate ids) is a :class:`RecipeError` naming the file. A problem with one image's record or one of its
annotations is that image's (:attr:`CocoImage.error`): under ``on_error: fail`` the plan stops with it
(:func:`load_coco`), under ``skip`` that input fails (stage ``annotations``, :func:`check_item`) and the rest
build. So does a path that leaves ``inputs.root`` (``file_name`` or a field's template over ``image_id``), and
an image missing on disk (``on_error`` applies). Masks are drawn one object at a time into the output, under
the per-input budget ``limits.input_bytes`` (:meth:`CocoImage.rasterise`). Each image's annotations are part of
its input fingerprint (:attr:`CocoImage.digest`, used by ``keys.shard_key``), so changing one rebuilds one
shard.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ... import errors
from ...errors import DecodeError, MissingDependencyError, RecipeError
from ...kinds import Kind
from ...sample import FieldSpec, Tied

#: the fields an ``inputs.coco`` adds (beside the image field)
BOXES, BOX_LABELS, KEYPOINTS, MASK = "boxes", "box_labels", "keypoints", "mask"
#: the index attribute holding the categories, keypoint names and skeleton (``Dataset.coco``)
ATTR = "coco"
#: bumped when the same file and options give other bytes (part of the recipe key, recipe.content_dict):
#: 2: coordinates scaled by reduced / source size per axis, masks sampled at the reduced pixels' centres,
#: EXIF orientations applied to boxes, keypoints and masks, RLE decoded here into cleared memory
OUTPUT_VERSION = 2
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
        kinds[BOXES] = Kind.BOXES
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


# -- plan side: the JSON, parsed once ------------------------------------------------------------

@dataclass
class CocoParse:
    """What the annotation file gives, whatever ``inputs.root`` and the fields' paths are: every image
    (file order) as ``(file_name, height, width)`` and its :class:`CocoImage`, the label names (categories in
    id order), the index attribute (:data:`ATTR`), the keypoints per category and the mask dtype. This is
    what :mod:`.coco_cache` keeps in the output folder."""

    images: dict[Any, tuple[str, int, int]]
    annotations: dict[Any, CocoImage]
    label_names: list[str]
    attrs: dict[str, Any]
    num_keypoints: int
    mask_dtype: str

    def specs(self, spec: Any) -> dict[str, FieldSpec]:
        """The annotation fields' specs under ``spec`` (the recipe's ``inputs.coco``)."""
        return _specs(spec, self.num_keypoints, np.dtype(self.mask_dtype), len(self.label_names))


@dataclass
class CocoSource:
    """What :func:`load_coco` makes of the annotation file: the plan's items (key order), the label names
    (categories in id order), the annotation fields' specs and the index attribute (:data:`ATTR`).
    ``pending``: the parse to keep in the output folder once the build holds its lock
    (:class:`.coco_cache.Pending`; None when it was read from there, or no cache was asked for)."""

    table: Any   # an ItemTable (compiler/items.py): keys, paths, each image's annotations
    factors: dict[str, tuple[np.ndarray, list]]   # the captures (file_name, stem, image_id) a split: reads
    label_names: list[str]
    specs: dict[str, FieldSpec]
    attrs: dict[str, Any]
    pending: Any = None

    @property
    def items(self) -> Any:
        from ..items import Items

        return Items(self.table)


def coco_path(recipe: Any) -> str:
    """The annotation file's path (relative paths are relative to the recipe's folder, like ``inputs.root``)
    or URL."""
    from ...storage.remote import is_url

    file = recipe.model.inputs.coco.file
    if is_url(file):
        return file
    return os.path.normpath(os.path.join(recipe.base_dir, os.path.expanduser(file)))


def _file_bytes(path: str, recipe: Any) -> bytes:
    """The annotation file's bytes: a local file, or a URL's object fetched whole (``inputs.storage_options``;
    the store's refusals are a PlanError naming the URL)."""
    from ...storage.remote import filesystem, is_url, store_error

    if not is_url(path):
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise RecipeError(f"cannot read the COCO annotation file {path}: {e.strerror or e}",
                              source=recipe.source, loc="inputs.coco.file") from None
    fs = filesystem(path, recipe.model.inputs.storage_options)
    try:
        return fs.cat_file(path)
    except Exception as e:  # OSErrors, and the store's own errors (botocore's NoCredentialsError, ...)
        raise store_error(f"COCO annotation file {path!r}", path, e, "read") from None


def read_json(path: str, recipe: Any) -> dict:
    """The parsed file; unreadable or malformed JSON is a :class:`RecipeError` naming it."""
    raw = _file_bytes(path, recipe)
    try:
        data = json.loads(raw)
    except RecursionError:   # the C scanner counts its depth against Python's recursion limit: bounded memory
        raise RecipeError(f"not valid JSON: nested more deeply than the JSON reader allows (about "
                          f"{sys.getrecursionlimit()} levels, Python's recursion limit; a COCO file needs 5)",
                          source=path) from None
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        where = f"line {e.lineno}, column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise RecipeError(f"not valid JSON: {where}", source=path) from None
    if not isinstance(data, dict):
        raise RecipeError(f"expected a JSON object with images, annotations and categories, got "
                          f"{type(data).__name__}", source=path)
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key, []), list) or (key == "images" and key not in data):
            raise RecipeError(f"{key!r} must be a list" if key in data else "has no 'images' list", source=path)
    return data


@dataclass
class _Categories:
    ids: dict[int, int]                 # COCO category id -> contiguous label id (id order)
    names: list[str]
    records: list[dict]                 # {id, name, supercategory} in label order
    keypoints: list[str]                # the keypoint names (the categories that have them share them)
    skeleton: list
    has_keypoints: set[int]             # label ids of the categories with keypoints


def _categories(data: dict, path: str) -> _Categories:
    cats = data.get("categories", [])
    seen: dict[int, int] = {}
    for j, c in enumerate(cats):
        if not isinstance(c, dict) or type(c.get("id")) is not int or not isinstance(c.get("name"), str):
            raise RecipeError("a category needs an integer id and a name", source=path, loc=f"categories[{j}]")
        if c["id"] in seen:
            raise RecipeError(f"category id {c['id']} is listed twice (categories[{seen[c['id']]}] too)",
                              source=path, loc=f"categories[{j}]")
        seen[c["id"]] = j
    order = sorted(seen)
    records = [cats[seen[i]] for i in order]
    kp_names: Optional[list] = None
    skeleton: list = []
    has = set()
    for lab, c in enumerate(records):
        names = c.get("keypoints") or []
        if not names:
            continue
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise RecipeError("keypoints must be a list of names", source=path, loc=f"categories[{seen[c['id']]}]")
        if kp_names is not None and names != kp_names:
            raise RecipeError(f"category {c['name']!r} has other keypoints than another category "
                              f"({len(names)} vs {len(kp_names)}); one keypoints field needs one list",
                              source=path, loc=f"categories[{seen[c['id']]}]")
        kp_names, skeleton = names, c.get("skeleton") or skeleton
        has.add(lab)
    return _Categories({i: lab for lab, i in enumerate(order)}, [c["name"] for c in records],
                       [{"id": c["id"], "name": c["name"], "supercategory": c.get("supercategory")} for c in records],
                       kp_names or [], skeleton, has)


#: the largest height or width an image record may give
MAX_SIDE = (1 << 31) - 1


def _images(data: dict, path: str) -> tuple[dict[Any, tuple[str, int, int]], dict[Any, tuple[str, str]]]:
    """``{image id: (file_name, height, width)}`` (ids and file names unique) and the errors of the images
    whose record is unusable: ``{image id: (loc, detail)}`` (a size that is not a positive whole number, a
    file_name that is not a relative path inside the root; such an image's size is 0 x 0)."""
    out: dict[Any, tuple[str, int, int]] = {}
    errors: dict[Any, tuple[str, str]] = {}
    names: dict[str, Any] = {}
    for j, im in enumerate(data["images"]):
        loc = f"images[{j}]"
        if not isinstance(im, dict) or type(im.get("id")) not in (int, str) or not isinstance(im.get("file_name"), str) \
                or not im["file_name"]:
            raise RecipeError("an image needs an id (an integer or a string) and a file_name", source=path, loc=loc)
        iid, fn = im["id"], im["file_name"]
        if iid in out:
            raise RecipeError(f"image id {_id(iid)} is listed twice", source=path, loc=loc)
        if fn in names:
            raise RecipeError(f"image id {_id(iid)}: file_name {echo(fn)} is also image id {_id(names[fn])}'s (a "
                              f"sample key must be unique)", source=path, loc=loc)
        names[fn] = iid
        h, w = im.get("height"), im.get("width")
        if not all(type(v) is int and 1 <= v <= MAX_SIDE for v in (h, w)):
            errors[iid] = (loc, f"image id {_id(iid)} ({echo(fn)}): height and width must be whole numbers from 1 "
                                f"to {MAX_SIDE}, got {echo(h)} and {echo(w)}")
            h = w = 0
        elif leaves_root(fn) or "\\" in fn:
            errors[iid] = (loc, f"image id {_id(iid)}: file_name {echo(fn)} must be a relative path inside "
                                f"inputs.root")
        out[iid] = (fn, h, w)
    if not out:
        raise RecipeError("lists no images", source=path, loc="images")
    return out, errors


def leaves_root(rel: str) -> bool:
    """Whether a path made from the file (relative to ``inputs.root``, '/'-separated) leaves the root as
    written: absolute, a '..' part, or a NUL byte (what the plan checks; symlinks are resolved when the
    input is read, compiler/shard.py)."""
    return rel.startswith("/") or ".." in rel.split("/") or "\0" in rel


#: a float64 rounds to an infinite float32 from here on (half an ulp past float32's largest, ties to even)
F32_LIMIT = 2.0 ** 128 - 2.0 ** 103


def _finite_f64(v: Any) -> float:
    try:
        return float(v)
    except OverflowError:   # an integer past float's range
        return math.inf


def _annotation(a: dict, j: int, images: dict, cats: _Categories) -> tuple:
    """``(id, image id, label, bbox, crowd)`` of one annotation whose image is known; a :class:`BadImage`
    for its image when it is unusable."""
    loc, aid, iid = f"annotations[{j}]", a.get("id"), a["image_id"]
    who = f"annotation id {_id(aid)} (image id {_id(iid)}, {echo(images[iid][0])})"
    bbox = a.get("bbox")
    if type(aid) is not int or "category_id" not in a or not isinstance(bbox, list) or len(bbox) != 4 \
            or not all(type(v) in (int, float) and math.isfinite(_finite_f64(v)) for v in bbox):
        raise BadImage(loc, f"{who}: needs an integer id, image_id, category_id and bbox [x, y, w, h] of 4 numbers")
    label = cats.ids.get(a["category_id"]) if type(a["category_id"]) is int else None
    if label is None:
        raise BadImage(loc, f"{who}: category_id {echo(a['category_id'])} is not in categories")
    if bbox[2] < 0 or bbox[3] < 0:
        raise BadImage(loc, f"{who}: bbox {echo(bbox)} has a negative width or height")
    x, y, bw, bh = (float(v) for v in bbox)
    if not all(abs(v) < F32_LIMIT for v in (x, y, x + bw, y + bh)):   # stored as float32 (_image): inf there
        with np.errstate(over="ignore"):
            stored = np.array([x, y, x + bw, y + bh]).astype(np.float32)
        raise BadImage(loc, f"{who}: bbox {echo(bbox)} is not finite as float32 (x1 y1 x2 y2 = "
                            f"{' '.join(f'{v:g}' for v in stored)})")
    crowd = a.get("iscrowd", 0)
    if crowd not in (0, 1):
        raise BadImage(loc, f"{who}: iscrowd must be 0 or 1, got {echo(crowd)}")
    return aid, iid, label, bbox, bool(crowd)


def _group(data: dict, path: str, images: dict, cats: _Categories, crowd: str,
           errors: dict[Any, tuple[str, str]]) -> dict[Any, list]:
    """One pass over the annotations: ``{image id: [(index, checked annotation), ...]}`` in file order
    (every image present, with [] when it has none); ``crowd: drop`` leaves crowd annotations out. An
    annotation that names no listed image, or whose id another has, is an error of the file; any other
    problem is its image's (the first one is kept in ``errors``)."""
    per: dict[Any, list] = {iid: [] for iid in images}
    seen: dict[int, int] = {}
    for j, a in enumerate(data.get("annotations", [])):
        loc = f"annotations[{j}]"
        if not isinstance(a, dict):
            raise RecipeError("an annotation must be an object with an id, image_id, category_id and bbox",
                              source=path, loc=loc)
        aid = a.get("id")
        who = f"annotation id {_id(aid)}" if aid is not None else "annotation"
        iid = a.get("image_id")
        if "image_id" not in a:
            raise RecipeError(f"{who}: needs an integer id, image_id, category_id and bbox [x, y, w, h] of 4 "
                              f"numbers", source=path, loc=loc)
        if type(iid) not in (int, str) or iid not in images:
            raise RecipeError(f"{who}: image_id {echo(iid)} is not in images", source=path, loc=loc)
        if type(aid) is int:
            if aid in seen:
                raise RecipeError(f"annotation id {aid} is listed twice (annotations[{seen[aid]}] too)", source=path,
                                  loc=loc)
            seen[aid] = j
        if iid in errors:
            continue   # its image fails already
        try:
            row = _annotation(a, j, images, cats)
        except BadImage as e:
            errors[iid] = (e.loc, e.detail)
            continue
        if row[4] and crowd == "drop":
            continue
        per[iid].append((j, row))
    return per


def _keypoints(a: dict, j: int, who: str, k: int) -> np.ndarray:
    kp = a.get("keypoints")
    if kp is None:
        return np.zeros((k, 3), dtype=np.float32)
    if not isinstance(kp, list) or len(kp) != 3 * k or not all(type(v) in (int, float) for v in kp):
        raise BadImage(f"annotations[{j}]", f"{who}: keypoints must be {3 * k} numbers (x, y, v for each of the "
                                            f"category's {k} keypoints)")
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.array([_finite_f64(v) for v in kp]).astype(np.float32).reshape(k, 3)
    bad = ~np.isfinite(out).all(axis=1)
    if bad.any():
        i = int(np.argmax(bad))
        raise BadImage(f"annotations[{j}]", f"{who}: keypoints are not finite as float32 (keypoint {i}: "
                                            f"{' '.join(f'{v:g}' for v in out[i])})")
    return out


def _segment(a: dict, j: int, who: str, h: int, w: int) -> Any:
    """A checked segmentation: a list of polygon arrays (those under 3 points dropped: they hold no pixel; the
    others within the image's margin, :func:`check_polygons`), an RLE dict (``counts`` a string, or a uint32
    array when uncompressed; either summing to h x w, :func:`rle_counts`), or None when there is none."""
    seg = a.get("segmentation")
    loc = f"annotations[{j}]"
    if seg is None or seg == []:
        return None
    if isinstance(seg, list):
        try:
            polys = [np.asarray(p, dtype=np.float64) for p in seg if isinstance(p, list)]
        except (TypeError, ValueError, OverflowError):
            polys = []
        if len(polys) != len(seg) or not all(p.ndim == 1 and p.size % 2 == 0 for p in polys):
            raise BadImage(loc, f"{who}: a polygon segmentation is a list of [x1, y1, x2, y2, ...] lists of finite "
                                f"numbers")
        flat = np.concatenate(polys) if len(polys) > 1 else polys[0] if polys else np.zeros(0)
        if not np.isfinite(flat).all():
            raise BadImage(loc, f"{who}: a polygon segmentation is a list of [x1, y1, x2, y2, ...] lists of finite "
                                f"numbers")
        kept = [p for p in polys if p.size >= 6]
        try:
            check_polygons([flat] if len(kept) == len(polys) else kept, h, w)   # x, y alternate across polygons
        except ValueError as e:
            raise BadImage(loc, f"{who}: {e}") from None
        return kept or None
    if isinstance(seg, dict):
        counts = seg.get("counts")
        if seg.get("size") != [h, w]:
            raise BadImage(loc, f"{who}: RLE size {echo(seg.get('size'))} is not its image's [height, width] "
                                f"{[h, w]}")
        if isinstance(counts, (str, list)):
            try:
                c = rle_counts(counts, h, w)
            except ValueError as e:
                raise BadImage(loc, f"{who}: {e}") from None
            return {"counts": counts if isinstance(counts, str) else c, "size": [h, w]}
    raise BadImage(loc, f"{who}: segmentation must be polygons or an RLE {{counts, size}}")


def _empty(iid: Any, info: tuple, spec: Any, k: int, dtype: np.dtype) -> CocoImage:
    """An image without annotations (a failed image's arrays)."""
    kp = np.zeros((0, k, 3), np.float32) if spec.keypoints else None
    return CocoImage(iid, info[1], info[2], np.zeros((0, 4), np.float32), np.zeros(0, np.int64), kp,
                     mask_dtype=dtype.name)


def _image(iid: Any, info: tuple, rows: list, anns: list, cats: _Categories, spec: Any,
           dtype: np.dtype) -> CocoImage:
    """One image's :class:`CocoImage` from its checked annotations (a :class:`BadImage` when its keypoints or
    a segmentation are unusable)."""
    fn, h, w = info
    ignore = [r for r in rows if r[1][4] and spec.crowd == "ignore"]
    rows = [r for r in rows if not (r[1][4] and spec.crowd == "ignore")]
    xywh = np.asarray([r[1][3] for r in rows], dtype=np.float64).reshape(-1, 4)
    boxes = np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], axis=1).astype(np.float32)
    labels = np.asarray([r[1][2] for r in rows], dtype=np.int64)

    def who(j: int) -> str:
        return f"annotation id {anns[j]['id']} (image id {_id(iid)}, {echo(fn)})"
    kp = None
    if spec.keypoints:
        k = len(cats.keypoints)
        kp = np.zeros((len(rows), k, 3), dtype=np.float32)
        for n, (j, r) in enumerate(rows):
            if r[2] in cats.has_keypoints:
                kp[n] = _keypoints(anns[j], j, who(j), k)
    img = CocoImage(iid, h, w, boxes, labels, kp, mask_dtype=dtype.name)
    if spec.mask != "none":
        img.segments = [_segment(anns[j], j, who(j), h, w) for j, _ in rows]
        img.ignore = [s for s in (_segment(anns[j], j, who(j), h, w) for j, _ in ignore) if s is not None]
    return img.seal()


def _specs(spec: Any, k: int, dtype: np.dtype, num_classes: int) -> dict[str, FieldSpec]:
    out = {BOXES: FieldSpec(Kind.BOXES, (None, 4), "float32"),
           BOX_LABELS: FieldSpec(Kind.BOX_LABELS, (None,), "int64", of=BOXES)}
    if spec.keypoints:
        out[KEYPOINTS] = FieldSpec(Kind.KEYPOINTS, (None, k, 3), "float32", of=BOXES)
    if spec.mask != "none":
        out[MASK] = FieldSpec(Kind.MASK, (None, None, 1), dtype.name, of=BOXES if spec.mask == "instance" else None,
                              classes=num_classes + 1 if spec.mask == "semantic" else None)
    return out


def parse_coco(recipe: Any) -> CocoParse:
    """Parse the recipe's annotation file: every annotation checked and grouped by image in one pass, each
    image's arrays and digest made (an image whose record or annotations are unusable gets its error)."""
    spec = recipe.model.inputs.coco
    path = coco_path(recipe)
    data = read_json(path, recipe)
    cats = _categories(data, path)
    if spec.keypoints and not cats.keypoints:
        raise RecipeError(f"no category in {path} has keypoints", source=recipe.source, loc="inputs.coco.keypoints")
    images, errors = _images(data, path)
    per = _group(data, path, images, cats, spec.crowd, errors)
    dtype = mask_dtype(spec.mask, len(cats.names))
    anns = data.get("annotations", [])
    k = len(cats.keypoints)
    annotations = {}
    for iid, info in images.items():
        try:
            if iid in errors:
                raise BadImage(*errors[iid])
            annotations[iid] = _image(iid, info, per[iid], anns, cats, spec, dtype)
        except BadImage as e:
            annotations[iid] = _empty(iid, info, spec, k, dtype).failed(e.loc, e.detail)
    ignore = int(np.iinfo(dtype).max) if spec.crowd == "ignore" and spec.mask != "none" else None
    attrs = {ATTR: {"categories": cats.records, "keypoints": cats.keypoints if spec.keypoints else [],
                    "skeleton": cats.skeleton if spec.keypoints else [], "crowd": spec.crowd, "mask": spec.mask,
                    "mask_ignore": ignore}}
    return CocoParse(images, annotations, cats.names, attrs, len(cats.keypoints), dtype.name)


def load_coco(recipe: Any, cache: Optional[str] = None, content: bool = False) -> CocoSource:
    """The recipe's annotation file as the plan's items, label names, specs and index attribute. With
    ``cache`` (a file in the output folder, :mod:`.coco_cache`), the parse kept there is used when it was
    made from this file as it is now (its fingerprint: size and mtime, with ``content`` the sha256 of its
    bytes; a URL's ETag, size and mtime) under the same options; else the file is parsed and the parse is
    owed to the cache (``pending``). Under ``on_error: fail`` an image's error (its record, an annotation, a
    path leaving the root) stops the plan here, the first in file order; under ``skip`` that input fails."""
    spec = recipe.model.inputs.coco
    if spec.mask != "none":
        pycocotools_mask()   # a missing extra fails the plan, not every input
    parsed, pending = None, None
    if cache is not None:
        from . import cache as coco_cache

        key = coco_cache.cache_key(recipe, coco_path(recipe), content)
        parsed = coco_cache.load(cache, key)
        pending = None if parsed is not None else coco_cache.Pending(cache, key)
    if parsed is None:
        parsed = parse_coco(recipe)
        if pending is not None:
            pending.parsed = parsed
    table, factors = _items(recipe, parsed.annotations, parsed.images)
    if recipe.model.on_error == "fail":
        bad = [a.error for a in table.annotations if a.error]
        if bad:
            loc, detail = min(bad, key=_file_order)
            raise RecipeError(detail, source=coco_path(recipe), loc=loc)
    return CocoSource(table, factors, parsed.label_names, parsed.specs(spec), parsed.attrs, pending)


def _file_order(err: tuple[str, str]) -> tuple[int, int]:
    """Where an error's entry is in the file: images first, then annotations, by index."""
    part, _, rest = err[0].partition("[")
    return (0 if part == "images" else 1, int(rest.rstrip("]") or 0))


def _items(recipe: Any, annotations: dict[Any, CocoImage], images: dict) -> tuple[Any, dict]:
    """The plan's items as an :class:`~precompile.compiler.items.ItemTable`, one per image in key
    (file_name) order: each field's path (the image's file_name, or the field's ``path`` template over
    ``file_name``, ``stem`` and ``image_id``) under ``inputs.root``, and the image's annotations; and the
    factors of those three captures (for ``split:``). A path that leaves the root as written (an image id
    ``../x`` in ``{image_id}``) fails its image (:attr:`CocoImage.error`)."""
    from ..items import ItemTable, Strings
    from ..listing import factorize, local_prefix
    from ...compiler.plan import fill_template
    from ...storage.remote import is_url, list_tree

    inp = recipe.model.inputs
    root = recipe.input_root
    remote = is_url(root)
    if remote:
        list_tree(root, False, inp.storage_options)   # records the fingerprints
    elif not os.path.isdir(root):
        raise RecipeError(f"input root {root!r} is not a folder", source=recipe.source, loc="inputs.root")
    prefix = local_prefix(root, remote)
    index = {iid: j for j, iid in enumerate(images)}
    order = sorted(images, key=lambda iid: images[iid][0])
    paths: dict[str, list[str]] = {f: [] for f in inp.fields}
    captures: dict[str, list[str]] = {"file_name": [], "stem": [], "image_id": []}
    anns = []
    for iid in order:
        fn = images[iid][0]
        ann = annotations[iid]
        base = fn.rsplit("/", 1)[-1]
        caps = {"file_name": fn, "stem": fn[:len(fn) - len(base)] + base.rsplit(".", 1)[0] if "." in base else fn,
                "image_id": str(iid)}
        for k, v in caps.items():
            captures[k].append(v)
        for fname, decl in inp.fields.items():
            rp = fn if decl.path is None else fill_template(decl.path, caps)
            if not ann.error and leaves_root(rp):
                made = "its file_name" if decl.path is None else f"template {echo(decl.path)}"
                ann = ann.failed(f"images[{index[iid]}]", f"image id {_id(iid)} ({echo(fn)}): the path {echo(rp)} of "
                                 f"field {fname!r} ({made}) leaves inputs.root {echo(root)}")
            if leaves_root(rp):
                rp = "-"   # never joined: the input fails before anything is read
            full = f"{root}/{rp}" if remote else os.path.join(root, *rp.split("/"))
            paths[fname].append(full[len(prefix):])   # join keeps the root's text in front (POSIX)
        anns.append(ann)
    table = ItemTable(keys=Strings.from_list([images[iid][0] for iid in order]), prefix=prefix,
                      paths={f: Strings.from_list(col) for f, col in paths.items()}, annotations=anns)
    return table, {k: factorize(v) for k, v in captures.items()}


def add_specs(recipe: Any, specs: dict[str, FieldSpec], extra: dict[str, FieldSpec]) -> dict[str, FieldSpec]:
    """The decoders' specs plus the annotation fields; the image field must be an image, and no decoder
    output may take an annotation field's name."""
    name = recipe.model.inputs.coco.image
    if name not in specs or specs[name].kind is not Kind.IMAGE:
        got = specs[name].describe() if name in specs else "nothing"
        raise RecipeError(f"the annotations need an image field {name!r}, but its decoder gives {got}",
                          source=recipe.source, loc="inputs.coco.image")
    for f in [*extra, ATTR]:
        if f in specs:
            raise RecipeError(f"field {f!r} clashes with a field inputs.coco adds ({', '.join(extra)}; and the "
                              f"meta key {ATTR!r})", source=recipe.source, loc=f"inputs.fields.{f}")
    return {**specs, **extra}
