"""``mean``/``std`` without a ``dtype`` (issue 35): normalised values need a float type, so the Loader gives
float32, the same batches as ``dtype="float32"``; before, the Loader refused the pair when made, which under
Lightning (the DataModule makes its Loaders inside ``trainer.fit``) surfaced only once training started."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from precompile.reader.loader import Loader
from precompile.tools.stats import stats

from loader_cases import built, ds  # noqa: F401


def test_mean_and_std_without_dtype_give_float32(built, ds):
    mean, std = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]
    plain = Loader(built, batch_size=12, shuffle=True, seed=3, device="cpu", mean=mean, std=std)
    assert plain.conversion.dtype == "float32" and plain.dtype == torch.float32
    ref = Loader(built, batch_size=12, shuffle=True, seed=3, device="cpu", dtype="float32", mean=mean, std=std)
    idx = plain.batch_indices(0)
    for a, b, i in zip(plain, ref, idx):
        want = (ds.batch(i)["image"].astype(np.float64) / 255 - mean) / std      # numpy on the stored bytes
        assert a["image"].dtype == torch.float32 and torch.equal(a["image"], b["image"])
        np.testing.assert_allclose(a["image"].numpy(), want, atol=1e-5)
        assert a["label"].dtype == torch.int64 and torch.equal(a["label"], b["label"])


def test_stats_without_dtype_normalise_with_the_stored_statistics(built, ds):
    st = stats(built)["fields"]["image"]
    got = next(iter(Loader(built, batch_size=12, shuffle=False, device="cpu", mean="stats", std="stats",
                           channels_first=True)))["image"]
    m, s = np.array(st["mean"]) / 255, np.array(st["std"]) / 255
    want = (ds.batch(range(12))["image"].astype(np.float64) / 255 - m) / s
    assert got.dtype == torch.float32 and got.shape == (12, 3, 8, 8)
    np.testing.assert_allclose(got.permute(0, 2, 3, 1).numpy(), want, atol=1e-5)


def test_no_mean_no_std_keeps_the_stored_dtype_and_one_without_the_other_is_refused(built):
    assert next(iter(Loader(built, batch_size=4, device="cpu")))["image"].dtype == torch.uint8
    with pytest.raises(ValueError, match="give both mean and std, or neither"):
        Loader(built, batch_size=4, device="cpu", mean=[0.5, 0.5, 0.5])
