"""An outside attack on object storage: a build read from a URL whose index lies about its shards, a store
that serves other bytes than the index promises, and builds written to a URL. Every object lives in fsspec's
in-process ``memory://`` store (one prefix per test), so each test takes well under a second."""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import fsspec
import h5py
import numpy as np
import pytest
from PIL import Image

import precompile
from precompile.errors import FormatError
from precompile.recipe import parse_recipe


def tiny_build(root: Path, n: int = 4) -> Path:
    """``n`` 4x4 RGB images whose pixels are their own number, 2 per shard; returns the local index."""
    (root / "in" / "a").mkdir(parents=True)
    for i in range(n):
        Image.fromarray(np.full((4, 4, 3), 20 * i, np.uint8)).save(root / "in" / "a" / f"{i}.png")
    recipe = parse_recipe({"name": "t", "seed": 0,
                           "inputs": {"root": "in", "match": "{label}/{name}.png",
                                      "fields": {"image": {"decoder": "image"}}, "label": {"capture": "label"}},
                           "output": {"format": "hdf5", "samples_per_shard": 2}}, base_dir=str(root))
    precompile.build(recipe, out_dir=str(root / "out"))
    return root / "out" / "t.h5"


def upload(out: Path) -> str:
    """Every file of the local output folder ``out`` under a new memory:// prefix; the prefix's URL."""
    fs = fsspec.filesystem("memory")
    url = f"memory://sa-{uuid.uuid4().hex[:12]}/p"
    for p in sorted(out.rglob("*")):
        if p.is_file():
            fs.pipe_file(f"{url}/{p.relative_to(out).as_posix()}", p.read_bytes())
    return url


def set_entries(index: Path, change) -> None:
    """Rewrite the index's shard entries (its ``shards`` attribute) with ``change(entries)``."""
    with h5py.File(index, "r+") as f:
        shards = json.loads(f.attrs["shards"])
        change(shards)
        f.attrs["shards"] = json.dumps(shards)


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# -- an index at a URL whose shard entries lie ---------------------------------------------------------------
@pytest.mark.parametrize("file", ["../q/t.shards/x.h5", "t.shards/../../q/x.h5", "/abs/x.h5", "t.shards//x.h5",
                                  "./t.shards/x.h5", "", "t.shards/x.h5\0", "t.shards\\..\\..\\x.h5"])
def test_a_shard_entry_naming_a_file_outside_the_index_folder_is_refused_at_open(tmp_path, file):
    """A shard path that leaves the index's folder (or names no object) is a damaged index, said at open:
    nothing is requested from another prefix of the store."""
    index = tiny_build(tmp_path)

    def change(shards):
        shards[0]["file"] = file
    set_entries(index, change)
    url = upload(index.parent)
    before = files_under(tmp_path)
    with pytest.raises(FormatError) as e:
        precompile.open(f"{url}/t.h5", cache_dir=tmp_path / "c")
    assert str(e.value).startswith(f"{url}/t.h5: the index is damaged: shard entry 0 names the file {file!r}, "
                                   f"which is not a path inside the index's folder"), str(e.value)
    assert files_under(tmp_path) - before <= {"c", "c/files", "c/locks"} | \
        {f"c/files/{n}" for n in os.listdir(tmp_path / "c" / "files")}
    assert all(n.endswith(".h5") and len(n) == 67 for n in os.listdir(tmp_path / "c" / "files"))


@pytest.mark.parametrize("field, value, what", [
    ("sha256", "000000000000000/../../x", "its sha256 '000000000000000/../../x' is not 64 lowercase hex digits"),
    ("sha256", "0x" + "a" * 62, "its sha256 '0x" + "a" * 62 + "' is not 64 lowercase hex digits"),
    ("sha256", "A" * 64, "its sha256 '" + "A" * 64 + "' is not 64 lowercase hex digits"),
    ("bytes", -5, "its size (bytes) -5 is not a number of bytes >= 0"),
    ("bytes", True, "its size (bytes) True is not a number of bytes >= 0")])
def test_a_shard_entry_with_a_malformed_digest_or_size_is_a_damaged_index(tmp_path, field, value, what):
    """The digest names the cached copy's file and its byte in the cache's locks: one that is no sha256 was
    taken for a store fault ("cannot read from the store: ValueError ..., check the network")."""
    index = tiny_build(tmp_path)

    def change(shards):
        shards[0][field] = value
    set_entries(index, change)
    url = upload(index.parent)
    with pytest.raises(FormatError) as e:
        ds = precompile.open(f"{url}/t.h5", cache_dir=tmp_path / "c")
        ds[0]
    assert str(e.value).startswith(f"{url}/t.h5: the index is damaged: shard entry 0 "), str(e.value)
    assert what in str(e.value), str(e.value)
    assert not (tmp_path / "c" / "files").exists() or \
        all(len(n) == 67 for n in os.listdir(tmp_path / "c" / "files"))
