"""Differential test: an incremental rebuild after a change equals a clean build of the changed state.

The truth here is not computed by the incremental code: after each mutation of a small generated
project (inputs, a CSV table, a COCO file, the recipe, or the output folder itself), the output is
rebuilt in place (``-j1`` or ``-j2``) and the same state is built from scratch into an empty folder.
Both must agree on

* every shard the indexes name: file name (number and content key) and bytes (for the file-folder
  formats, every file inside the shard folder);
* the index files, byte for byte (``SOURCE_DATE_EPOCH`` is set, so ``build_date`` agrees: it is the
  only field docs/reference-build.md calls time dependent; nothing host dependent is in an index);
* the reader's samples (``precompile.open``: same keys, copies and values, in the same order) and so the
  split membership (one output per split);
* the inputs the report lists as failed (``on_error: skip``); the report's timings are left out.

The rebuilt folder must also hold no shard that neither an index nor ``previous.json`` (the snapshot
the last build replaced, kept by design until the next build: docs/faults.md) names, and no index
may name a missing file. Where the docs promise what a rebuild redoes (one input's pixels changed:
its shard only; the output name changed: nothing built), that is checked too.

Mutations that docs say a rebuild cannot see are not applied as failures: a file rewritten with the
same size and its old mtime restored is only visible to ``--content-hash`` builds (the fingerprint is
size + mtime otherwise), so that mutation is used only in projects built with ``content_hash``.

``PRECOMPILE_REBUILD_EXPLORE=N`` runs N more seeds (from 1000, or ``PRECOMPILE_REBUILD_EXPLORE_FROM``), one test
each, instead of skipping the explore test.
"""
from __future__ import annotations

import csv
import glob
import json
import os
import random
import shutil

import numpy as np
import pytest
import yaml

import precompile
from precompile import build
from precompile.formats import snapshot

EPOCH = "1700000000"
SEEDS = list(range(24))


# ---------------------------------------------------------------- the project: files + recipe on disk

class Project:
    """A small project in ``base``: images under ``base/in``, maybe a table or a COCO file, a recipe."""

    def __init__(self, base, seed: int):
        self.base = str(base)
        self.root = os.path.join(self.base, "in")
        os.makedirs(self.root)
        self.rng = random.Random(seed)
        r = self.rng
        self.kind = r.choice(["folder", "folder", "table", "coco"])
        self.content_hash = r.random() < 0.25
        self.n_made = 0
        self.images: list[str] = []       # relative paths under root
        self.shapes: dict[str, tuple[int, int]] = {}   # each image's (h, w) as written (a corrupted one keeps its)
        n = r.randint(6, 11)
        self.exts = ["png"] if self.kind == "coco" else ["png", "png", "jpg"]
        for _ in range(n):
            self.add_image()
        fmt = "hdf5" if self.kind == "coco" else r.choice(["hdf5", "hdf5", "png", "bmp"])
        steps = [{"resize": {"size": [r.choice([6, 8]), 8]}}]
        if r.random() < 0.4:
            steps.append({"center_crop": {"size": [6, 6]}})
        copies = 0
        if r.random() < 0.5:
            steps.append({"random_flip": {"horizontal": 0.5, "vertical": r.choice([0.0, 0.5])}})
            copies = r.choice([0, 1, 2])
        self.interruptible = r.random() < 0.3   # its image decoder stops a build on a chosen input (a Ctrl-C)
        self.recipe: dict = {"name": "rb", "seed": r.randint(0, 5), "steps": steps, "copies": copies,
                             "on_error": r.choice(["fail", "skip"]),
                             "output": {"format": fmt, "samples_per_shard": r.choice([2, 3])}}
        if r.random() < 0.2:
            self.recipe["stats"] = True   # the index holds the output's statistics, kept current by rebuilds
        if r.random() < 0.35:
            self.recipe["split"] = {"by": "hash", "fractions": {"train": 0.6, "val": 0.4}, "seed": r.randint(0, 3)}
        if self.kind == "folder":
            self.recipe["inputs"] = {"root": self.root, "match": "{label}/{name}.{ext}",
                                     "fields": {"image": {"decoder": "image", "mode": "rgb8"}},
                                     "label": {"capture": "label"}}
        elif self.kind == "table":
            self.rows = [{"path": p, "label": r.choice(["x", "y", "z"]), "score": str(r.randint(0, 4))}
                         for p in self.images]
            self.recipe["inputs"] = {"root": self.root, "table": os.path.join(self.base, "t.csv"), "path": "{path}",
                                     "fields": {"image": {"decoder": "image", "mode": "rgb8"}},
                                     "columns": {"label": {"column": "label", "kind": "label"}}}
            if r.random() < 0.4:
                self.recipe["inputs"]["where"] = "score >= 1"
            self.write_table()
        else:
            self.coco = {"images": [], "annotations": [], "categories": [{"id": 1, "name": "cat"},
                                                                         {"id": 2, "name": "dog"}]}
            for i, p in enumerate(self.images):
                self.coco_image(i + 1, p)
            self.recipe["inputs"] = {"root": self.root, "coco": {"file": os.path.join(self.base, "c.json")},
                                     "fields": {"image": {"decoder": "image", "mode": "rgb8"}}}
            self.write_coco()
        if self.interruptible:
            self.recipe["imports"] = ["interrupting_decoder"]
            self.recipe["inputs"]["fields"]["image"]["decoder"] = "_interrupting_image_test"
        self.write_recipe()

    # ---- files
    def _pixels(self, h: int, w: int) -> np.ndarray:
        g = np.random.default_rng(self.rng.randint(0, 2**31))
        return g.integers(0, 256, (h, w, 3), dtype=np.uint8)

    def write_image(self, rel: str, h: int, w: int) -> None:
        from PIL import Image

        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        old = os.stat(path).st_mtime_ns if os.path.exists(path) else None
        im = Image.fromarray(self._pixels(h, w))
        self.shapes[rel] = (h, w)
        if rel.endswith(".png"):
            im.save(path, compress_level=0)     # uncompressed: the size depends on the shape only
        else:
            im.save(path, quality=90)
        if old is not None:   # a new mtime for sure (a coarse clock could repeat the old one)
            os.utime(path, ns=(old + 2_000_000_000, old + 2_000_000_000))

    def add_image(self) -> str:
        r = self.rng
        ext = r.choice(self.exts)
        label = r.choice(["a", "b"])
        rel = f"{label}/im{self.n_made:03d}.{ext}"
        self.n_made += 1
        self.write_image(rel, r.randint(10, 14), r.randint(10, 14))
        self.images.append(rel)
        return rel

    def shape(self, rel: str) -> tuple[int, int]:
        return self.shapes[rel]

    def write_table(self) -> None:
        with open(os.path.join(self.base, "t.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, ["path", "label", "score"])
            w.writeheader()
            w.writerows(self.rows)

    def coco_image(self, iid: int, rel: str) -> None:
        h, w = self.shape(rel)
        self.coco["images"].append({"id": iid, "file_name": rel, "height": h, "width": w})
        self.coco_ann(iid, h, w)

    def coco_ann(self, iid: int, h: int, w: int) -> None:
        r = self.rng
        x, y = r.randint(0, w - 4), r.randint(0, h - 4)
        aid = 1 + max([a["id"] for a in self.coco["annotations"]], default=0)
        self.coco["annotations"].append({"id": aid, "image_id": iid, "category_id": r.choice([1, 2]), "iscrowd": 0,
                                         "bbox": [x, y, r.randint(2, w - x), r.randint(2, h - y)], "area": 4.0})

    def write_coco(self) -> None:
        with open(os.path.join(self.base, "c.json"), "w") as f:
            json.dump(self.coco, f)

    def write_recipe(self) -> None:
        with open(os.path.join(self.base, "r.yaml"), "w") as f:
            yaml.safe_dump(self.recipe, f)

    @property
    def recipe_path(self) -> str:
        return os.path.join(self.base, "r.yaml")

    def out_name(self) -> str:
        return self.recipe["output"].get("name", self.recipe["name"])


# ---------------------------------------------------------------- mutations

def _m_pixels(p: Project) -> str:
    rel = p.rng.choice(p.images)
    p.write_image(rel, *p.shape(rel))
    return f"pixels {rel}"


def _m_pixels_same_mtime(p: Project) -> str:
    rel = p.rng.choice([i for i in p.images if i.endswith(".png")] or p.images)
    path = os.path.join(p.root, rel)
    st = os.stat(path)
    p.write_image(rel, *p.shape(rel))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return f"pixels same size+mtime {rel} (size {st.st_size}->{os.path.getsize(path)})"


def _m_touch(p: Project) -> str:
    rel = p.rng.choice(p.images)
    st = os.stat(os.path.join(p.root, rel))
    os.utime(os.path.join(p.root, rel), ns=(st.st_atime_ns, st.st_mtime_ns + 3_000_000_000))
    return f"touch {rel}"


def _drop_from_listing(p: Project, rel: str) -> None:
    p.images.remove(rel)
    if p.kind == "table":
        p.rows = [row for row in p.rows if row["path"] != rel]
        p.write_table()
    elif p.kind == "coco":
        ids = {im["id"] for im in p.coco["images"] if im["file_name"] == rel}
        p.coco["images"] = [im for im in p.coco["images"] if im["id"] not in ids]
        p.coco["annotations"] = [a for a in p.coco["annotations"] if a["image_id"] not in ids]
        p.write_coco()


def _add_to_listing(p: Project, rel: str) -> None:
    if p.kind == "table":
        p.rows.append({"path": rel, "label": p.rng.choice(["x", "y"]), "score": str(p.rng.randint(0, 4))})
        p.write_table()
    elif p.kind == "coco":
        p.coco_image(1 + max(im["id"] for im in p.coco["images"]), rel)
        p.write_coco()


def _m_delete(p: Project) -> str:
    rel = p.rng.choice(p.images)
    os.remove(os.path.join(p.root, rel))
    _drop_from_listing(p, rel)
    return f"delete {rel}"


def _m_add(p: Project) -> str:
    rel = p.add_image()
    _add_to_listing(p, rel)
    return f"add {rel}"


def _m_rename(p: Project) -> str:
    rel = p.rng.choice(p.images)
    d, b = os.path.split(rel)
    new = f"{d}/r{b}"
    os.rename(os.path.join(p.root, rel), os.path.join(p.root, new))
    if p.kind == "table":
        for row in p.rows:
            if row["path"] == rel:
                row["path"] = new
        p.write_table()
    elif p.kind == "coco":
        for im in p.coco["images"]:
            if im["file_name"] == rel:
                im["file_name"] = new
        p.write_coco()
    p.images[p.images.index(rel)] = new
    p.shapes[new] = p.shapes.pop(rel)
    return f"rename {rel} -> {new}"


def _m_swap(p: Project) -> str:
    a, b = p.rng.sample(p.images, 2)
    pa, pb = os.path.join(p.root, a), os.path.join(p.root, b)
    da, db = _read(pa), _read(pb)
    ma, mb = os.stat(pa).st_mtime_ns, os.stat(pb).st_mtime_ns
    _write(pa, db)
    _write(pb, da)
    later = max(ma, mb) + 2_000_000_000
    os.utime(pa, ns=(later, later))
    os.utime(pb, ns=(later, later))
    p.shapes[a], p.shapes[b] = p.shapes[b], p.shapes[a]
    if p.kind == "coco":   # the image sizes the COCO file records follow the files
        for im in p.coco["images"]:
            if im["file_name"] in (a, b):
                im["height"], im["width"] = p.shape(im["file_name"])
        p.write_coco()
    return f"swap {a} <-> {b}"


def _m_label_cell(p: Project) -> str:
    row = p.rng.choice(p.rows)
    row["label"] = p.rng.choice([c for c in ["x", "y", "z"] if c != row["label"]])
    p.write_table()
    return f"label cell {row['path']} -> {row['label']}"


def _m_score_cell(p: Project) -> str:
    row = p.rng.choice(p.rows)
    row["score"] = str((int(row["score"]) + 1) % 5)
    p.write_table()
    return f"score cell {row['path']} -> {row['score']}"


def _m_reorder_rows(p: Project) -> str:
    p.rng.shuffle(p.rows)
    p.write_table()
    return "reorder rows"


def _m_remove_row(p: Project) -> str:
    row = p.rng.choice(p.rows)
    p.rows.remove(row)
    p.write_table()
    return f"remove row {row['path']} (file kept)"


def _m_box(p: Project) -> str:
    a = p.rng.choice(p.coco["annotations"])
    a["bbox"] = [a["bbox"][0], a["bbox"][1], max(1, a["bbox"][2] - 1), a["bbox"][3]]
    p.write_coco()
    return f"box of annotation {a['id']}"


def _m_add_ann(p: Project) -> str:
    im = p.rng.choice(p.coco["images"])
    p.coco_ann(im["id"], im["height"], im["width"])
    p.write_coco()
    return f"annotation added to image {im['id']}"


def _m_category_name(p: Project) -> str:
    c = p.rng.choice(p.coco["categories"])
    c["name"] = c["name"] + "2"
    p.write_coco()
    return f"category {c['id']} renamed {c['name']}"


def _m_step(p: Project) -> str:
    s = p.recipe["steps"][0]["resize"]
    s["size"] = [s["size"][0], 8 if s["size"][1] != 8 else 7]
    p.write_recipe()
    return f"resize -> {s['size']}"


def _m_seed(p: Project) -> str:
    p.recipe["seed"] += 1
    p.write_recipe()
    return f"seed -> {p.recipe['seed']}"


def _m_per_shard(p: Project) -> str:
    o = p.recipe["output"]
    o["samples_per_shard"] = 5 - o["samples_per_shard"]
    p.write_recipe()
    return f"samples_per_shard -> {o['samples_per_shard']}"


def _m_split(p: Project) -> str:
    if "split" in p.recipe and p.rng.random() < 0.3:
        del p.recipe["split"]
        what = "split removed"
    elif "split" in p.recipe:
        s = p.recipe["split"]
        if p.rng.random() < 0.5:
            s["seed"] = s.get("seed", 0) + 1
        else:
            half = s["fractions"]["train"] == 0.5
            s["fractions"] = {"train": 0.7, "val": 0.3} if half else {"train": 0.5, "val": 0.5}
        what = f"split -> {s}"
    else:
        p.recipe["split"] = {"by": "hash", "fractions": {"train": 0.5, "val": 0.5}}
        what = "split added"
    p.write_recipe()
    return what


def _m_copies(p: Project) -> str:
    if not any("random_flip" in s for s in p.recipe["steps"]):
        p.recipe["steps"].append({"random_flip": {"horizontal": 0.5}})
    p.recipe["copies"] = (p.recipe["copies"] + 1) % 3
    p.write_recipe()
    return f"copies -> {p.recipe['copies']}"


def _m_output_name(p: Project) -> str:
    p.recipe["output"]["name"] = p.out_name() + "x"
    p.write_recipe()
    return f"output name -> {p.out_name()}"


def _m_field(p: Project) -> str:
    f = p.recipe["inputs"]["fields"]
    if "twin" in f:
        del f["twin"]
        what = "field twin removed"
    else:
        path = {"coco": "{file_name}", "table": "{path}", "folder": "{label}/{name}.{ext}"}[p.kind]
        f["twin"] = {"decoder": "image", "mode": "gray8", "path": path}
        what = "field twin added"
    p.write_recipe()
    return what


def _m_where(p: Project) -> str:
    i = p.recipe["inputs"]
    if p.kind == "table":
        i["where"] = "score >= 2" if i.get("where") != "score >= 2" else "score <= 2"
    else:
        i["where"] = {"name": "im00[0-5]"} if "where" not in i else {"name": "im00[2-9]"}
    p.write_recipe()
    return f"where -> {i['where']}"


def _m_format(p: Project) -> str:
    o = p.recipe["output"]
    o["format"] = p.rng.choice([f for f in ("hdf5", "png", "bmp") if f != o["format"]])
    p.write_recipe()
    return f"format -> {o['format']}"


def _m_corrupt(p: Project) -> str:
    """An input that no longer decodes: a failure (on_error: skip lists it; fail stops both builds)."""
    rel = p.rng.choice(p.images)
    path = os.path.join(p.root, rel)
    mtime = os.stat(path).st_mtime_ns + 2_000_000_000
    _write(path, b"not an image at all")
    os.utime(path, ns=(mtime, mtime))
    return f"corrupt {rel}"


def _m_keep_original(p: Project) -> str:
    p.recipe["keep_original"] = not p.recipe.get("keep_original", True)
    if not p.recipe["keep_original"] and not p.recipe["copies"]:
        _m_copies(p)
    p.write_recipe()
    return f"keep_original -> {p.recipe['keep_original']}"


def _m_interrupted_build(p: Project, out: str) -> str:
    """A -j1 build of the (already mutated) state stopped by a Ctrl-C at one input (BuildInterrupted: the
    finished shards kept, the half-written one removed), before the rebuild under test."""
    from precompile.compiler.driver import BuildInterrupted

    rel = p.rng.choice(p.images)
    os.environ["PRECOMPILE_TEST_INTERRUPT_AT"] = os.path.basename(rel)
    try:
        build(p.recipe_path, out_dir=out, n_jobs=1, content_hash=p.content_hash, progress=False)
        what = "not reached"
    except BuildInterrupted as e:
        what = f"{e.kept} of {e.total} kept"
    except precompile.errors.PrecompileError as e:
        what = f"failed first: {type(e).__name__}"
    finally:
        del os.environ["PRECOMPILE_TEST_INTERRUPT_AT"]
    return f"build interrupted at {rel}: {what}"


def _m_content_hash(p: Project) -> str:
    """``--content-hash`` given or dropped (not part of the recipe; both builds get the same flag)."""
    p.content_hash = not p.content_hash
    return f"content_hash -> {p.content_hash}"


def _m_kill_shard(p: Project, out: str) -> str:
    files = _named_files(out)
    victim = p.rng.choice(sorted(files))
    path = os.path.join(out, victim)
    if os.path.isdir(path):
        inner = sorted(glob.glob(os.path.join(path, "*")))
        victim = os.path.relpath(inner[0], out)
        path = inner[0]
    if p.rng.random() < 0.5:
        os.remove(path)
        return f"deleted {victim}"
    with open(path, "r+b") as f:
        f.truncate(max(1, os.path.getsize(path) // 2))
    return f"truncated {victim}"


def _m_killed_build(p: Project, out: str, tmp: str) -> str:
    """A build of the (already mutated) state killed before its index: some of its finished shards are in the
    shard folder, no index names them, and a half-written temporary lies beside them."""
    side = os.path.join(tmp, "killed")
    rep = _build(p, side, 1)
    if isinstance(rep, Exception):
        return "killed build (the state fails)"
    name = p.out_name()
    shard_dir = os.path.join(out, name + ".shards")
    os.makedirs(shard_dir, exist_ok=True)
    done = sorted(d for d in glob.glob(os.path.join(side, name + ".shards", "shard-*")) if not d.endswith(".json"))
    kept = [d for d in done if p.rng.random() < 0.5]
    for src in kept:   # the skipped-inputs sidecar first, as a shard task writes them
        for a in (src + ".skipped.json", src):
            dst = os.path.join(shard_dir, os.path.basename(a))
            if os.path.exists(a) and not os.path.exists(dst):
                (shutil.copytree if os.path.isdir(a) else shutil.copyfile)(a, dst)
    if done:
        tmp_name = os.path.join(shard_dir, os.path.basename(done[0]) + ".tmp-999999")
        if os.path.isdir(done[0]):
            shutil.copytree(done[0], tmp_name)
        else:
            _write(tmp_name, _read(done[0])[:100])
    shutil.rmtree(side)
    return f"killed build left {len(kept)} of {len(done)} shard(s) and a temporary"


COMMON = [_m_pixels, _m_touch, _m_delete, _m_add, _m_rename, _m_swap, _m_step, _m_seed, _m_per_shard,
          _m_split, _m_copies, _m_output_name, _m_field, _m_corrupt, _m_keep_original, _m_content_hash]
BY_KIND = {"folder": [_m_where, _m_format],
           "table": [_m_label_cell, _m_score_cell, _m_reorder_rows, _m_remove_row, _m_where, _m_format],
           "coco": [_m_box, _m_add_ann, _m_category_name]}


# ---------------------------------------------------------------- what the two outputs are

def _indexes(out: str) -> list[str]:
    return sorted(snapshot.indexes_in(out))


def _named_files(out: str) -> set[str]:
    """Every shard path (relative to ``out``) some index in ``out`` names."""
    files: set[str] = set()
    for ix in _indexes(out):
        attrs = snapshot.read_index_attrs(ix)
        assert attrs is not None, f"{ix}: unreadable index"
        files.update(s["file"] for s in json.loads(attrs["shards"]))
    return files


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _tree_bytes(path: str) -> dict[str, bytes]:
    if os.path.isfile(path):
        return {"": _read(path)}
    return {os.path.relpath(f, path): _read(f)
            for f in sorted(glob.glob(os.path.join(path, "**"), recursive=True)) if os.path.isfile(f)}


def _own_indexes(out: str, name: str) -> list[str]:
    """The indexes in ``out`` of the output ``name`` (``name.h5``, ``name.<split>.h5``, ``name.json``, ...):
    those naming shards in ``name.shards/`` (another output's indexes, e.g. the one an output-name change
    left, name shards in their own folder and are not compared)."""
    own = []
    for ix in _indexes(out):
        files = [s["file"] for s in json.loads(snapshot.read_index_attrs(ix)["shards"])]
        if os.path.basename(ix).startswith(name + ".") and all(f.startswith(name + ".shards/") for f in files):
            own.append(ix)
    return own


def _state(out: str, name: str) -> dict:
    """What a clean build and a rebuild must agree on (see the module docstring)."""
    st: dict = {"indexes": {}, "shards": {}, "samples": {}}
    for ix in _own_indexes(out, name):
        rel = os.path.relpath(ix, out)
        st["indexes"][rel] = _read(ix)
        for s in json.loads(snapshot.read_index_attrs(ix)["shards"]):
            st["shards"][s["file"]] = _tree_bytes(os.path.join(out, s["file"]))
        ds = precompile.open(ix)
        rows = []
        for i in range(len(ds)):
            sample = ds[i]
            rows.append((ds.key(i), ds.copy(i), {k: (np.asarray(v).dtype.str, np.asarray(v).shape,
                                                     np.asarray(v).tobytes()) for k, v in sorted(sample.items())}))
        if hasattr(ds, "close"):
            ds.close()
        st["samples"][rel] = rows
    rep = os.path.join(out, f"{name}.report.json")
    st["failures"] = [(f.get("key"), f.get("stage")) for f in json.loads(_read(rep)).get("failures", [])] \
        if os.path.exists(rep) else None
    return st


def _check_no_stale(out: str, name: str, where: str = "") -> None:
    own = set()
    for ix in _own_indexes(out, name):   # (another output's index may name a shard the mutation deleted)
        own.update(s["file"] for s in json.loads(snapshot.read_index_attrs(ix)["shards"]))
    for f in own:
        assert os.path.exists(os.path.join(out, f)), f"{where}: an index names a missing shard {f}"
    shard_dir = os.path.join(out, name + ".shards")
    prev = snapshot.previous(shard_dir) if os.path.isdir(shard_dir) else set()
    keep = {os.path.basename(f) for f in _named_files(out)} | {os.path.basename(f) for f in prev}
    for d in glob.glob(os.path.join(out, "*.shards")):
        for entry in os.listdir(d):
            if entry.startswith("shard-") and not entry.endswith(".skipped.json"):
                if d == shard_dir:
                    assert entry in keep, f"{where}: stale shard {entry} in {d}: no index and no previous.json names it"


def _build(p: Project, out: str, jobs: int):
    try:
        return build(p.recipe_path, out_dir=out, n_jobs=jobs, content_hash=p.content_hash, progress=False)
    except precompile.errors.PrecompileError as e:
        return e


def _diff(a: dict, b: dict) -> list[str]:
    out = []
    for part in ("failures", "indexes", "shards", "samples"):
        if a[part] == b[part]:
            continue
        if isinstance(a[part], dict):
            ka, kb = set(a[part]), set(b[part])
            if ka != kb:
                out.append(f"{part}: only rebuild {sorted(ka - kb)}, only clean {sorted(kb - ka)}")
            out += [f"{part}: {k} differs" for k in sorted(ka & kb) if a[part][k] != b[part][k]]
        else:
            out.append(f"{part}: rebuild {a[part]} != clean {b[part]}")
    return out


def run_case(tmp_path, seed: int, monkeypatch) -> list[str]:
    """Build a project, apply 2 rounds of 1-2 mutations, each followed by an in-place rebuild compared with
    a clean build; returns the log. Fails on the first difference."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    p = Project(tmp_path / "proj", seed)
    out = str(tmp_path / "out")
    first = _build(p, out, p.rng.choice([1, 2]))
    assert not isinstance(first, Exception), f"seed {seed}: the first build failed: {first}"
    muts = COMMON + BY_KIND[p.kind] + [_m_pixels_same_mtime]
    log = [f"seed {seed}: {p.kind} {p.recipe['output']['format']} content_hash={p.content_hash}"]
    for rnd in range(2):
        k = p.rng.choice([1, 1, 2])
        applied = []
        fns = p.rng.sample(muts, k)
        for fn in fns:
            if len(p.images) <= 3 and fn in (_m_delete, _m_remove_row):
                fn = _m_add
            if fn is _m_pixels_same_mtime and not p.content_hash:   # invisible to a size+mtime key, by design
                fn = _m_pixels
            applied.append(fn(p))
        killed = None
        if p.rng.random() < 0.2 and _named_files(out):
            killed = _m_kill_shard(p, out)
            applied.append(killed)
        if p.rng.random() < 0.15:
            killed = _m_killed_build(p, out, str(tmp_path))
            applied.append(killed)
        if p.interruptible and p.rng.random() < 0.6:
            killed = _m_interrupted_build(p, out)
            applied.append(killed)
        jobs = p.rng.choice([1, 2])
        log.append(f"  round {rnd}: {applied} -j{jobs}")
        name = p.out_name()
        rep = _build(p, out, jobs)
        clean_dir = str(tmp_path / f"clean{rnd}")
        clean = _build(p, clean_dir, 1)
        where = f"seed {seed} round {rnd} after {applied}"
        if isinstance(clean, Exception) or isinstance(rep, Exception):
            assert type(clean) is type(rep), f"{where}: rebuild gave {rep!r}, clean build {clean!r}"
            log.append(f"    both failed: {type(clean).__name__}")
            return log   # the state is an error either way; later rounds would build on a failed output
        got, want = _state(out, name), _state(clean_dir, name)
        diffs = _diff(got, want)
        assert not diffs, f"{where} (-j{jobs}): the rebuild differs from a clean build: {diffs}\n" + "\n".join(log)
        _check_no_stale(out, name, f"{where} (-j{jobs})\n" + "\n".join(log))
        from precompile.tools.verify import verify

        for ix in _own_indexes(out, name):   # every byte of the rebuilt output checks against its index
            res = verify(ix)
            assert res.ok, f"{where}: verify {os.path.basename(ix)}: {res}"
        assert rep["num_samples"] == clean["num_samples"]
        # what a rebuild redoes, where the docs promise it
        if fns == [_m_pixels] and killed is None:
            assert rep["shards"]["built"] <= 1, f"{where}: one changed input rebuilt {rep['shards']}"
        if fns == [_m_add] and killed is None and p.kind == "folder" and "where" not in p.recipe["inputs"] \
                and "split" not in p.recipe and p.images[-1] == max(p.images):
            # docs/reference-build.md: appending (a key that sorts after all others) rebuilds only the last shard.
            # Not with split: shards are numbered split after split, so an input appended to the first split
            # that opens a new shard renumbers (and so rebuilds) the next split's shards (seed 2365)
            assert rep["shards"]["built"] <= 1, f"{where}: an appended input rebuilt {rep['shards']}"
        if fns == [_m_output_name] and killed is None:
            assert rep["shards"]["built"] == 0, f"{where}: a new output name rebuilt {rep['shards']}"
        if fns == [_m_touch] and killed is None and p.content_hash:
            assert rep["shards"]["built"] == 0, f"{where}: a touch under --content-hash rebuilt {rep['shards']}"
        log.append(f"    ok: {rep['shards']}")
    return log


@pytest.mark.parametrize("seed", SEEDS)
def test_rebuild_equals_clean_build(tmp_path, seed, monkeypatch):
    run_case(tmp_path, seed, monkeypatch)


EXPLORE = int(os.environ.get("PRECOMPILE_REBUILD_EXPLORE", "0") or 0)
EXPLORE_FROM = int(os.environ.get("PRECOMPILE_REBUILD_EXPLORE_FROM", "1000") or 1000)   # the first seed explored


@pytest.mark.skipif(not EXPLORE, reason="explore mode: set PRECOMPILE_REBUILD_EXPLORE=N to run N more seeds")
@pytest.mark.parametrize("seed", range(EXPLORE_FROM, EXPLORE_FROM + max(EXPLORE, 1)))
def test_rebuild_equals_clean_build_explore(tmp_path, seed, monkeypatch):
    run_case(tmp_path, seed, monkeypatch)


# ---------------------------------------------------------------- the differences the generator found, each alone

def _tiny(tmp_path, fmt: str, n: int = 4) -> tuple[dict, str]:
    from PIL import Image

    root = tmp_path / "in"
    root.mkdir(parents=True)
    for i in range(n):
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (10, 10, 3), dtype=np.uint8)).save(root / f"i{i}.png")
    recipe = {"name": "t", "inputs": {"root": str(root), "match": "{name}.png",
                                      "fields": {"image": {"decoder": "image"}}},
              "output": {"format": fmt, "samples_per_shard": 2}}
    return recipe, str(root)


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_file_folder_shard_with_a_damaged_file_is_rebuilt(tmp_path, monkeypatch, damage):
    """A sample file of a png shard folder deleted or truncated by hand: a plain build rebuilds that shard alone
    (docs/faults.md: 'a truncated shard ... a build rebuilds that shard alone'; a deleted one 'a build rewrites
    the missing ones'), ending with a clean build's bytes. It kept the damaged shard: only info.json was read."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    recipe, _ = _tiny(tmp_path, "png")
    out = str(tmp_path / "out")
    build(recipe, out_dir=out)
    victim = sorted(glob.glob(os.path.join(out, "t.shards", "shard-00001-*", "*.png")))[0]
    if damage == "delete":
        os.remove(victim)
    else:
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) - 7)
    rep = build(recipe, out_dir=out)
    assert rep["shards"]["built"] == 1 and rep["shards"]["skipped"] == 1, rep["shards"]
    build(recipe, out_dir=str(tmp_path / "clean"))
    assert _state(out, "t") == _state(str(tmp_path / "clean"), "t")


def test_truncated_shard_is_rebuilt_while_this_process_has_it_open(tmp_path, monkeypatch):
    """A reader in the building process (a notebook) holds shard 0 open; the shard is truncated by hand and an
    input of shard 1 changes. HDF5 hands an already-open file's cached metadata to the build's check of shard 0,
    so its key read fine and the truncated file was kept (and its new size written into the index): the kept
    shard must have the size the index recorded."""
    from PIL import Image

    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    recipe, root = _tiny(tmp_path, "hdf5")
    out = str(tmp_path / "out")
    build(recipe, out_dir=out)
    ds = precompile.open(os.path.join(out, "t.h5"))
    ds[0], ds[3]   # both shards opened
    shard0 = glob.glob(os.path.join(out, "t.shards", "shard-00000-*.h5"))[0]
    with open(shard0, "r+b") as f:
        f.truncate(os.path.getsize(shard0) // 2)
    p = os.path.join(root, "i3.png")
    mtime = os.stat(p).st_mtime_ns + 2_000_000_000
    Image.fromarray(np.full((10, 10, 3), 7, np.uint8)).save(p)
    os.utime(p, ns=(mtime, mtime))
    rep = build(recipe, out_dir=out)
    del ds
    assert rep["shards"]["built"] == 2, rep["shards"]
    build(recipe, out_dir=str(tmp_path / "clean"))
    assert _state(out, "t") == _state(str(tmp_path / "clean"), "t")


@pytest.mark.parametrize("change", ["add split", "remove split", "rename split", "hdf5 -> png"])
def test_a_rebuild_leaves_no_index_of_the_output_the_recipe_no_longer_writes(tmp_path, monkeypatch, change):
    """Adding ``split:`` to a built output left its unsplit ``t.h5`` (and removing it left ``t.train.h5`` and
    ``t.val.h5``; renaming a split, or changing the format, the same) beside the new indexes: an index of the
    old recipe that a clean build does not have, serving stale samples and keeping its shards forever (every
    index in the folder is asked which shards to keep). The rebuild removes it; its shards stay as the
    replaced snapshot (previous.json) until the next build, as any replaced index's do."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    recipe, _ = _tiny(tmp_path, "hdf5", n=6)
    other, _ = _tiny(tmp_path / "o", "hdf5", n=2)
    other["name"] = "t.v2"   # another output whose name starts like this one's: never touched
    split = {"by": "hash", "fractions": {"train": 0.5, "val": 0.5}}
    before, after = dict(recipe), dict(recipe)
    if change == "add split":
        after["split"] = split
    elif change == "remove split":
        before["split"] = split
    elif change == "rename split":
        before["split"] = split
        after["split"] = {"by": "hash", "fractions": {"train": 0.5, "test": 0.5}}
    else:
        after["output"] = dict(recipe["output"], format="png")
    out = str(tmp_path / "out")
    build(other, out_dir=out)
    build(before, out_dir=out)
    old = _named_files(out)
    build(after, out_dir=out)
    build(after, out_dir=str(tmp_path / "clean"))
    assert _state(out, "t") == _state(str(tmp_path / "clean"), "t")
    left = sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "t.*"))
                  if not os.path.basename(p).startswith("t.v2"))
    want = sorted(os.path.basename(p) for p in glob.glob(os.path.join(tmp_path, "clean", "t.*")))
    assert left == want
    assert os.path.exists(os.path.join(out, "t.v2.h5")) and os.path.exists(os.path.join(out, "t.v2.report.json"))
    _check_no_stale(out, "t")
    prev = snapshot.previous(os.path.join(out, "t.shards"))
    for f in old - _named_files(out):   # the replaced snapshot, kept until the next build
        if f.startswith("t.shards/"):
            assert os.path.basename(f) in prev and os.path.exists(os.path.join(out, f)), f


@pytest.mark.parametrize("fmt", ["png", "bmp"])
def test_new_output_name_reuses_a_sibling_shard_folder(tmp_path, monkeypatch, fmt):
    """docs/reference-build.md: 'Changing only the output name reuses the shards of a sibling build (hard
    links)'. A file-folder format's shards are folders, and only files were looked for: every shard was built
    again. Linked, the new output's files are the sibling's (same inodes) and equal a clean build's bytes."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    recipe, _ = _tiny(tmp_path, fmt)
    out = str(tmp_path / "out")
    build(recipe, out_dir=out)
    renamed = dict(recipe, output=dict(recipe["output"], name="u"))
    rep = build(renamed, out_dir=out)
    assert rep["shards"]["built"] == 0 and rep["shards"]["reused"] == 2, rep["shards"]
    build(renamed, out_dir=str(tmp_path / "clean"))
    assert _state(out, "u") == _state(str(tmp_path / "clean"), "u")
    for f in _named_files(out):
        if f.startswith("u.shards/"):
            for n in os.listdir(os.path.join(out, f)):
                a, b = os.stat(os.path.join(out, f, n)), os.stat(os.path.join(out, "t" + f[1:], n))
                assert (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev), n
    assert build(recipe, out_dir=out)["shards"]["built"] == 0   # the sibling is untouched
