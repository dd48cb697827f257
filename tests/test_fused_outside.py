"""The fused device chain (precompile/reader/fused.py) attacked from outside (issue 35): hostile windows and shapes
against the eager chain (the reference, ``PRECOMPILE_FUSED=0``'s path), on the CPU through Triton's interpreter
(tiny batches: it is slow), on the GPU compiled.

Hand-made draws: 1-pixel windows at each corner, the full image, a full-height 1-column and a full-width 1-row
window, output sizes 1x1 and 3x5, images of one row or one column, jitter at the ends of its ranges with hue
+-0.5, every flip, and input batches that are views (a crop of a larger batch, the RGB of an RGBA batch, every
other sample): the fused result must be the eager one (every value equal on the CPU, as tests/test_fused.py
measured; within one uint8 level on the GPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fused_cases import DEV, MEAN, STD, bind, interpret  # noqa: F401  (skips this module without triton)
from precompile.reader import fused, gpu  # noqa: E402


def _compare(steps: list, x: torch.Tensor, params: list, what: str) -> None:
    conv = {"image": gpu.Convert(torch.float32, MEAN, STD, True, 1 / 255)}
    chain = fused.FusedChain.of(steps, conv)
    assert chain is not None and chain.usable({"image": x}), what
    got = chain.run(x, params).cpu()
    want = conv["image"](gpu.run_steps({"image": x.contiguous().clone()}, steps, params)["image"]).cpu()
    assert got.shape == want.shape and got.stride() == want.stride(), what
    if DEV == "cpu":
        assert torch.equal(got, want), f"{what}: {int((got != want).sum())} of {got.numel()} values differ"
    else:
        level = torch.tensor([1 / 255 / s + 1e-6 for s in STD]).view(1, 3, 1, 1)
        assert bool(((got - want).abs() <= level).all()), what


def _draws(windows, flips, jitter) -> list[dict]:
    a = np.array(windows, np.int64)
    return [{"top": a[:, 0], "left": a[:, 1], "height": a[:, 2], "width": a[:, 3]},
            {"horizontal": np.array([f[0] for f in flips], bool), "vertical": np.array([f[1] for f in flips], bool)},
            {k: np.array(v, np.float64) for k, v in zip(("brightness", "contrast", "saturation", "hue"), jitter)}]


CHAIN = [{"random_flip": {"horizontal": 0.5, "vertical": 0.5}},
         {"color_jitter": {"brightness": [0, 3], "contrast": [0, 3], "saturation": [0, 3], "hue": 0.5}}]


@pytest.mark.parametrize("size", [[1, 1], [3, 5]])
def test_hostile_windows_equal_the_eager_chain(interpret, size):
    H, W = 9, 11
    steps = bind([{"random_resized_crop": {"size": size}}, *CHAIN], (H, W))
    wins = [(0, 0, 1, 1), (H - 1, W - 1, 1, 1), (0, 0, H, W), (0, W - 1, H, 1), (H - 1, 0, 1, W), (3, 4, 2, 7)]
    flips = [(1, 0), (0, 1), (1, 1), (0, 0), (1, 1), (1, 0)]
    jitter = ([0, 3, 1, 2.9, 0.1, 1], [3, 0, 1, 2.5, 1, 0.2], [0, 3, 2, 1, 0.5, 3], [0.5, -0.5, 0, 0.25, -0.49, 0.5])
    x = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (6, H, W, 3)).astype(np.uint8)).to(DEV)
    _compare(steps, x, _draws(wins, flips, jitter), f"windows to {size}")


@pytest.mark.parametrize("hw", [(1, 7), (7, 1)])
def test_images_of_one_row_or_column_equal_the_eager_chain(interpret, hw):
    steps = bind([{"random_resized_crop": {"size": [3, 4], "scale": [0.3, 1.0]}}, *CHAIN], hw)
    x = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (3, *hw, 3)).astype(np.uint8)).to(DEV)
    _compare(steps, x, gpu.step_params(steps, 1, 0, 0, 0, 3), f"{hw} images")


def test_views_of_larger_batches_equal_the_eager_chain(interpret):
    """A crop of a larger batch, the RGB channels of an RGBA batch and every other sample: strided uint8 views
    the kernels read through their strides."""
    H, W = 9, 11
    steps = bind([{"random_resized_crop": {"size": [5, 6], "scale": [0.2, 1.0]}}, *CHAIN], (H, W))
    params = gpu.step_params(steps, 2, 0, 0, 0, 3)
    rng = np.random.default_rng(3)
    big = torch.from_numpy(rng.integers(0, 256, (6, H + 4, W + 6, 4)).astype(np.uint8)).to(DEV)
    for what, x in (("crop of a batch", big[:3, 2:2 + H, 3:3 + W, :3]), ("rgb of rgba", big[:3, :H, :W, :3]),
                    ("every other sample", big[::2, 1:1 + H, :W, 1:])):
        assert not x.is_contiguous()
        _compare(steps, x, params, what)
