"""The Loader's order: shuffles as functions of (seed, epoch), block windows of whole chunks (or shards), batches in
file order, DDP shares, and resume (state_dict, set_epoch, a new pass, len).

Builds: ``built`` (120 samples, loader_cases) and ``small_build`` (10 samples of 32x32, conftest tree).
"""
from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
import torch

from precompile.reader.loader import Loader

from loader_cases import N, _assert_same_as_dataset, built, ds, small_build  # noqa: F401


def test_full_shuffle_is_a_function_of_seed_and_epoch(built, ds):
    a = Loader(built, batch_size=10, shuffle=True, seed=5, device="cpu")
    b = Loader(built, batch_size=10, shuffle="full", seed=5, device="cpu")
    c = Loader(built, batch_size=10, shuffle="full", seed=6, device="cpu")
    e0 = np.concatenate(a.batch_indices(0))
    assert sorted(e0.tolist()) == list(range(N))
    np.testing.assert_array_equal(e0, np.concatenate(b.batch_indices(0)))
    assert not np.array_equal(e0, np.concatenate(a.batch_indices(1)))
    assert not np.array_equal(e0, np.concatenate(c.batch_indices(0)))
    assert not np.array_equal(e0, np.arange(N))
    _assert_same_as_dataset(a, ds, epoch=1)


def test_epoch_advances_after_a_full_pass(built):
    loader = Loader(built, batch_size=30, shuffle=True, seed=1, device="cpu")
    first = [b["label"].clone() for b in loader]
    assert loader.epoch == 1 and loader.state_dict()["batch"] == 0
    second = [b["label"].clone() for b in loader]
    assert loader.epoch == 2
    assert not all(torch.equal(x, y) for x, y in zip(first, second))
    loader.set_epoch(0)
    again = [b["label"] for b in loader]
    assert all(torch.equal(x, y) for x, y in zip(first, again))


def _storage_chunks(built: str, ds) -> np.ndarray:
    """Chunk id per row, from the shard files' own chunk shapes (independent of the reader)."""
    ids, nxt = [], 0
    base = os.path.dirname(built)
    for s in ds.shards:
        with h5py.File(os.path.join(base, s["file"]), "r") as f:
            c = f["image"].chunks[0]
        local = np.arange(s["num_samples"]) // c
        ids.append(nxt + local)
        nxt += int(local[-1]) + 1
    return np.concatenate(ids)


@pytest.mark.parametrize("window", [1, 3])
def test_block_shuffle_reads_whole_chunks(built, ds, window):
    chunk_of = _storage_chunks(built, ds)
    assert len(np.unique(chunk_of)) == 3 * 7 + 5  # shards of 32 rows: 6 chunks of 5 + 1 of 2; the last (24): 5
    loader = Loader(built, batch_size=8, shuffle="block", seed=2, device="cpu", block_window=window,
                    sort_batches=False)
    order = np.concatenate(loader.batch_indices(0))
    assert sorted(order.tolist()) == list(range(N))
    chunks_in_order = list(dict.fromkeys(chunk_of[order].tolist()))  # chunks by first appearance
    pos = 0
    for g in range(0, len(chunks_in_order), window):
        group = chunks_in_order[g:g + window]
        rows = np.flatnonzero(np.isin(chunk_of, group))
        # the next len(rows) positions hold exactly the rows of these whole chunks
        assert sorted(order[pos:pos + len(rows)].tolist()) == rows.tolist()
        pos += len(rows)
    assert pos == N
    assert chunks_in_order != sorted(chunks_in_order)  # chunk order is shuffled
    other = np.concatenate(loader.batch_indices(1))
    assert not np.array_equal(order, other)
    np.testing.assert_array_equal(order, np.concatenate(
        Loader(built, batch_size=8, shuffle="block", seed=2, device="cpu", block_window=window,
               sort_batches=False).batch_indices(0)))
    _assert_same_as_dataset(loader, ds, epoch=0)


@pytest.mark.parametrize("window", [1, 2])
def test_shard_shuffle_reads_whole_shards_in_one_stretch(built, ds, window):
    shard_of = np.repeat(np.arange(len(ds.shards)), [s["num_samples"] for s in ds.shards])
    loader = Loader(built, batch_size=8, shuffle="shard", seed=4, device="cpu", block_window=window,
                    sort_batches=False)
    order = np.concatenate(loader.batch_indices(0))
    assert sorted(order.tolist()) == list(range(N))
    shards_in_order = list(dict.fromkeys(shard_of[order].tolist()))
    pos = 0
    for g in range(0, len(shards_in_order), window):   # each window of shards: exactly their rows, then the next
        rows = np.flatnonzero(np.isin(shard_of, shards_in_order[g:g + window]))
        assert sorted(order[pos:pos + len(rows)].tolist()) == rows.tolist()
        pos += len(rows)
    assert pos == N and shards_in_order != sorted(shards_in_order)
    if window == 1:   # rows are permuted within their shard
        assert not np.array_equal(order, np.sort(order))
    assert not np.array_equal(order, np.concatenate(loader.batch_indices(1)))
    again = Loader(built, batch_size=8, shuffle="shard", seed=4, device="cpu", block_window=window,
                   sort_batches=False)
    np.testing.assert_array_equal(order, np.concatenate(again.batch_indices(0)))
    _assert_same_as_dataset(loader, ds, epoch=0)


@pytest.mark.parametrize("mode", ["full", "block"])
def test_sorted_batches_hold_the_sampler_rows_in_file_order(built, ds, mode):
    kw = dict(batch_size=8, shuffle=mode, seed=3, device="cpu")
    plain = Loader(built, sort_batches=False, **kw).batch_indices(1)
    srt = Loader(built, **kw)
    sorted_batches = srt.batch_indices(1)
    assert len(plain) == len(sorted_batches)
    for a, b in zip(plain, sorted_batches):
        assert sorted(a.tolist()) == sorted(b.tolist())                 # the same members
        assert (np.diff(srt.reader.gather_rank[b]) > 0).all()          # in gather (file) order
    assert any(not np.array_equal(a, b) for a, b in zip(plain, sorted_batches))
    _assert_same_as_dataset(srt, ds, epoch=1)


def test_shuffle_argument_is_checked(built):
    with pytest.raises(ValueError, match="shuffle must be"):
        Loader(built, batch_size=4, shuffle="random", device="cpu")


@pytest.mark.parametrize("mode", ["full", "block", False])
def test_ddp_shares_pad(built, ds, mode):
    ws = 7  # 120 = 7 * 17 + 1: uneven
    shares = [np.concatenate(Loader(built, batch_size=4, shuffle=mode, seed=9, device="cpu", rank=r,
                                    world_size=ws).batch_indices(3)) for r in range(ws)]
    assert {len(s) for s in shares} == {18}
    allrows = np.concatenate(shares)
    assert set(allrows.tolist()) == set(range(N))  # covering
    vals, counts = np.unique(allrows, return_counts=True)
    assert counts.max() == 2 and (counts == 2).sum() == 18 * ws - N  # only the padding repeats
    loader = Loader(built, batch_size=4, shuffle=mode, seed=9, device="cpu", rank=2, world_size=ws)
    _assert_same_as_dataset(loader, ds, epoch=3)


def test_ddp_shares_drop(built):
    ws = 7
    shares = [np.concatenate(Loader(built, batch_size=5, shuffle=True, seed=9, device="cpu", rank=r, world_size=ws,
                                    uneven="drop", sort_batches=False).batch_indices(0)) for r in range(ws)]
    assert {len(s) for s in shares} == {17}
    allrows = np.concatenate(shares)
    assert len(set(allrows.tolist())) == len(allrows) == 17 * ws  # disjoint
    # all ranks agree on the global order: the shares are consecutive pieces of one permutation
    one = np.concatenate(Loader(built, batch_size=5, shuffle=True, seed=9, device="cpu",
                                sort_batches=False).batch_indices(0))
    np.testing.assert_array_equal(allrows, one[:17 * ws])
    with pytest.raises(ValueError, match="rank"):
        Loader(built, batch_size=5, device="cpu", rank=7, world_size=7)


@pytest.mark.parametrize("mode", ["full", "block"])
def test_state_dict_resume_gives_exactly_the_remaining_batches(built, mode):
    kw = dict(batch_size=7, shuffle=mode, seed=4, device="cpu", drop_last=True)
    full = Loader(built, **kw)
    full.set_epoch(2)
    ref = [b["image"].clone() for b in full]
    a = Loader(built, **kw)
    a.set_epoch(2)
    it = iter(a)
    seen = [next(it)["image"].clone() for _ in range(5)]
    state = a.state_dict()
    it.close()
    assert state["epoch"] == 2 and state["batch"] == 5
    b = Loader(built, **kw)
    b.load_state_dict(state)
    rest = [x["image"] for x in b]
    assert len(seen) + len(rest) == len(ref) == N // 7
    for x, y in zip(seen + rest, ref):
        assert torch.equal(x, y)
    assert b.state_dict()["epoch"] == 3
    with pytest.raises(ValueError, match="seed"):
        Loader(built, **{**kw, "seed": 5}).load_state_dict(state)


def test_a_new_pass_closes_an_unfinished_one(built):
    loader = Loader(built, batch_size=10, shuffle=True, seed=2, device="cpu")
    first = iter(loader)
    a = next(first)["label"].clone()
    second = iter(loader)  # resumes after the one batch handed out, and stops the first pass
    rest = [b["label"] for b in second]
    assert len(rest) == len(loader) - 1
    with pytest.raises(StopIteration):
        next(first)
    ref = [b["label"] for b in Loader(built, batch_size=10, shuffle=True, seed=2, device="cpu")]
    assert all(torch.equal(x, y) for x, y in zip([a] + rest, ref))


def test_len_and_drop_last(built):
    assert len(Loader(built, batch_size=50, device="cpu")) == 3
    assert len(Loader(built, batch_size=50, device="cpu", drop_last=True)) == 2
    assert [len(b["label"]) for b in Loader(built, batch_size=50, device="cpu", drop_last=True)] == [50, 50]


def _pass(loader) -> list[bytes]:
    """One pass, each batch as its image bytes (which samples, in which order)."""
    return [b["image"].numpy().tobytes() for b in loader]


def test_set_epoch_keeps_a_restored_position(small_build):
    kw = dict(batch_size=2, shuffle=True, seed=3, device="cpu", num_threads=0)
    ref = Loader(small_build, **kw)
    ref.set_epoch(1)
    e1 = _pass(ref)
    e2 = _pass(ref)
    assert len(e1) == 5 and ref.epoch == 3

    a = Loader(small_build, **kw)
    a.set_epoch(1)
    it = iter(a)
    seen = [next(it)["image"].numpy().tobytes() for _ in range(2)]
    state = a.state_dict()
    it.close()
    assert (state["epoch"], state["batch"]) == (1, 2)

    b = Loader(small_build, **kw)
    b.load_state_dict(state)
    got = []
    for epoch in range(state["epoch"], 3):   # the README loop: set_epoch before every pass
        b.set_epoch(epoch)
        got.append(_pass(b))
    assert seen + got[0] == e1               # the rest of epoch 1, not a replay
    assert got[1] == e2                      # the next epoch from its start
    b.set_epoch(1)                           # a pass has run since the restore: back to the start
    assert _pass(b) == e1

    c = Loader(small_build, **kw)
    c.load_state_dict(state)
    c.set_epoch(2)                           # another epoch than the restored one: from its start
    assert _pass(c) == e2


def test_load_state_dict_checks_the_batch(small_build):
    loader = Loader(small_build, batch_size=2, shuffle=True, device="cpu")
    state = loader.state_dict()
    for bad in (-1, 6):
        with pytest.raises(ValueError, match=r"batch must be in \[0, 5\] \(epoch 0 has 5 batches\), got " + str(bad)):
            loader.load_state_dict({**state, "batch": bad})
    loader.load_state_dict({**state, "batch": 5})   # all handed out: the pass yields nothing, then the next epoch
    assert list(loader) == [] and loader.epoch == 1
