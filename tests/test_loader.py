"""The Loader on real builds: same bytes as the map-style dataset, orders, DDP shares, resume, fallbacks.

Builds are made by ``precompile.build`` from generated PNG and JPEG files in a
temporary folder (120 samples of 8x8 RGB, 5 samples per chunk, 32 per shard),
so every test reads bytes the project's own writer produced. Shards are
rewritten with h5py where a test needs an unusual layout (chunks written out
of order and unaligned; gzip-compressed).
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
from PIL import Image

import precompile
from precompile import build
from precompile.errors import FormatError, PrecompileError
from precompile.reader import gpu
from precompile.reader import loader as loader_mod
from precompile.reader.direct import DirectReader
from precompile.reader.loader import Loader
from precompile.recipe import parse_recipe

N, CHUNK, PER_SHARD = 120, 5, 32
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _make_inputs(root: str) -> None:
    rng = np.random.default_rng(7)
    for c in ("cat", "dog", "eel"):
        os.makedirs(os.path.join(root, c), exist_ok=True)
    for i in range(N):
        c = ("cat", "dog", "eel")[i % 3]
        img = Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8))
        if i % 2:
            img.save(os.path.join(root, c, f"{i:04d}.png"))
        else:
            img.save(os.path.join(root, c, f"{i:04d}.jpg"), quality=90)


def _build(tmp: str, name: str = "t") -> str:
    _make_inputs(os.path.join(tmp, "in"))
    recipe = parse_recipe({
        "name": name, "seed": 0,
        "inputs": {"root": "in", "match": "{label}/{name}.{ext}", "where": {"ext": "png|jpg"},
                   "fields": {"image": {"decoder": "image"}}, "label": {"capture": "label"}},
        "steps": [{"resize": {"size": [8, 8]}}],
        "output": {"format": "hdf5", "samples_per_shard": PER_SHARD, "chunk_samples": CHUNK},
    }, base_dir=tmp)
    build(recipe, out_dir=os.path.join(tmp, "out"))
    return os.path.join(tmp, "out", f"{name}.h5")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> str:
    return _build(str(tmp_path_factory.mktemp("loader")))


@pytest.fixture()
def ds(built):
    d = precompile.open(built)
    yield d
    d.close()


def _rewrite_shard(path: str, *, compression: str | None = None, scramble: bool = False) -> None:
    """Rewrite a shard with the same datasets: gzip chunks, or chunks written in reverse, unaligned, with junk between."""
    with h5py.File(path, "r") as f:
        data = {k: f[k][()] for k in f}
        dtypes = {k: f[k].dtype for k in f}
        chunks = {k: f[k].chunks for k in f}
        attrs = dict(f.attrs)
    os.remove(path)
    with h5py.File(path, "w") as g:
        for k, v in data.items():
            if k.startswith("__"):
                g.create_dataset(k, data=v, dtype=dtypes[k])
                continue
            d = g.create_dataset(k, shape=v.shape, dtype=v.dtype, chunks=chunks[k], compression=compression)
            c = chunks[k][0]
            starts = list(range(0, len(v), c))
            for j, s in enumerate(reversed(starts) if scramble else starts):
                d[s:s + c] = v[s:s + c]
                if scramble:  # a small allocation between chunks: addresses are not evenly spaced
                    g.create_dataset(f"junk_{k}_{j}", data=np.arange(j * 13 + 3, dtype=np.uint8))
        for k, v in attrs.items():
            g.attrs[k] = v


def _chunk_addresses(path: str, name: str) -> list[int]:
    with h5py.File(path, "r") as f:
        out: list[tuple[int, int]] = []
        f[name].id.chunk_iter(lambda ci: out.append((ci.chunk_offset[0], ci.byte_offset)))
    return [a for _, a in sorted(out)]


def _assert_same_as_dataset(loader: Loader, ds, epoch: int | None = None) -> int:
    if epoch is not None:
        loader.set_epoch(epoch)
    idx = loader.batch_indices()
    got = list(loader)
    assert len(got) == len(idx) == len(loader)
    for b, i in zip(got, idx):
        ref = ds.batch(i)
        for f in loader.fields:
            np.testing.assert_array_equal(b[f].numpy(), ref[f])
    return len(got)


# -- same bytes as the dataset --------------------------------------------------------------
@pytest.mark.parametrize("in_memory", [False, True])
def test_full_shuffle_matches_dataset_from_maps_and_memory(built, ds, in_memory):
    loader = Loader(built, batch_size=16, shuffle=True, seed=3, device="cpu", in_memory=in_memory)
    # 4 shards: mapped into one address range (POSIX), or copied into one array per field
    if sys.platform.startswith("linux"):
        assert (loader.reader.region is not None) == (not in_memory)
    assert _assert_same_as_dataset(loader, ds, epoch=1) == 8


@pytest.mark.parametrize("batches_per_task", [1, 32])
def test_sequential_batches_match_dataset(built, ds, batches_per_task, monkeypatch):
    monkeypatch.setattr(loader_mod, "GROUP_BYTES", batches_per_task * 16 * (8 * 8 * 3 + 8))
    loader = Loader(built, batch_size=16, shuffle=False, device="cpu")
    assert loader.reader.fast and not loader.reader.fallbacks
    idx = loader.batch_indices()
    np.testing.assert_array_equal(np.concatenate(idx), np.arange(N))
    assert [len(i) for i in idx] == [16] * 7 + [8]
    assert _assert_same_as_dataset(loader, ds) == 8
    b = next(iter(Loader(built, batch_size=4, shuffle=False, device="cpu")))
    assert b["image"].dtype == torch.uint8 and b["image"].shape == (4, 8, 8, 3)
    assert b["label"].dtype == torch.int64


@pytest.mark.parametrize("threads", [2, 0])
def test_batches_are_not_reused_buffers(built, ds, threads):
    # on CPU each batch owns its memory: holding on to all of them keeps them intact
    loader = Loader(built, batch_size=8, shuffle=True, seed=3, device="cpu", prefetch=1, num_threads=threads)
    held = list(loader)
    for b, i in zip(held, loader.batch_indices(0)):
        np.testing.assert_array_equal(b["image"].numpy(), ds.batch(i)["image"])


def test_direct_reader_read_any_order(built, ds):
    r = DirectReader(ds)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, N, 50)  # repeats and shard crossings
    got = r.read(idx)
    ref = ds.batch(idx)
    for f in ("image", "label"):
        np.testing.assert_array_equal(got[f], ref[f])
    with pytest.raises(IndexError):
        r.plan(np.array([N]))


# -- orders -----------------------------------------------------------------------------------
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


# -- DDP ----------------------------------------------------------------------------------------
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


# -- resume -------------------------------------------------------------------------------------
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


# -- layouts the map cannot serve directly, and ones it can -------------------------------------------
def test_chunks_not_evenly_spaced(tmp_path):
    built = _build(str(tmp_path))
    d0 = precompile.open(built)
    shard0 = os.path.join(os.path.dirname(built), d0.shards[0]["file"])
    d0.close()
    _rewrite_shard(shard0, scramble=True)
    addr = _chunk_addresses(shard0, "image")
    steps = np.diff(addr)
    assert (steps < 0).any() and len(set(steps.tolist())) > 1  # the layout really is irregular
    assert any(a % 4096 for a in addr)                        # and unaligned
    ds = precompile.open(built)
    loader = Loader(ds, batch_size=9, shuffle=True, seed=0, device="cpu")
    assert loader.reader.fast
    _assert_same_as_dataset(loader, ds)
    # the in-memory copy reads the scrambled chunks from the files in runs: the same batches
    mem = Loader(ds, batch_size=9, shuffle=True, seed=0, device="cpu", in_memory=True, sort_batches=False)
    assert mem.reader.region is None and len(mem.reader._views["image"]) == 1
    _assert_same_as_dataset(mem, ds)
    ds.close()


def test_compressed_shard_falls_back_to_h5py(tmp_path):
    built = _build(str(tmp_path))
    d0 = precompile.open(built)
    shard1 = os.path.join(os.path.dirname(built), d0.shards[1]["file"])
    d0.close()
    _rewrite_shard(shard1, compression="gzip")
    ds = precompile.open(built)
    loader = Loader(ds, batch_size=16, shuffle="block", seed=1, device="cpu")
    assert not loader.reader.fast
    assert set(loader.reader.fallbacks) == {(1, "image"), (1, "label")}
    assert "filtered" in loader.reader.fallbacks[(1, "image")] and "deflate" in loader.reader.fallbacks[(1, "image")]
    _assert_same_as_dataset(loader, ds)
    _assert_same_as_dataset(Loader(ds, batch_size=16, shuffle=True, seed=1, device="cpu"), ds)
    ds.close()


def test_variable_shape_field_is_refused(ds):
    odd = copy.copy(ds)
    odd.field_specs = {**ds.field_specs, "image": {**ds.field_specs["image"], "shape": [None, None, 3]}}
    with pytest.raises(FormatError, match="'image' has shape .*unknown dimensions.*fixed-shape"):
        DirectReader(odd)
    with pytest.raises(KeyError, match="no field 'nope'"):
        DirectReader(ds, ["nope"])


# -- devices, conversion, batch steps -----------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA; the error is for machines without it")
def test_cuda_without_cuda_is_a_clear_error(built):
    with pytest.raises(PrecompileError, match="no CUDA device; use device='cpu'"):
        Loader(built, batch_size=4, device="cuda")
    assert Loader(built, batch_size=4, device="auto").device.type == "cpu"


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
    with pytest.raises(ValueError, match="need a float dtype"):
        Loader(built, batch_size=4, device="cpu", mean=mean, std=std)


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
    with pytest.raises(ValueError, match="'random_affine' is a build step with no device twin"):
        Loader(built, batch_size=4, device="cpu", gpu_steps=[{"random_affine": {}}])
    with pytest.raises(ValueError, match="'flip' is now the build step's twin random_flip"):
        Loader(built, batch_size=4, device="cpu", gpu_steps=[{"flip": {"p": 0.5}}])
    with pytest.raises(ValueError, match="random_crop: input 8x8 is smaller than the crop 9x9"):
        Loader(built, batch_size=4, device="cpu", gpu_steps=[{"random_crop": {"size": 9}}])
    with pytest.raises(ValueError, match="random_flip: cannot handle field 'label' of kind label"):
        Loader(built, batch_size=4, device="cpu", gpu_steps=[{"random_flip": {"fields": ["label"]}}])
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


@pytest.mark.parametrize("prefetch,threads", [(1, 3), (3, 3), (2, 0)])
@pytest.mark.parametrize("batches_per_task", [1, 3, 32])
def test_ring_pipeline_gives_the_cpu_batches(built, prefetch, threads, batches_per_task, monkeypatch):
    row = 8 * 8 * 3 + 8  # image + label bytes
    monkeypatch.setattr(loader_mod, "GROUP_BYTES", batches_per_task * 6 * row)
    kw = dict(batch_size=6, shuffle="block", seed=3, device="cpu", dtype="float32", mean=0.5, std=0.25,
              gpu_steps=[{"random_flip": {}}], prefetch=prefetch, num_threads=threads)
    ref = [b for b in Loader(built, **{**kw, "num_threads": 2})]
    ringed = Loader(built, **kw)
    ringed._use_ring, ringed._make_ring = True, FakeRing
    got = list(ringed)
    assert len(ref) == 20 and ringed._ring.launches == -(-20 // min(batches_per_task, 20))
    for x, y in zip(got, ref):
        assert torch.equal(x["image"], y["image"]) and torch.equal(x["label"], y["label"])


def test_stats_measure_the_wait(built):
    loader = Loader(built, batch_size=16, shuffle=True, device="cpu")
    n = sum(1 for _ in loader)
    st = loader.stats
    assert st.batches == n == len(st.waits) == 8
    assert 0 <= st.wait_s <= st.elapsed_s and abs(sum(st.waits) - st.wait_s) < 1e-9
    assert 0 <= st.wait_share <= 1
    assert f"{n} batches, waited" in st.summary()


def test_reader_does_not_import_torch():
    code = ("import sys, precompile, precompile.reader.direct, precompile.reader.sampler; "
            "precompile.open; assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
