"""A folder listing and symbolic links to folders (docs/reference-recipe.md, "Paths and symlinks"): with
``inputs.follow_links: outside`` (a trusted layout, "a dataset folder assembled from links into shared
storage") the walk still skipped every linked folder's files without a word, so root/cats -> /shared/cats
built none of its images. Now, with ``outside``, the listing walks into a linked folder wherever it leads; a
link back to a folder the walk is already in is not walked again, so a loop ends. Under the default
``inside`` the listing stays as it was (as ``os.walk``: linked folders are not walked into)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image

import precompile


def _png(path: Path, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((4, 6, 3), value, np.uint8)).save(path)


def _tree(tmp: Path) -> Path:
    """root/sub/c.png; root/subalias -> sub (inside); root/outdir -> secret/ (outside, s.png); root/sub/loop ->
    root (a loop back up)."""
    root = tmp / "root"
    _png(root / "sub" / "c.png", 30)
    _png(tmp / "secret" / "s.png", 250)
    os.symlink("sub", root / "subalias")
    os.symlink(tmp / "secret", root / "outdir")
    os.symlink("..", root / "sub" / "loop")
    return root


def _build(root: Path, out: Path, match: str, **inputs):
    r = {"name": "p", "on_error": "skip", "inputs": {"root": str(root), "match": match,
                                                     "fields": {"image": {"decoder": "image"}}, **inputs}}
    rep = precompile.build(r, out, n_jobs=1)
    ds = precompile.open(rep["output"])
    return rep, {ds.key(i): int(ds[i]["image"].max()) for i in range(len(ds))}


def test_under_inside_a_listing_does_not_walk_into_folder_links(tmp_path):
    """Unchanged (it passed before the fix too): nothing under outdir/ is read, nor subalias/ listed twice."""
    root = _tree(tmp_path)
    rep, got = _build(root, tmp_path / "out", "{d}/{n}.png")
    assert got == {"sub/c.png": 30}
    assert not rep["failures"]


def test_follow_links_outside_walks_into_a_folder_link_out_of_the_root(tmp_path):
    root = _tree(tmp_path)
    rep, got = _build(root, tmp_path / "out", "{d}/{n}.png", follow_links="outside")
    assert got == {"outdir/s.png": 250, "sub/c.png": 30, "subalias/c.png": 30}
    assert not rep["failures"]


def test_a_link_back_up_the_tree_ends_the_walk_there(tmp_path):
    """sub/loop -> root: sub/loop/... (root's own files again, and so on forever) is not walked."""
    root = _tree(tmp_path)
    _png(root / "top.png", 5)
    _png(root / "sub" / "deep" / "d.png", 7)
    rep, got = _build(root, tmp_path / "out", "{a}/{b}/{n}.png", follow_links="outside")
    assert got == {"sub/deep/d.png": 7, "subalias/deep/d.png": 7}
