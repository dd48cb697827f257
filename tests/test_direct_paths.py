"""Both gather paths of the DirectReader (residue views with np.take, and the strided fancy
index used when rows fall into many alignments) return exactly what the dataset returns."""
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


@pytest.mark.parametrize("max_views", [0, 64])
def test_gather_paths_match_the_dataset(built, monkeypatch, max_views):
    monkeypatch.setattr(direct, "MAX_VIEWS", max_views)
    r = direct.DirectReader(built)
    parts = r.parts["image"]
    if max_views == 0:
        assert all(p.strided is not None for p in parts)
    else:
        assert all(p.views is not None for p in parts) and max(len(p.views) for p in parts) > 1
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
            assert grouped == (size == 40 and order is idx), (size, len(calls))
