"""An outside check of the reader's promises on order, resume and distribution (Loader and Mix).

The truths here are not computed by the code under test:

- an uninterrupted pass is the truth for a resumed one: stop after ``k`` batches (0 to ``len``, and ``len``
  at the epoch's end), pass the state through JSON (a checkpoint), load it into a NEW reader (other
  ``num_threads``, ``prefetch``, ``in_memory``, ``map_shards``) and compare the remaining batches byte for byte;
- which sample a batch row is comes from its bytes, looked up in ``precompile.open(path)`` (h5py or the
  folder format, not the Loader's mapped gather): each key once per epoch (``copies="epoch"``), each row of
  the documented set once (``copies="all"``), and for a Mix each ``(__source, __row)`` holds that build's bytes;
- set arithmetic for DDP: the ranks' shares have equal batch counts, are disjoint where the docs say so
  (``uneven="drop"``, or a share that divides evenly) and together cover the single-process epoch;
- the restored reader is driven both as a training loop does (``set_epoch``, then ``iter``) and as Lightning
  does (``iter``, then ``set_epoch``, then ``next``), with and without device steps and the conversion;
- hostile states (types changed, keys missing or extra, another reader kind, a build rebuilt with another
  count, epochs past int64) are a ``ValueError`` naming what does not match, never another position.

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


def _draw_extra(rng: np.random.Generator) -> dict:
    """Options that change a batch's bytes but not its samples: device steps (drawn per sample from
    (seed, epoch, rank, batch)) and the conversion. The resume comparison runs with them; the identity checks
    (bytes looked up in the build) run without them."""
    if rng.random() < 0.5:
        return {}
    out: dict = {"gpu_steps": [{"random_flip": {"horizontal": 0.5}}, {"random_crop": {"size": 6, "padding": 1}},
                               {"color_jitter": {"brightness": 0.3}}][:int(rng.integers(1, 4))]}
    if rng.random() < 0.5:
        out.update(dtype="float32", mean=[0.5, 0.4, 0.3], std=[0.2, 0.3, 0.25], channels_first=bool(rng.integers(2)))
    return out


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
            "io": [io(), io(), io()], "ks": rng.random(2).tolist(), "lightning_order": bool(rng.integers(2)),
            "extra": _draw_extra(rng)}


def _loader(path: str, case: dict, rank: int, io: dict, extra: bool = True) -> Loader:
    return Loader(path, device="cpu", rank=rank, world_size=case["world"], **case["opts"], **io,
                  **(case["extra"] if extra else {}))


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
        length = len(ref)
        full = [_host(b) for b in ref]
        assert length == len(full), f"case {case['seed_of_case']}: len() {length}, a pass {len(full)} batches"
        nxt = [_host(b) for b in ref]        # the pass ended: the next one is epoch e + 1
        ref.close()
        if case["extra"]:
            plain = _loader(path, case, rank, case["io"][0], extra=False)
            plain.set_epoch(e)
            shares.append([_host(b) for b in plain])
            plain.close()
        else:
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
            assert (state["epoch"], state["batch"]) == ((e + 1, 0) if k == "end" else (e, k))
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


LOADER_SEEDS = list(range(FIRST_SEED, FIRST_SEED + 24 + EXPLORE))


@pytest.mark.parametrize("case_seed", LOADER_SEEDS)
def test_loader_resumes_with_exactly_the_remaining_batches(builds, truths, case_seed):
    _run_loader_case(builds, truths, _draw_loader(case_seed))


# -- precompile.Mix ---------------------------------------------------------------------------------------------
def _draw_mix(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    pick = lambda xs: xs[int(rng.integers(len(xs)))]   # noqa: E731
    io = lambda: {"num_threads": int(rng.integers(0, 3)), "prefetch": int(rng.integers(1, 4)),   # noqa: E731
                  "in_memory": bool(rng.integers(2))}
    names = pick([["plain", "png"], ["png", "plain"], ["plain", "aug", "png"]])
    weights = None if rng.random() < 0.3 else [int(w) for w in rng.integers(0, 4, len(names))]
    if weights is not None and sum(weights) == 0:
        weights[0] = 1
    stop = pick(["first_exhausted", "first_exhausted", "all_exhausted", int(rng.integers(1, 40))])
    cycle = None
    if stop == "first_exhausted" and rng.random() < 0.4:
        cycle = [bool(c) for c in rng.integers(0, 2, len(names))]
        active = [i for i in range(len(names)) if weights is None or weights[i] > 0]
        if all(cycle[i] for i in active):
            cycle[active[0]] = False
    return {"seed_of_case": seed, "names": names, "epoch": int(rng.integers(0, 4)), "world": int(pick([1, 1, 2, 3])),
            "opts": {"batch_size": int(rng.integers(1, 8)), "shuffle": bool(rng.integers(2)),
                     "seed": int(rng.integers(0, 4)), "drop_last": bool(rng.integers(2)),
                     "sort_batches": bool(rng.integers(2)), "uneven": pick(["pad", "drop"]),
                     "weights": weights, "stop": stop, "cycle": cycle},
            "io": [io(), io(), io()], "ks": rng.random(2).tolist(), "lightning_order": bool(rng.integers(2)),
            "extra": _draw_extra(rng)}


def _mix(builds: dict, case: dict, rank: int, io: dict, extra: bool = True):
    return precompile.Mix([builds[n] for n in case["names"]], device="cpu", rank=rank, world_size=case["world"],
                          **case["opts"], **io, **(case["extra"] if extra else {}))


def _doc_counts(sizes: list[int], case: dict) -> list[int]:
    """docs/reference-reader.md's table, in exact fractions: the epoch's length N, then floor(N p_i) each and the
    rest one each to the largest remainders (ties to the lower index)."""
    from fractions import Fraction
    import math

    o = case["opts"]
    w = [Fraction(x) for x in (o["weights"] if o["weights"] is not None else sizes)]
    p = [x / sum(w) for x in w]
    active = [i for i in range(len(p)) if p[i] > 0]
    if o["stop"] == "first_exhausted":
        ending = [i for i in active if not (o["cycle"] and o["cycle"][i])]
        n = max(m for m in range(sum(sizes) * 10 + 1) if all(m * p[i] <= sizes[i] for i in ending))
    elif o["stop"] == "all_exhausted":
        n = min(m for m in range(sum(sizes) * 10 + 1) if all(m * p[i] >= sizes[i] for i in active))
    else:
        n = o["stop"]
    counts = [math.floor(n * q) for q in p]
    rest = sorted(range(len(p)), key=lambda i: (-(n * p[i] - counts[i]), i))[:n - sum(counts)]
    return [c + (i in rest) for i, c in enumerate(counts)]


def _run_mix_case(builds: dict, truths: dict, case: dict) -> None:
    e, world, o = case["epoch"], case["world"], case["opts"]
    ts = [truths[n] for n in case["names"]]
    shares = []
    for rank in range(world):
        ref = _mix(builds, case, rank, case["io"][0])
        ref.set_epoch(e)
        length = len(ref)
        full = [_host(b) for b in ref]
        assert length == len(full), f"Mix case {case['seed_of_case']}: len() {length}, a pass {len(full)} batches"
        nxt = [_host(b) for b in ref]
        counts, sizes = list(ref.counts), list(ref.sizes)
        ref.close()
        if case["extra"]:
            plain = _mix(builds, case, rank, case["io"][0], extra=False)
            plain.set_epoch(e)
            shares.append([_host(b) for b in plain])
            plain.close()
        else:
            shares.append(full)
        n = len(full)
        ks = sorted({0, n, int(case["ks"][0] * (n + 1)), int(case["ks"][1] * (n + 1))})
        for k in ks + ["end"]:
            a = _mix(builds, case, rank, case["io"][1])
            a.set_epoch(e)
            it = iter(a)
            for _ in range(n if k == "end" else k):
                next(it)
            if k == "end":
                assert next(it, None) is None
            state = _json(a.state_dict())
            assert (state["epoch"], state["batch"]) == ((e + 1, 0) if k == "end" else (e, k))
            a.close()
            b = _mix(builds, case, rank, case["io"][2])
            b.load_state_dict(state)
            if case["lightning_order"]:
                it = iter(b)
                b.set_epoch(state["epoch"])
            else:
                b.set_epoch(state["epoch"])
                it = iter(b)
            rest = [_host(x) for x in it]
            b.close()
            _same(rest, nxt if k == "end" else full[k:],
                  f"Mix case {case['seed_of_case']} rank {rank} resumed after {k} of {n} batches")
    assert sizes == [t.n for t in ts]
    assert counts == _doc_counts(sizes, case), f"Mix case {case['seed_of_case']}: counts {counts}"
    # every sample is its build's row, by the bytes precompile.open reads
    per_rank = []
    for full in shares:
        pairs = []
        for batch in full:
            for j, (s, r) in enumerate(zip(batch["__source"].tolist(), batch["__row"].tolist())):
                got = np.ascontiguousarray(batch["image"][j]).tobytes() + int(batch["label"][j]).to_bytes(8, "little")
                assert got == ts[s].rows[r], f"Mix case {case['seed_of_case']}: sample is not row {r} of source {s}"
                pairs.append((s, r))
        per_rank.append(pairs)
    assert len({len(s) for s in shares}) == 1, f"ranks' batch counts differ: {[len(s) for s in shares]}"
    total = sum(counts)
    per = -(-total // world) if o["uneven"] == "pad" else total // world
    bs = o["batch_size"]
    for pairs in per_rank:
        assert len(pairs) == (per - per % bs if o["drop_last"] else per)
    seen = Counter(x for pairs in per_rank for x in pairs)
    once = [i for i in range(len(counts)) if counts[i] <= sizes[i]]   # no row twice in an epoch (documented)
    if not o["drop_last"] and (o["uneven"] == "drop" or total % world == 0):
        assert all(seen[x] == 1 for x in seen if x[0] in once), "a row twice in one epoch"
    if not o["drop_last"] and world == 1:
        assert Counter(s for s, _ in seen.elements()) == Counter({i: c for i, c in enumerate(counts) if c})


MIX_SEEDS = list(range(FIRST_SEED, FIRST_SEED + 16 + EXPLORE))


@pytest.mark.parametrize("case_seed", MIX_SEEDS)
def test_mix_resumes_with_exactly_the_remaining_batches(builds, truths, case_seed):
    _run_mix_case(builds, truths, _draw_mix(case_seed))


# -- hostile states -----------------------------------------------------------------------------------------------
def _readers(builds: dict) -> dict:
    return {"Loader": lambda: Loader(builds["plain"], batch_size=4, device="cpu", num_threads=0, seed=1),
            "Mix": lambda: precompile.Mix([builds["plain"], builds["png"]], batch_size=4, device="cpu",
                                          num_threads=0, seed=1)}


BAD_VALUES = [
    ("epoch", 1.5, "epoch must be a whole number, got 1.5"),
    ("batch", 1.5, "batch must be a whole number, got 1.5"),
    ("epoch", "1", "epoch must be a whole number, got '1'"),
    ("batch", "1", "batch must be a whole number, got '1'"),
    ("batch", True, "batch must be a whole number, got True"),
    ("epoch", None, "epoch must be a whole number, got None"),
    ("epoch", [1], r"epoch must be a whole number, got \[1\]"),
    ("batch", {"a": 1}, "batch must be a whole number, got {'a': 1}"),
    ("batch", float("nan"), "batch must be a whole number, got nan"),
    ("epoch", float("inf"), "epoch must be a whole number, got inf"),
    ("epoch", -1, r"state_dict epoch must be in \[0, 2\*\*63\), got -1"),
    ("batch", -1, r"state_dict batch must be in \[0, \d+\] \(epoch 0 has \d+ batches\), got -1"),
    ("batch", 10 ** 30, r"state_dict batch must be in \[0, \d+\] .*got 1000000000000000000000000000000"),
    ("seed", 2, "state_dict was taken with seed=2, this (Loader|Mix) has seed=1"),
    ("seed", {"x": list(range(10 ** 4))}, r"state_dict was taken with seed=\{'x': \[0, 1, 2, .{0,80}\.\.\. \(\d+ characters\), "),
    ("batch_size", 8, "state_dict was taken with batch_size=8, this (Loader|Mix) has batch_size=4"),
    ("world_size", 2, "state_dict was taken with world_size=2"),
]


@pytest.mark.parametrize("kind", ["Loader", "Mix"])
@pytest.mark.parametrize("key,value,message", BAD_VALUES, ids=[f"{k}={v!r:.20}" for k, v, _ in BAD_VALUES])
def test_a_state_with_a_bad_value_is_a_value_error_naming_it(builds, kind, key, value, message):
    """Before: ``int()`` took an epoch or batch of 1.5 as 1, of ``"1"`` or True as 1 (resuming elsewhere without a
    word), and None, a list, NaN or infinity crashed with a TypeError, ValueError or OverflowError from ``int``;
    a mismatching value was quoted whole in the message."""
    reader = _readers(builds)[kind]()
    state = {**_json(reader.state_dict()), key: value}
    with pytest.raises(ValueError, match=message) as err:
        reader.load_state_dict(state)
    assert len(str(err.value)) < 400
    assert (reader.epoch, reader._pos) == (0, 0)       # nothing changed


@pytest.mark.parametrize("kind", ["Loader", "Mix"])
def test_a_state_without_a_key_or_not_a_dict_is_a_value_error(builds, kind):
    """Before: a state without ``epoch`` or ``batch`` was a KeyError, one that is not a dict a TypeError, and one
    without ``seed``, ``batch_size``, ``num_rows``... was taken as matching (another build's position, read here)."""
    reader = _readers(builds)[kind]()
    state = _json(reader.state_dict())
    for key in state:
        if key == "rank":   # every rank may resume from rank 0's state (a DDP checkpoint holds rank 0's): no check
            continue
        if key in type(reader).STATE_ADDED:   # newer than states already written: checked only where present
            continue
        with pytest.raises(ValueError, match=f"state_dict has no {key!r}: .*a state_dict\\(\\) of this {kind}"):
            reader.load_state_dict({k: v for k, v in state.items() if k != key})
    for bad in ([1, 2], None, "abc", 3):
        with pytest.raises(ValueError, match=f"state_dict must be a dict .*got {type(bad).__name__}"):
            reader.load_state_dict(bad)
    reader.load_state_dict({**state, "batch": 1, "from_a_later_version": {"x": 1}})   # extra keys: ignored
    assert reader._pos == 1


def test_a_mix_state_past_the_countable_epochs_is_a_value_error(builds):
    """Before: an epoch whose stream positions pass int64 crashed deep in numpy (OverflowError)."""
    mix = _readers(builds)["Mix"]()
    with pytest.raises(ValueError, match=r"Mix: epoch 4611686018427387904 is past the last epoch"):
        mix.load_state_dict({**_json(mix.state_dict()), "epoch": 2 ** 62})
    mix.set_epoch(2 ** 62)
    with pytest.raises(ValueError, match=r"Mix: epoch 4611686018427387904 is past the last epoch"):
        len(mix)


@pytest.mark.parametrize("kind", ["Loader", "Mix"])
def test_whole_floats_from_a_config_resume_as_their_ints(builds, kind):
    """``epoch`` and ``batch`` as 1.0 (a state that went through a float-only format) are the same position."""
    reader = _readers(builds)[kind]()
    state = _json(reader.state_dict())
    reader.load_state_dict({**state, "epoch": 1.0, "batch": 1.0})
    assert (reader.epoch, reader._pos) == (1, 1) and type(reader.epoch) is int and type(reader._pos) is int


@pytest.mark.parametrize("taken,loaded,message", [
    ({"copies": "all"}, {"copies": "epoch"}, "state_dict was taken with copies='all', this Loader has copies='epoch'"),
    ({"include_original": False}, {}, "state_dict was taken with include_original=False, this Loader has "
                                      "include_original=True"),
    ({"sort_batches": False}, {}, "state_dict was taken with sort_batches=False, this Loader has sort_batches=True"),
])
def test_a_state_of_other_copies_or_batch_order_is_a_value_error(builds, taken, loaded, message):
    """Before: the Loader's state did not hold ``copies``, ``include_original`` or ``sort_batches``, which decide
    which rows an epoch of an augmented build holds and in what order a batch holds them: a state taken with
    ``copies="all"`` (21 rows an epoch here) resumed a ``copies="epoch"`` Loader (7 rows) at its batch number of
    another order, without a word (the truth: the uninterrupted Loader's batches differ)."""
    kw = {"batch_size": 2, "device": "cpu", "num_threads": 0, "seed": 2}
    a = Loader(builds["aug"], **kw, **taken)
    it = iter(a)
    next(it)
    state = _json(a.state_dict())
    a.close()
    b = Loader(builds["aug"], **kw, **loaded)
    with pytest.raises(ValueError, match=message):
        b.load_state_dict(state)
    # the same options resume, and a state written before these keys existed is still read
    same = Loader(builds["aug"], **kw, **taken)
    same.load_state_dict(state)
    old = {k: v for k, v in state.items() if k not in ("copies", "include_original", "sort_batches", "layout")}
    b.load_state_dict(old)
    assert same._pos == b._pos == 1


def test_copies_and_include_original_are_not_checked_where_the_build_has_no_copies(builds):
    """A build without augmented copies reads the same rows whatever ``copies``/``include_original`` say."""
    kw = {"batch_size": 3, "device": "cpu", "num_threads": 0}
    a = Loader(builds["plain"], copies="all", include_original=False, **kw)
    b = Loader(builds["plain"], **kw)
    assert a.batch_indices(0)[1].tolist() == b.batch_indices(0)[1].tolist()
    next(iter(a))
    b.load_state_dict(_json(a.state_dict()))
    assert b._pos == 1


def test_a_state_of_the_other_kind_of_reader_is_a_value_error(builds):
    """A Loader's state given to a Mix, and a Mix's to a Loader: each lacks what the other checks."""
    readers = _readers(builds)
    loader, mix = readers["Loader"](), readers["Mix"]()
    with pytest.raises(ValueError, match="state_dict has no 'stop': it is not a state_dict\\(\\) of this Mix"):
        mix.load_state_dict(_json(loader.state_dict()))
    with pytest.raises(ValueError, match="state_dict has no 'block_window': it is not a state_dict\\(\\) of this Loader"):
        loader.load_state_dict(_json(mix.state_dict()))


def test_a_state_taken_before_a_rebuild_with_another_count_is_a_value_error(tmp_path):
    """The build rebuilt in place with one sample more (or less): the state's position is of another order."""
    root = _tree(tmp_path / "in", 2, 21)
    recipe = image_recipe(root, name="grow", steps=SMALL, output={"format": "hdf5", "samples_per_shard": 4})
    precompile.build(recipe, out_dir=tmp_path / "out")
    path = str(tmp_path / "out" / "grow.h5")
    kw = {"batch_size": 2, "device": "cpu", "num_threads": 0}
    a = Loader(path, **kw)
    next(iter(a))
    state = _json(a.state_dict())
    a.close()
    mix = precompile.Mix([path, path], **kw)
    mstate = _json(mix.state_dict())
    mix.close()
    for change in ("more", "fewer"):
        if change == "more":
            make_image_tree(tmp_path / "extra", classes=("a",), per_class=1, seed=99)
            (tmp_path / "extra" / "a" / "000.jpg").rename(root / "a" / "zzz.jpg")
        else:
            for f in sorted(root.rglob("*.*"))[:2]:
                f.unlink()
        precompile.build(recipe, out_dir=tmp_path / "out")
        n = len(precompile.open(path))
        assert n == (7 if change == "more" else 5)
        with pytest.raises(ValueError, match=f"state_dict was taken with num_rows=6, this Loader has num_rows={n}"):
            Loader(path, **kw).load_state_dict(state)
        with pytest.raises(ValueError, match=f"state_dict was taken with sizes=\\[6, 6\\], this Mix has sizes=\\[{n}, {n}\\]"):
            precompile.Mix([path, path], **kw).load_state_dict(mstate)


@pytest.mark.parametrize("epoch", [2 ** 63, 10 ** 30])
def test_an_epoch_past_int64_is_a_value_error(builds, epoch):
    """Before: over an augmented build (the copy of an epoch is ``epoch mod n`` in numpy) an epoch past int64 was
    an OverflowError from numpy, from ``set_epoch``'s pass or from ``load_state_dict``."""
    loader = Loader(builds["aug"], batch_size=4, device="cpu", num_threads=0)
    with pytest.raises(ValueError, match=f"state_dict epoch must be in \\[0, 2\\*\\*63\\), got {epoch}"):
        loader.load_state_dict({**_json(loader.state_dict()), "epoch": epoch})
    with pytest.raises(ValueError, match=f"epoch must be in \\[0, 2\\*\\*63\\), got {epoch}"):
        loader.set_epoch(epoch)
    loader.set_epoch(2 ** 62)   # the largest epochs still count
    assert sum(len(b["label"]) for b in loader) == 7


@pytest.mark.parametrize("kind", ["Loader", "Mix"])
def test_every_rank_resumes_from_rank_0s_state(builds, kind):
    """A DDP checkpoint holds rank 0's state (Lightning saves on rank 0); every rank loads it and gets its own
    remaining batches: the ranks move in step, so rank 0's position is theirs."""
    def make(rank):
        kw = {"batch_size": 2, "device": "cpu", "num_threads": 0, "seed": 5, "rank": rank, "world_size": 3}
        if kind == "Loader":
            return Loader(builds["aug"], **kw)
        return precompile.Mix([builds["plain"], builds["png"]], weights=[2, 1], **kw)

    zero = make(0)
    zero.set_epoch(1)
    it = iter(zero)
    next(it)
    state = _json(zero.state_dict())
    zero.close()
    for rank in (0, 1, 2):
        ref = make(rank)
        ref.set_epoch(1)
        want = [_host(b) for b in ref][1:]
        again = make(rank)
        again.load_state_dict(state)
        again.set_epoch(1)
        _same([_host(b) for b in again], want, f"rank {rank} from rank 0's state")


@pytest.fixture(scope="module")
def relaid(tmp_path_factory) -> dict[str, str]:
    """The same 13 inputs built three ways: ``a`` (shards of 5, chunks of 2), ``b`` (shards of 4, chunks of 3):
    the same samples in other chunks and shards; ``c``: the same count of other samples (two files swapped for
    two others)."""
    tmp = tmp_path_factory.mktemp("relaid")
    root = _tree(tmp / "in", 5, 11, drop=2)
    out = {}
    for name, per, chunk in (("a", 5, 2), ("b", 4, 3)):
        precompile.build(image_recipe(root, name=name, steps=SMALL,
                                      output={"format": "hdf5", "samples_per_shard": per, "chunk_samples": chunk}),
                         out_dir=tmp / "out")
        out[name] = str(tmp / "out" / f"{name}.h5")
    other = _tree(tmp / "other", 5, 11)             # the two files the others dropped, for two of theirs
    for f in sorted(root.rglob("*.*"))[-2:]:
        f.unlink()
    for f in sorted(other.rglob("*.*"))[:2]:
        f.rename(root / f.parent.name / f"0{f.name}")
    precompile.build(image_recipe(root, name="c", steps=SMALL,
                                  output={"format": "hdf5", "samples_per_shard": 5, "chunk_samples": 2}),
                     out_dir=tmp / "out")
    out["c"] = str(tmp / "out" / "c.h5")
    return out


def _epoch_keys(path: str, loader_kw: dict, state: dict | None, first: list[str]) -> list[str]:
    ds = precompile.open(path)
    ld = Loader(path, **loader_kw)
    if state is not None:
        ld.load_state_dict(state)
        ld.set_epoch(state["epoch"])
    keys = first + [ds.key(int(r)) for b in ld.batch_indices()[ld._pos:] for r in b]
    ld.close()
    ds.close()
    return keys


@pytest.mark.parametrize("shuffle", ["block", "shard"])
def test_a_state_over_another_layout_of_the_same_samples_is_a_value_error(relaid, shuffle):
    """Before: only the row count was checked, so a state taken over ``a`` resumed a block- or shard-shuffled
    Loader over ``b`` (the same 13 samples in other chunks and shards: another order) at its batch number. The
    truth, by the keys: that epoch showed samples twice and others never, without a word."""
    kw = {"batch_size": 3, "device": "cpu", "num_threads": 0, "seed": 4, "shuffle": shuffle, "block_window": 2}
    a = Loader(relaid["a"], **kw)
    a.set_epoch(1)
    first = [precompile.open(relaid["a"]).key(int(r)) for r in a.batch_indices()[0]]
    state = _json(a.state_dict() | {"batch": 1})
    a.close()
    assert sorted(_epoch_keys(relaid["a"], kw, state, first)) == sorted(precompile.open(relaid["a"]).keys)
    b = Loader(relaid["b"], **kw)     # what the state's position reads over b: not the rest of the epoch
    b.set_epoch(1)
    misread = first + [precompile.open(relaid["b"]).key(int(r)) for x in b.batch_indices()[1:] for r in x]
    assert sorted(misread) != sorted(precompile.open(relaid["b"]).keys)
    b.close()
    with pytest.raises(ValueError, match="state_dict was taken over another build or layout: .*sample keys, copies, "
                                         "chunks .*shards"):
        Loader(relaid["b"], **kw).load_state_dict(state)


def test_a_state_over_other_samples_of_the_same_count_is_a_value_error(relaid):
    """Before: a state over ``a`` resumed a Loader over ``c`` (13 samples, two of them others) at its batch
    number: the epoch's first part was ``a``'s samples and the rest ``c``'s at ``a``'s positions."""
    kw = {"batch_size": 3, "device": "cpu", "num_threads": 0, "seed": 4}
    a = Loader(relaid["a"], **kw)
    state = _json(a.state_dict() | {"batch": 2})
    a.close()
    with pytest.raises(ValueError, match="state_dict was taken over another build or layout"):
        Loader(relaid["c"], **kw).load_state_dict(state)


def test_a_full_shuffle_resumes_over_a_rebuild_in_other_chunks(relaid):
    """A full (or no) shuffle's order depends on the samples, not on how they are chunked: a state over ``a``
    resumes ``b`` at the same place, each key once in the epoch."""
    for shuffle in (True, False):
        kw = {"batch_size": 3, "device": "cpu", "num_threads": 0, "seed": 4, "shuffle": shuffle}
        a = Loader(relaid["a"], **kw)
        first = [precompile.open(relaid["a"]).key(int(r)) for r in a.batch_indices()[0]]
        state = _json(a.state_dict() | {"batch": 1})
        a.close()
        keys = _epoch_keys(relaid["b"], kw, state, first)
        assert sorted(keys) == sorted(precompile.open(relaid["b"]).keys)


def test_a_mix_state_over_other_samples_of_the_same_sizes_is_a_value_error(relaid, builds):
    """Before: a Mix checked its builds' sizes only: a state over ``[a, png]`` resumed ``[c, png]`` (c: as many
    samples, two of them others) and ``[a, b]`` resumed ``[b, a]`` at their batch numbers, the rest of the epoch
    then of other samples. A rebuild of the same samples in other chunks still resumes (a Mix's order does not
    depend on them)."""
    kw = {"batch_size": 3, "device": "cpu", "num_threads": 0, "seed": 4}
    for before, after in (([relaid["a"], builds["png"]], [relaid["c"], builds["png"]]),
                          ([relaid["a"], relaid["c"]], [relaid["c"], relaid["a"]])):
        mix = precompile.Mix(before, **kw)
        state = _json(mix.state_dict() | {"batch": 1})
        mix.close()
        with pytest.raises(ValueError, match="state_dict was taken over other builds: .*sample keys"):
            precompile.Mix(after, **kw).load_state_dict(state)
    mix = precompile.Mix([relaid["a"], builds["png"]], **kw)
    state = _json(mix.state_dict() | {"batch": 1})
    again = precompile.Mix([relaid["b"], builds["png"]], **kw)
    again.load_state_dict(state)
    assert again._pos == 1



@pytest.mark.parametrize("name", ["plain", "png"])
def test_a_boolean_mask_is_not_taken_as_row_numbers(builds, name):
    """``ds.batch(mask)`` with a boolean array read rows 1 and 0 (True and False as numbers): a mask of 13 with
    two True gave 13 samples of rows 0 and 1, without a word. A mask of ``len(ds)`` values picks the rows where
    it is True, as numpy does (formats.dataset.rows_of); one of another length is an IndexError."""
    ds = precompile.open(builds[name])
    mask = np.zeros(len(ds), dtype=bool)
    mask[[1, 4]] = True
    got = ds.batch(mask)
    np.testing.assert_array_equal(got["image"], np.stack([ds[1]["image"], ds[4]["image"]]))
    with pytest.raises(IndexError, match=r"boolean index of 2 values for \d+ samples"):
        ds.batch([True, False])
    ds.close()


def test_a_mix_visiting_epochs_out_of_order_gives_each_as_a_fresh_mix(builds):
    """A Mix's passes depend on the ones before (kept two at a time): a Mix that went to epoch 20, back to 3 and
    on again must give every epoch's order as a Mix made afresh for it (a resumed run) does."""
    paths = [builds["plain"], builds["png"]]
    rng = np.random.default_rng(3)
    for weights, stop in (([2, 1], "first_exhausted"), ([1, 3], "all_exhausted"), ([1, 1], 11)):
        kw = {"batch_size": 2, "weights": weights, "stop": stop, "device": "cpu", "num_threads": 0, "seed": 1}
        walker = precompile.Mix(paths, **kw)
        for e in [20, 3, 4, 21] + rng.integers(0, 25, 4).tolist():
            fresh = precompile.Mix(paths, **kw)
            for x, y in zip(walker.epoch_order(e), fresh.epoch_order(e)):
                np.testing.assert_array_equal(x, y, err_msg=f"weights {weights}, stop {stop}, epoch {e}")
            fresh.close()
        walker.close()
