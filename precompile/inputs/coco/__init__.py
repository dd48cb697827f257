"""COCO annotation files as inputs (``inputs.coco``): one sample per image, with its boxes, box labels and,
on request, keypoints and a mask.

The JSON is read once, in the parent at plan time (:func:`load_coco`, :mod:`.parse`): categories are numbered in id order
(COCO's ids have gaps: 1..90 for 80 classes), annotations are checked and grouped by image in one pass, and
each image becomes an :class:`~precompile.inputs.items.Item` carrying a
:class:`~.annotations.CocoImage`: its annotations as compact arrays (never the whole JSON). In the worker,
:meth:`CocoImage.add_fields <.annotations.CocoImage.add_fields>` adds the annotation fields beside the decoded
image:

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

Modules: :mod:`.annotations` (an image's arrays, the worker side, the RLE and polygon checks), :mod:`.parse`
(the file, parsed once, checked), :mod:`.cache` (the parse kept in the output folder); here, :func:`load_coco`
turns a parse into the plan's :class:`~precompile.inputs.items.Inputs`.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from ...errors import RecipeError
from ...kinds import Kind
from ...sample import FieldSpec
from ...storage.remote import is_url, list_tree
from ..items import Inputs, ItemTable, Strings, factorize
from ..paths import leaves_root, local_prefix
from ..templates import CAPTURE_RE, fill_template
from . import cache as coco_cache
from .annotations import ATTR, CocoImage, _id, coco_path, echo, pycocotools_mask
from .parse import parse_coco

#: the captures a field's ``path`` template may use: the image's file_name, that without its extension, its id
CAPTURES = ("file_name", "stem", "image_id")


def check_inputs(inp: Any, source: Optional[str]) -> None:
    """The recipe's ``inputs`` (``inp``, from the recipe file ``source``) with ``inputs.coco``: no
    ``match``/``where``/``label``/``kind: dir``; the image field is declared; the fields' path templates use only
    the captures a COCO image gives (:data:`CAPTURES`); a RecipeError naming the key otherwise."""
    for key, bad in (("match", inp.match is not None), ("where", bool(inp.where)), ("label", inp.label is not None),
                     ("kind", inp.kind != "file")):
        if bad:
            raise RecipeError("does not apply with inputs.coco (the annotation file lists the images and their "
                              "labels)", source=source, loc=f"inputs.{key}")
    if inp.coco.image not in inp.fields:
        raise RecipeError(f"{inp.coco.image!r} is not a field in inputs.fields", source=source,
                          loc="inputs.coco.image")
    for fname, decl in inp.fields.items():
        bad = set(CAPTURE_RE.findall(decl.path or "")) - set(CAPTURES)
        if bad:
            raise RecipeError(f"uses capture(s) {sorted(bad)} that inputs.coco does not define",
                              source=source, loc=f"inputs.fields.{fname}.path")


def load_coco(recipe: Any, cache: Optional[str] = None, content: bool = False) -> Inputs:
    """The recipe's annotation file as the plan's items, label names, specs and index attribute. With
    ``cache`` (a file in the output folder, :mod:`.cache`), the parse kept there is used when it was
    made from this file as it is now (its fingerprint: size and mtime, with ``content`` the sha256 of its
    bytes; a URL's ETag, size and mtime) under the same options; else the file is parsed and the parse is
    owed to the cache (``pending``). Under ``on_error: fail`` an image's error (its record, an annotation, a
    path leaving the root) stops the plan here, the first in file order; under ``skip`` that input fails."""
    spec = recipe.model.inputs.coco
    if spec.mask != "none":
        pycocotools_mask()   # a missing extra fails the plan, not every input
    parsed, pending = None, None
    if cache is not None:
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
    return Inputs(table, parsed.label_names, factors, specs=parsed.specs(spec), attrs=parsed.attrs, pending=pending)


def _file_order(err: tuple[str, str]) -> tuple[int, int]:
    """Where an error's entry is in the file: images first, then annotations, by index."""
    part, _, rest = err[0].partition("[")
    return (0 if part == "images" else 1, int(rest.rstrip("]") or 0))


def _items(recipe: Any, annotations: dict[Any, CocoImage], images: dict) -> tuple[Any, dict]:
    """The plan's items as an :class:`~precompile.inputs.items.ItemTable`, one per image in key
    (file_name) order: each field's path (the image's file_name, or the field's ``path`` template over
    ``file_name``, ``stem`` and ``image_id``) under ``inputs.root``, and the image's annotations; and the
    factors of those three captures (for ``split:``). A path that leaves the root as written (an image id
    ``../x`` in ``{image_id}``) fails its image (:attr:`CocoImage.error`)."""
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
    captures: dict[str, list[str]] = {c: [] for c in CAPTURES}
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
