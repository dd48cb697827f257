"""An outside check of ``precompile.hf.to_hf`` against the source files: every column of every row, read back by
Hugging Face ``datasets`` (numpy with ``dtype=None``, and the Python format) through ``precompile.hf.array``, is
the sample's own array (dtype, shape, bytes; NaN and inf included), and its text and label are what Python's
``json`` read from the table. The builds are tests/test_readers_agree_outside.py's drawn recipes (the same
truths), and a saved and reloaded copy (``save_to_disk`` / ``load_from_disk``) reads the same."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

if importlib.util.find_spec("datasets") is None:
    pytest.skip("Hugging Face datasets is not installed (extra 'hf': pip install 'precompile[hf]')",
                allow_module_level=True)

import datasets  # noqa: E402

import precompile  # noqa: E402
from precompile.hf import array, to_hf  # noqa: E402
from test_readers_agree_outside import FORMATS, _draw, _make, _same  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
EXPLORE = int(os.environ.get("PRECOMPILE_READERS_EXPLORE", "0") or 0)


def _check_hf(tmp, seed: int, fmt: str) -> None:
    out, truth, names = _make(tmp, seed, fmt)
    ds = precompile.open(out)
    hf = to_hf(out, cache_dir=str(tmp / "cache"))
    assert len(hf) == len(truth) and hf.features["label"] == datasets.ClassLabel(names=names)
    hf.save_to_disk(str(tmp / "saved"))
    again = datasets.load_from_disk(str(tmp / "saved"))
    for view in (hf.with_format("numpy", dtype=None), hf, again):
        for i, (key, t) in enumerate(truth):
            row = view[i]
            assert row["__key__"] == key == ds.key(i)
            assert row["caption"] == t["caption"] and int(row["label"]) == int(t["label"])
            for f, want in t.items():
                if f in ("caption", "label"):
                    continue
                got = array(view, row, f)
                assert _same(got, want), (seed, fmt, i, f, getattr(got, "dtype", None), np.shape(got),
                                          want.dtype, want.shape)


@pytest.mark.parametrize("seed,fmt", [(seed, fmt) for seed in range(2) for fmt in FORMATS])
def test_to_hf_gives_the_files_own_values(tmp_path, seed, fmt):
    _check_hf(tmp_path, seed, fmt)


def test_array_gives_annotation_rows_in_the_builds_dtype_and_shape(tmp_path):
    """Boxes and keypoints are nested lists in the dataset: ``array`` gave float64 in the Python format (it took
    the dtype only from a list of values), and a sample with no boxes came back (0,) (object in numpy), not
    (0, 4) float32 as ``ds[i]`` has it; a one-channel mask, an ``Image`` column, came back (H, W)."""
    seed = next(s for s in range(100) if (lambda sp, a, r: any(len(x["boxes"]) == 0 for x in a)
                                          and sp["@"][1][-1] == 1)(*_draw(np.random.default_rng(s), "png")))
    out, truth, _ = _make(tmp_path, seed, "png")
    hf = to_hf(out, cache_dir=str(tmp_path / "cache"))
    empty = next(i for i, (_, t) in enumerate(truth) if len(t["boxes"]) == 0)
    for view in (hf, hf.with_format("numpy", dtype=None)):
        row = view[empty]
        k = truth[empty][1]["keypoints"].shape[1]
        assert array(view, row, "boxes").dtype == np.float32 and array(view, row, "boxes").shape == (0, 4)
        assert array(view, row, "keypoints").shape == (0, k, 3)
        img = array(view, row, "image")
        assert img.shape == truth[empty][1]["image"].shape and img.shape[-1] == 1


@pytest.mark.skipif(not EXPLORE, reason="set PRECOMPILE_READERS_EXPLORE=N to draw N more recipes")
def test_to_hf_explore(tmp_path):
    for n in range(EXPLORE):
        seed = 2000 + n
        _check_hf(tmp_path / f"{seed}", seed, FORMATS[n % len(FORMATS)])


def test_to_hf_of_an_empty_split_is_an_empty_dataset(tmp_path):
    """A split no sample fell into is a build of 0 samples: ``to_hf`` gives an empty dataset with the build's
    columns and types (it raised datasets' ``Instruction "train" corresponds to no data!``)."""
    out, truth, names = _make(tmp_path / "a", 5, "hdf5")
    recipe = dict(precompile.open(out).recipe, name="spl",
                  split={"fractions": {"train": 0.999, "val": 0.001}, "seed": 1})
    precompile.build(recipe, out_dir=tmp_path / "spl")
    val, train = tmp_path / "spl" / "spl.val.h5", tmp_path / "spl" / "spl.train.h5"
    assert len(precompile.open(val)) == 0 and len(precompile.open(train)) == len(truth)
    empty = to_hf(val, cache_dir=str(tmp_path / "cache"))
    full = to_hf(train, cache_dir=str(tmp_path / "cache"))
    assert isinstance(empty, datasets.Dataset) and len(empty) == 0
    assert empty.features == full.features and empty.info.description == full.info.description
    assert empty.with_format("numpy", dtype=None)[:]["boxes"].shape[0] == 0
    # an augmented build's empty split has its __copy__ column too
    aug = dict(recipe, name="aug", copies=2, steps=[{"random_flip": {"fields": ["image"]}}])
    precompile.build(aug, out_dir=tmp_path / "aug")
    empty = to_hf(tmp_path / "aug" / "aug.val.h5", cache_dir=str(tmp_path / "cache"))
    full = to_hf(tmp_path / "aug" / "aug.train.h5", cache_dir=str(tmp_path / "cache"))
    assert "__copy__" in full.column_names and len(empty) == 0 and empty.features == full.features


def test_to_hf_echoes_a_bounded_part_of_a_field_name(tmp_path):
    """``to_hf(fields=[name])`` with no such field echoed the whole name (100,000 letters here)."""
    out, _, _ = _make(tmp_path, 1, "hdf5")
    with pytest.raises(ValueError, match="no field 'fff") as e:
        to_hf(out, fields=["f" * 100_000], cache_dir=str(tmp_path / "cache"))
    assert len(str(e.value)) < 1000
