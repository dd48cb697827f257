"""The CPU Loader recycles host buffers only after the consumer has released them."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the Loader needs it)")

import precompile  # noqa: E402
from precompile.reader.feed import HostPool  # noqa: E402


def test_pool_reuses_only_released_buffers():
    pool = HostPool(limit=4)
    a = pool.get((3, 4), np.uint8)
    t = torch.from_numpy(a)[1:]          # a view keeps the ndarray alive
    del a
    b = pool.get((3, 4), np.uint8)
    assert b.ctypes.data != t.data_ptr() - 4  # still held: a fresh buffer
    del t
    c = pool.get((3, 4), np.uint8)
    assert c is pool.held((3, 4), np.uint8)[0]  # released: reused
    del b, c


def test_kept_batches_stay_intact_and_dropped_ones_are_recycled(image_recipe_file, tmp_path):
    precompile.build(image_recipe_file, out_dir=tmp_path / "out")
    ds = precompile.open(tmp_path / "out" / "imgs.h5")
    loader = precompile.Loader(ds, batch_size=2, shuffle=True, seed=1, device="cpu", dtype="float32",
                               num_threads=0)
    kept = [{k: v.clone() for k, v in b.items()} | {"raw": b} for b in loader]   # hold every batch
    idx = loader.batch_indices(0)
    for b, i in zip(kept, idx):
        ref = ds.batch(i)
        np.testing.assert_allclose(b["raw"]["image"].numpy(), ref["image"] / 255, rtol=1e-6)
        np.testing.assert_array_equal(b["raw"]["image"].numpy(), b["image"].numpy())
    del kept
    ptrs = set()
    for e in range(4):                    # the consumer drops each batch: a few buffers go round
        loader.set_epoch(e)
        for b in loader:
            ptrs.add(b["image"].untyped_storage().data_ptr())
    assert len(ptrs) <= 2
