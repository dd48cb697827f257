"""A shard's share of the HDF5 index (formats/hdf5_parts.py): the same from the writer, the shard file, the
index it is in and its JSON sidecar, so finalize writes the same index bytes whichever it takes (the
writer's for built shards, the replaced index's for kept ones)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import precompile
from precompile.formats import names as fmt
from precompile.formats import snapshot
from precompile.formats.hdf5 import Hdf5Format
from precompile.formats.hdf5_parts import ShardParts, parts_from_index, read_parts
from precompile.sample import FieldSpec

SIZES = ((20, 30), (24, 24), (18, 40), (32, 16), (20, 30), (8, 12), (16, 16))


def make_tree(root: Path, seed: int = 0) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    for k, (h, w) in enumerate(SIZES):
        (root / "ab"[k % 2]).mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "ab"[k % 2] / f"img{k}.png")


def recipe(root: Path) -> dict:
    """Two fields: ``image`` at its native size (ragged) and a fixed 8x8 copy; three shards of 3, 3, 1."""
    return {"name": "parts", "seed": 1,
            "inputs": {"root": str(root), "match": "{label}/{name}.png", "label": {"capture": "label"},
                       "fields": {"image": {"decoder": "image", "mode": "rgb8"},
                                  "small": {"decoder": "image", "mode": "rgb8"}}},
            "steps": [{"resize": {"size": [8, 8], "fields": ["small"]}}],
            "output": {"format": "hdf5", "samples_per_shard": 3}}


def assert_same(a: ShardParts, b: ShardParts) -> None:
    assert a.keys == b.keys and a.metas == b.metas
    assert a.copies.dtype == b.copies.dtype == np.int32 and np.array_equal(a.copies, b.copies)
    assert sorted(a.chunks) == sorted(b.chunks)
    for f, (c, t) in a.chunks.items():
        assert c == b.chunks[f][0] and t.dtype == b.chunks[f][1].dtype == np.uint64
        assert np.array_equal(t, b.chunks[f][1])
    assert sorted(a.ragged) == sorted(b.ragged)
    for f, (o, s) in a.ragged.items():
        assert np.array_equal(o, b.ragged[f][0]) and np.array_equal(s, b.ragged[f][1])
        assert o.dtype == s.dtype == np.int64 and s.shape == b.ragged[f][1].shape


def test_every_source_gives_the_same_parts(tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    make_tree(tmp_path / "in")
    out = tmp_path / "out"
    precompile.build(recipe(tmp_path / "in"), out_dir=out)
    index = out / "parts.h5"
    attrs = snapshot.read_index_attrs(str(index))
    entries = json.loads(attrs[fmt.A_SHARDS])
    specs = {f: FieldSpec(s["kind"], tuple(s["shape"]), s["dtype"]) for f, s in json.loads(attrs[fmt.A_FIELDS]).items()}
    assert not specs["image"].fixed and specs["small"].fixed and [e["num_samples"] for e in entries] == [3, 3, 1]
    from_index = parts_from_index(str(index), entries, {e["file"] for e in entries})
    for e in entries:
        own = read_parts(str(out / e["file"]), specs)
        assert len(own.keys) == e["num_samples"] and "small" in own.chunks and "image" in own.ragged
        assert_same(own, from_index[e["file"]])
        assert_same(own, ShardParts.from_json(json.loads(json.dumps(own.to_json()))))
    # the index the build wrote (from the writers' parts) is the one written from the shard files
    again = tmp_path / "again" / "parts.h5"
    again.parent.mkdir()
    (again.parent / "parts.shards").symlink_to(out / "parts.shards")
    Hdf5Format().finalize(str(again), [{k: v for k, v in e.items() if k != fmt.E_CHUNKS} for e in entries], specs, {})
    assert _datasets(again) == _datasets(index)


def _datasets(path: Path) -> dict:
    import h5py

    out = {}
    with h5py.File(path, "r") as f:
        def value(o):   # a compound dataset (the __shards__ table) by its bytes: tolist() nests arrays
            return None if not isinstance(o, h5py.Dataset) else o[()].tobytes() if o.dtype.names else o[()].tolist()

        f.visititems(lambda n, o: out.__setitem__(n, value(o)))
    return out


def test_a_rebuild_takes_kept_shards_parts_from_the_index_and_writes_a_fresh_builds_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    make_tree(tmp_path / "in")
    precompile.build(recipe(tmp_path / "in"), out_dir=tmp_path / "out")
    make_tree(tmp_path / "other", seed=5)
    (tmp_path / "in" / "a" / "img6.png").write_bytes((tmp_path / "other" / "a" / "img6.png").read_bytes())
    import precompile.formats.hdf5_parts as hp

    opened: list[str] = []
    real = hp.read_parts
    monkeypatch.setattr(hp, "read_parts", lambda p, s: opened.append(p) or real(p, s))
    import precompile.formats.hdf5 as h5mod

    monkeypatch.setattr(h5mod, "read_parts", hp.read_parts)
    rep = precompile.build(recipe(tmp_path / "in"), out_dir=tmp_path / "out")
    assert rep["shards"]["built"] == 1 and rep["shards"]["skipped"] == 2
    assert opened == []   # neither the kept shards nor the built one was reopened for the index
    precompile.build(recipe(tmp_path / "in"), out_dir=tmp_path / "fresh")
    assert (tmp_path / "out" / "parts.h5").read_bytes() == (tmp_path / "fresh" / "parts.h5").read_bytes()


@pytest.mark.parametrize("bad", [{"keys": ["a"], "copies": [0, 1], "metas": ["{}"], "chunks": {}, "ragged": {}},
                                 {"keys": ["a"], "copies": [0], "metas": [], "chunks": {}, "ragged": {}},
                                 {"keys": ["a"], "copies": [0], "metas": ["{}"]}])
def test_a_damaged_sidecar_is_refused(bad):
    with pytest.raises((ValueError, KeyError)):
        ShardParts.from_json(bad)
