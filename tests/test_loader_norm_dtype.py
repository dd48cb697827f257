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


@pytest.mark.parametrize("shape,dtype,contiguous", [((5, 7, 9, 3), torch.uint8, True), ((2, 3, 6, 5, 3), torch.uint8, True),
                                                    ((4, 6, 8, 1), torch.uint16, True), ((4, 6, 8, 4), torch.uint8, True),
                                                    ((4, 6, 8, 3), torch.float32, False), ((9, 3), torch.uint8, True)])
def test_conversion_is_the_float32_product_then_sum_per_element(shape, dtype, contiguous):
    # the Loader's conversion, whatever view it computes through (rows of W * C values against repeated
    # coefficients where the result is contiguous), gives each element float32(float32(x * a[c]) + b[c]):
    # numpy's float32 arithmetic on the same numbers is the truth, bit for bit
    from precompile.reader.gpu import Convert

    rng = np.random.default_rng(0)
    c = shape[-1]
    mean, std = rng.uniform(0.1, 0.9, c).tolist(), rng.uniform(0.1, 0.5, c).tolist()
    scale = 1 / 255 if dtype == torch.uint8 else 1 / 65535 if dtype == torch.uint16 else 1.0
    if dtype == torch.float32:
        base = torch.from_numpy(rng.uniform(0, 1, shape[:-2] + (shape[-2] * 2, c)).astype(np.float32))
        x = base[..., ::2, :]                    # not contiguous: converted where it is
    else:
        top = 255 if dtype == torch.uint8 else 65535
        x = torch.from_numpy(rng.integers(0, top + 1, shape).astype(np.uint8 if top == 255 else np.uint16))
    assert x.is_contiguous() == contiguous
    want_in = x.numpy().astype(np.float32)
    conv = Convert(torch.float32, mean, std, scale=scale)
    a = (scale / np.asarray(std, np.float64)).astype(np.float32)
    b = (-np.asarray(mean, np.float64) / np.asarray(std, np.float64)).astype(np.float32)
    want = (want_in * a) + b                     # float32 product, rounded, then float32 sum
    got = conv(x.clone() if dtype == torch.float32 else x).numpy()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    out = torch.empty(shape, dtype=torch.float32)
    if dtype != torch.float32:
        np.testing.assert_array_equal(conv(x, out=out).numpy().view(np.int32), want.view(np.int32))
