"""An outside check of the reader's promises on order, resume and distribution (Loader and Mix).

The truths here are not computed by the code under test:

- an uninterrupted pass is the truth for a resumed one: stop after ``k`` batches (0 to ``len``, and ``len``
  at the epoch's end), pass the state through JSON (a checkpoint), load it into a NEW reader (other
  ``num_threads``, ``prefetch``, ``in_memory``, ``map_shards``) and compare the remaining batches byte for byte;
- which sample a batch row is comes from its bytes, looked up in ``precompile.open(path)`` (h5py or the
  folder format, not the Loader's mapped gather): each key once per epoch (``copies="epoch"``), each row of
  the documented set once (``copies="all"``), and for a Mix each ``(__source, __row)`` holds that build's bytes;
- set arithmetic for DDP: the ranks' shares have equal batch counts, are disjoint where the docs say so
  (``uneven="drop"``, or a share that divides evenly) and together cover the single-process epoch.

A fixed set of drawn cases runs by default; ``PRECOMPILE_RESUME_EXPLORE=N`` draws N more of each (the case
seed is printed in a failure's message, ``PRECOMPILE_RESUME_SEED`` picks the first one drawn).
"""
from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the Loader needs it)")

import precompile  # noqa: E402
from precompile.reader.loader import Loader  # noqa: E402

from conftest import image_recipe, make_image_tree  # noqa: E402

EXPLORE = int(os.environ.get("PRECOMPILE_RESUME_EXPLORE", "0") or 0)
FIRST_SEED = int(os.environ.get("PRECOMPILE_RESUME_SEED", "1000") or 1000)


SMALL = [{"resize": {"size": [8, 8]}}]


def _tree(root, per_class: int, seed: int, drop: int = 0):
    """Smooth random images (distinct bytes per file) in root/<class>/<i>.<ext>; ``drop`` files removed."""
    make_image_tree(root, classes=("a", "b", "c"), per_class=per_class, seed=seed)
    for f in sorted(root.rglob("*.*"))[:drop]:
        f.unlink()
    return root


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, str]:
    """``plain``: 13 HDF5 samples of 8x8 (shards of 5, chunks of 2); ``aug``: 7 keys, each stored as its original
    and 2 copies flipped at random (21 rows, shards of 4, chunks of 3); ``png``: a PNG folder build of 6 samples
    of the same shape and fields (for a Mix)."""
    tmp = tmp_path_factory.mktemp("resume_outside")
    out = tmp / "out"
    precompile.build(image_recipe(_tree(tmp / "p", 5, 11, drop=2), name="plain", steps=SMALL,
                                  output={"format": "hdf5", "samples_per_shard": 5, "chunk_samples": 2}), out_dir=out)
    precompile.build(image_recipe(_tree(tmp / "g", 3, 12, drop=2), name="aug", copies=2,
                                  steps=SMALL + [{"random_flip": {}}],
                                  output={"format": "hdf5", "samples_per_shard": 4, "chunk_samples": 3}), out_dir=out)
    precompile.build(image_recipe(_tree(tmp / "n", 2, 13), name="png", steps=SMALL,
                                  output={"format": "png", "samples_per_shard": 4}), out_dir=out)
    return {"plain": str(out / "plain.h5"), "aug": str(out / "aug.h5"), "png": str(out / "png.json")}


def test_builds_are_what_the_cases_assume(builds):
    plain, aug, png = (precompile.open(builds[k]) for k in ("plain", "aug", "png"))
    assert (len(plain), len(aug), len(png)) == (13, 21, 6)
    assert len(set(aug.keys)) == 7 and sorted(Counter(aug.copies.tolist()).values()) == [7, 7, 7]


# -- helpers ----------------------------------------------------------------------------------------------------
def _host(batch: dict) -> dict:
    return {k: (v.numpy().copy() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _same(got: list[dict], want: list[dict], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} batches, the uninterrupted run has {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), f"{what}: batch {i} fields {sorted(g)} != {sorted(w)}"
        for f in w:
            a, b = np.asarray(g[f]), np.asarray(w[f])
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), \
                f"{what}: batch {i} field {f!r} differs from the uninterrupted run"


def _json(state: dict) -> dict:
    """What a checkpoint keeps: the state through JSON."""
    return json.loads(json.dumps(state))


class Truth:
    """Each sample's identity from its bytes, read by ``precompile.open`` (not the Loader's gather)."""

    def __init__(self, path: str):
        ds = precompile.open(path)
        self.n = len(ds)
        self.keys = list(ds.keys)
        self.copies = np.asarray(getattr(ds, "copies", np.zeros(self.n, dtype=np.int64)))
        self.rows: list[bytes] = []
        self.by_bytes: dict[bytes, set[int]] = {}
        for i in range(self.n):
            s = ds[i]
            b = np.ascontiguousarray(s["image"]).tobytes() + int(s["label"]).to_bytes(8, "little")
            self.rows.append(b)
            self.by_bytes.setdefault(b, set()).add(i)
        ds.close()

    def of_batch(self, batch: dict) -> list[bytes]:
        img, lab = batch["image"], batch["label"]
        out = [np.ascontiguousarray(img[j]).tobytes() + int(lab[j]).to_bytes(8, "little") for j in range(len(lab))]
        for b in out:
            assert b in self.by_bytes, "a batch holds a sample that is no row of the build"
        return out

    def key_of(self, b: bytes) -> str:
        keys = {self.keys[r] for r in self.by_bytes[b]}
        assert len(keys) == 1, f"bytes shared by keys {keys}"
        return keys.pop()


# -- the Loader -------------------------------------------------------------------------------------------------
def _draw_loader(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    pick = lambda xs: xs[int(rng.integers(len(xs)))]   # noqa: E731
    io = lambda: {"num_threads": int(rng.integers(0, 3)), "prefetch": int(rng.integers(1, 4)),   # noqa: E731
                  "in_memory": bool(rng.integers(2)), "map_shards": pick(["all", "lazy"])}
    return {"seed_of_case": seed, "build": pick(["plain", "aug"]), "epoch": int(rng.integers(0, 3)),
            "world": int(pick([1, 1, 2, 3])),
            "opts": {"batch_size": int(rng.integers(1, 8)), "shuffle": pick([False, True, "block", "shard"]),
                     "seed": int(rng.integers(0, 4)), "drop_last": bool(rng.integers(2)),
                     "block_window": int(rng.integers(1, 4)), "sort_batches": bool(rng.integers(2)),
                     "copies": pick(["epoch", "all"]), "include_original": bool(rng.integers(2)),
                     "uneven": pick(["pad", "drop"])},
            "io": [io(), io(), io()], "ks": rng.random(2).tolist(), "lightning_order": bool(rng.integers(2))}


def _loader(path: str, case: dict, rank: int, io: dict) -> Loader:
    return Loader(path, device="cpu", rank=rank, world_size=case["world"], **case["opts"], **io)


def _expected(truth: Truth, case: dict) -> Counter:
    """The documented epoch (one process, every row of it once): by sample key for ``copies="epoch"`` over an
    augmented build, else by the rows' bytes."""
    o = case["opts"]
    augmented = truth.copies.max() > 0
    if augmented and o["copies"] == "epoch":
        return Counter(sorted(set(truth.keys)))
    rows = range(truth.n)
    if augmented and not o["include_original"]:     # every key here has other copies: the originals go
        rows = [r for r in rows if truth.copies[r] != 0]
    return Counter(truth.rows[r] for r in rows)


def _identities(truth: Truth, case: dict, batches: list[dict]) -> list:
    o = case["opts"]
    ids = [b for batch in batches for b in truth.of_batch(batch)]
    if truth.copies.max() > 0 and o["copies"] == "epoch":
        if not o["include_original"]:
            for b in ids:
                assert any(truth.copies[r] != 0 for r in truth.by_bytes[b]), "an original with include_original=False"
        return [truth.key_of(b) for b in ids]
    return ids


def _check_epoch(truth: Truth, case: dict, shares: list[list[dict]]) -> None:
    """Set arithmetic over the ranks' passes of one epoch against the documented rule."""
    o, world = case["opts"], case["world"]
    want = _expected(truth, case)
    n = sum(want.values())
    counts = {len(s) for s in shares}
    assert len(counts) == 1, f"ranks' batch counts differ: {[len(s) for s in shares]} (DDP would hang)"
    per_rank = [_identities(truth, case, s) for s in shares]
    per = -(-n // world) if o["uneven"] == "pad" else n // world
    for ids in per_rank:
        bs = o["batch_size"]
        assert len(ids) == (per - per % bs if o["drop_last"] else per), f"a rank got {len(ids)} samples"
        assert len(set(ids)) == len(ids) or max(want.values()) > 1 or per > n, "a sample twice in one rank's share"
    seen = Counter(x for ids in per_rank for x in ids)
    assert set(seen) <= set(want), "a sample outside the documented epoch"
    if not o["drop_last"]:
        if o["uneven"] == "drop" or n % world == 0:   # disjoint shares
            assert all(seen[x] <= want[x] for x in seen), "a sample in two ranks' shares"
        if o["uneven"] == "pad" or n % world == 0:     # every sample seen
            assert set(seen) == set(want), "the ranks' shares do not cover the epoch"
            assert sum(seen.values()) == per * world


def _run_loader_case(builds: dict, truths: dict, case: dict) -> None:
    path, truth = builds[case["build"]], truths[case["build"]]
    e, world = case["epoch"], case["world"]
    shares = []
    for rank in range(world):
        ref = _loader(path, case, rank, case["io"][0])
        ref.set_epoch(e)
        full = [_host(b) for b in ref]
        nxt = [_host(b) for b in ref]        # the pass ended: the next one is epoch e + 1
        ref.close()
        shares.append(full)
        n = len(full)
        ks = sorted({0, n, int(case["ks"][0] * (n + 1)), int(case["ks"][1] * (n + 1))})
        for k in ks + ["end"]:
            a = _loader(path, case, rank, case["io"][1])
            a.set_epoch(e)
            it = iter(a)
            for _ in range(n if k == "end" else k):
                next(it)
            if k == "end":                   # the loop ran to its end: the state is the next epoch's start
                assert next(it, None) is None
            state = _json(a.state_dict())
            a.close()
            b = _loader(path, case, rank, case["io"][2])
            b.load_state_dict(state)
            if case["lightning_order"]:      # Lightning: iter() first, then set_epoch on the sampler
                it = iter(b)
                b.set_epoch(state["epoch"])
            else:
                b.set_epoch(state["epoch"])
                it = iter(b)
            rest = [_host(x) for x in it]
            b.close()
            want = nxt if k == "end" else full[k:]
            _same(rest, want, f"case {case['seed_of_case']} rank {rank} resumed after {k} of {n} batches")
    _check_epoch(truth, case, shares)


@pytest.fixture(scope="module")
def truths(builds) -> dict[str, Truth]:
    return {k: Truth(p) for k, p in builds.items()}


LOADER_SEEDS = list(range(FIRST_SEED, FIRST_SEED + 10 + EXPLORE))


@pytest.mark.parametrize("case_seed", LOADER_SEEDS)
def test_loader_resumes_with_exactly_the_remaining_batches(builds, truths, case_seed):
    _run_loader_case(builds, truths, _draw_loader(case_seed))
