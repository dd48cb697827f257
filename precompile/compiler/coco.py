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

An image listed in the JSON but missing on disk fails as that input (``on_error`` applies). A malformed
file, an annotation naming an unknown image or category, a negative box size or a malformed segmentation is
a :class:`RecipeError` naming the file and the annotation. Each image's annotations are part of its input
fingerprint (:attr:`CocoImage.digest`, used by ``keys.shard_key``), so changing one rebuilds one shard.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ..errors import DecodeError, MissingDependencyError, RecipeError
from ..kinds import Kind
from ..sample import FieldSpec, Tied

#: the fields an ``inputs.coco`` adds (beside the image field)
BOXES, BOX_LABELS, KEYPOINTS, MASK = "boxes", "box_labels", "keypoints", "mask"
#: the index attribute holding the categories, keypoint names and skeleton (``Dataset.coco``)
ATTR = "coco"


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
    ``crowd: ignore``; both only when a mask is asked for.
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

    def seal(self) -> "CocoImage":
        """Set :attr:`digest`: a hash of everything here that decides the sample's bytes."""
        h = hashlib.sha256(json.dumps([self.image_id, self.height, self.width]).encode())
        for a in (self.boxes, self.labels, self.keypoints):
            if a is not None:
                h.update(a.tobytes())
        for seg in self.segments + ["|"] + self.ignore:
            _hash_segment(h, seg)
        self.digest = h.hexdigest()
        return self

    # -- worker side --------------------------------------------------------------------------------
    def add_fields(self, fields: dict[str, np.ndarray], kinds: dict[str, Kind], meta: dict[str, Any],
                   spec: Any, item: Any) -> None:
        """Add the annotation fields to a decoded sample (``spec``: the recipe's ``inputs.coco``).

        The decoded image must be the size the JSON gives, or that size reduced by the JPEG decode scale
        the image decoder records (``meta[image]["reduce"]``): the coordinates are then scaled with it."""
        k = self._scale(fields[spec.image], meta.get(spec.image) or {}, item.paths[spec.image], item.key, spec.image)
        meta[ATTR] = {"image_id": self.image_id}
        fields[BOXES] = self.boxes / np.float32(k) if k != 1 else self.boxes.copy()
        kinds[BOXES] = Kind.BOXES
        fields[BOX_LABELS] = self.labels.copy()
        kinds[BOX_LABELS] = Kind.BOX_LABELS
        if spec.keypoints:
            kp = self.keypoints.copy()
            kp[..., :2] /= np.float32(k)
            fields[KEYPOINTS] = kp
            kinds[KEYPOINTS] = Kind.KEYPOINTS
        if spec.mask != "none":
            h, w = fields[spec.image].shape[:2]
            fields[MASK] = self.rasterise(spec.mask, np.dtype(self.mask_dtype), k, (h, w))
            kinds[MASK] = Tied(Kind.MASK, BOXES) if spec.mask == "instance" else Kind.MASK   # ids follow boxes

    def _scale(self, image: np.ndarray, meta: dict, path: str, key: str, fname: str) -> int:
        from ..decoders.jpeg_reduce import reduced_size

        k = int(meta.get("reduce", 1))
        got = tuple(image.shape[:2])
        if got != reduced_size(self.height, self.width, k):
            scale = f" (decoded at 1/{k} scale)" if k != 1 else ""
            turned = got == reduced_size(self.width, self.height, k)
            hint = "; turned by its EXIF orientation? (annotations of the stored pixels: exif_transpose: false)" \
                if turned else ""
            raise DecodeError(f"the image is {got[0]}x{got[1]} (h x w){scale} but the annotation file gives "
                              f"{self.height}x{self.width} for image id {self.image_id}{hint}", path=path,
                              stage="decode", field=fname, key=key)
        return k

    def rasterise(self, mode: str, dtype: np.dtype, k: int = 1, size: Optional[tuple[int, int]] = None) -> np.ndarray:
        """The (H, W, 1) mask: ``semantic`` (label + 1) or ``instance`` (box index + 1); see the module doc.
        ``k`` > 1: rasterised at the JSON's size, then every k-th pixel (the centre of each k x k block)."""
        h, w = self.height, self.width
        out = np.zeros((h, w), dtype=dtype)
        top = np.iinfo(dtype).max
        for seg in self.ignore:
            out[decode_segment(seg, h, w) > 0] = top
        drawn = [(i, decode_segment(s, h, w)) for i, s in enumerate(self.segments) if s is not None]
        drawn.sort(key=lambda im: -int(np.count_nonzero(im[1])))   # stable: equal sizes keep annotation order
        for i, m in drawn:
            out[m > 0] = (self.labels[i] + 1) if mode == "semantic" else (i + 1)
        if k != 1:
            rows = np.minimum(np.arange(size[0]) * k + k // 2, h - 1)
            cols = np.minimum(np.arange(size[1]) * k + k // 2, w - 1)
            out = out[np.ix_(rows, cols)]
        return np.ascontiguousarray(out[..., None])


def mask_dtype(mode: str, num_classes: Optional[int]) -> np.dtype:
    """uint8 for a semantic mask of up to 254 categories (255 is left for ``crowd: ignore``), else uint16."""
    if mode == "semantic" and (num_classes is None or num_classes <= 254):
        return np.dtype(np.uint8)
    return np.dtype(np.uint16)


def decode_segment(seg: Any, h: int, w: int) -> np.ndarray:
    """One object's (h, w) uint8 mask from its segmentation: polygons (a list of coordinate arrays) or
    an RLE dict (``counts`` a string, compressed, or a list, uncompressed), through pycocotools."""
    mask = pycocotools_mask()
    if isinstance(seg, dict):
        rle = mask.frPyObjects({"counts": list(seg["counts"]), "size": seg["size"]}, h, w) \
            if not isinstance(seg["counts"], (str, bytes)) else dict(seg)
        if isinstance(rle.get("counts"), str):
            rle["counts"] = rle["counts"].encode("ascii")
    else:
        if not seg:
            return np.zeros((h, w), dtype=np.uint8)
        rle = mask.merge(mask.frPyObjects([p.tolist() for p in seg], h, w))
    with warnings.catch_warnings():   # pycocotools' Cython decode calls np.array(copy=False) on its own class
        warnings.filterwarnings("ignore", r"__array__ implementation doesn't accept a copy keyword", DeprecationWarning)
        return mask.decode(rle)


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
        from .items import Items

        return Items(self.table)


def coco_path(recipe: Any) -> str:
    """The annotation file's path (relative paths are relative to the recipe's folder, like ``inputs.root``)
    or URL."""
    from ..remote import is_url

    file = recipe.model.inputs.coco.file
    if is_url(file):
        return file
    return os.path.normpath(os.path.join(recipe.base_dir, os.path.expanduser(file)))


def _file_bytes(path: str, recipe: Any) -> bytes:
    """The annotation file's bytes: a local file, or a URL's object fetched whole (``inputs.storage_options``;
    the store's refusals are a PlanError naming the URL)."""
    from ..remote import filesystem, is_url, store_error

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


def _images(data: dict, path: str) -> dict[int, tuple[str, int, int]]:
    """``{image id: (file_name, height, width)}``; ids and file names unique, names relative and inside root."""
    out: dict[int, tuple[str, int, int]] = {}
    names: dict[str, int] = {}
    for j, im in enumerate(data["images"]):
        ok = isinstance(im, dict) and type(im.get("id")) in (int, str) and isinstance(im.get("file_name"), str) \
            and all(type(im.get(k)) is int and im[k] > 0 for k in ("height", "width"))
        if not ok:
            raise RecipeError("an image needs an id (an integer or a string), a file_name and positive integer "
                              "height and width", source=path, loc=f"images[{j}]")
        fn = im["file_name"]
        if not fn or fn.startswith("/") or "\\" in fn or ".." in fn.split("/"):
            raise RecipeError(f"image id {im['id']}: file_name {fn!r} must be a relative path inside inputs.root",
                              source=path, loc=f"images[{j}]")
        if im["id"] in out:
            raise RecipeError(f"image id {im['id']} is listed twice", source=path, loc=f"images[{j}]")
        if fn in names:
            raise RecipeError(f"image id {im['id']}: file_name {fn!r} is also image id {names[fn]}'s (a sample key "
                              f"must be unique)", source=path, loc=f"images[{j}]")
        names[fn] = im["id"]
        out[im["id"]] = (fn, im["height"], im["width"])
    if not out:
        raise RecipeError("lists no images", source=path, loc="images")
    return out


def _annotation(a: Any, j: int, path: str, images: dict, cats: _Categories) -> tuple:
    """``(id, image id, label, bbox, crowd)`` of one checked annotation."""
    aid = a.get("id") if isinstance(a, dict) else None
    who = f"annotation id {aid}" if aid is not None else "annotation"
    bbox = a.get("bbox") if isinstance(a, dict) else None
    if type(aid) is not int or "image_id" not in a or "category_id" not in a or not isinstance(bbox, list) \
            or len(bbox) != 4 or not all(type(v) in (int, float) and math.isfinite(v) for v in bbox):
        raise RecipeError(f"{who}: needs an integer id, image_id, category_id and bbox [x, y, w, h] of 4 numbers",
                          source=path, loc=f"annotations[{j}]")
    if a["image_id"] not in images:
        raise RecipeError(f"{who}: image_id {a['image_id']!r} is not in images", source=path, loc=f"annotations[{j}]")
    label = cats.ids.get(a["category_id"]) if type(a["category_id"]) is int else None
    if label is None:
        raise RecipeError(f"{who}: category_id {a['category_id']!r} is not in categories", source=path,
                          loc=f"annotations[{j}]")
    if bbox[2] < 0 or bbox[3] < 0:
        raise RecipeError(f"{who}: bbox {bbox} has a negative width or height", source=path, loc=f"annotations[{j}]")
    crowd = a.get("iscrowd", 0)
    if crowd not in (0, 1):
        raise RecipeError(f"{who}: iscrowd must be 0 or 1, got {crowd!r}", source=path, loc=f"annotations[{j}]")
    return aid, a["image_id"], label, bbox, bool(crowd)


def _group(data: dict, path: str, images: dict, cats: _Categories, crowd: str) -> dict[int, list]:
    """One pass over the annotations: ``{image id: [(index, checked annotation), ...]}`` in file order
    (every image present, with [] when it has none); ``crowd: drop`` leaves crowd annotations out."""
    per: dict[int, list] = {iid: [] for iid in images}
    seen: dict[int, int] = {}
    for j, a in enumerate(data.get("annotations", [])):
        row = _annotation(a, j, path, images, cats)
        if row[0] in seen:
            raise RecipeError(f"annotation id {row[0]} is listed twice (annotations[{seen[row[0]]}] too)",
                              source=path, loc=f"annotations[{j}]")
        seen[row[0]] = j
        if row[4] and crowd == "drop":
            continue
        per[row[1]].append((j, row))
    return per


def _keypoints(a: dict, j: int, path: str, k: int) -> np.ndarray:
    kp = a.get("keypoints")
    if kp is None:
        return np.zeros((k, 3), dtype=np.float32)
    if not isinstance(kp, list) or len(kp) != 3 * k or not all(type(v) in (int, float) for v in kp):
        raise RecipeError(f"annotation id {a['id']}: keypoints must be {3 * k} numbers (x, y, v for each of the "
                          f"category's {k} keypoints)", source=path, loc=f"annotations[{j}]")
    return np.asarray(kp, dtype=np.float32).reshape(k, 3)


def _segment(a: dict, j: int, path: str, h: int, w: int) -> Any:
    """A checked segmentation: a list of polygon arrays (those under 3 points dropped: they hold no pixel),
    an RLE dict (``counts`` a string, or a uint32 array when uncompressed), or None when there is none."""
    seg = a.get("segmentation")
    who = f"annotation id {a['id']}"
    if seg is None or seg == []:
        return None
    if isinstance(seg, list):
        try:
            polys = [np.asarray(p, dtype=np.float64) for p in seg if isinstance(p, list)]
        except (TypeError, ValueError):
            polys = []
        if len(polys) != len(seg) or not all(p.ndim == 1 and p.size % 2 == 0 for p in polys) \
                or not np.isfinite(np.concatenate(polys)).all():
            raise RecipeError(f"{who}: a polygon segmentation is a list of [x1, y1, x2, y2, ...] lists of numbers",
                              source=path, loc=f"annotations[{j}]")
        return [p for p in polys if p.size >= 6] or None
    if isinstance(seg, dict):
        counts = seg.get("counts")
        if seg.get("size") != [h, w]:
            raise RecipeError(f"{who}: RLE size {seg.get('size')!r} is not its image's [height, width] {[h, w]}",
                              source=path, loc=f"annotations[{j}]")
        if isinstance(counts, str):
            return {"counts": counts, "size": [h, w]}
        if isinstance(counts, list) and all(type(c) is int and c >= 0 for c in counts):
            return {"counts": np.asarray(counts, dtype=np.uint32), "size": [h, w]}
    raise RecipeError(f"{who}: segmentation must be polygons or an RLE {{counts, size}}", source=path,
                      loc=f"annotations[{j}]")


def _image(iid: int, info: tuple, rows: list, anns: list, path: str, cats: _Categories, spec: Any,
           dtype: np.dtype) -> CocoImage:
    """One image's :class:`CocoImage` from its checked annotations."""
    _, h, w = info
    ignore = [r for r in rows if r[1][4] and spec.crowd == "ignore"]
    rows = [r for r in rows if not (r[1][4] and spec.crowd == "ignore")]
    xywh = np.asarray([r[1][3] for r in rows], dtype=np.float64).reshape(-1, 4)
    boxes = np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], axis=1).astype(np.float32)
    labels = np.asarray([r[1][2] for r in rows], dtype=np.int64)
    kp = None
    if spec.keypoints:
        k = len(cats.keypoints)
        kp = np.zeros((len(rows), k, 3), dtype=np.float32)
        for n, (j, r) in enumerate(rows):
            if r[2] in cats.has_keypoints:
                kp[n] = _keypoints(anns[j], j, path, k)
    img = CocoImage(iid, h, w, boxes, labels, kp, mask_dtype=dtype.name)
    if spec.mask != "none":
        img.segments = [_segment(anns[j], j, path, h, w) for j, _ in rows]
        img.ignore = [s for s in (_segment(anns[j], j, path, h, w) for j, _ in ignore) if s is not None]
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
    image's arrays and digest made."""
    spec = recipe.model.inputs.coco
    path = coco_path(recipe)
    data = read_json(path, recipe)
    cats = _categories(data, path)
    if spec.keypoints and not cats.keypoints:
        raise RecipeError(f"no category in {path} has keypoints", source=recipe.source, loc="inputs.coco.keypoints")
    images = _images(data, path)
    per = _group(data, path, images, cats, spec.crowd)
    dtype = mask_dtype(spec.mask, len(cats.names))
    anns = data.get("annotations", [])
    annotations = {iid: _image(iid, info, per[iid], anns, path, cats, spec, dtype) for iid, info in images.items()}
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
    owed to the cache (``pending``)."""
    spec = recipe.model.inputs.coco
    if spec.mask != "none":
        pycocotools_mask()   # a missing extra fails the plan, not every input
    parsed, pending = None, None
    if cache is not None:
        from . import coco_cache

        key = coco_cache.cache_key(recipe, coco_path(recipe), content)
        parsed = coco_cache.load(cache, key)
        pending = None if parsed is not None else coco_cache.Pending(cache, key)
    if parsed is None:
        parsed = parse_coco(recipe)
        if pending is not None:
            pending.parsed = parsed
    table, factors = _items(recipe, parsed.annotations, parsed.images)
    return CocoSource(table, factors, parsed.label_names, parsed.specs(spec), parsed.attrs, pending)


def _items(recipe: Any, annotations: dict[int, CocoImage], images: dict) -> tuple[Any, dict]:
    """The plan's items as an :class:`~precompile.compiler.items.ItemTable`, one per image in key
    (file_name) order: each field's path (the image's file_name, or the field's ``path`` template over
    ``file_name``, ``stem`` and ``image_id``) under ``inputs.root``, and the image's annotations; and the
    factors of those three captures (for ``split:``)."""
    from .items import ItemTable, Strings
    from .listing import factorize, local_prefix
    from .plan import fill_template
    from ..remote import is_url, list_tree

    inp = recipe.model.inputs
    root = recipe.input_root
    remote = is_url(root)
    if remote:
        list_tree(root, False, inp.storage_options)   # records the fingerprints
    elif not os.path.isdir(root):
        raise RecipeError(f"input root {root!r} is not a folder", source=recipe.source, loc="inputs.root")
    prefix = local_prefix(root, remote)
    order = sorted(images, key=lambda iid: images[iid][0])
    paths: dict[str, list[str]] = {f: [] for f in inp.fields}
    captures: dict[str, list[str]] = {"file_name": [], "stem": [], "image_id": []}
    for iid in order:
        fn = images[iid][0]
        base = fn.rsplit("/", 1)[-1]
        caps = {"file_name": fn, "stem": fn[:len(fn) - len(base)] + base.rsplit(".", 1)[0] if "." in base else fn,
                "image_id": str(iid)}
        for k, v in caps.items():
            captures[k].append(v)
        for fname, decl in inp.fields.items():
            rp = fn if decl.path is None else fill_template(decl.path, caps)
            full = f"{root}/{rp}" if remote else os.path.join(root, *rp.split("/"))
            paths[fname].append(full[len(prefix):])   # join keeps the root's text in front (POSIX)
    table = ItemTable(keys=Strings.from_list([images[iid][0] for iid in order]), prefix=prefix,
                      paths={f: Strings.from_list(col) for f, col in paths.items()},
                      annotations=[annotations[iid] for iid in order])
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
