"""Shard layout: chunks that tile each shard, and ``plan``'s size estimate against the bytes a build writes."""
from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

import precompile
from precompile.compiler.plan import make_plan
from precompile.formats.base import tile_rows
from precompile.recipe import load_recipe

from conftest import image_recipe, make_image_tree, shard_file, write_recipe


@pytest.mark.parametrize("n,cap,want", [
    (256, 170, 128),    # 64x64x3 under 2 MiB: two chunks of 128, not 170 + an 86-row hole
    (256, 256, 256), (16, 170, 16), (1, 170, 1), (10, 3, 2),
    (997, 170, 167),    # a prime: spread evenly over 6 chunks (1002 rows, 5 empty)
    (1000, 170, 125),
])
def test_tile_rows(n, cap, want):
    c = tile_rows(n, cap)
    assert c == want and c <= cap
    k = -(-n // c)
    assert k * c - n < k                       # never more than k - 1 empty rows
    if any(n % kk == 0 for kk in range(-(-n // cap), 2 * -(-n // cap) + 1)):
        assert n % c == 0                      # exact tiling whenever a near divisor exists


def _build(tmp_path, per_class, size, per_shard, **output):
    tree = make_image_tree(tmp_path / "data", classes=("a", "b", "c"), per_class=per_class)
    r = image_recipe(tree, steps=[{"resize": {"size": list(size)}}],
                     output={"format": "hdf5", "samples_per_shard": per_shard, **output})
    path = write_recipe(tmp_path / "r.yaml", r)
    plan = make_plan(load_recipe(path))
    rep = precompile.build(path, out_dir=tmp_path / "out")
    return plan, rep, tmp_path / "out" / "imgs.shards"


@pytest.mark.parametrize("per_class,size,per_shard", [
    (12, (64, 64), 16),     # images.yaml's layout: 36 samples in shards of 16, 16, 4
    (30, (64, 64), 45),     # 90 samples, shards of 45 (12 KiB rows: 2 MiB caps chunks at 170 rows)
    (400, (8, 8), 1200),    # tiny rows (192 B): the columns and metadata are a third of the bytes
])
def test_chunks_tile_shards_and_the_estimate_is_within_5_percent(tmp_path, per_class, size, per_shard):
    plan, rep, shards = _build(tmp_path, per_class, size, per_shard)
    rb = size[0] * size[1] * 3
    for name in sorted(n for n in os.listdir(shards) if n.endswith(".h5")):
        with h5py.File(shards / name, "r") as f:
            d = f["image"]
            n = d.shape[0]
            assert n % d.chunks[0] == 0, (name, n, d.chunks)      # no partly empty chunk, short shards too
            assert d.id.get_storage_size() == n * rb               # allocated = data
            assert f["label"].id.get_storage_size() == n * 8
    written = sum(os.path.getsize(shards / n) for n in os.listdir(shards) if n.endswith(".h5"))
    assert rep["bytes"] == written
    est = plan.estimated_bytes()
    assert abs(est - written) <= 0.05 * written, (est, written)
    assert plan.data_bytes() == plan.num_samples * (rb + 8)


def test_chunk_samples_from_the_recipe_is_kept(tmp_path):
    plan, rep, shards = _build(tmp_path, 4, (16, 16), 12, chunk_samples=5)
    with h5py.File(shard_file(shards.parent / "imgs.h5", 0), "r") as f:
        assert f["image"].chunks[0] == 5 and f["image"].shape[0] == 12
    ds = precompile.open(shards.parent / "imgs.h5")
    assert np.array_equal(ds.batch(range(len(ds)))["image"].shape, (12, 16, 16, 3))
