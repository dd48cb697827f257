"""Both gather paths of the DirectReader (residue views with np.take, and the strided fancy
index used when rows fall into many alignments), over one region holding every shard or one map
per shard, and the in-memory copy, return exactly what the dataset returns."""
from __future__ import annotations

import numpy as np
import pytest

import precompile
from precompile.reader import direct

from conftest import image_recipe, write_recipe


@pytest.fixture
def built(tmp_path, image_tree):
    # 30x30x3 rows (2700 bytes) in chunks of 3 samples: chunk addresses fall into several residues
    r = image_recipe(image_tree, steps=[{"resize": {"size": [30, 30]}}],
                     output={"format": "hdf5", "samples_per_shard": 6, "chunk_samples": 3})
    precompile.build(write_recipe(tmp_path / "r.yaml", r), out_dir=tmp_path / "out")
    return precompile.open(tmp_path / "out" / "imgs.h5")


@pytest.mark.parametrize("region", [True, False])
@pytest.mark.parametrize("max_views", [0, 64])
def test_gather_paths_match_the_dataset(built, monkeypatch, max_views, region):
    monkeypatch.setattr(direct, "MAX_VIEWS", max_views)
    monkeypatch.setattr(direct, "USE_REGION", region)
    r = direct.DirectReader(built)
    nshards = len(built.shards)
    if not region:
        assert r.region is None and len(r._maps) == nshards
    takeable = r._takeable["image"]
    spaces = 1 if r.region is not None else nshards
    if max_views == 0:
        assert takeable == [False] * spaces                # one strided view per mapped space
    else:                                                  # several residues, all served by np.take
        assert all(takeable) and len(takeable) > spaces
    calls = []
    run = r._gather_runs
    monkeypatch.setattr(r, "_gather_runs", lambda *a: calls.append(1) or run(*a))
    rng = np.random.default_rng(0)
    for size in (7, 7, 7, 40, 40):  # 40 scattered rows: many more runs than views, grouped by view first
        idx = rng.choice(len(built), size=size, replace=True)
        for order in (idx, r.order_batch(idx)):        # scattered and gather-ordered batches
            calls.clear()
            got = r.read(order)
            want = built.batch(order)
            for f in ("image", "label"):
                np.testing.assert_array_equal(got[f], want[f])
            grouped = len(calls) > 2                   # one call per field, plus one per field it grouped
            # one strided view (max_views 0, one region) is one run whatever the order
            assert grouped == (size == 40 and order is idx and len(takeable) > 1), (size, len(calls))


def test_one_region_serves_every_shard_and_in_memory_matches(built, monkeypatch):
    monkeypatch.setattr(direct, "USE_REGION", True)
    r = direct.DirectReader(built)
    if r.region is None:
        pytest.skip("no MAP_FIXED through ctypes on this platform")
    # every shard file lies in the one range, page aligned, in shard order
    assert len(r.region.bases) == len(built.shards) and (r.region.bases % direct.mmap.PAGESIZE == 0).all()
    assert not r.region.array.flags.writeable
    with pytest.raises(ValueError):
        r.region.array[0] = 1
    # the views of the range cover the rows of every shard: their number does not grow with shards
    assert len(r._views["image"]) == len(np.unique(r._vid["image"]))
    m = direct.DirectReader(built, in_memory=True)
    assert m.region is None and len(m._views["image"]) == 1
    idx = np.random.default_rng(1).choice(len(built), size=25, replace=True)
    want = built.batch(idx)
    for reader in (r, m):
        got = reader.read(idx)
        for f in ("image", "label"):
            np.testing.assert_array_equal(got[f], want[f])
    r.close()
    m.close()
