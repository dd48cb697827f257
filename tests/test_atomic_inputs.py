"""A failing input is dropped whole under on_error: skip: none of its samples, copies or
companion rows stay behind, and the error names the field and file at fault."""
from __future__ import annotations

import json

import numpy as np
import pytest

import precompile

from conftest import REPO, image_recipe, write_recipe


def test_skipped_input_leaves_no_rows_in_any_field(tmp_path):
    # img goes to a per-shard .npy, audio to WAV files; only tone_16k.wav is at the forced 16 kHz
    recipe = {
        "name": "mix", "on_error": "skip",
        "inputs": {"root": str(REPO / "sample_data"), "match": "audio/{name}.{ext}", "where": {"ext": "wav|flac|ogg"},
                   "fields": {"audio": {"decoder": "audio", "mono": True, "dtype": "float32"},
                              "img": {"decoder": "image", "path": "images/beach/beach_01.jpg"}}},
        "steps": [{"resize": {"size": [8, 8]}}],
        "output": {"format": "wav", "options": {"sample_rate": 16000}},
    }
    rep = precompile.build(write_recipe(tmp_path / "r.yaml", recipe), out_dir=tmp_path / "out")
    assert rep["num_samples"] == 1 and len(rep["failures"]) == 3
    for f in rep["failures"]:
        assert f["field"] == "audio" and f["stage"] == "write" and f["path"].endswith((".flac", ".ogg", "8k.wav"))
        assert "output.options.sample_rate is 16000" in f["message"]
    shard = next(p for p in (tmp_path / "out" / "mix.shards").glob("shard-*") if p.is_dir())
    info = json.loads((shard / "info.json").read_text())
    assert info["num_samples"] == 1
    assert np.load(shard / "img.npy", allow_pickle=False).shape == (1, 8, 8, 3)   # no orphan rows
    assert sorted(p.name for p in shard.glob("*.wav")) == ["000000.wav"]
    ds = precompile.open(tmp_path / "out" / "mix.json")
    assert ds.keys == ["audio/tone_16k.wav"] and ds[0]["img"].shape == (8, 8, 3)



def _register_fail_step():
    from precompile.errors import StepError
    from precompile.registry import STEPS
    from precompile.transforms.base import Step

    if "test_fail_on_copy2" in STEPS:
        return

    @STEPS.register()
    class FailOnCopy2(Step):
        name = "test_fail_on_copy2"
        kinds = frozenset({"image"})
        random = True

        def run(self, sample, rng):
            if sample.copy == 2 and sample.key.startswith("dog/001"):
                raise StepError("copy 2 cannot be made", field="image")
            return [sample]


def test_input_whose_copy_fails_is_dropped_with_all_its_copies(tmp_path, image_tree):
    _register_fail_step()
    r = image_recipe(image_tree, copies=2, on_error="skip",
                     steps=[{"resize": {"size": [32, 32]}}, {"test_fail_on_copy2": {}}])
    rep = precompile.build(write_recipe(tmp_path / "r.yaml", r), out_dir=tmp_path / "out")
    ds = precompile.open(tmp_path / "out" / "imgs.h5")
    assert [f["key"] for f in rep["failures"]] == ["dog/001.png"]
    assert "copy 2 cannot be made" in rep["failures"][0]["message"]
    assert "dog/001.png" not in ds.keys                      # not even copies 0 and 1
    counts = {k: ds.keys.count(k) for k in set(ds.keys)}
    assert len(counts) == 9 and set(counts.values()) == {3}   # the others: original + 2 copies


def test_missing_field_in_a_sample_names_the_field(tmp_path, image_tree):
    from precompile.errors import StepError
    from precompile.sample import FieldSpec, Sample
    from precompile.errors import SampleError
    from precompile.formats.hdf5 import Hdf5ShardWriter

    w = Hdf5ShardWriter(str(tmp_path / "s.h5"), {"a": FieldSpec("image", (2, 2, 1), "uint8")}, "k", None, {"a": 1})
    try:
        with pytest.raises(SampleError) as ei:
            w.check(Sample("x", {"a": np.zeros((3, 2, 1), np.uint8)}, {"a": "image"}))
        assert ei.value.field == "a" and "differs from the declared (2, 2, 1)" in str(ei.value)
    finally:
        w.abort()
    assert issubclass(StepError, precompile.errors.InputError)
