"""precompile.Mix: several real builds (HDF5, PNG and BMP folders) mixed by weight (issue 35).

Truths the Mix does not compute: each sample's bytes against ``precompile.open(path)[row]`` of the build
``__source`` names; the per-source counts against the weights' arithmetic done by hand; ranks against the
single-process order."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

import precompile
from precompile.errors import FormatError, PrecompileError

from conftest import image_recipe, make_image_tree


def _build(tmp: Path, name: str, fmt: str, per_class: int, seed: int, classes=("cat", "dog"), **over) -> str:
    root = make_image_tree(tmp / f"data_{name}", classes=classes, per_class=per_class, seed=seed)
    recipe = image_recipe(root, name=name, output={"format": fmt, "samples_per_shard": 4}, **over)
    precompile.build(recipe, out_dir=tmp / "out")
    return str(tmp / "out" / (f"{name}.h5" if fmt == "hdf5" else f"{name}.json"))


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> list[str]:
    """An HDF5 build of 10 samples, a PNG folder build of 6 and a BMP folder build of 4 (32x32 RGB + label)."""
    tmp = tmp_path_factory.mktemp("mix")
    return [_build(tmp, "a", "hdf5", 5, 1), _build(tmp, "b", "png", 3, 2), _build(tmp, "c", "bmp", 2, 3)]


def _pass(mix) -> list[dict]:
    return [{k: v.numpy().copy() for k, v in b.items()} for b in mix]


def _digest(batches: list[dict]) -> str:
    h = hashlib.sha256()
    for b in batches:
        for k in sorted(b):
            h.update(k.encode() + np.ascontiguousarray(b[k]).tobytes())
    return h.hexdigest()


def _sources(batches) -> np.ndarray:
    return np.concatenate([b["__source"] for b in batches])


def _pairs(batches) -> list[tuple[int, int]]:
    return list(zip(_sources(batches).tolist(), np.concatenate([b["__row"] for b in batches]).tolist()))


def test_each_sample_is_its_sources_bytes(builds):
    mix = precompile.Mix(builds, batch_size=5, weights=[0.5, 0.3, 0.2], stop=20, seed=3, device="cpu")
    batches = _pass(mix)
    opened = [precompile.open(p) for p in builds]
    assert sum(len(b["label"]) for b in batches) == 20
    for b in batches:
        for j, (s, r) in enumerate(zip(b["__source"].tolist(), b["__row"].tolist())):
            want = opened[s][r]
            assert np.array_equal(b["image"][j], want["image"]), (s, r)
            assert b["label"][j] == want["label"]
    assert set(_sources(batches).tolist()) == {0, 1, 2}
    # the three builds do hold different pixels: the check above can tell them apart
    assert not np.array_equal(opened[0][0]["image"], opened[1][0]["image"])
    for d in opened:
        d.close()
    mix.close()


@pytest.mark.parametrize("weights, stop, counts", [
    ([0.5, 0.3, 0.2], 50, [25, 15, 10]),      # exact quotas
    ([1, 1, 1], 10, [4, 3, 3]),               # 3.33 each: the one left over goes to the lowest index
    ([1, 1, 1], "first_exhausted", [4, 4, 4]),   # the 4-sample BMP build runs out first: 3 * 4
    ([1, 1, 1], "all_exhausted", [10, 10, 10]),  # the 10-sample HDF5 build is the last to run out
    ([2, 1, 1], "first_exhausted", [8, 4, 4]),
    ([0, 1, 3], "all_exhausted", [0, 6, 18]),   # 6 / 0.25 = 24 samples; a zero weight reads nothing
    (None, "first_exhausted", [10, 6, 4]),      # default: proportional to size, each sample once
])
def test_counts_per_epoch_are_exact(builds, weights, stop, counts):
    mix = precompile.Mix(builds, batch_size=7, weights=weights, stop=stop, seed=1, device="cpu", num_threads=0)
    assert mix.counts == counts
    for epoch in (0, 1, 2):
        mix.set_epoch(epoch)
        got = np.bincount(_sources(_pass(mix)), minlength=3).tolist()
        assert got == counts, epoch
    mix.close()


def test_first_exhausted_repeats_nothing_and_sources_go_on_across_epochs(builds):
    mix = precompile.Mix(builds, batch_size=4, weights=[1, 1, 1], stop="first_exhausted", seed=5, device="cpu")
    seen_a = []
    for epoch in range(5):
        mix.set_epoch(epoch)
        pairs = _pairs(_pass(mix))
        assert len(pairs) == len(set(pairs)) == 12          # no sample twice in an epoch
        assert sorted(r for s, r in pairs if s == 2) == [0, 1, 2, 3]   # the limiting source, whole, once
        seen_a += [r for s, r in pairs if s == 0]
    # source a gives 4 of its 10 rows per epoch and goes on where it stopped: 20 samples = 2 whole passes
    assert sorted(seen_a) == sorted(list(range(10)) * 2)
    mix.close()


def test_all_exhausted_shows_every_row(builds):
    mix = precompile.Mix(builds, batch_size=8, weights=[1, 1, 1], stop="all_exhausted", seed=2, device="cpu")
    pairs = _pairs(_pass(mix))
    for s, n in enumerate([10, 6, 4]):
        rows = [r for src, r in pairs if src == s]
        assert set(rows) == set(range(n))
        assert len(rows) == 10
    mix.close()


def test_deterministic_across_runs_and_thread_counts(builds):
    def run(threads, seed=4, epoch=1):
        m = precompile.Mix(builds, batch_size=3, weights=[0.2, 0.5, 0.3], stop=17, seed=seed, device="cpu",
                           num_threads=threads, prefetch=3)
        m.set_epoch(epoch)
        d = _digest(_pass(m))
        m.close()
        return d

    ref = run(0)
    assert run(0) == ref == run(1) == run(3)
    assert run(0, seed=5) != ref
    assert run(0, epoch=2) != ref


def test_unshuffled_mix_interleaves_evenly_in_file_order(builds):
    mix = precompile.Mix(builds[:2], batch_size=4, weights=[1, 1], stop=8, shuffle=False, device="cpu")
    assert _pairs(_pass(mix)) == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3)]
    mix.close()


def test_resume_mid_epoch_gives_the_remaining_batches(builds):
    kw = dict(batch_size=3, weights=[0.5, 0.25, 0.25], stop="all_exhausted", seed=9, device="cpu", num_threads=2)
    full = precompile.Mix(builds, **kw)
    full.set_epoch(2)
    want = _pass(full)
    assert len(want) > 4
    first = precompile.Mix(builds, **kw)
    first.set_epoch(2)
    it = iter(first)
    got = [{k: v.numpy().copy() for k, v in next(it).items()} for _ in range(3)]
    state = first.state_dict()
    first.close()
    assert state["epoch"] == 2 and state["batch"] == 3
    again = precompile.Mix(builds, **kw)
    again.load_state_dict(state)
    for epoch in range(2, 4):       # the usual loop: the restored epoch resumes, the next one starts whole
        again.set_epoch(epoch)
        if epoch == 2:
            rest = _pass(again)
            assert _digest(got + rest) == _digest(want)
            assert len(rest) == len(want) - 3
        else:
            full.set_epoch(3)
            assert _digest(_pass(again)) == _digest(_pass(full))
    with pytest.raises(ValueError, match=r"state_dict was taken with seed=9, this Mix has seed=10"):
        precompile.Mix(builds, **{**kw, "seed": 10}).load_state_dict(state)
    for m in (full, again):
        m.close()


@pytest.mark.parametrize("uneven", ["pad", "drop"])
def test_ranks_are_disjoint_equal_and_cover_the_order(builds, uneven):
    # 10 + 6 + 4: every sample of the three builds once, so a sample seen twice is a share overlapping another
    kw = dict(batch_size=4, weights=[0.5, 0.3, 0.2], stop=20, seed=6, device="cpu", uneven=uneven)
    one = precompile.Mix(builds, sort_batches=False, **kw)   # the global order, as the sampler made it
    order = _pairs(_pass(one))
    assert len(order) == 20 and len(set(order)) == 20
    shares = []
    for rank in range(3):
        m = precompile.Mix(builds, rank=rank, world_size=3, **kw)
        shares.append(_pairs(_pass(m)))
        m.close()
    per = 7 if uneven == "pad" else 6
    assert [len(s) for s in shares] == [per] * 3
    # pad: 7 each, the order then its first sample again; drop: 6 each, the last 2 samples left out
    padded = order + order[:1] if uneven == "pad" else order[:18]
    for rank, share in enumerate(shares):   # rank r's share is the r-th contiguous cut (each batch sorted)
        assert sorted(share) == sorted(padded[rank * per:(rank + 1) * per])
    seen = shares[0] + shares[1] + shares[2]
    assert len(set(seen)) == (20 if uneven == "pad" else 18)
    assert len(seen) - len(set(seen)) == (1 if uneven == "pad" else 0)   # pad: only the one wrapped sample twice
    one.close()


def test_sorted_batches_keep_their_members(builds):
    kw = dict(batch_size=6, weights=[0.5, 0.3, 0.2], stop=30, seed=8, device="cpu")
    plain = _pass(precompile.Mix(builds, sort_batches=False, **kw))
    fast = _pass(precompile.Mix(builds, **kw))
    assert len(plain) == len(fast) == 5
    for p, f in zip(plain, fast):
        assert sorted(_pairs([p])) == sorted(_pairs([f]))
        assert f["__source"].tolist() == sorted(f["__source"].tolist())   # each source's samples together
        by_pair = {pr: j for j, pr in enumerate(_pairs([p]))}
        for j, pr in enumerate(_pairs([f])):
            assert np.array_equal(f["image"][j], p["image"][by_pair[pr]])
    assert any(_pairs([p]) != _pairs([f]) for p, f in zip(plain, fast))


def test_field_mismatch_names_the_field_and_the_builds(builds, tmp_path):
    small = _build(tmp_path, "small", "hdf5", 1, 4, steps=[{"resize": {"size": [16, 16]}}])
    with pytest.raises(FormatError) as e:
        precompile.Mix([builds[0], small], batch_size=2)
    assert str(e.value) == (f"Mix: field 'image' has shape (32, 32, 3) in {builds[0]} but (16, 16, 3) in {small}; "
                            f"the mixed builds must agree (resize/crop them to one size in their recipes)")
    other = _build(tmp_path, "other", "png", 1, 4)
    unlabelled_root = make_image_tree(tmp_path / "nolabel", per_class=1)
    r = image_recipe(unlabelled_root, name="nolabel", output={"format": "hdf5"})
    del r["inputs"]["label"]
    precompile.build(r, out_dir=tmp_path / "out")
    nolabel = str(tmp_path / "out" / "nolabel.h5")
    with pytest.raises(FormatError) as e:
        precompile.Mix([builds[1], nolabel], batch_size=2)
    assert str(e.value).startswith(f"Mix: field 'label' is in {builds[1]} but not in {nolabel} (its fields: image)")
    with pytest.raises(FormatError, match=r"field 'label' is in .*other\.json but not in .*nolabel\.h5"):
        precompile.Mix([other, nolabel], batch_size=2)
    with pytest.raises(FormatError, match=r"^Mix: field 'label' is in .*other\.json but not in .*nolabel\.h5"):
        precompile.Mix([nolabel, other], batch_size=2)  # the extra field of a later build is named too
    m = precompile.Mix([builds[0], nolabel], batch_size=2, fields=["image"], device="cpu")   # leaving it out
    assert set(next(iter(m))) == {"image", "__source", "__row"}
    m.close()
    eel = _build(tmp_path, "eel", "hdf5", 1, 4, classes=("cat", "eel"))
    with pytest.raises(FormatError, match=r"field 'label' has class names \['cat', 'dog'\] in .*a\.h5 but "
                                          r"\['cat', 'eel'\] in .*eel\.h5: the same id would mean two classes"):
        precompile.Mix([builds[0], eel], batch_size=2)


@pytest.mark.parametrize("weights, message", [
    ([1, -1, 1], "Mix: weight 1 is -1.0; weights must be >= 0"),
    ([0, 0, 0], "Mix: the weights sum to 0 ([0.0, 0.0, 0.0]); give at least one source a weight > 0"),
    ([1, float("nan"), 1], "Mix: weight 1 is nan; weights must be finite numbers >= 0"),
    ([float("inf"), 1, 1], "Mix: weight 0 is inf; weights must be finite numbers >= 0"),
    ([1, 1], "Mix: 2 weights for 3 sources"),
    (["a", 1, 1], "Mix: weights must be a list of numbers, one per source, got ['a', 1, 1]"),
    # before: "123" was iterated as [1, 2, 3], "2" and True taken as the numbers 2 and 1
    ("123", "Mix: weights must be a list of numbers, one per source, got 123"),
    ([1, "2", 1], "Mix: weights must be a list of numbers, one per source, got [1, '2', 1]"),
    ([1, True, 1], "Mix: weights must be a list of numbers, one per source, got [1, True, 1]"),
])
def test_weights_are_checked(builds, weights, message):
    with pytest.raises(ValueError) as e:
        precompile.Mix(builds, batch_size=2, weights=weights)
    assert str(e.value) == message


@pytest.mark.parametrize("stop", ["longest", 0, -3, 2.5, True])
def test_stop_is_checked(builds, stop):
    with pytest.raises(ValueError, match=r"^Mix: stop must be 'first_exhausted', 'all_exhausted' or a number"):
        precompile.Mix(builds, batch_size=2, stop=stop)


def test_verify_names_the_damaged_build(builds, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(Path(builds[1]).parent, copy)
    png = next((copy / "b.shards").rglob("*.png"))
    raw = bytearray(png.read_bytes())
    raw[-20] ^= 0xFF
    png.write_bytes(raw)
    damaged = str(copy / "b.json")
    with pytest.raises(FormatError, match=r"b\.json: verify on open failed"):
        precompile.Mix([builds[0], damaged], batch_size=2, verify=True)
    opened = precompile.open(damaged)   # an opened build is checked too
    with pytest.raises(FormatError, match=r"b\.json: verify on open failed"):
        precompile.Mix([builds[0], opened], batch_size=2, verify=True)
    opened.close()


def test_variable_shape_fields_are_refused(builds, tmp_path):
    native = _build(tmp_path, "native", "hdf5", 1, 4, steps=[])
    with pytest.raises(FormatError, match=r"^Mix: field 'image' of .*native\.h5 has shape \(None, None, 3\) with "
                                          r"unknown dimensions; Mix reads fixed-shape fields"):
        precompile.Mix([native, builds[0]], batch_size=2)


def test_an_epoch_too_large_to_hold_is_refused(builds):
    # all_exhausted must show the 10-sample build whole at a share of 1e-8 / (2 + 1e-8): 2e9 + 10 samples
    with pytest.raises(ValueError, match=r"^Mix: stop='all_exhausted' with these weights makes an epoch of "
                                         r"2,000,000,010 samples \(more than 268,435,456"):
        precompile.Mix(builds, batch_size=2, weights=[1e-8, 1, 1], stop="all_exhausted")
    with pytest.raises(ValueError, match=r"^Mix: stop=300000000 with these weights makes an epoch of 300,000,000"):
        precompile.Mix(builds, batch_size=2, stop=300_000_000)


@pytest.mark.parametrize("name,value", [("seed", 1.5), ("batch_size", 2.5), ("prefetch", 1.5), ("num_threads", 0.5),
                                        ("seed", "3"), ("batch_size", True)])
def test_sizes_and_seeds_must_be_whole_numbers(builds, name, value):
    # int() truncated them without a word: seed=1.5 drew seed 1's order, batch_size=2.5 gave batches of 2
    kw = {"batch_size": 2, name: value}
    with pytest.raises(ValueError, match=rf"^{name} must be a whole number, got "):
        precompile.Mix(builds, **kw)
    ok = precompile.Mix(builds, batch_size=np.int64(2), seed=3.0, prefetch=2.0)   # whole numbers of other types
    assert (ok.batch_size, ok.seed, ok.prefetch) == (2, 3, 2)
    ok.close()


def test_ranks_come_from_an_initialised_process_group(builds, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mix = precompile.Mix(builds, batch_size=4, device="cpu")
        assert (mix.rank, mix.world_size) == (0, 1) and "rank=0/1 (from torch.distributed)" in repr(mix)
        mix.close()
        with pytest.raises(ValueError, match=r"rank=1, world_size=2 contradict the initialised torch.distributed"):
            precompile.Mix(builds, batch_size=4, device="cpu", rank=1, world_size=2)
    finally:
        dist.destroy_process_group()
    assert "torch.distributed" not in repr(precompile.Mix(builds, batch_size=4, device="cpu"))


def test_decimal_weights_mean_what_they_say():
    # 0.3 and 0.7 are not exact binary fractions: read as floats, 0.3's share comes out a hair over 3/10, and
    # 3 samples at that share would make an epoch of 9, not 10
    from precompile.reader.mix import check_weights, mix_counts

    assert mix_counts(check_weights([0.3, 0.7], [3, 100]), [3, 100], "first_exhausted") == [3, 7]
    assert mix_counts(check_weights([0.1, 0.2, 0.7], [1, 100, 100]), [1, 100, 100], "first_exhausted") == [1, 2, 7]
    assert mix_counts(check_weights([0.3, 0.7], [30, 7]), [30, 7], "all_exhausted") == [30, 70]
    assert mix_counts(check_weights(np.array([0.3, 0.7], dtype=np.float64), [3, 100]), [3, 100], 10) == [3, 7]


def test_cycling_sources_never_end_the_epoch(builds):
    # a (10) and b (6) end the epoch, c (4) cycles: at a third each, b runs out first at 18 samples, 6 per build
    mix = precompile.Mix(builds, batch_size=5, weights=[1, 1, 1], cycle=[False, False, True], seed=3, device="cpu")
    assert mix.counts == [6, 6, 6]
    seen_c = []
    for epoch in range(2):
        mix.set_epoch(epoch)
        pairs = _pairs(_pass(mix))
        assert np.bincount([s for s, _ in pairs], minlength=3).tolist() == [6, 6, 6]
        assert sorted(r for s, r in pairs if s == 1) == list(range(6))        # b whole, once
        assert len({r for s, r in pairs if s == 0}) == 6                        # a: no row twice
        seen_c += [r for s, r in pairs if s == 2]
    assert sorted(seen_c) == sorted(list(range(4)) * 3)   # 12 samples of c: three whole passes over its 4 rows
    mix.close()
    # without cycle the 4-sample build ends it at 12
    assert precompile.Mix(builds, batch_size=5, weights=[1, 1, 1], device="cpu").counts == [4, 4, 4]


@pytest.mark.parametrize("kw, message", [
    (dict(cycle=[True, True, True]), "Mix: every source with a weight > 0 has cycle=True, so none ends the "
                                     "epoch; let one run out (cycle=False) or give stop=<samples per epoch>"),
    (dict(cycle=[True, True, False], weights=[1, 1, 0]), "Mix: every source with a weight > 0 has cycle=True"),
    (dict(cycle=[True, False]), "Mix: cycle must be one True/False per source (3), got [True, False]"),
    (dict(cycle=[1, 0, 0]), "Mix: cycle must be one True/False per source (3), got [1, 0, 0]"),
    (dict(cycle=[True, False, False], stop=30), "Mix: cycle applies to stop='first_exhausted'"),
    (dict(cycle=[True, False, False], stop="all_exhausted"), "Mix: cycle applies to stop='first_exhausted'"),
])
def test_cycle_is_checked(builds, kw, message):
    with pytest.raises(ValueError) as e:
        precompile.Mix(builds, batch_size=2, **kw)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("weights, stop", [([1, 1, 1], "first_exhausted"),    # a: 4 of its 10 rows an epoch
                                           ([0.7, 0.3, 0], 10),               # a: 7 of 10, b: 3 of 6
                                           ([0.9, 0.1, 0], 10)])              # a: 9 of 10, b: 1 of 6
def test_a_source_read_in_part_shows_no_row_twice_in_an_epoch(builds, weights, stop):
    # the epochs run across the end of one pass over a build and into the next (a new permutation): the rows
    # the next pass gives such an epoch must not be ones the end of the last pass gave it
    for seed in range(12):
        mix = precompile.Mix(builds, batch_size=4, weights=weights, stop=stop, seed=seed, device="cpu")
        counts = {s: 0 for s in range(3)}
        per_row = {s: np.zeros(n, int) for s, n in enumerate([10, 6, 4])}
        epochs = 30
        for epoch in range(epochs):
            src = np.concatenate([s for s, _ in mix.batch_indices(epoch)])
            row = np.concatenate([r for _, r in mix.batch_indices(epoch)])
            for s in range(3):
                rows = row[src == s]
                assert len(set(rows.tolist())) == len(rows), (seed, epoch, s, sorted(rows.tolist()))
                np.add.at(per_row[s], rows, 1)
                counts[s] += len(rows)
        for s, n in enumerate([10, 6, 4]):   # over the epochs every row as often as the others (to one pass)
            assert per_row[s].max() - per_row[s].min() <= 1, (seed, s, per_row[s])
        mix.close()


def test_one_build_in_file_order_is_the_loaders_batches(builds):
    # the Loader over the same build, in file order, is a truth the Mix did not compute
    from precompile.reader.loader import Loader

    loader = Loader(builds[0], batch_size=3, shuffle=False, device="cpu", num_threads=0)
    want = [{k: v.numpy() for k, v in b.items()} for b in loader]
    mix = precompile.Mix(builds[:1], batch_size=3, shuffle=False, device="cpu")
    got = _pass(mix)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert np.array_equal(g["image"], w["image"]) and np.array_equal(g["label"], w["label"])
        assert g["__source"].tolist() == [0] * len(g["label"])
    assert np.concatenate([g["__row"] for g in got]).tolist() == list(range(10))
    loader.close()
    mix.close()


def test_dtype_mismatch_names_the_field_and_the_builds(tmp_path):
    root = make_image_tree(tmp_path / "data", per_class=1)
    paths = []
    for mode in ("gray8", "gray16"):
        r = image_recipe(root, name=mode, output={"format": "hdf5"})
        r["inputs"]["fields"]["image"]["mode"] = mode
        precompile.build(r, out_dir=tmp_path / "out")
        paths.append(str(tmp_path / "out" / f"{mode}.h5"))
    with pytest.raises(FormatError) as e:
        precompile.Mix(paths, batch_size=2)
    assert str(e.value) == (f"Mix: field 'image' has dtype uint8 in {paths[0]} but uint16 in {paths[1]}; "
                            f"the mixed builds must agree")


def test_sources_are_builds(builds):
    with pytest.raises(TypeError, match=r"^Mix: a source must be a build's index path or a build opened with "
                                        r"precompile.open, got int 3$"):
        precompile.Mix([builds[0], 3], batch_size=2)
    with pytest.raises(ValueError, match=r"^Mix: sources must be a list of builds"):
        precompile.Mix(builds[0], batch_size=2)
    opened = [precompile.open(p) for p in builds]   # opened builds work like paths, and stay open after close()
    mix = precompile.Mix(opened, batch_size=4, device="cpu")
    assert sum(len(b["label"]) for b in mix) == 20
    mix.close()
    assert opened[0][0]["image"].shape == opened[1][0]["image"].shape == (32, 32, 3)
    for d in opened:
        d.close()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_batches_equal_the_cpu_batches(builds):
    """device="cuda": the same batches, on the device (pinned host buffer, then a copy on the current stream)."""
    kw = dict(batch_size=5, weights=[0.5, 0.3, 0.2], stop=20, seed=3)
    cpu = precompile.Mix(builds, device="cpu", **kw)
    gpu = precompile.Mix(builds, device="cuda", **kw)
    want = _pass(cpu)
    got = []
    for b in gpu:
        assert all(v.device.type == "cuda" for k, v in b.items() if k in ("image", "label"))
        got.append({k: v.cpu().numpy().copy() for k, v in b.items()})
    assert _digest(got) == _digest(want)
    cpu.close()
    gpu.close()


# -- the Loader's conversion (dtype, mean/std, channels_first, convert_fields) -------------------------------
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


@pytest.mark.parametrize("conv", [
    dict(dtype="float32", mean=MEAN, std=STD),
    dict(dtype="float16", mean=MEAN, std=STD, channels_first=True),
    dict(dtype="bfloat16"),
    dict(mean=0.5, std=0.25),                       # mean/std without a dtype: float32
    dict(channels_first=True),                     # no dtype: NCHW views of the stored uint8
])
def test_one_build_converted_is_the_loaders_converted_batches(builds, conv):
    # the Loader's batches of the same rows (file order: the same rows in the same batches) are the truth
    from precompile.reader.loader import Loader

    loader = Loader(builds[0], batch_size=4, shuffle=False, device="cpu", num_threads=0, **conv)
    want = [{k: v.clone() for k, v in b.items()} for b in loader]
    mix = precompile.Mix(builds[:1], batch_size=4, shuffle=False, device="cpu", num_threads=2, **conv)
    got = list(mix)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        for f in ("image", "label"):
            assert g[f].dtype == w[f].dtype and g[f].shape == w[f].shape and g[f].stride() == w[f].stride(), f
            assert g[f].contiguous().view(torch.uint8).numpy().tobytes() == \
                w[f].contiguous().view(torch.uint8).numpy().tobytes(), f
    assert mix.dtype == loader.dtype and set(mix.convert) == set(loader.convert) == {"image"}
    loader.close()
    mix.close()


def test_mixed_converted_batches_are_the_stored_bytes_normalised(builds):
    # plain numpy on each sample's stored bytes (precompile.open) is the truth, for every format in the mix
    mix = precompile.Mix(builds, batch_size=5, weights=[0.5, 0.3, 0.2], stop=20, seed=3, device="cpu",
                         dtype="float32", mean=MEAN, std=STD, channels_first=True)
    opened = [precompile.open(p) for p in builds]
    n = 0
    for b in mix:
        assert b["image"].shape == (len(b["label"]), 3, 32, 32) and b["image"].dtype == torch.float32
        assert b["label"].dtype == torch.int64 and b["__source"].dtype == torch.int64   # only the images convert
        for j, (s, r) in enumerate(zip(b["__source"].tolist(), b["__row"].tolist())):
            x = opened[s][r]["image"].astype(np.float64) / 255
            want = ((x - np.array(MEAN)) / np.array(STD)).transpose(2, 0, 1)
            np.testing.assert_allclose(b["image"][j].numpy(), want, rtol=0, atol=1e-5)
            n += 1
    assert n == 20
    for d in opened:
        d.close()
    mix.close()


@pytest.mark.parametrize("conv", [
    dict(dtype="int8"),
    dict(dtype="float32", mean=[0.5, 0.5]),
    dict(dtype="float32", mean=[0.5] * 3, std=[0.2, 0.0, 0.2]),
    dict(mean="average", std=0.5),
    dict(dtype="float32", convert_fields=["depth"]),
    dict(dtype="float32", mean=[0.1, 0.2], std=[0.3, 0.4]),   # two values for three channels: at the first batch
])
def test_bad_conversion_options_are_the_loaders_errors(builds, conv):
    from precompile.reader.loader import Loader

    def error(make):
        try:
            reader = make()
            next(iter(reader))
        except (ValueError, TypeError) as e:
            return type(e), str(e)
        raise AssertionError(f"{conv}: no error")

    want = error(lambda: Loader(builds[0], batch_size=4, device="cpu", num_threads=0, **conv))
    assert error(lambda: precompile.Mix(builds, batch_size=4, device="cpu", num_threads=0, **conv)) == want


def test_stats_of_a_mix_are_the_stats_of_its_stream(tmp_path):
    # mean="stats" / std="stats": each build's stored stats, mixed as the epoch mixes the builds; with weights by
    # size (every sample once) that is plain numpy's mean and population std over all the builds' pixels
    paths = [_build(tmp_path, "s", "hdf5", 3, 11, stats=True), _build(tmp_path, "t", "png", 1, 12, stats=True)]
    pixels = np.concatenate([np.stack([d[i]["image"] for i in range(len(d))]).reshape(-1, 3)
                             for d in map(precompile.open, paths)]).astype(np.float64) / 255
    mix = precompile.Mix(paths, batch_size=8, device="cpu", dtype="float64", mean="stats", std="stats")
    assert mix.counts == [6, 2]
    conv = mix.convert["image"]
    np.testing.assert_allclose(conv.mean, pixels.mean(axis=0), rtol=1e-9, atol=0)
    np.testing.assert_allclose(conv.std, pixels.std(axis=0), rtol=1e-9, atol=0)
    got = torch.cat([b["image"] for b in mix]).numpy().reshape(-1, 3)   # the batches normalised with them
    np.testing.assert_allclose(got.mean(axis=0), 0, atol=1e-5)   # (the Loader's Convert computes in float32)
    np.testing.assert_allclose(got.std(axis=0), 1, atol=1e-5)
    mix.close()
    # a build without stats: the Loader's error, naming that build
    plain = _build(tmp_path, "u", "hdf5", 1, 13)
    with pytest.raises(PrecompileError, match=rf"^{plain}: has no stats; run `precompile stats"):
        precompile.Mix([paths[0], plain], batch_size=4, device="cpu", mean="stats", std="stats")


# -- gpu_steps: the Loader's device steps, drawn as the Loader draws them ------------------------------------
STEPS = [{"random_resized_crop": {"size": 24, "scale": [0.3, 1.0]}}, {"random_flip": {"horizontal": 0.5}},
         {"color_jitter": {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "hue": 0.1}},
         {"random_erasing": {"p": 0.5, "value": [124, 116, 104]}}]
MIXED = dict(batch_size=5, weights=[0.5, 0.3, 0.2], stop=20, seed=3, device="cpu")


def test_gpu_steps_are_the_device_steps_run_by_hand_on_the_raw_batch(builds):
    # the same steps, parsed and bound apart, drawn with gpu.step_params for (seed, epoch, rank, batch) and run
    # with gpu.run_steps on the Mix's raw batch, then the Loader's Convert: the Mix's augmented batch, byte for byte
    from precompile.reader import augment, gpu

    aug = precompile.Mix(builds, gpu_steps=STEPS, dtype="float32", mean=MEAN, std=STD, num_threads=2, **MIXED)
    raw = precompile.Mix(builds, num_threads=0, **MIXED)
    by_hand = augment.parse_steps(STEPS)
    gpu.bind_steps(by_hand, raw.specs, raw.shapes)
    conv = gpu.Convert(torch.float32, MEAN, STD, scale=1 / 255)
    for m in (aug, raw):
        m.set_epoch(2)
    moved = 0
    for b, (g, r) in enumerate(zip(aug, raw)):
        n = len(r["label"])
        assert g["__source"].tolist() == r["__source"].tolist() and g["__row"].tolist() == r["__row"].tolist()
        params = gpu.step_params(by_hand, 3, 2, 0, b, n)
        want = conv(gpu.run_steps({"image": r["image"].clone()}, by_hand, params)["image"])
        assert g["image"].shape == (n, 24, 24, 3)
        assert g["image"].numpy().tobytes() == want.numpy().tobytes(), b
        assert torch.equal(g["label"], r["label"])
        moved += int(params[1]["horizontal"].sum())
    assert b == 3 and moved > 0        # four batches, and some samples were flipped
    aug.close()
    raw.close()


def test_a_certain_flip_mirrors_each_stored_sample(builds):
    # numpy's mirror of each sample's stored bytes (precompile.open) is the truth
    mix = precompile.Mix(builds, gpu_steps=[{"random_flip": {"horizontal": 1.0}}], **MIXED)
    opened = [precompile.open(p) for p in builds]
    n = 0
    for b in mix:
        for j, (s, r) in enumerate(zip(b["__source"].tolist(), b["__row"].tolist())):
            assert np.array_equal(b["image"][j].numpy(), opened[s][r]["image"][:, ::-1]), (s, r)
            n += 1
    assert n == 20
    for d in opened:
        d.close()
    mix.close()


def test_gpu_steps_do_not_depend_on_threads_and_resume_mid_epoch(builds):
    def make(threads):
        m = precompile.Mix(builds, gpu_steps=STEPS, num_threads=threads, prefetch=3, **MIXED)
        m.set_epoch(1)
        return m

    first = make(0)
    whole = _pass(first)
    assert _digest(_pass(make(3))) == _digest(whole)
    cut = make(2)
    it = iter(cut)
    head = [{k: v.numpy().copy() for k, v in next(it).items()} for _ in range(2)]
    state = cut.state_dict()
    assert state["epoch"] == 1 and state["batch"] == 2
    again = make(1)
    again.load_state_dict(state)
    again.set_epoch(1)
    assert _digest(head + _pass(again)) == _digest(whole)
    # another epoch draws other parameters (the rows too: compare the augmented images' bytes only)
    other = make(0)
    other.set_epoch(4)
    assert _digest([{"image": b["image"]} for b in _pass(other)]) != _digest([{"image": b["image"]} for b in whole])


def test_bad_gpu_steps_are_the_loaders_errors(builds):
    from precompile.reader.loader import Loader

    for steps in ([{"random_flop": {}}], [{"random_crop": {"size": 64, "pad": "sometimes"}}],
                  [{"random_flip": {"fields": ["label"]}}]):
        with pytest.raises(ValueError) as want:
            Loader(builds[0], batch_size=4, device="cpu", gpu_steps=steps)
        with pytest.raises(ValueError) as got:
            precompile.Mix(builds, batch_size=4, device="cpu", gpu_steps=steps)
        assert str(got.value) == str(want.value)


@pytest.fixture(scope="module")
def coco_builds(tmp_path_factory) -> list[str]:
    """recipes/coco.yaml (8 images: image 96x128, semantic mask, boxes, box_labels) built as HDF5, as it is, and
    as a PNG folder build mirrored (a random_flip that always flips), so the two builds hold other pixels and
    boxes, in both kinds of storage."""
    import yaml

    repo = Path(__file__).resolve().parent.parent
    tmp = tmp_path_factory.mktemp("mix_coco")
    out = []
    for name, mirror in (("coco_a", False), ("coco_b", True)):
        r = yaml.safe_load((repo / "recipes" / "coco.yaml").read_text())
        r["name"] = name
        r["inputs"]["root"] = str(repo / "sample_data" / "coco" / "images")
        r["inputs"]["coco"]["file"] = str(repo / "sample_data" / "coco" / "annotations" / "instances.json")
        if mirror:
            r["steps"].append({"random_flip": {"horizontal": 1.0}})
            r["output"]["format"] = "png"
        precompile.build(r, out_dir=tmp / "out")
        out.append(str(tmp / "out" / f"{name}.{'json' if mirror else 'h5'}"))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.numpy(), b.numpy(), equal_nan=True)


def test_annotations_move_with_the_device_steps_as_run_by_hand(coco_builds):
    from precompile.reader import augment, gpu

    steps = [{"random_resized_crop": {"size": [48, 64], "scale": [0.3, 1.0], "min_visibility": 0.3}},
             {"random_flip": {"horizontal": 0.5}}, {"random_crop": {"size": [40, 56], "padding": 4}}]
    kw = dict(batch_size=4, weights=[1, 1], stop=12, seed=5, device="cpu",
              fields=["image", "mask", "boxes", "box_labels"])
    aug = precompile.Mix(coco_builds, gpu_steps=steps, num_threads=2, **kw)
    raw = precompile.Mix(coco_builds, num_threads=0, **kw)
    by_hand = augment.parse_steps(steps)
    gpu.bind_steps(by_hand, raw.specs, {**raw.shapes, **{f: tuple(raw.specs[f]["shape"]) for f in raw.ragged}})
    dropped = 0
    for b, (g, r) in enumerate(zip(aug, raw)):
        assert set(g) == set(r) == {"image", "mask", "boxes", "boxes__count", "box_labels", "box_labels__count",
                                    "__source", "__row"}
        params = gpu.step_params(by_hand, 5, 0, 0, b, len(r["__row"]))
        want = gpu.run_steps({k: v.clone() for k, v in r.items()}, by_hand, params)
        for k in g:
            assert _same(g[k], want[k]), (b, k)
        assert g["image"].shape[1:] == (40, 56, 3) and g["mask"].shape[1:] == (40, 56, 1)
        dropped += int((r["boxes__count"] - g["boxes__count"]).sum())
        assert torch.equal(g["boxes__count"], g["box_labels__count"])    # a dropped box took its label along
    assert b == 2 and dropped > 0
    aug.close()
    raw.close()


def test_a_certain_flip_mirrors_boxes_and_masks_of_each_stored_sample(coco_builds):
    # numpy on each sample's stored arrays (precompile.open) is the truth: x -> W - x, the mask mirrored
    mix = precompile.Mix(coco_builds, batch_size=4, weights=[1, 1], stop=12, seed=2, device="cpu",
                         gpu_steps=[{"random_flip": {"horizontal": 1.0}}])
    opened = [precompile.open(p) for p in coco_builds]
    n = boxes = 0
    for b in mix:
        for j, (s, r) in enumerate(zip(b["__source"].tolist(), b["__row"].tolist())):
            want = opened[s][r]
            k = int(b["boxes__count"][j])
            assert k == len(want["boxes"]) and b["box_labels"][j, :k].tolist() == want["box_labels"].tolist()
            x1, y1, x2, y2 = want["boxes"].T
            np.testing.assert_array_equal(b["boxes"][j, :k].numpy(), np.stack([128 - x2, y1, 128 - x1, y2], 1))
            assert torch.isnan(b["boxes"][j, k:]).all()
            assert np.array_equal(b["mask"][j].numpy(), want["mask"][:, ::-1])
            assert np.array_equal(b["image"][j].numpy(), want["image"][:, ::-1])
            n, boxes = n + 1, boxes + k
    assert n == 12 and boxes > 0
    for d in opened:
        d.close()
    mix.close()


def test_batch_maps_lead_back_to_the_stored_pixels(builds):
    # a random crop without padding: each sample's map takes the batch's pixel (0, 0) to the window's corner in the
    # stored sample, and the stored bytes there (precompile.open) are the batch's
    mix = precompile.Mix(builds, gpu_steps=[{"random_crop": {"size": 20}}, {"random_flip": {"horizontal": 0.5}}],
                         **MIXED)
    mix.set_epoch(1)
    opened = [precompile.open(p) for p in builds]
    corners = set()
    for b, batch in enumerate(mix):
        src, row, maps = mix.batch_maps(b, epoch=1)
        assert src.tolist() == batch["__source"].tolist() and row.tolist() == batch["__row"].tolist()
        for j, (s, r) in enumerate(zip(src.tolist(), row.tolist())):
            m = maps[j]
            x0, y0 = m @ [0.5, 0.5, 1]          # the first pixel's centre, in the stored sample's pixels
            flipped = m[0, 0] < 0
            left, top = int(round(x0 - 0.5)) - (19 if flipped else 0), int(round(y0 - 0.5))
            window = opened[s][r]["image"][top:top + 20, left:left + 20]
            assert np.array_equal(batch["image"][j].numpy(), window[:, ::-1] if flipped else window), (b, j)
            corners.add((top, left, flipped))
    assert len(corners) > 3
    with pytest.raises(IndexError, match=r"^batch 4 out of range: epoch 1 has 4 batches on this rank$"):
        mix.batch_maps(4, epoch=1)
    for d in opened:
        d.close()
    mix.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_steps_and_conversion_equal_the_cpu_ones(builds, coco_builds):
    """device="cuda": the steps and the conversion run on the device after the copy; flips, crops and masks give
    the CPU's bytes, the float conversion the CPU's values; boxes move on the host and come on the device."""
    steps = [{"random_flip": {"horizontal": 0.5}}, {"random_crop": {"size": [40, 56], "padding": 4}}]
    for srcs, kw in ((coco_builds, dict(fields=["image", "mask", "boxes", "box_labels"])),
                     (builds, dict(dtype="float32", mean=MEAN, std=STD, channels_first=True))):
        both = [precompile.Mix(srcs, batch_size=4, stop=12, seed=5, device=d, gpu_steps=steps[:1] if srcs is builds
                               else steps, **kw) for d in ("cpu", "cuda")]
        for c, g in zip(*both):
            assert set(c) == set(g)
            for k in c:
                assert g[k].device.type == "cuda", k
                if c[k].is_floating_point() and k == "image":
                    torch.testing.assert_close(g[k].cpu(), c[k], rtol=0, atol=1e-6)
                else:
                    assert _same(g[k].cpu().contiguous(), c[k].contiguous()), k
        for m in both:
            m.close()


# -- Loader([a, b], weights=[...]): a Mix ----------------------------------------------------------------------
def test_a_loader_of_a_list_of_builds_is_a_mix(builds):
    from precompile.reader.loader import Loader
    from precompile.reader.mix import Mix

    kw = dict(weights=[0.5, 0.3, 0.2], stop=20, seed=3, device="cpu", dtype="float16", mean=MEAN, std=STD,
              gpu_steps=[{"random_flip": {"horizontal": 0.5}}])
    got = Loader(builds, batch_size=5, **kw)
    assert type(got) is Mix and got.weights == precompile.Mix(builds, batch_size=5, **kw).weights
    want = precompile.Mix(builds, batch_size=5, **kw)
    assert _digest(_pass(got)) == _digest(_pass(want))
    # positional arguments keep the Loader's meaning: (builds, batch_size, shuffle, seed, device)
    pos = Loader(tuple(builds), 5, True, 3, "cpu", weights=[0.5, 0.3, 0.2], stop=20)
    assert (type(pos), pos.batch_size, pos.shuffle, pos.seed, pos.device.type) == (Mix, 5, True, 3, "cpu")
    assert Loader(builds, 5, "full", device="cpu").shuffle is True and Loader(builds, 5, False).shuffle is False
    for m in (got, want, pos):
        m.close()
    one = Loader(builds[0], batch_size=5, device="cpu")     # one build: the Loader, as ever
    assert type(one) is Loader
    one.close()


@pytest.mark.parametrize("kw, message", [
    (dict(block_window=4), "Loader([...]): a list of builds is read as one precompile.Mix, which has no block_window "
                           "(an option of the Loader of one build); leave it out, or make one Loader per build"),
    (dict(shuffle="block"), "Loader([...]): a list of builds is read as one precompile.Mix, which shuffles "
                            "fully (shuffle=True or 'full') or not at all (False), got shuffle='block'"),
    (dict(targets="list"), "Loader([...]): a list of builds is read as one precompile.Mix, which has no targets "
                           "(an option of the Loader of one build); leave it out, or make one Loader per build"),
])
def test_a_loader_of_a_list_refuses_what_a_mix_has_not(builds, kw, message):
    from precompile.reader.loader import Loader

    with pytest.raises(ValueError) as e:
        Loader(builds, batch_size=4, device="cpu", **kw)
    assert str(e.value) == message


# -- in_memory=True --------------------------------------------------------------------------------------------
def test_in_memory_reads_each_build_once_and_gives_the_same_batches(builds, tmp_path):
    import shutil

    png = _build(tmp_path, "m", "png", 3, 21)
    srcs = [builds[0], png]
    kw = dict(batch_size=4, weights=[0.6, 0.4], stop=16, seed=9, device="cpu", dtype="float32", mean=MEAN,
              std=STD, gpu_steps=[{"random_flip": {"horizontal": 0.5}}])
    want = _digest(_pass(precompile.Mix(srcs, **kw)))
    mapped = precompile.Mix(srcs, **kw)
    held = precompile.Mix(srcs, in_memory=True, **kw)
    assert held.sources[0].reader.in_memory     # the HDF5 build: the Loader's DirectReader(in_memory=True)
    for shard in Path(png).parent.glob("m.shards/shard-*"):   # the PNG build's files are gone
        shutil.rmtree(shard)
    assert _digest(_pass(held)) == want            # ... and the Mix that holds them in memory does not notice
    with pytest.raises(FormatError):
        _pass(mapped)
    held.close()
    mapped.close()


@pytest.mark.parametrize("value, message", [
    ("gpu", "Mix: in_memory='gpu' is the Loader's for one build (its rows gathered on the device); a Mix holds its "
            "builds in host memory: in_memory=True"),
    ("pinned", "Mix: in_memory='pinned' is the Loader's for one build (its rows gathered on the device); a Mix "
               "holds its builds in host memory: in_memory=True"),
    (1, "in_memory must be False or True, got 1"),
    ("yes", "in_memory must be False or True, got 'yes'"),
])
def test_in_memory_is_checked(builds, value, message):
    with pytest.raises(ValueError) as e:
        precompile.Mix(builds, batch_size=4, device="cpu", in_memory=value)
    assert str(e.value) == message


def test_box_labels_of_other_class_names_are_refused(coco_builds, tmp_path):
    # the COCO file with one category renamed: box label 1 would be 'person' in one build, 'rider' in the other
    import json

    import yaml

    repo = Path(__file__).resolve().parent.parent
    ann = json.loads((repo / "sample_data" / "coco" / "annotations" / "instances.json").read_text())
    for c in ann["categories"]:
        if c["name"] == "person":
            c["name"] = "rider"
    (tmp_path / "instances.json").write_text(json.dumps(ann))
    r = yaml.safe_load((repo / "recipes" / "coco.yaml").read_text())
    r["name"] = "riders"
    r["inputs"]["root"] = str(repo / "sample_data" / "coco" / "images")
    r["inputs"]["coco"]["file"] = str(tmp_path / "instances.json")
    precompile.build(r, out_dir=tmp_path / "out")
    other = str(tmp_path / "out" / "riders.h5")
    a, b = precompile.open(coco_builds[0]), precompile.open(other)
    names = a.label_names
    assert "person" in names and names != b.label_names
    a.close()
    b.close()
    with pytest.raises(FormatError) as e:
        precompile.Mix([coco_builds[0], other], batch_size=2, fields=["image", "boxes", "box_labels"])
    assert str(e.value).startswith(f"Mix: field 'box_labels' has class names {names} in {coco_builds[0]} but ")
    assert str(e.value).endswith(f"in {other}: the same id would mean two classes")
    mix = precompile.Mix([coco_builds[0], other], batch_size=2, fields=["image", "boxes"])   # without the labels
    mix.close()


# -- batches that are kept: no buffer reused under them, no conversion twice ----------------------------------
def _normalised(x: np.ndarray, conv: dict) -> np.ndarray:
    """The Loader's float32 conversion done with numpy (x * (1/255/std) + (-mean/std), each op rounded to
    float32 as torch's mul_/add_ round it): the exact bytes a conversion done once gives."""
    if "dtype" not in conv:
        return x
    a = (1 / 255 / np.asarray(STD, np.float64)).astype(np.float32)
    b = (-np.asarray(MEAN, np.float64) / np.asarray(STD, np.float64)).astype(np.float32)
    return x.astype(np.float32) * a + b


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("conv", [{}, dict(dtype="float32", mean=MEAN, std=STD)])
def test_batches_kept_across_epochs_stay_their_samples(builds, conv, threads):
    # every batch of two epochs held in a list while the Mix goes on (small batches: many in one read task, and
    # host buffers reused once let go), then each compared with its samples' stored bytes (precompile.open),
    # converted by numpy; a buffer overwritten under a kept batch, or a conversion run twice, would differ
    kw = dict(batch_size=3, weights=[0.5, 0.3, 0.2], stop=20, seed=4, device="cpu", num_threads=threads,
              prefetch=3, **conv)
    mix = precompile.Mix(builds, **kw)
    kept = []
    for epoch in range(2):
        mix.set_epoch(epoch)
        kept += list(mix)
    fresh = precompile.Mix(builds, **kw)
    again = []
    for epoch in range(2):
        fresh.set_epoch(epoch)
        again += _pass(fresh)
    opened = [precompile.open(p) for p in builds]
    assert len(kept) == len(again) == 14
    for b, f in zip(kept, again):
        for k in b:
            assert np.array_equal(b[k].numpy(), f[k]), k
        for j, (s, r) in enumerate(zip(b["__source"].tolist(), b["__row"].tolist())):
            want = _normalised(opened[s][r]["image"], conv)
            assert b["image"].numpy().dtype == want.dtype
            assert np.array_equal(b["image"][j].numpy(), want), (s, r)
            assert int(b["label"][j]) == int(opened[s][r]["label"])
    for d in opened:
        d.close()
    mix.close()
    fresh.close()


def test_kept_batches_of_annotations_are_padded_per_batch(coco_builds):
    # boxes held across a whole epoch: each batch padded to its own largest count (as the Loader pads), NaN past
    # each sample's rows, the rows those of the stored sample (precompile.open)
    mix = precompile.Mix(coco_builds, batch_size=2, weights=[1, 1], stop=12, seed=6, device="cpu", num_threads=1,
                         fields=["image", "boxes", "box_labels"])
    kept = list(mix)
    opened = [precompile.open(p) for p in coco_builds]
    widths = set()
    for b in kept:
        counts = b["boxes__count"].tolist()
        assert b["boxes"].shape[1] == b["box_labels"].shape[1] == max(1, max(counts))
        widths.add(b["boxes"].shape[1])
        for j, (s, r) in enumerate(zip(b["__source"].tolist(), b["__row"].tolist())):
            want = opened[s][r]
            k = counts[j]
            assert k == len(want["boxes"])
            assert np.array_equal(b["boxes"][j, :k].numpy(), want["boxes"])
            assert b["box_labels"][j, :k].tolist() == want["box_labels"].tolist()
            assert torch.isnan(b["boxes"][j, k:]).all()
            assert np.array_equal(b["image"][j].numpy(), want["image"])
    assert len(kept) == 6 and len(widths) > 1   # batches of other widths in the same epoch
    for d in opened:
        d.close()
    mix.close()


def test_a_mix_converts_once_per_read_task_into_reused_buffers_as_the_loader(builds):
    # small batches: the Loader reads and converts several in one task (feed.group_size), into host buffers it
    # reuses once the batches are let go; a Mix of the same build the same (calls of its Convert counted)
    from precompile.reader.loader import Loader

    kw = dict(batch_size=2, shuffle=False, device="cpu", num_threads=1, dtype="float32", mean=MEAN, std=STD)
    loader = Loader(builds[0], **kw)
    mix = precompile.Mix(builds[:1], **kw)
    calls = {}

    class Counted:
        def __init__(self, conv, name):
            self.conv, self.name, self.dtype = conv, name, conv.dtype

        def __call__(self, x, out=None):
            calls[self.name] += 1
            return self.conv(x, out=out)

    for name, r in (("loader", loader), ("mix", mix)):
        calls[name] = 0
        r.finisher.convert = {"image": Counted(r.convert["image"], name)}
        for epoch in range(3):
            r.set_epoch(epoch)
            n = sum(len(b["label"]) for b in r)   # every batch let go once counted
            assert n == 10
    assert calls == {"loader": 3, "mix": 3}      # 5 batches of 2, one task, each epoch
    held = mix.finisher.pool.held((10, 32, 32, 3), np.float32)
    assert 1 <= len(held) <= 2                    # three epochs, the same buffer(s) again
    loader.close()
    mix.close()


def test_a_task_reads_each_run_of_one_sources_rows_in_one_call(builds, monkeypatch):
    # one build: a read task of 5 shuffled batches (sorted) is one call of its reader, as the Loader gathers a task;
    # two builds: short runs (small batches) one call per build a task, then put in their places; long runs one
    # call per run; the stored bytes either way (precompile.open)
    from precompile.reader import mix as mixmod

    def counting(m, calls):
        for i, s in enumerate(m.sources):
            def counted(rows, out, read=s.read_into, i=i):
                calls.append((i, len(rows)))
                return read(rows, out)
            s.read_into = counted
        return m

    def check(batches, srcs):
        opened = [precompile.open(p) for p in srcs]
        for b in batches:
            for j, (s, r) in enumerate(zip(b["__source"].tolist(), b["__row"].tolist())):
                assert np.array_equal(b["image"][j], opened[s][r]["image"]) and b["label"][j] == opened[s][r]["label"]
        for d in opened:
            d.close()

    kw = dict(batch_size=2, seed=1, device="cpu", num_threads=0)
    calls = []
    one = _pass(counting(precompile.Mix(builds[:1], **kw), calls))
    assert len(one) == 5 and calls == [(0, 10)]
    check(one, builds[:1])
    calls = []
    short = _pass(counting(precompile.Mix(builds[:2], **kw), calls))
    assert len(short) == 8 and sorted(calls) == [(0, 10), (1, 6)]   # 3 KiB rows: runs far under RUN_BYTES
    check(short, builds[:2])
    monkeypatch.setattr(mixmod, "RUN_BYTES", 1)
    calls = []
    long = _pass(counting(precompile.Mix(builds[:2], **kw), calls))
    assert sum(n for _, n in calls) == 16 and 8 < len(calls) <= 16   # a call per run, at most two a batch
    assert _digest(long) == _digest(short)
