"""Loader API edges: resume through set_epoch, close, state checks, argument checks, non-HDF5 builds,
batch steps that cover nothing, and the CUDA device choice (its logic, without a GPU).

Builds are made by ``precompile.build`` from a generated image tree (conftest): 10 samples of
32x32 RGB in shards of 4, so every test reads bytes the project's own writer produced.
"""
from __future__ import annotations

import pytest
import torch

import precompile
from precompile.errors import FormatError, PrecompileError
from precompile.reader import gpu
from precompile.reader.loader import Loader

from conftest import image_recipe, write_recipe


@pytest.fixture
def built(tmp_path, image_tree) -> str:
    precompile.build(write_recipe(tmp_path / "r.yaml", image_recipe(image_tree)), out_dir=tmp_path / "out")
    return str(tmp_path / "out" / "imgs.h5")


def _pass(loader) -> list[bytes]:
    """One pass, each batch as its image bytes (which samples, in which order)."""
    return [b["image"].numpy().tobytes() for b in loader]


def test_set_epoch_keeps_a_restored_position(built):
    kw = dict(batch_size=2, shuffle=True, seed=3, device="cpu", num_threads=0)
    ref = Loader(built, **kw)
    ref.set_epoch(1)
    e1 = _pass(ref)
    e2 = _pass(ref)
    assert len(e1) == 5 and ref.epoch == 3

    a = Loader(built, **kw)
    a.set_epoch(1)
    it = iter(a)
    seen = [next(it)["image"].numpy().tobytes() for _ in range(2)]
    state = a.state_dict()
    it.close()
    assert (state["epoch"], state["batch"]) == (1, 2)

    b = Loader(built, **kw)
    b.load_state_dict(state)
    got = []
    for epoch in range(state["epoch"], 3):   # the README loop: set_epoch before every pass
        b.set_epoch(epoch)
        got.append(_pass(b))
    assert seen + got[0] == e1               # the rest of epoch 1, not a replay
    assert got[1] == e2                      # the next epoch from its start
    b.set_epoch(1)                           # a pass has run since the restore: back to the start
    assert _pass(b) == e1

    c = Loader(built, **kw)
    c.load_state_dict(state)
    c.set_epoch(2)                           # another epoch than the restored one: from its start
    assert _pass(c) == e2


def test_load_state_dict_checks_the_batch(built):
    loader = Loader(built, batch_size=2, shuffle=True, device="cpu")
    state = loader.state_dict()
    for bad in (-1, 6):
        with pytest.raises(ValueError, match=r"batch must be in \[0, 5\] \(epoch 0 has 5 batches\), got " + str(bad)):
            loader.load_state_dict({**state, "batch": bad})
    loader.load_state_dict({**state, "batch": 5})   # all handed out: the pass yields nothing, then the next epoch
    assert list(loader) == [] and loader.epoch == 1


def test_close_stops_the_pass_and_later_use_is_a_clear_error(built):
    loader = Loader(built, batch_size=2, shuffle=True, device="cpu", num_threads=2, prefetch=3)
    it = iter(loader)
    first = next(it)
    loader.close()
    with pytest.raises(StopIteration):   # the pass ended with close (its threads joined)
        next(it)
    assert first["image"].shape == (2, 32, 32, 3)
    with pytest.raises(PrecompileError, match="reader is closed"):
        iter(loader)
    with pytest.raises(PrecompileError, match="reader is closed"):
        loader.reader.read([0])


def test_arguments_checked_up_front(built):
    with pytest.raises(ValueError, match="block_window must be >= 1 chunk, got 0"):
        Loader(built, batch_size=2, shuffle="block", device="cpu", block_window=0)
    # a crop that covers no field: refused at construction, not a TypeError at the first batch
    with pytest.raises(ValueError, match="random_crop: matches no field"):
        Loader(built, batch_size=2, device="cpu", fields=["label"], gpu_steps=[{"random_crop": {"size": 4}}])
    # fields: [] says it on purpose, as in a recipe: the step does nothing
    kept = Loader(built, batch_size=2, device="cpu", shuffle=False, gpu_steps=[{"random_flip": {"fields": []}}])
    plain = Loader(built, batch_size=2, device="cpu", shuffle=False)
    assert all(torch.equal(a["image"], b["image"]) for a, b in zip(kept, plain))


def test_file_build_is_refused_with_a_pointer_to_the_dataset(tmp_path, image_tree):
    r = image_recipe(image_tree, output={"format": "png", "samples_per_shard": 4})
    precompile.build(write_recipe(tmp_path / "r.yaml", r), out_dir=tmp_path / "out")
    index = tmp_path / "out" / "imgs.json"
    ds = precompile.open(index)
    assert ds.output_format == "png" and len(ds) == 10   # the build itself is fine
    for src in (index, ds):
        with pytest.raises(FormatError, match="a png build .*HDF5 builds only.*precompile.open\\(path\\) inside a "
                                              "torch DataLoader"):
            Loader(src, batch_size=2, device="cpu")


def test_cuda_device_gets_an_explicit_index(monkeypatch):
    # the choice logic only (no GPU here): "cuda" and "auto" name the device current at construction
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert gpu.resolve_device("cuda") == torch.device("cuda", 1)
    assert gpu.resolve_device("auto") == torch.device("cuda", 1)
    assert gpu.resolve_device("cuda:0") == torch.device("cuda", 0)
    assert gpu.thread_init(torch.device("cuda", 1)) == {"initializer": torch.cuda.set_device,
                                                         "initargs": (torch.device("cuda", 1),)}
    assert gpu.thread_init(torch.device("cpu")) == {}
    assert gpu.resolve_device("cpu") == torch.device("cpu")
