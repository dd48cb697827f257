"""The same shard tasks on a dask cluster give the same bytes as a local build."""
from __future__ import annotations

import os

import pytest

import precompile


def test_local_dask_cluster_matches_in_process_build(tmp_path, image_recipe_file):
    pytest.importorskip("dask.distributed", reason="dask.distributed is not installed (extra 'dask')")
    a = precompile.build(image_recipe_file, out_dir=tmp_path / "a", n_jobs=1)
    b = precompile.build(image_recipe_file, out_dir=tmp_path / "b", n_jobs=2, scheduler="local")
    assert a["num_samples"] == b["num_samples"] == 10 and b["shards"]["built"] == 3
    for name in sorted(os.listdir(tmp_path / "a" / "imgs.shards")):
        assert (tmp_path / "a" / "imgs.shards" / name).read_bytes() == \
            (tmp_path / "b" / "imgs.shards" / name).read_bytes(), name
