"""An ``inputs.coco`` annotation file parsed once, in the parent at plan time: categories in id order, every
image record and annotation checked and grouped by image in one pass, each image's :class:`CocoImage` made
(its error kept when its record or an annotation is unusable). :class:`CocoParse` is what the output's cache
keeps (:mod:`.cache`). See :mod:`precompile.inputs.coco`.
"""
from __future__ import annotations

import json
import math
import posixpath
import sys
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ...errors import RecipeError
from ...kinds import Kind
from ...sample import FieldSpec
from ...storage.remote import filesystem, is_url, store_error
from ..paths import leaves_root
from .annotations import (ATTR, BOXES, BOX_LABELS, KEYPOINTS, MASK, BadImage, CocoImage, _id, check_polygons,
                          coco_path, echo, mask_dtype, rle_counts)

# -- plan side: the JSON, parsed once ------------------------------------------------------------

@dataclass
class CocoParse:
    """What the annotation file gives, whatever ``inputs.root`` and the fields' paths are: every image
    (file order) as ``(file_name, height, width)`` and its :class:`CocoImage`, the label names (categories in
    id order), the index attribute (:data:`ATTR`), the keypoints per category and the mask dtype. This is
    what :mod:`.cache` keeps in the output folder."""

    images: dict[Any, tuple[str, int, int]]
    annotations: dict[Any, CocoImage]
    label_names: list[str]
    attrs: dict[str, Any]
    num_keypoints: int
    mask_dtype: str

    def specs(self, spec: Any) -> dict[str, FieldSpec]:
        """The annotation fields' specs under ``spec`` (the recipe's ``inputs.coco``)."""
        return _specs(spec, self.num_keypoints, np.dtype(self.mask_dtype), len(self.label_names))


def _file_bytes(path: str, recipe: Any) -> bytes:
    """The annotation file's bytes: a local file, or a URL's object fetched whole (``inputs.storage_options``;
    the store's refusals are a PlanError naming the URL)."""
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
    spelled: dict = {}   # file names as normpath writes them -> image id
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
        norm = posixpath.normpath(fn) if ("./" in fn or "//" in fn or fn.endswith("/.")) else fn
        if norm in spelled:   # one file written two ways (a/./x.jpg beside a/x.jpg): the same image twice
            other = spelled[norm]
            raise RecipeError(f"image id {_id(iid)}: file_name {echo(fn)} names the file of image id {_id(other)} "
                              f"({echo(out[other][0])}), written another way (a sample key must be unique)",
                              source=path, loc=loc)
        names[fn] = iid
        spelled[norm] = iid
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
    out = {BOXES: FieldSpec(Kind.BOXES, (None, 4), "float32", of=spec.image),
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
