"""The device side: device choice, conversion and normalisation, seeded batch steps, and the CUDA
feeder's ring scheduling driven on CPU through a stand-in ring (``Loader.make_feeder(make_ring=...)``).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from precompile.errors import PrecompileError
from precompile.reader import feed, gpu
from precompile.reader.loader import Loader

from loader_cases import built, ds  # noqa: F401


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA; the error is for machines without it")
def test_cuda_without_cuda_is_a_clear_error(built):
    with pytest.raises(PrecompileError, match="no CUDA device; use device='cpu'"):
        Loader(built, batch_size=4, device="cuda")
    assert Loader(built, batch_size=4, device="auto").device.type == "cpu"


def test_default_threads_on_cuda_follow_the_source(monkeypatch):
    # the peaks measured on a 16-core H200 node: 4 threads from mapped files, 8 from memory; one core trains
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    from precompile.reader.loader import default_threads

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert default_threads(cuda) == 4 and default_threads(cuda, in_memory=True) == 8
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert default_threads(cuda) == 2 and default_threads(cuda, in_memory=True) == 2
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert default_threads(cuda, in_memory=True) == 1
    # 8 ranks of torchrun on a 16-core node: each has 2 cores, one of them trains
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert default_threads(cuda) == 1 and default_threads(cuda, in_memory=True) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_threads(cuda) == 4 and default_threads(cuda, in_memory=True) == 7
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert default_threads(cuda, in_memory=True) == 8


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


def test_conversion_and_normalisation(built, ds):
    mean, std = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]
    loader = Loader(built, batch_size=12, shuffle=True, seed=1, device="cpu", dtype="float32", mean=mean, std=std)
    idx = loader.batch_indices(0)
    for b, i in zip(loader, idx):
        ref = (ds.batch(i)["image"].astype(np.float64) / 255 - mean) / std
        assert b["image"].dtype == torch.float32
        np.testing.assert_allclose(b["image"].numpy(), ref, atol=1e-5)
        assert b["label"].dtype == torch.int64  # labels are not converted
    for name, tdt in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        b = next(iter(Loader(built, batch_size=12, shuffle=False, device="cpu", dtype=name, mean=mean, std=std,
                             channels_first=True)))
        ref = (ds.batch(range(12))["image"].astype(np.float64) / 255 - mean) / std
        assert b["image"].dtype == tdt and b["image"].shape == (12, 3, 8, 8)
        np.testing.assert_allclose(b["image"].float().permute(0, 2, 3, 1).numpy(), ref, atol=0.03)
    # mean/std without a dtype: float32 (tests/test_loader_norm_dtype.py)


def test_channels_first_without_dtype_gives_nchw_views_of_the_stored_bytes(built, ds):
    """Issue 32: channels_first=True without dtype was silently ignored (the batch stayed NHWC). It gives NCHW
    views of the image fields in their stored dtype, after the device steps; labels are untouched."""
    steps = [{"random_crop": {"size": [6, 5]}}]
    for kw in ({}, {"gpu_steps": steps}):
        plain = list(Loader(built, batch_size=12, shuffle=False, device="cpu", **kw))
        nchw = list(Loader(built, batch_size=12, shuffle=False, device="cpu", channels_first=True, **kw))
        assert len(plain) == len(nchw) == 10
        for a, b in zip(plain, nchw):
            assert b["image"].dtype == torch.uint8 and b["image"].shape == (12, 3, *a["image"].shape[1:3])
            assert torch.equal(b["image"], a["image"].permute(0, 3, 1, 2)) and torch.equal(b["label"], a["label"])
    first = next(iter(Loader(built, batch_size=12, shuffle=False, device="cpu", channels_first=True)))
    np.testing.assert_array_equal(first["image"].numpy(), ds.batch(range(12))["image"].transpose(0, 3, 1, 2))


def test_batch_steps_are_seeded_and_match_numpy(built, ds):
    steps = [{"random_flip": {"horizontal": 0.5}}, {"random_crop": {"size": [6, 5], "padding": 1}}]
    loader = Loader(built, batch_size=10, shuffle=True, seed=8, device="cpu", gpu_steps=steps)
    loader.set_epoch(1)
    idx = loader.batch_indices()
    got = list(loader)
    for k, (b, i) in enumerate(zip(got, idx)):
        flip, crop = gpu.step_params(loader.steps, 8, 1, 0, k, len(i))
        ref = ds.batch(i)["image"]
        ref = np.where(flip["horizontal"][:, None, None, None], ref[:, :, ::-1], ref)
        ref = np.pad(ref, ((0, 0), (1, 1), (1, 1), (0, 0)))
        ref = np.stack([r[t:t + 6, l:l + 5] for r, t, l in zip(ref, crop["top"], crop["left"])])
        np.testing.assert_array_equal(b["image"].numpy(), ref)
    assert any(p["horizontal"].any() and not p["horizontal"].all()
               for p in [gpu.step_params(loader.steps, 8, 1, 0, 0, 10)[0]])
    again = Loader(built, batch_size=10, shuffle=True, seed=8, device="cpu", gpu_steps=steps)
    again.set_epoch(1)
    assert all(torch.equal(x["image"], y["image"]) for x, y in zip(got, again))
    again.set_epoch(2)
    assert gpu.step_params(again.steps, 8, 2, 0, 0, 10)[1]["top"].tolist() != \
        gpu.step_params(again.steps, 8, 1, 0, 0, 10)[1]["top"].tolist()
    with pytest.raises(ValueError, match="'rotate' is unknown"):
        Loader(built, batch_size=4, device="cpu", gpu_steps=[{"rotate": {}}])
    with pytest.raises(ValueError, match="'gaussian_noise' is a build step with no device twin"):
        Loader(built, batch_size=4, device="cpu", gpu_steps=[{"gaussian_noise": {"std": 1}}])
    with pytest.raises(ValueError, match="'flip' is now the build step's twin random_flip"):
        Loader(built, batch_size=4, device="cpu", gpu_steps=[{"flip": {"p": 0.5}}])
    with pytest.raises(ValueError, match="random_crop: input 8x8 is smaller than the crop 9x9"):
        Loader(built, batch_size=4, device="cpu", gpu_steps=[{"random_crop": {"size": 9}}])
    with pytest.raises(ValueError, match="random_flip: cannot handle field 'label' of kind label"):
        Loader(built, batch_size=4, device="cpu", gpu_steps=[{"random_flip": {"fields": ["label"]}}])
    # a pad value the stored uint8 cannot hold: refused when the Loader is made, as the build refuses it (it
    # wrapped around on uint16 and raised torch's raw overflow error mid-epoch on uint8)
    with pytest.raises(ValueError, match=r"random_crop: pad_value -5 is outside the range of field 'image': its "
                                         r"dtype uint8 holds 0 to 255"):
        Loader(built, batch_size=4, device="cpu", gpu_steps=[{"random_crop": {"size": 8, "padding": 2,
                                                                               "pad_value": -5}}])
    with pytest.raises(ValueError, match="random_flip: horizontal: .*within"):
        Loader(built, batch_size=4, device="cpu", gpu_steps=[{"random_flip": {"horizontal": 2}}])


class FakeRing:
    """The CudaRing protocol on CPU tensors; checks the Loader never refills a slot before its copy launched."""

    def __init__(self, device, slots, batch_size, shapes, dtypes):
        self.bufs = [{f: torch.empty((batch_size, *shapes[f]), dtype=gpu.numpy_to_torch_dtype(dtypes[f]))
                      for f in shapes} for _ in range(slots)]
        self.state = ["free"] * slots  # free -> filling -> filled -> launched(=free)
        self.launches = 0

    def host(self, slot, n):
        return {f: t[:n].numpy() for f, t in self.bufs[slot].items()}

    def wait_free(self, slot):
        assert self.state[slot] == "free", f"slot {slot} refilled while {self.state[slot]}"
        self.state[slot] = "filling"

    def launch(self, slot, n, finish):
        self.launches += 1
        out = finish({f: t[:n].clone() for f, t in self.bufs[slot].items()})  # the "copy to the device"
        self.state[slot] = "free"
        return out, None

    def deliver(self, out, done):
        return out

    def synchronize(self):
        pass


@pytest.mark.parametrize("prefetch,threads,split", [(1, 3, False), (3, 3, False), (2, 0, False), (1, 3, True)])
@pytest.mark.parametrize("batches_per_task", [1, 3, 32])
def test_ring_pipeline_gives_the_cpu_batches(built, prefetch, threads, split, batches_per_task, monkeypatch):
    row = 8 * 8 * 3 + 8  # image + label bytes
    monkeypatch.setattr(feed, "GROUP_BYTES", batches_per_task * 6 * row)
    if split:  # every task's rows gathered into the slot by 3 threads
        monkeypatch.setattr(feed, "SPLIT_BYTES", 1)
    kw = dict(batch_size=6, shuffle="block", seed=3, device="cpu", dtype="float32", mean=0.5, std=0.25,
              gpu_steps=[{"random_flip": {}}], prefetch=prefetch, num_threads=threads)
    ref = [b for b in Loader(built, **{**kw, "num_threads": 2})]
    ringed = Loader(built, **kw)
    ringed.feeder = ringed.make_feeder(make_ring=FakeRing)
    got = list(ringed)
    assert len(ref) == 20 and ringed.feeder.ring.launches == -(-20 // min(batches_per_task, 20))
    for x, y in zip(got, ref):
        assert torch.equal(x["image"], y["image"]) and torch.equal(x["label"], y["label"])


def test_uint16_fields_move_like_the_build_kernels():
    """torch lacks uint16 kernels for flips (CPU) and advanced indexing (CUDA, seen on an H200): the device
    steps move uint16 fields through an int16 view of the same bits. Pixels equal the build step's kernels,
    a pad value past int16's range included."""
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.integers(0, 65536, (6, 9, 11, 1)).astype(np.uint16))
    steps = gpu.parse_steps([{"random_flip": {"horizontal": 0.5, "vertical": 0.5}},
                             {"random_crop": {"size": [8, 12], "padding": 2, "pad_value": 40000}}])
    gpu.bind_steps(steps, {"img": {"kind": "image"}}, {"img": (9, 11, 1)})
    params = gpu.step_params(steps, 1, 0, 0, 0, 6)
    out = gpu.run_steps({"img": x}, steps, params)["img"]
    assert out.dtype == torch.uint16 and out.shape == (6, 8, 12, 1)
    for i in range(6):
        a = x[i].numpy()
        for step, p in zip(steps, params):
            a = step.step.apply_image(a, **{k: (bool(v[i]) if v.dtype == bool else int(v[i])) for k, v in p.items()})
        np.testing.assert_array_equal(out[i].numpy(), a)
    assert (out.numpy() == 40000).any()
