"""The Loader over an augmented build: one copy per sample each epoch, chosen as epoch_view chooses."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the Loader needs it)")

import precompile  # noqa: E402
from precompile.reader.copies import epoch_view  # noqa: E402

from conftest import image_recipe, write_recipe  # noqa: E402


@pytest.fixture
def augmented(tmp_path, image_tree):
    r = image_recipe(image_tree, copies=3,
                     steps=[{"resize": {"shorter": 36}}, {"random_crop": {"size": 32}}, {"random_flip": {}}])
    precompile.build(write_recipe(tmp_path / "r.yaml", r), out_dir=tmp_path / "out")
    return precompile.open(tmp_path / "out" / "imgs.h5")


def _epoch(loader, e):
    loader.set_epoch(e)
    return {k: torch.cat([b[k] for b in loader]).numpy() for k in ("image", "label")}


def test_each_epoch_shows_every_sample_once_as_one_copy(augmented):
    ds = augmented
    assert len(ds) == 40 and sorted(set(ds.copies.tolist())) == [0, 1, 2, 3]
    loader = precompile.Loader(ds, batch_size=4, shuffle=False, device="cpu")
    seen = []
    for e in range(4):
        got = _epoch(loader, e)
        view = epoch_view(ds, e)
        assert len(view) == 10 and got["image"].shape[0] == 10
        np.testing.assert_array_equal(got["image"], view.batch(range(10))["image"])
        assert [view.key(i) for i in range(10)] == sorted(set(ds.keys))
        seen.append([view.copy(i) for i in range(10)])
    seen = np.array(seen)
    # consecutive epochs show a different variant of every sample; four epochs use all four copies
    assert (seen[1:] != seen[:-1]).all()
    assert all(sorted(col) == [0, 1, 2, 3] for col in seen.T)


def test_copies_all_reads_every_row_and_original_can_be_left_out(augmented):
    ds = augmented
    every = precompile.Loader(ds, batch_size=8, shuffle=False, device="cpu", copies="all")
    np.testing.assert_array_equal(_epoch(every, 0)["image"], ds.batch(range(len(ds)))["image"])
    no_orig = precompile.Loader(ds, batch_size=8, shuffle=True, device="cpu", include_original=False)
    for e in range(3):
        rows = np.concatenate(no_orig.batch_indices(e))
        assert len(rows) == 10 and (ds.copies[rows] != 0).all()


def test_copies_all_without_the_original_reads_every_augmented_row_and_no_original(augmented):
    """``copies="all", include_original=False``: before, include_original was dropped without a word for
    copies="all" (no copy schedule was made), so the originals were read, 40 rows of which 10 copy 0; now every
    row but the originals, each epoch, in any order the shuffle gives, the values of those rows."""
    ds = augmented
    want = np.flatnonzero(ds.copies != 0)
    for shuffle in (False, True, "block"):
        ld = precompile.Loader(ds, batch_size=8, shuffle=shuffle, device="cpu", copies="all",
                               include_original=False)
        for e in range(2):
            rows = np.concatenate(ld.batch_indices(e))
            assert sorted(rows.tolist()) == want.tolist()
        got = _epoch(ld, 1)
        rows = np.concatenate(ld.batch_indices(1))
        np.testing.assert_array_equal(got["image"], ds.batch(rows)["image"])
        ld.close()
