"""Follow-ups on the reader left by outside reviews (tests/test_resume_outside.py and friends show their harnesses).

Truths the reader does not compute: a Mix's passes against the sequential rule it had (every pass made from
pass 0, copied here as it was), counted calls to the seeded permutation, the documented index rules of
``precompile.open`` against ``ds.keys``."""
from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the Loader and Mix need it)")

import precompile  # noqa: E402
from precompile.reader.mix import Mix  # noqa: E402
from precompile.seeding import rng_for  # noqa: E402

from conftest import image_recipe, make_image_tree  # noqa: E402

SMALL = [{"resize": {"size": [8, 8]}}]


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, str]:
    """``a``: 9 HDF5 samples of 8x8 (shards of 4); ``b``: 4 HDF5 samples; ``c``: 6 PNG folder samples; 3 classes."""
    tmp = tmp_path_factory.mktemp("followups")
    out = tmp / "out"
    got = {}
    for name, per_class, drop, fmt in (("a", 3, 0, "hdf5"), ("b", 2, 2, "hdf5"), ("c", 2, 0, "png")):
        root = make_image_tree(tmp / name, classes=("x", "y", "z"), per_class=per_class, size=(12, 10),
                               seed=len(got))
        for cls in ("x", "y", "z")[:drop]:   # one file of each of the first classes: every class stays
            sorted((root / cls).iterdir())[0].unlink()
        precompile.build(image_recipe(root, name=name, steps=SMALL,
                                      output={"format": fmt, "samples_per_shard": 4}), out_dir=out)
        got[name] = str(out / (f"{name}.h5" if fmt == "hdf5" else f"{name}.json"))
    return got


# -- 1. a far epoch of a Mix -----------------------------------------------------------------------------------

def _sequential_passes(seed: int, i: int, n: int, c: int, upto: int) -> list[np.ndarray]:
    """Mix._pass as it was before (every pass made in order from pass 0): the truth the new one must equal."""
    out, prev = [], None
    for q in range(upto + 1):
        perm = rng_for(seed, "mix/source", i, q).permutation(n)
        r = (q * n) % c
        if q > 0 and r:
            w = c - r
            tail = prev[n - r:]
            clash = np.isin(perm, tail)
            free = np.flatnonzero(~clash)[:w]
            rest = np.ones(n, dtype=bool)
            rest[free] = False
            perm = np.concatenate([perm[free], perm[rest]])
        prev = perm
        out.append(perm)
    return out


def _bare_mix(seed: int, sizes: list[int], counts: list[int]) -> Mix:
    m = object.__new__(Mix)   # only what the order needs: sizes, counts, seed and the pass cache
    m.seed, m.sizes, m.counts, m._pass_cache = seed, list(sizes), list(counts), {}
    return m


@pytest.mark.parametrize("seed", [0, 7])
def test_a_mix_pass_reached_directly_is_the_pass_made_in_order(seed):
    """Each pass of every (size n, samples per epoch c <= n) reached directly (a far pass first, then back, then
    on) equals the pass the sequential rule makes from pass 0, byte for byte."""
    upto = 30
    for n in range(1, 12):
        for c in range(1, n + 1):
            want = _sequential_passes(seed, 0, n, c, upto)
            rng = np.random.default_rng(n * 100 + c)
            mix = _bare_mix(seed, [n], [c])
            for k in [upto, *rng.integers(0, upto + 1, 12).tolist(), 3, 4, 5, 0, 1]:
                got = mix._pass(0, int(k))
                assert np.array_equal(got, want[k]), (n, c, k)
            fresh = _bare_mix(seed, [n], [c])
            assert [fresh._pass(0, k).tolist() for k in range(upto + 1)] == [w.tolist() for w in want], (n, c)


def test_a_far_epoch_of_a_mix_costs_a_bounded_number_of_passes(builds, monkeypatch):
    """Before: set_epoch(e) (or a restored state of epoch e) made every pass of each build from pass 0 (10^5
    epochs of tiny builds: seconds; 10^9: hours). Now the passes are made from the last one that follows from
    the seeded permutations alone: at most ceil(c / (n - c)) + 2 seeded permutations a build (c: its samples per
    epoch, n its rows), and the batches are those a Mix walked there epoch by epoch gives."""
    paths = [builds["a"], builds["b"], builds["c"]]
    calls = []
    real = Mix._raw_pass
    monkeypatch.setattr(Mix, "_raw_pass", lambda self, i, k: calls.append((i, k)) or real(self, i, k))
    mix = Mix(paths, batch_size=4, weights=[0.5, 0.25, 0.25], seed=3, device="cpu", num_threads=0)
    n, c = mix.sizes, mix.counts
    assert c == [8, 4, 4] and n == [9, 4, 6]   # build a: c = n - 1 (a chain of up to 8 passes); b: c = n; c: n < 2c
    far = 10 ** 4
    mix.set_epoch(far)
    got = [{k: v.numpy().copy() for k, v in b.items()} for b in mix]
    for i in range(3):
        made = sum(1 for s, _ in calls if s == i)
        bound = (0 if c[i] == n[i] else -(-c[i] // (n[i] - c[i]))) + 2
        assert made <= bound, (i, made, bound)
    # the same epoch's batches from a Mix that went there from a state of the epoch before (its passes kept)
    calls.clear()
    again = Mix(paths, batch_size=4, weights=[0.5, 0.25, 0.25], seed=3, device="cpu", num_threads=0)
    again.load_state_dict({**again.state_dict(), "epoch": far - 1, "batch": len(again.batch_indices(far - 1))})
    again.set_epoch(far - 1)
    assert list(again) == []
    assert again.epoch == far
    walked = [{k: v.numpy().copy() for k, v in b.items()} for b in again]
    assert len(walked) == len(got)
    for x, y in zip(walked, got):
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
    # and the source rows of that epoch against the sequential rule
    src, row = mix.epoch_order(far)
    for i in (0, 2):
        passes = _sequential_passes(3, i, n[i], c[i], (far + 1) * c[i] // n[i] + 1)
        stream = np.concatenate(passes)[far * c[i]:(far + 1) * c[i]]
        assert row[src == i].tolist() == stream.tolist()


# -- 2. load_state_dict / set_epoch while a pass is being consumed -----------------------------------------------

def _host(b: dict) -> dict:
    return {k: v.numpy().copy() for k, v in b.items()}


def _same(xs: list[dict], ys: list[dict]) -> bool:
    return len(xs) == len(ys) and all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
                                      for x, y in zip(xs, ys))


def _reader(kind: str, builds: dict):
    if kind == "Loader":
        return precompile.Loader(builds["a"], batch_size=2, shuffle=True, seed=5, device="cpu", num_threads=1)
    return Mix([builds["a"], builds["c"]], batch_size=2, seed=5, device="cpu", num_threads=1)


@pytest.mark.parametrize("kind", ["Loader", "Mix"])
def test_restoring_a_state_mid_pass_ends_the_running_pass(builds, kind):
    """Before: load_state_dict while a pass was being consumed did not stop it: its next batches were handed out
    and written over the restored position (state_dict said epoch 1, batch 0 at the pass's end). Now the running
    pass ends there (its iterator stops), and the next pass yields exactly the restored position's batches."""
    ref = _reader(kind, builds)
    whole = [_host(b) for b in ref]
    r = _reader(kind, builds)
    it = iter(r)
    got = [_host(next(it)), _host(next(it))]
    state = r.state_dict()
    assert (state["epoch"], state["batch"]) == (0, 2)
    got.append(_host(next(it)))
    r.load_state_dict(state)            # back to batch 2, while the pass is at batch 3
    assert list(it) == []               # the running pass ended
    assert (r.state_dict()["epoch"], r.state_dict()["batch"]) == (0, 2)
    rest = [_host(b) for b in r]
    assert _same(got[:2] + rest, whole)
    assert (r.epoch, r._pos) == (1, 0)


@pytest.mark.parametrize("kind", ["Loader", "Mix"])
def test_set_epoch_mid_pass_ends_the_running_pass(builds, kind):
    """Before: set_epoch(e) mid-pass let the old pass go on, its positions counted as epoch e's, and its end
    moved the reader to the old epoch + 1. Now the running pass ends; the next pass is epoch e from its start."""
    ref = _reader(kind, builds)
    ref.set_epoch(4)
    want = [_host(b) for b in ref]
    r = _reader(kind, builds)
    it = iter(r)
    next(it)
    r.set_epoch(4)
    assert list(it) == []
    assert (r.epoch, r._pos) == (4, 0)
    assert _same([_host(b) for b in r], want)


@pytest.mark.parametrize("kind", ["Loader", "Mix"])
def test_an_iterator_not_started_keeps_reading_the_restored_position(builds, kind):
    """Lightning's order (iter, then load_state_dict / set_epoch, then next) is not a running pass: the iterator
    made before reads the restored position at its first next."""
    ref = _reader(kind, builds)
    whole = [_host(b) for b in ref]
    r = _reader(kind, builds)
    state = {**r.state_dict(), "batch": 3}
    it = iter(r)
    r.load_state_dict(state)
    r.set_epoch(0)
    assert _same([_host(b) for b in it], whole[3:])


# -- 5. bounded echoes of caller input; one rule for a boolean index -----------------------------------------------

LONG = "f" * 20000


def _bounded(message: str, limit: int = 1200) -> str:
    assert len(message) < limit, f"{len(message)} characters: {message[:300]}"
    assert re.search(r"\(2000\d characters\)", message), message[:300]   # said how long it was (errors.echo)
    return message


def test_an_unknown_field_asked_of_a_build_is_a_bounded_key_error_naming_the_build(builds):
    """Before: ds.variable(unknown) raised Python's own KeyError (the bare name, whole: 20,000 characters)."""
    ds = precompile.open(builds["a"])
    with pytest.raises(KeyError) as e:
        ds.variable(LONG)
    msg = _bounded(str(e.value))
    assert "no field 'ffff" in msg and builds["a"] in msg and "image" in msg
    with pytest.raises(KeyError, match=r"no field 'image2' in .*a\.h5 \(fields: image, label\)"):
        ds.variable("image2")
    assert ds.variable("image") is False


@pytest.mark.parametrize("option", ["fields", "copies", "in_memory", "map_shards", "uneven", "convert_fields",
                                    "convert_fields+dtype", "mean"])
def test_a_loader_option_echoes_a_long_value_bounded(builds, option):
    """Before: the Loader's checks quoted the caller's value whole (direct.py's unknown field, copies, in_memory,
    map_shards, uneven, convert_fields, mean/std)."""
    value = [LONG] if option.startswith(("fields", "convert_fields")) else LONG
    extra = {"dtype": "float32"} if option.endswith("+dtype") else {}
    with pytest.raises((KeyError, ValueError)) as e:
        precompile.Loader(builds["a"], batch_size=2, device="cpu", **{option.split("+")[0]: value}, **extra)
    _bounded(str(e.value))


def test_detection_targets_echo_a_long_field_name_bounded():
    from precompile.reader.targets import detection_targets

    batch = {"boxes": torch.zeros(1, 0, 4), "boxes__count": torch.zeros(1, dtype=torch.int64)}
    for kw in ({"boxes": LONG}, {"masks": LONG}):
        with pytest.raises(KeyError) as e:
            detection_targets(batch, **kw)
        _bounded(str(e.value))


@pytest.mark.parametrize("index", [True, False, np.True_, np.False_, "torch-true", "torch-false", "torch-[true]"],
                         ids=lambda x: str(x))
def test_a_boolean_is_not_a_sample_index_whatever_its_type(builds, index):
    """Before: ds[np.True_] was a TypeError while ds[True] and ds[torch.tensor(True)] read row 1 (and
    ds[torch.tensor(False)] row 0). A boolean is no row (a mask has one value per sample, ds.batch takes one):
    every boolean scalar, Python's, numpy's or a tensor's, is the same TypeError."""
    if isinstance(index, str):
        index = {"torch-true": torch.tensor(True), "torch-false": torch.tensor(False),
                 "torch-[true]": torch.tensor([True])}[index]
    ds = precompile.open(builds["a"])
    with pytest.raises(TypeError, match=r"sample index must be an integer, got a boolean \(.*\); a boolean mask of "
                                        r"one value per sample goes to ds\.batch"):
        ds[index]
    with pytest.raises(TypeError, match=r"sample index must be an integer, got a boolean"):
        ds.locate(index)
    # integers of every kind still read their row, the same bytes
    want = ds[1]["image"]
    for i in (1, np.int64(1), np.uint8(1), torch.tensor(1), torch.tensor([1]), -8):
        assert np.array_equal(ds[i]["image"], want)
    mask = np.zeros(len(ds), dtype=bool)
    mask[1] = True
    assert np.array_equal(ds.batch(mask)["image"][0], want)


# -- 6. targets="list": images of several sizes as a list of tensors -------------------------------------------------

@pytest.fixture(scope="module")
def raw_det(tmp_path_factory) -> str:
    """5 samples of random sizes (30-50 x 30-60), boxes, box_labels and keypoints; no resize: the image's shape
    varies (sample 0 has no boxes)."""
    from annotated_decoder import K  # noqa: F401  (registers the test decoders)
    from test_annotation_builds import make_inputs

    tmp = tmp_path_factory.mktemp("raw_det")
    make_inputs(str(tmp / "in"), n=5)
    r = {"name": "raw", "inputs": {"root": str(tmp / "in"), "match": "{label}/{name}.npz",
                                   "fields": {"image": {"decoder": "_annotations_test"}}},
         "output": {"format": "hdf5", "samples_per_shard": 2}}
    return precompile.build(r, out_dir=str(tmp / "out"))["output"]


def _check_listed_batch(batch: dict, rows: list[int], ds) -> None:
    from precompile.reader.targets import image_target

    assert set(batch) == {"image", "targets"}
    assert isinstance(batch["image"], list) and len(batch["image"]) == len(rows) == len(batch["targets"])
    for img, t, r in zip(batch["image"], batch["targets"], rows):
        want = ds[r]
        assert isinstance(img, torch.Tensor) and img.dtype == torch.uint8
        assert img.shape == want["image"].shape and np.array_equal(img.numpy(), want["image"])
        ref = image_target(want["boxes"], want["box_labels"], None, want["keypoints"])
        assert t.keys() == ref.keys() and all(torch.equal(t[k], ref[k]) for k in t)


@pytest.mark.parametrize("threads", [0, 2])
def test_the_loader_gives_images_of_several_sizes_as_a_list_with_targets_list(raw_det, threads):
    """Before: Loader(targets="list") over a build whose images vary in size was a FormatError (it gathers
    fixed-shape fields only), though torchvision's detection models take a list of images of their own sizes.
    Now each batch's images are a list of tensors of their own sizes, each the stored sample's bytes."""
    ds = precompile.open(raw_det)
    sizes = {ds[i]["image"].shape for i in range(len(ds))}
    assert len(sizes) > 1
    loader = precompile.Loader(raw_det, batch_size=2, device="cpu", targets="list", seed=1, num_threads=threads)
    for e in range(2):
        loader.set_epoch(e)
        batches = list(loader)
        order = loader.batch_indices(e)
        assert len(batches) == len(order) == 3
        for b, rows in zip(batches, order):
            _check_listed_batch(b, [int(r) for r in rows], ds)
    # the padded path stays as it was: without targets the image field is refused by name
    with pytest.raises(precompile.errors.FormatError, match=r"field 'image' has shape \(None, None, 3\) with unknown"):
        precompile.Loader(raw_det, batch_size=2, device="cpu")


def test_collate_gives_images_of_several_sizes_as_a_list_with_targets_list(raw_det):
    """Before: precompile.collate(ds, targets="list") refused images of several sizes (ShapeMismatchError). Now
    they come as a list of tensors of their own sizes; without targets the padded path refuses them as before."""
    from torch.utils.data import DataLoader

    ds = precompile.open(raw_det)
    got = list(DataLoader(ds, batch_size=2, collate_fn=precompile.collate(ds, targets="list")))
    assert len(got) == 3
    for k, batch in enumerate(got):
        _check_listed_batch(batch, list(range(2 * k, min(2 * k + 2, len(ds)))), ds)
    with pytest.raises(precompile.errors.ShapeMismatchError, match="field 'image': cannot stack samples of different"):
        precompile.collate(ds)([ds[0], ds[1]])


@pytest.mark.parametrize("kw, what", [({"gpu_steps": [{"random_flip": {}}]}, "gpu_steps need one size a batch"),
                                      ({"dtype": "float32"}, "the conversion .* applies to fixed-shape fields"),
                                      ({"dtype": "float32", "convert_fields": ["image"]}, "the conversion"),
                                      ({"channels_first": True}, "the conversion")])
def test_steps_or_conversion_of_images_of_several_sizes_are_refused_by_name(raw_det, kw, what):
    with pytest.raises(ValueError, match=rf"targets='list' gives 'image' \(a shape that varies between samples\).*"
                                         rf"{what}"):
        precompile.Loader(raw_det, batch_size=2, device="cpu", targets="list", **kw)
