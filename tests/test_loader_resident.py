"""The GPU-resident mode (``in_memory="gpu"``): the resident feeder driven on CPU tensors gives the CPU
Loader's batches exactly (uint8, converted dtypes, gpu_steps, block shuffle, ranks, resume); its budget,
its share per rank and its errors; on CUDA (skipped without it) the Loader itself against the CPU Loader, in
every mode (mapped, ``in_memory=True``, ``"gpu"``), and resumed mid-epoch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from precompile.errors import PrecompileError
from precompile.reader import feed, resident
from precompile.reader.loader import Loader
from precompile.reader.resident import ResidentFeeder

from loader_cases import built, ds  # noqa: F401

CPU = torch.device("cpu")
CASES = {
    "uint8": dict(shuffle=True, seed=1),
    "float32 normalised, steps": dict(shuffle=True, seed=2, dtype="float32", mean=[0.4, 0.5, 0.6], std=0.25,
                                      gpu_steps=[{"random_flip": {}}, {"random_crop": {"size": 6, "padding": 1}}]),
    "bfloat16 channels_first": dict(shuffle="block", seed=3, dtype="bfloat16", mean=0.5, std=0.2,
                                    channels_first=True),
    "float16, drop_last": dict(shuffle="full", seed=4, dtype="float16", drop_last=True),
    "sequential": dict(shuffle=False),
    "rank 1 of 3, shuffled": dict(shuffle=True, seed=5, rank=1, world_size=3),
    "rank 0 of 2, sequential": dict(shuffle=False, rank=0, world_size=2),
}


def same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) and len(a) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for f in x:
            assert x[f].dtype == y[f].dtype and x[f].shape == y[f].shape, f
            assert torch.equal(x[f].cpu(), y[f].cpu()), f


def same_two_epochs(got: Loader, ref: Loader, device: str = "cpu") -> None:
    """Epochs 0 and 1 of ``got`` (its batches on ``device``) equal ``ref``'s."""
    for epoch in (0, 1):
        got.set_epoch(epoch)
        ref.set_epoch(epoch)
        batches = list(got)
        assert all(t.device.type == device for b in batches for t in b.values())
        same(batches, list(ref))


def same_after_resume(built: str, make, kw: dict) -> None:
    """A Loader from ``make(**kw)`` stopped after 4 batches of epoch 2 and resumed from its state_dict in a
    fresh one gives the rest of the epoch; both parts together are the CPU Loader's epoch."""
    a = make(**kw)
    a.set_epoch(2)
    it = iter(a)
    first = [next(it) for _ in range(4)]
    state = a.state_dict()
    rest = list(it)
    b = make(**kw)
    b.load_state_dict(state)
    b.set_epoch(2)
    same(list(b), rest)
    ref = Loader(built, batch_size=7, device="cpu", **kw)
    ref.set_epoch(2)
    same(first + rest, list(ref))


def resident_on_cpu(built: str, budget=None, **kw) -> Loader:
    loader = Loader(built, batch_size=7, device="cpu", **kw)
    loader.feeder = ResidentFeeder.for_loader(loader, CPU, budget)
    return loader


@pytest.mark.parametrize("case", list(CASES))
def test_resident_batches_are_the_cpu_loaders(built, case):
    kw = CASES[case]
    same_two_epochs(resident_on_cpu(built, **kw), Loader(built, batch_size=7, device="cpu", num_threads=1, **kw))


def test_resident_resumes_mid_epoch(built):
    same_after_resume(built, lambda **kw: resident_on_cpu(built, **kw), CASES["float32 normalised, steps"])


def test_a_rank_holds_its_share_when_the_share_is_fixed(built, ds):
    whole = resident_on_cpu(built, shuffle=False)
    half = resident_on_cpu(built, shuffle=False, rank=1, world_size=2)
    assert whole.feeder.rows.size == len(ds) == 120 and whole.feeder.dense
    assert half.feeder.rows.size == 60 and not half.feeder.dense
    assert half.feeder.nbytes * 2 == whole.feeder.nbytes == 120 * (8 * 8 * 3 + 8)
    np.testing.assert_array_equal(half.feeder.rows, np.unique(np.concatenate(half.batch_indices(0))))
    shuffled = resident_on_cpu(built, shuffle=True, rank=1, world_size=2)
    assert shuffled.feeder.rows.size == 120   # a shuffled share changes every epoch: every row


def test_a_set_over_the_budget_is_a_clear_error(built):
    need = 120 * (8 * 8 * 3 + 8)
    with pytest.raises(PrecompileError, match=r"the loaded fields \['image', 'label'\] of 120 rows need 24000 bytes "
                                              r"on cpu, over the budget of 23999 bytes \(gpu_budget"):
        resident_on_cpu(built, budget=need - 1)
    assert resident_on_cpu(built, budget=need).feeder.nbytes == need
    for bad in (0, -5, 1.5, "half", True):
        with pytest.raises(ValueError, match="gpu_budget must be"):
            resident.budget_bytes(CPU, bad)


def test_the_upload_goes_piece_by_piece(built, monkeypatch):
    monkeypatch.setattr(resident, "PIECE_BYTES", 3 * 8 * 8 * 3)   # 3 images per piece: 40 pieces
    kw = CASES["uint8"]
    same(list(resident_on_cpu(built, **kw)), list(Loader(built, batch_size=7, device="cpu", **kw)))


def test_gpu_mode_needs_cuda(built):
    with pytest.raises(PrecompileError, match=r"in_memory='gpu'\) keeps the data on a CUDA device; this "
                                              r"Loader's device is cpu"):
        Loader(built, batch_size=4, device="cpu", in_memory="gpu")
    with pytest.raises(ValueError, match="in_memory must be False, True, 'gpu' or 'pinned', got 'cuda'"):
        Loader(built, batch_size=4, device="cpu", in_memory="cuda")
    with pytest.raises(PrecompileError, match=r"in_memory='pinned'\) lets a CUDA device read page-locked host "
                                              r"memory; this Loader's device is cpu"):
        Loader(built, batch_size=4, device="cpu", in_memory="pinned")
    with pytest.raises(ValueError, match="gpu_budget applies only with in_memory='gpu'"):
        Loader(built, batch_size=4, device="cpu", gpu_budget=0.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA; the error is for machines without it")
def test_gpu_mode_without_cuda_says_so(built):
    with pytest.raises(PrecompileError, match="sees no CUDA device"):
        Loader(built, batch_size=4, device="auto", in_memory="gpu")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_resident_batches_are_the_cpu_loaders(built, case):
    kw = CASES[case]
    got = Loader(built, batch_size=7, device="cuda", in_memory="gpu", **kw)
    assert isinstance(got.feeder, ResidentFeeder)
    same_two_epochs(got, Loader(built, batch_size=7, device="cpu", **kw), "cuda")


@needs_cuda
@pytest.mark.parametrize("in_memory", [False, True], ids=["mapped", "in_memory"])
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_loader_batches_are_the_cpu_loaders(built, case, in_memory, monkeypatch):
    # the pinned ring and the copy stream: the same batches as the CPU Loader, with one task for the whole pass
    # (this build's rows are small), then with a task per batch, 3 slots in flight and every task's rows split
    # over 4 threads
    kw = CASES[case]
    ref = Loader(built, batch_size=7, device="cpu", **kw)
    row = ref.reader.row_bytes["image"] + ref.reader.row_bytes["label"]
    for threads, prefetch, split in ((1, 1, False), (4, 3, True)):
        if split:
            monkeypatch.setattr(feed, "GROUP_BYTES", 7 * row)   # one batch per gather task
            monkeypatch.setattr(feed, "SPLIT_BYTES", 1)         # each task's rows cut into ranges, one per thread
        got = Loader(built, batch_size=7, device="cuda", in_memory=in_memory, num_threads=threads, prefetch=prefetch,
                     **kw)
        same_two_epochs(got, ref, "cuda")
        got.close()


@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_pinned_batches_are_the_cpu_loaders(built, case):
    """in_memory='pinned': the fields live once in page-locked host memory and the device gathers each batch
    from there (its tensors are device views over the host copy's own addresses): the CPU Loader's batches."""
    kw = CASES[case]
    before = torch.cuda.memory_allocated()
    got = Loader(built, batch_size=7, device="cuda", in_memory="pinned", **kw)
    assert isinstance(got.feeder, ResidentFeeder) and got.feeder.pinned
    assert all(t.device.type == "cuda" for t in got.feeder.tensors.values())
    assert torch.cuda.memory_allocated() - before < got.feeder.nbytes   # the fields are not on the device
    same_two_epochs(got, Loader(built, batch_size=7, device="cpu", **kw), "cuda")


@needs_cuda
def test_a_device_alias_reads_the_host_bytes():
    host = torch.arange(6 * 5, dtype=torch.int16).reshape(6, 5).pin_memory()
    dev = torch.device("cuda", torch.cuda.current_device())
    alias = resident.device_alias(host, dev)
    assert alias.device == dev and alias.data_ptr() == host.data_ptr() and alias.dtype == torch.int16
    idx = torch.tensor([5, 0, 3], device=dev)
    assert torch.equal(alias.index_select(0, idx).cpu(), host[[5, 0, 3]])
    host[0, 0] = -7   # the same bytes, not a copy
    assert int(alias[0, 0]) == -7
    with pytest.raises(PrecompileError, match="not page-locked"):
        resident.device_alias(torch.ones(3), dev)
    assert resident.device_alias(torch.empty(0, 4).pin_memory(), dev).shape == (0, 4)


def test_a_pinned_set_over_the_host_memory_is_a_clear_error(built):
    ref = Loader(built, batch_size=7, device="cpu")
    rows = np.arange(len(ref.reader.chunk_rows))
    with pytest.raises(PrecompileError, match=r"in_memory='pinned'\): the loaded fields \['image', 'label'\] of "
                                              r"\d+ rows need .* of page-locked host memory, over 0.8 of the memory "
                                              r"available \(100 bytes\)"):
        resident.upload(ref.reader, ["image", "label"], rows, torch.device("cpu"), 100, pinned=True)
    assert 0 < resident.host_budget_bytes()


@needs_cuda
@pytest.mark.parametrize("in_memory", [False, True, "gpu", "pinned"])
def test_cuda_loader_resumes_mid_epoch(built, in_memory):
    same_after_resume(built, lambda **kw: Loader(built, batch_size=7, device="cuda", in_memory=in_memory, **kw),
                      CASES["float32 normalised, steps"])


@needs_cuda
def test_cuda_budget_is_a_share_of_free_memory(built):
    free, _ = torch.cuda.mem_get_info()
    assert 0 < resident.budget_bytes(torch.device("cuda", torch.cuda.current_device()), None) <= free
    with pytest.raises(PrecompileError, match="over the budget"):
        Loader(built, batch_size=4, device="cuda", in_memory="gpu", gpu_budget=100)
