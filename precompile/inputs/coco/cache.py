"""The parsed COCO annotation file kept in the output folder (``inputs.coco``): a rebuild whose annotation
file has not changed does not parse the JSON again.

Parsing COCO's train2017 instances file (json, checks, grouping, per-image arrays and digests) costs 40-60 s
on a shared core; a no-change rebuild should cost seconds. :func:`precompile.inputs.coco.load_coco` asks
:func:`load` for the parse kept at ``<out>/<name>.shards/coco-plan.h5``
(``formats.names.COCO_PLAN_CACHE``) under a key
(:func:`cache_key`): this module's version, the package version, the file's path or URL and fingerprint
(size and mtime_ns; the sha256 of its bytes with ``--content-hash``; a URL's ETag, size and mtime, one
request) and the ``inputs.coco`` options that shape the parse (``mask``, ``crowd``, ``keypoints``). The
parse is used only when the stored key equals it; a missing, damaged or other-version file means the JSON
is parsed again, and the driver then writes the new parse (:class:`Pending`) once it holds the build lock.
What ``inputs.root`` and the fields' ``path`` templates make of the images (the items' paths) is worked
out again every time: it is cheap, and it keeps the cache independent of them.

The file is HDF5 (libver ``latest``: its metadata carries checksums) holding one flat, Fletcher-32
checksummed dataset per column (file names as UTF-8 with offsets, sizes, box and keypoint arrays,
segmentations as polygon coordinates with counts, RLE texts and counts, digests) and ``meta``, the key and
the small parts (label names, the index attribute, the errors of the images refused at plan time) as JSON
bytes. Nothing is pickled. It is written to a
temporary beside it and renamed (a killed build leaves no half file under its name; the next build's
clean-up removes the temporary), only in a local output folder (a URL output parses every time), and
never outside the output folder. ``precompile gc`` keeps it.
"""
from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..items import Strings
from .annotations import CocoImage
from .parse import CocoParse

#: bumped whenever what is stored, or how it is read, changes (an older file is then parsed again)
#: 2: each image's error (its record or an annotation refused at plan time) kept in the meta
VERSION = 2
#: segment kinds
NONE, POLYGONS, RLE_TEXT, RLE_COUNTS = 0, 1, 2, 3


def cache_key(recipe: Any, path: str, content: bool) -> dict[str, Any]:
    """What a kept parse must have been made from to be used (JSON data; see the module docstring)."""
    from ... import __version__
    from ...storage.files import fingerprint
    from ...storage.remote import file_fingerprint, is_url

    spec = recipe.model.inputs.coco
    fp = (file_fingerprint(path, recipe.model.inputs.storage_options, f"COCO annotation file {path!r}")
          if is_url(path) else fingerprint(path, content))
    key = {"version": VERSION, "precompile": __version__, "file": path, "fingerprint": fp, "mask": spec.mask,
           "crowd": spec.crowd, "keypoints": spec.keypoints}
    return json.loads(json.dumps(key))   # as it reads back


@dataclass
class Pending:
    """A parse owed to the cache at ``path`` under ``key``; :meth:`write` writes it (the driver calls it once
    the output is locked)."""

    path: str
    key: dict[str, Any]
    parsed: Optional[CocoParse] = None

    def write(self) -> bool:
        """Write the parse (atomically); False when the output folder refuses it (the build goes on: the
        next one parses again)."""
        return self.parsed is not None and save(self.path, self.key, self.parsed)


def save(path: str, key: dict[str, Any], parsed: CocoParse) -> bool:
    """Keep ``parsed`` at ``path`` under ``key``: written to a temporary beside it, then renamed."""
    import h5py

    meta = {"key": key, "label_names": parsed.label_names, "attrs": parsed.attrs,
            "num_keypoints": parsed.num_keypoints, "mask_dtype": parsed.mask_dtype}
    columns = _columns(parsed, meta)
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with h5py.File(tmp, "w", libver="latest") as f:
            for name, a in {**columns, "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)}.items():
                f.create_dataset(name, data=a, chunks=True, fletcher32=True)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)
        return False
    return True


def load(path: str, key: dict[str, Any]) -> Optional[CocoParse]:
    """The parse kept at ``path`` if it was made under ``key``; None when there is none, it was made from
    something else, or it cannot be read whole (a flipped bit fails its checksum)."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            meta = json.loads(f["meta"][()].tobytes())
            if not isinstance(meta, dict) or meta.get("key") != key:
                return None
            columns = {name: f[name][()] for name in f if name != "meta"}
        return _from_columns(columns, meta)
    except (OSError, KeyError, ValueError, TypeError, IndexError):   # missing, damaged, another layout
        return None


# -- a parse as flat columns, and back -------------------------------------------------------------

def _columns(parsed: CocoParse, meta: dict[str, Any]) -> dict[str, np.ndarray]:
    """The parse as flat arrays (``meta`` gets the image ids when they are not all integers)."""
    ids = list(parsed.images)
    imgs = [parsed.annotations[i] for i in ids]
    names = Strings.from_list([parsed.images[i][0] for i in ids])
    out = {"file_name": names.blob, "file_name_offsets": names.offsets,
           "size": np.array([parsed.images[i][1:] for i in ids], np.int64).reshape(-1),
           "boxes_per_image": np.array([len(a.labels) for a in imgs], np.int64),
           "boxes": _cat([a.boxes.reshape(-1) for a in imgs], np.float32),
           "labels": _cat([a.labels for a in imgs], np.int64),
           "digest": np.frombuffer(bytes.fromhex("".join(a.digest for a in imgs)), np.uint8)}
    if all(type(i) is int and -(1 << 63) <= i < (1 << 63) for i in ids):
        out["image_id"] = np.array(ids, np.int64)
    else:
        meta["image_ids"] = ids
    meta["errors"] = [[j, *a.error] for j, a in enumerate(imgs) if a.error]
    if imgs and imgs[0].keypoints is not None:
        out["keypoints"] = _cat([a.keypoints.reshape(-1) for a in imgs], np.float32)
    if parsed.attrs["coco"]["mask"] != "none":
        out["ignore_per_image"] = np.array([len(a.ignore) for a in imgs], np.int64)
        out.update(_flat_segments([s for a in imgs for s in a.segments], "segments"))
        out.update(_flat_segments([s for a in imgs for s in a.ignore], "ignore"))
    return out


def _cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


def _flat_segments(segs: list, prefix: str) -> dict[str, np.ndarray]:
    """Segmentations (None, a list of polygon arrays, an RLE with text or uint32 counts) as flat arrays:
    each one's kind and polygon count, each polygon's length, the coordinates, the RLE texts and counts."""
    kind = np.zeros(len(segs), np.uint8)
    npoly = np.zeros(len(segs), np.int64)
    polys, texts, counts = [], [], []
    for j, s in enumerate(segs):
        if isinstance(s, list):
            kind[j], npoly[j] = POLYGONS, len(s)
            polys.extend(s)
        elif isinstance(s, dict) and isinstance(s["counts"], str):
            kind[j] = RLE_TEXT
            texts.append(s["counts"])
        elif isinstance(s, dict):
            kind[j] = RLE_COUNTS
            counts.append(s["counts"])
    text = Strings.from_list(texts)
    return {f"{prefix}_kind": kind, f"{prefix}_polygons": npoly,
            f"{prefix}_polygon_len": np.array([p.size for p in polys], np.int64),
            f"{prefix}_coords": _cat(polys, np.float64), f"{prefix}_rle_text": text.blob,
            f"{prefix}_rle_text_offsets": text.offsets,
            f"{prefix}_rle_len": np.array([c.size for c in counts], np.int64),
            f"{prefix}_rle_counts": _cat(counts, np.uint32)}


def _segments(c: dict[str, np.ndarray], prefix: str, sizes: np.ndarray) -> list:
    """The segmentations :func:`_flat_segments` flattened (``sizes``: each one's image [height, width])."""
    kind, npoly = c[f"{prefix}_kind"].tolist(), c[f"{prefix}_polygons"].tolist()
    coords = _split(c[f"{prefix}_coords"], c[f"{prefix}_polygon_len"])
    texts = iter(Strings(c[f"{prefix}_rle_text"], c[f"{prefix}_rle_text_offsets"]).to_list())
    counts = iter(_split(c[f"{prefix}_rle_counts"], c[f"{prefix}_rle_len"]))
    out: list = []
    pos = 0
    for k, n, hw in zip(kind, npoly, sizes.tolist()):
        if k == POLYGONS:
            out.append(coords[pos:pos + n])
            pos += n
        elif k in (RLE_TEXT, RLE_COUNTS):
            out.append({"counts": next(texts) if k == RLE_TEXT else next(counts), "size": hw})
        else:
            out.append(None)
    return out


def _split(flat: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """``flat`` cut into pieces of ``lengths`` (views; np.split costs three times as much per piece)."""
    ends = np.cumsum(lengths).tolist()
    return [flat[a:b] for a, b in zip([0] + ends[:-1], ends)]


def _from_columns(c: dict[str, np.ndarray], meta: dict[str, Any]) -> CocoParse:
    """The :class:`CocoParse` the columns were made from."""
    names = Strings(c["file_name"], c["file_name_offsets"]).to_list()
    ids = c["image_id"].tolist() if "image_id" in c else meta["image_ids"]
    if len(ids) != len(names):
        raise ValueError("the image columns disagree")
    size = c["size"].reshape(-1, 2)
    per = c["boxes_per_image"]
    off = np.concatenate([[0], np.cumsum(per)]).tolist()
    boxes, labels = c["boxes"].reshape(-1, 4), c["labels"]
    kp = c["keypoints"].reshape(-1, int(meta["num_keypoints"]), 3) if "keypoints" in c else None
    digests = c["digest"].reshape(len(ids), 32)
    mask = meta["attrs"]["coco"]["mask"] != "none"
    segs = _segments(c, "segments", np.repeat(size, per, axis=0)) if mask else []
    ign_off = np.concatenate([[0], np.cumsum(c["ignore_per_image"])]).tolist() if mask else [0] * (len(ids) + 1)
    ignore = _segments(c, "ignore", np.repeat(size, c["ignore_per_image"], axis=0)) if mask else []
    images, annotations = {}, {}
    dtype = meta["mask_dtype"]
    for j, (iid, (h, w)) in enumerate(zip(ids, size.tolist())):
        a, b = off[j], off[j + 1]
        images[iid] = (names[j], h, w)
        annotations[iid] = CocoImage(iid, h, w, boxes[a:b], labels[a:b], kp[a:b] if kp is not None else None,
                                     segs[a:b] if mask else [], ignore[ign_off[j]:ign_off[j + 1]], dtype,
                                     digests[j].tobytes().hex())
    for j, loc, detail in meta["errors"]:
        annotations[ids[j]].error = (loc, detail)
    return CocoParse(images, annotations, meta["label_names"], meta["attrs"], meta["num_keypoints"], dtype)
