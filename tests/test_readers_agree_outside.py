"""An outside check of the plain-reader paths against truths the code did not compute.

Every build here reads ``.npz`` files through a test decoder that passes their arrays through as declared fields
(tests/readers_outside_decoder.py), so the source file is the truth: ``ds[i]``, ``ds.batch``, a plain
``DataLoader`` with ``precompile.collate`` (padded and ``targets="list"``) must each give back exactly the arrays
written (dtype, shape, bytes; NaN and inf included) and the table's text and labels as Python's ``json`` reads
them. A modest fixed set of drawn recipes runs by default; ``PRECOMPILE_READERS_EXPLORE=N`` draws N more.
The Hugging Face bridge is checked against the same truth in tests/test_hf_outside.py."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

import precompile
import readers_outside_decoder  # noqa: F401  (registers the decoder; a build's workers import that module)
from precompile import build

FORMATS = ("hdf5", "png", "bmp", "wav")
TEXTS = ["", "héllo ☃", "a\x00b", "日本語 \U0001F600", "tab\tand\nnewline", "x" * 300, "\"quoted\" \\ back"]


def _audio(channels: int, n: int, i: int, dtype: str) -> np.ndarray:
    """Samples that count up (sample j of channel c: 37 (c n + j) + i), as int16, or as float32 in [-1, 1)."""
    count = (np.arange(channels * n, dtype=np.int64).reshape(channels, n) * 37 + i) % 65536 - 32768
    return count.astype(np.int16) if dtype == "int16" else (count / 32768).astype(np.float32)


def _draw(rng: np.random.Generator, fmt: str) -> tuple[dict, list[dict], list[dict]]:
    """A random set of fields for ``fmt``: (decoder specs, per-sample arrays, per-sample table rows). Images whose
    pixels count up (each value its own position), float fields with NaN and inf, 0 to 4 boxes per sample (with
    labels and keypoints tied to them), a variable 1-D index vector."""
    n = int(rng.integers(1, 7))
    fixed = bool(rng.integers(2))
    ch = {"hdf5": [0, 1, 3, 4], "png": [0, 1, 3, 4], "bmp": [0, 3], "wav": [0, 1, 3, 4]}[fmt]
    c = int(rng.choice(ch))
    dt = "uint16" if fmt == "png" and c in (0, 1) and rng.integers(2) else "uint8"
    if fmt in ("hdf5", "wav"):
        dt = str(rng.choice(["uint8", "uint16", "float32"]))
    mdt = "uint8" if fmt == "bmp" else "uint16"
    ach = int(rng.integers(1, 3))
    adt = str(rng.choice(["float32", "int16"]))
    k = int(rng.integers(1, 4))
    hw = [int(rng.integers(1, 6)), int(rng.integers(1, 7))]
    img_shape = (hw if fixed else [None, None]) + ([c] if c else [])
    specs = {"@": ["image", img_shape, dt, None],
             "boxes": ["boxes", [None, 4], "float32", None],
             "box_labels": ["box_labels", [None], "int64", "boxes"],
             "keypoints": ["keypoints", [None, k, 3], "float32", "boxes"],
             "flow": ["flow", [2, 3, 2], "float32", None],
             "vec": ["index", [None], "int32", None],
             "inst": ["mask", img_shape[:2] + [1], mdt, "boxes"],
             "audio": ["audio", [ach, None], adt, None],
             "clip": ["video", [2, 3, None, 3], "uint8", None],
             "vol": ["volume", [2, 2, 3], "float32", None],
             "valid": ["flow_valid", [2, 3, 1], "uint8", "flow"],
             "vmask": ["volume_mask", [2, 2, 3], "uint8", None]}
    if fmt in ("png", "bmp"):
        del specs["audio"]
    arrays, rows = [], []
    for i in range(n):
        h, w = hw if fixed else [int(rng.integers(1, 6)), int(rng.integers(1, 7))]
        shape = (h, w) + ((c,) if c else ())
        count = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) + 7 * i
        img = (count % (65536 if dt == "uint16" else 256)).astype(dt) if dt != "float32" else count.astype(dt) / 3
        if dt == "float32":
            img.flat[0] = np.nan
        nb = int(rng.choice([0, 0, 1, 2, 4]))
        flow = rng.standard_normal((2, 3, 2)).astype(np.float32)
        flow.flat[:3] = [np.nan, np.inf, -np.inf]
        arrays.append({"@": img,
                       "boxes": (np.arange(nb * 4, dtype=np.float32).reshape(nb, 4) + 0.5 * i),
                       "box_labels": np.arange(nb, dtype=np.int64) * 3 + i,
                       "keypoints": rng.random((nb, k, 3)).astype(np.float32),
                       "flow": flow,
                       "vec": np.arange(int(rng.integers(0, 4)), dtype=np.int32) - 2,
                       # instance ids 0 (background) .. nb (box i is id i + 1), and 255 / 65535 (ignored)
                       "inst": rng.choice(np.array([0, *range(1, nb + 1), np.iinfo(mdt).max], mdt), (h, w, 1)),
                       "audio": _audio(ach, int(rng.integers(1, 40)), i, adt),
                       "clip": (np.arange(2 * 3 * 3 * (i + 1)) % 256).astype(np.uint8).reshape(2, 3, i + 1, 3),
                       "vol": rng.standard_normal((2, 2, 3)).astype(np.float32),
                       "valid": np.isfinite(flow).all(-1, keepdims=True).astype(np.uint8),
                       "vmask": rng.integers(0, 4, (2, 2, 3)).astype(np.uint8)})
        rows.append({"caption": str(rng.choice(TEXTS)), "cls": str(rng.choice(["b", "a", "z"])),
                     "y": [None, 0.1, -2.5, 1e30][int(rng.integers(4))], "y2": float(rng.integers(-3, 3)) / 7})
    return specs, arrays, rows


def _make(tmp, seed: int, fmt: str):
    """Write a drawn input set under ``tmp`` and build it in ``fmt``: (index path, truth per sample in key order)."""
    rng = np.random.default_rng(seed)
    specs, arrays, rows = _draw(rng, fmt)
    data = tmp / "data"
    data.mkdir(parents=True)
    with open(data / "t.jsonl", "w", encoding="utf-8") as f:
        for i, (a, r) in enumerate(zip(arrays, rows)):
            np.savez(data / f"s{i:02d}.npz", **{n: v for n, v in a.items() if n in specs})
            f.write(json.dumps({"file": f"s{i:02d}.npz", **r}) + "\n")
    recipe = {"name": "agree", "inputs": {
        "root": str(data), "table": str(data / "t.jsonl"), "path": "{file}", "key": "file",
        "fields": {"image": {"decoder": "_readers_outside_test", "specs": json.dumps(specs)}},
        "columns": {"caption": {"column": "caption", "kind": "text"}, "label": {"column": "cls", "kind": "label"},
                    "y": {"column": "y", "kind": "target"}, "ys": {"columns": ["y2", "y"], "kind": "target"}}},
        "output": {"format": fmt, "samples_per_shard": int(rng.integers(1, 4)),
                   **({"options": {"sample_rate": 8000}} if fmt == "wav" else {})}}
    out = build(recipe, out_dir=tmp / "out")["output"]
    # the truth: the files' own arrays, and the table as Python's json reads it (labels: sorted unique names)
    with open(data / "t.jsonl", encoding="utf-8") as f:
        table = [json.loads(line) for line in f]
    names = sorted({r["cls"] for r in table})
    truth = []
    for r in table:
        with np.load(data / r["file"], allow_pickle=False) as z:
            t = {("image" if n == "@" else n): z[n] for n in z.files}
        t["caption"] = r["caption"]
        t["label"] = np.int64(names.index(r["cls"]))
        # a target is float32, a blank (null) cell NaN
        t["y"] = np.float32(np.nan if r["y"] is None else r["y"])
        t["ys"] = np.array([r["y2"], np.nan if r["y"] is None else r["y"]], np.float32)
        truth.append((r["file"], t))
    return out, truth, names


def _masks(inst: np.ndarray, n: int) -> np.ndarray:
    """Box i's pixels, (n, H, W) uint8: the instance mask's id i + 1."""
    return (inst[None, ..., 0] == np.arange(1, n + 1)[:, None, None]).astype(np.uint8)


def _same(got, want) -> bool:
    if isinstance(want, str):
        return isinstance(got, str) and got == want
    got = np.asarray(got)
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


def _check_build(tmp, seed: int, fmt: str) -> None:
    import torch
    from torch.utils.data import DataLoader

    out, truth, names = _make(tmp, seed, fmt)
    ds = precompile.open(out)
    assert len(ds) == len(truth) and ds.label_names == names
    for i, (key, t) in enumerate(truth):
        assert ds.key(i) == key
        s = ds[i]
        assert set(s) == set(t)
        for f, want in t.items():
            assert _same(s[f], want), (seed, fmt, i, f, s[f], want)
    # batch(pad=True), in a shuffled order with a repeat: each row's own values, then the padding
    order = list(np.random.default_rng(seed).permutation(len(ds))) + [0]
    b = ds.batch(order, pad=True)
    for pos, i in enumerate(order):
        t = truth[i][1]
        for f in ("boxes", "box_labels", "keypoints", "vec", "image", "inst", "clip", "vol", "audio"):
            if f not in t:
                continue
            want = t[f]
            got = b[f][pos][tuple(slice(0, n) for n in want.shape)]
            assert _same(got, want), (seed, fmt, pos, f)
            if f in ("boxes", "keypoints"):
                assert np.isnan(b[f][pos][want.shape[0]:]).all(), (seed, fmt, pos, f)
            if f == "box_labels":
                assert (b[f][pos][want.shape[0]:] == -1).all(), (seed, fmt, pos, f)
        assert b["caption"][pos] == t["caption"] and int(b["label"][pos]) == int(t["label"])
    # a plain DataLoader with precompile.collate: padded with counts, and targets="list"
    fields = [f for f in ds.fields if not ds.variable(f) or f in ("boxes", "box_labels", "keypoints", "caption")]
    sub = precompile.open(out, fields=fields)
    for targets in (None, "list"):
        loader = DataLoader(sub, batch_size=3, collate_fn=precompile.collate(sub, targets=targets))
        start = 0
        for batch in loader:
            for pos in range(len(batch["label"])):
                t = truth[start + pos][1]
                n = len(t["boxes"])
                if targets is None:
                    assert int(batch["boxes__count"][pos]) == n
                    got = {"boxes": batch["boxes"][pos, :n], "box_labels": batch["box_labels"][pos, :n],
                           "keypoints": batch["keypoints"][pos, :n]}
                else:
                    d = batch["targets"][pos]
                    got = {"boxes": d["boxes"], "box_labels": d["labels"], "keypoints": d["keypoints"]}
                    if "inst" in fields:   # box i's pixels: the instance mask's id i + 1 (numpy on the file's ids)
                        assert _same(d["masks"].numpy(), _masks(t["inst"], n)), (seed, fmt, start + pos)
                    else:
                        assert "masks" not in d
                    assert d["boxes"].dtype == torch.float32 and d["labels"].dtype == torch.int64
                    assert tuple(d["boxes"].shape) == (n, 4) and tuple(d["keypoints"].shape) == (n, *t["keypoints"].shape[1:])
                for f, g in got.items():
                    assert _same(g.numpy(), t[f]), (seed, fmt, targets, start + pos, f)
                assert batch["caption"][pos] == t["caption"] and int(batch["label"][pos]) == int(t["label"])
                for f in fields:   # every other loaded field: stacked, each row the file's own
                    if f not in ("boxes", "box_labels", "keypoints", "caption"):
                        assert _same(batch[f][pos].numpy(), t[f]), (seed, fmt, targets, start + pos, f)
                if "image" in batch:
                    assert _same(batch["image"][pos].numpy(), t["image"])
            start += len(batch["label"])
        assert start == len(truth)
    if fmt == "hdf5":   # the Loader reads HDF5 builds: its padded fields and targets="list" give the same rows
        for targets in (None, "list"):
            loader = precompile.Loader(out, batch_size=2, shuffle=False, device="cpu", fields=fields, targets=targets)
            start = 0
            for batch in loader:
                for pos in range(len(batch["label"])):
                    t = truth[start + pos][1]
                    n = len(t["boxes"])
                    if targets is None:
                        assert int(batch["boxes__count"][pos]) == n
                        got = {f: batch[f][pos, :n] for f in ("boxes", "box_labels", "keypoints")}
                    else:
                        d = batch["targets"][pos]
                        got = {"boxes": d["boxes"], "box_labels": d["labels"], "keypoints": d["keypoints"]}
                        if "inst" in fields:
                            assert _same(d["masks"].numpy(), _masks(t["inst"], n)), (seed, "Loader", start + pos)
                    for f, g in got.items():
                        assert _same(g.numpy(), t[f]), (seed, "Loader", targets, start + pos, f)
                    assert batch["caption"][pos] == t["caption"]
                    for f in fields:
                        if f not in ("boxes", "box_labels", "keypoints", "caption"):
                            assert _same(batch[f][pos].numpy(), t[f]), (seed, "Loader", targets, start + pos, f)
                    if "image" in batch:
                        assert _same(batch["image"][pos].numpy(), t["image"])
                start += len(batch["label"])
            assert start == len(truth)


CASES = [(seed, fmt) for seed in range(3) for fmt in FORMATS]
EXPLORE = int(os.environ.get("PRECOMPILE_READERS_EXPLORE", "0") or 0)


@pytest.mark.parametrize("seed,fmt", CASES)
def test_readers_give_the_files_own_values(tmp_path, seed, fmt):
    _check_build(tmp_path, seed, fmt)


@pytest.mark.skipif(not EXPLORE, reason="set PRECOMPILE_READERS_EXPLORE=N to draw N more recipes")
def test_readers_explore(tmp_path):
    for n in range(EXPLORE):
        seed = 1000 + n
        fmt = FORMATS[n % len(FORMATS)]
        _check_build(tmp_path / f"{seed}", seed, fmt)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """One drawn HDF5 build and one PNG build with their truths."""
    out = {}
    for fmt in ("hdf5", "png"):
        tmp = tmp_path_factory.mktemp(f"small-{fmt}")
        for seed in range(50):   # a draw with at least 4 samples
            if len(_draw(np.random.default_rng(seed), fmt)[1]) >= 4:
                break
        out[fmt] = _make(tmp, seed, fmt)
    return out


@pytest.mark.parametrize("fmt", ["hdf5", "png"])
def test_batch_takes_a_boolean_mask_as_numpy_does(small, fmt):
    """A boolean index picks the rows where it is True (numpy's rule); before, ``batch([True, False, True])``
    quietly gave rows 1, 0, 1 (the booleans cast to integers)."""
    path, truth, _ = small[fmt]
    ds = precompile.open(path)
    mask = np.zeros(len(ds), bool)
    mask[[0, 2]] = True
    for m in (mask, list(mask)):
        b = ds.batch(m, pad=True)
        assert b["caption"] == [truth[0][1]["caption"], truth[2][1]["caption"]]
        assert [int(v) for v in b["label"]] == [int(truth[0][1]["label"]), int(truth[2][1]["label"])]
    assert ds.batch(np.zeros(len(ds), bool), pad=True)["caption"] == []
    with pytest.raises(IndexError, match=f"boolean index of 3 values for {len(ds)} samples"):
        ds.batch([True, False, True])


@pytest.mark.parametrize("fmt", ["hdf5", "png"])
def test_batch_index_forms(small, fmt):
    """Slices as a list takes them; numpy integers of any width; an empty list; a 2-D index and floats refused."""
    path, truth, _ = small[fmt]
    ds = precompile.open(path)
    n = len(ds)
    caps = [t["caption"] for _, t in truth]
    assert ds.batch(slice(1, None), pad=True)["caption"] == caps[1:]
    assert ds.batch(slice(None, None, -2), pad=True)["caption"] == caps[::-1][::2]
    assert ds.batch(range(n - 1, -1, -1), pad=True)["caption"] == caps[::-1]
    assert ds.batch(np.array([-1, 0], dtype=np.int8), pad=True)["caption"] == [caps[-1], caps[0]]
    assert ds.batch([np.uint64(1)], pad=True)["caption"] == [caps[1]]
    empty = ds.batch([], pad=True)
    assert empty["caption"] == [] and empty["label"].shape == (0,) and empty["flow"].shape == (0, 2, 3, 2)
    assert ds[np.int16(-1)]["caption"] == caps[-1]
    with pytest.raises(TypeError, match="sample indices must be integers"):
        ds.batch([0.0, 1.0])
    with pytest.raises(TypeError, match=r"sample indices must be one list of rows, got an index of shape \(1, 2\)"):
        ds.batch([[0, 1]])
    with pytest.raises(IndexError, match=f"sample index {n} out of range for {n} samples"):
        ds.batch([0, n])
    with pytest.raises(IndexError, match=f"sample index {-n - 1} out of range for {n} samples"):
        ds.batch([-n - 1])
    with pytest.raises(TypeError, match="sample index must be an integer, got slice"):
        ds[0:2]


def test_a_field_named_like_a_count_is_refused_not_overwritten(tmp_path):
    """A field may be named ``boxes__count`` (letters, digits, '_'), the batch key of the boxes' counts: the
    Loader quietly gave the counts in its place and ``precompile.collate`` the field in the counts' place (what
    ``detection_targets`` then cut the rows by). Both now refuse it, naming the two; left out, it reads."""
    data = tmp_path / "data"
    data.mkdir()
    specs = {"@": ["image", [2, 3, 3], "uint8", None], "boxes": ["boxes", [None, 4], "float32", None],
             "boxes__count": ["index", [], "int64", None]}
    for i in range(3):
        np.savez(data / f"s{i}.npz", **{"@": np.full((2, 3, 3), i, np.uint8),
                                       "boxes": np.arange(4 * i, dtype=np.float32).reshape(i, 4),
                                       "boxes__count": np.int64(100 + i)})
    out = build({"name": "clash", "inputs": {"root": str(data), "match": "{name}.npz", "fields": {
        "image": {"decoder": "_readers_outside_test", "specs": json.dumps(specs)}}}}, out_dir=tmp_path / "out")["output"]
    ds = precompile.open(out)
    assert [int(ds[i]["boxes__count"]) for i in range(3)] == [100, 101, 102]
    why = ("the field 'boxes__count' has the name of the batch key of 'boxes''s row counts; load the fields "
           "without one of them (fields=[...])")
    with pytest.raises(ValueError, match=re.escape(why)):
        precompile.collate(ds)
    with pytest.raises(ValueError, match=re.escape(why)):
        precompile.Loader(out, batch_size=3, shuffle=False, device="cpu")
    with pytest.raises(ValueError, match=re.escape(why)):
        precompile.Mix([out], batch_size=3, device="cpu")
    sub = precompile.open(out, fields=["image", "boxes"])
    batch = precompile.collate(sub)([sub[0], sub[1], sub[2]])
    assert batch["boxes__count"].tolist() == [0, 1, 2]
    loader = precompile.Loader(out, batch_size=3, shuffle=False, device="cpu", fields=["boxes__count", "image"])
    assert next(iter(loader))["boxes__count"].tolist() == [100, 101, 102]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_sample_array_is_writable_in_every_format(tmp_path, fmt):
    """``ds[i]`` gives arrays a user may change in place (``s["image"] -= mean``) in every format: the PNG and BMP
    images were read-only (numpy over Pillow's bytes), unlike every other field and format, so an in-place
    transform failed only there, and torch's default collate in a plain DataLoader (the reference's example)
    warned that the tensor was not writable."""
    out, truth, _ = _make(tmp_path, 4, fmt)
    ds = precompile.open(out)
    for i in range(len(ds)):
        s = ds[i]
        for f, a in s.items():
            if isinstance(a, np.ndarray) and a.ndim:
                assert a.flags.writeable, (fmt, i, f)
        s["image"][...] = 0   # and changing it changes nothing stored
        assert _same(ds[i]["image"], truth[i][1]["image"])


def test_an_epoch_view_reads_as_its_dataset_does(tmp_path):
    """``epoch_view(ds, e)``, the map-style view of one epoch of an augmented build: its ``batch`` took no ``pad``
    and cast a boolean mask to rows 0 and 1; ``precompile.collate`` could not be made for it (no field specs).
    Now it batches with the dataset's rules over its own positions, and a DataLoader over it collates."""
    from torch.utils.data import DataLoader

    from precompile.reader.copies import epoch_view

    out, truth, _ = _make(tmp_path / "a", 4, "hdf5")
    recipe = dict(precompile.open(out).recipe, name="aug", copies=2, seed=3,
                  steps=[{"random_flip": {"fields": ["image"]}}])
    ds = precompile.open(build(recipe, out_dir=tmp_path / "aug")["output"])
    view = epoch_view(ds, 1)
    n = len(view)
    assert n == len(truth) and sorted(view.key(i) for i in range(n)) == [k for k, _ in truth]
    rows = [int(view.rows[i]) for i in range(n)]
    mask = np.zeros(n, bool)
    mask[[0, n - 1]] = True
    got = view.batch(mask, pad=True)
    assert got["caption"] == [ds[rows[0]]["caption"], ds[rows[-1]]["caption"]]
    assert _same(got["boxes"], ds.batch([rows[0], rows[-1]], pad=True)["boxes"])
    assert view.batch(slice(None, None, -1), pad=True)["caption"] == [ds[r]["caption"] for r in rows[::-1]]
    with pytest.raises(IndexError, match=f"sample index {n} out of range for {n} samples"):
        view.batch([n])
    sub = epoch_view(precompile.open(ds.path, fields=["label", "caption", "boxes", "box_labels"]), 1)
    batch = next(iter(DataLoader(sub, batch_size=n, collate_fn=precompile.collate(sub))))
    assert batch["boxes__count"].tolist() == [len(ds[r]["boxes"]) for r in rows]
    assert batch["caption"] == [ds[r]["caption"] for r in rows]


def test_collate_of_a_subset_of_a_build(small):
    """``random_split`` and ``Subset`` wrap the dataset: ``precompile.collate(subset)`` raised AttributeError
    ('Subset' object has no attribute 'field_specs'); it reads the wrapped build's fields. Anything else is a
    TypeError saying what it takes."""
    import torch
    from torch.utils.data import DataLoader, Subset, random_split

    path, truth, _ = small["hdf5"]
    ds = precompile.open(path, fields=["label", "caption", "boxes", "box_labels", "keypoints"])
    part = Subset(Subset(ds, [3, 1, 0]), [0, 2])
    batch = next(iter(DataLoader(part, batch_size=2, collate_fn=precompile.collate(part, targets="list"))))
    assert batch["caption"] == [truth[3][1]["caption"], truth[0][1]["caption"]]
    assert _same(batch["targets"][0]["boxes"].numpy(), truth[3][1]["boxes"])
    a, _ = random_split(ds, [2, len(ds) - 2], generator=torch.Generator().manual_seed(0))
    assert precompile.collate(a).specs == precompile.collate(ds).specs
    with pytest.raises(TypeError, match=r"precompile.collate\(ds\) takes a dataset of precompile.open \(or a "
                                        r"Subset of one\), got dict"):
        precompile.collate({"image": 1})


def test_collate_reads_the_fields_the_dataset_loads(small):
    """A dataset opened with ``fields=[]`` loads nothing: its collate took every field of the build for loaded
    (``or`` on the empty list), so ``targets="list"`` was made and then failed on the first batch with a
    KeyError 'boxes'; now it is refused when made, as the Loader refuses it, and the plain collate gives {}."""
    path, _, _ = small["hdf5"]
    ds = precompile.open(path, fields=[])
    with pytest.raises(ValueError, match=r"one boxes field; none is loaded \(loaded: nothing\)"):
        precompile.collate(ds, targets="list")
    assert precompile.collate(ds)([ds[0], ds[1]]) == {}


@pytest.mark.parametrize("fmt", ["hdf5", "png"])
def test_workers_threads_and_close_read_the_same_rows(small, fmt):
    """The dataset (with handles already open) and its collate pickled into DataLoader workers, forked and
    spawned; four threads reading one dataset at once; a dataset read again after ``close()``: the same rows."""
    import threading

    from torch.utils.data import DataLoader

    path, truth, _ = small[fmt]
    ds = precompile.open(path, fields=["label", "caption", "flow", "boxes", "box_labels", "keypoints"])
    assert _same(ds[0]["flow"], truth[0][1]["flow"])   # handles open before the fork
    for ctx in ("fork", "spawn") if fmt == "png" else ("fork",):   # (a spawned worker costs seconds: once)
        loader = DataLoader(ds, batch_size=2, num_workers=1, multiprocessing_context=ctx,
                            collate_fn=precompile.collate(ds, targets="list"))
        got = [(c, d) for b in loader for c, d in zip(b["caption"], b["targets"])]
        assert [c for c, _ in got] == [t["caption"] for _, t in truth]
        assert all(_same(d["boxes"].numpy(), t["boxes"]) for (_, d), (_, t) in zip(got, truth))
    errors = []

    def read(k):
        for r in range(20):
            i = (k + r) % len(truth)
            if not (_same(ds[i]["flow"], truth[i][1]["flow"]) and _same(ds[i]["boxes"], truth[i][1]["boxes"])):
                errors.append(i)
    threads = [threading.Thread(target=read, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    ds.close()
    assert _same(ds[1]["flow"], truth[1][1]["flow"]) and ds[1]["caption"] == truth[1][1]["caption"]


def test_a_pad_value_the_field_cannot_hold_is_refused(small):
    """``ds.batch(idx, pad=v)`` pads every field with ``v``: NaN in an int64 ``box_labels`` became
    -9223372036854775808 and 0.5 became 0 (numpy's unsafe cast, a RuntimeWarning at most), -1 in a uint8 field an
    OverflowError naming nothing. A value the field's dtype cannot hold exactly is a ValueError naming the field;
    one it can hold pads as given."""
    path, truth, _ = small["hdf5"]
    ds = precompile.open(path, fields=["boxes", "box_labels"])
    idx = list(range(len(truth)))
    counts = [len(t["boxes"]) for _, t in truth]
    assert len(set(counts)) > 1   # the draw has samples of different counts: there is padding
    for bad, why in ((float("nan"), "nan"), (0.5, "0.5"), (2.0 ** 70, "1.1805916207174113e+21"), (np.inf, "inf")):
        with pytest.raises(ValueError, match=re.escape(f"pad value {why} cannot be stored in field 'box_labels' (int64); "
                                                       f"pass pad=True")):
            ds.batch(idx, pad=bad)
    b = ds.batch(idx, pad=7.0)   # integral: held exactly
    assert all((b["box_labels"][i, n:] == 7).all() for i, n in enumerate(counts))
    assert all((b["boxes"][i, n:] == 7).all() for i, n in enumerate(counts))
    b = precompile.open(path, fields=["boxes"]).batch(idx, pad=np.nan)   # a float field holds NaN
    assert all(np.isnan(b["boxes"][i, n:]).all() for i, n in enumerate(counts))


def test_messages_echo_a_bounded_part_of_what_they_were_given(small):
    """A reader argument echoed in an error is cut to a bounded length (a 100,000-letter field name was echoed
    whole by open, the Loader, Mix, collate's targets, ds.batch's pad and source_map's field)."""
    path, _, _ = small["hdf5"]
    big = "f" * 100_000
    calls = {"open": lambda: precompile.open(path, fields=[big]),
             "Loader": lambda: precompile.Loader(path, batch_size=2, device="cpu", fields=[big]),
             "Mix": lambda: precompile.Mix([path], batch_size=2, device="cpu", fields=[big]),
             "pad": lambda: precompile.open(path).batch([0, 1], pad=big),
             "collate": lambda: precompile.collate(precompile.open(path), targets=big),
             "source_map": lambda: precompile.open(path).source_map(0, field=big)}
    for what, call in calls.items():
        with pytest.raises(Exception) as e:
            call()
        assert "fffff" in str(e.value) and len(str(e.value)) < 1000, (what, len(str(e.value)))


@pytest.mark.parametrize("fmt", ["hdf5", "png"])
def test_detection_targets_of_a_padded_dataset_batch(small, fmt):
    """``ds.batch(idx, pad=True)`` pads the boxes as the Loader does but holds each sample's own shape in
    ``batch.shapes``, not a ``boxes__count``: ``detection_targets`` took its padding for real rows (NaN boxes
    with label -1 in every image with fewer boxes than the batch's most). Each dict now holds the image's own
    rows, as the files have them."""
    path, truth, _ = small[fmt]
    ds = precompile.open(path, fields=["boxes", "box_labels", "keypoints", "inst"])
    idx = list(range(len(truth)))[::-1]
    assert len({len(truth[i][1]["boxes"]) for i in idx}) > 1   # some padding
    for pad in (True, np.nan):
        b = ds.batch(idx, pad=True) if pad is True else precompile.open(path, fields=["boxes"]).batch(idx, pad=pad)
        targets = precompile.detection_targets(b, masks="inst" if "inst" in b else None)
        for d, i in zip(targets, idx):
            t = truth[i][1]
            assert _same(d["boxes"].numpy(), t["boxes"]), (fmt, i)
            if "box_labels" in b:
                assert _same(d["labels"].numpy(), t["box_labels"]) and _same(d["keypoints"].numpy(), t["keypoints"])
            if "inst" in b and not ds.variable("inst"):
                assert _same(d["masks"].numpy(), _masks(t["inst"], len(t["boxes"])))


def test_wav_pcm16_refuses_nan_samples(tmp_path):
    """WAV ``subtype: PCM_16`` writes ``clip(round(x * 32768))``; a NaN sample has no such value: numpy's cast made
    it 0 (a RuntimeWarning at most), so the build stored silence where the input had no number. It is now the
    write stage's error naming the input, the field and the sample; ``on_error: skip`` drops only that input.
    Infinities follow the clip rule (+inf -> 32767 / 32768)."""
    data = tmp_path / "data"
    data.mkdir()
    specs = {"@": ["audio", [2, None], "float32", None]}
    good = np.array([[-np.inf, -0.5, 0.0, 0.5, np.inf], [0.25, -0.25, 1.0, -1.0, 0.0]], np.float32)
    bad = good.copy()
    bad[1, 3] = np.nan
    np.savez(data / "a.npz", **{"@": good})
    np.savez(data / "b.npz", **{"@": bad})
    recipe = {"name": "pcm", "inputs": {"root": str(data), "match": "{name}.npz", "fields": {
        "audio": {"decoder": "_readers_outside_test", "specs": json.dumps(specs)}}},
        "output": {"format": "wav", "options": {"sample_rate": 8000, "subtype": "PCM_16"}}}
    with pytest.raises(precompile.errors.BuildError, match=re.escape(
            f"{data / 'b.npz'}, stage write, field 'audio': field 'audio': a NaN sample (channel 1, sample 3) has no "
            f"16-bit PCM value")):
        build(recipe, out_dir=tmp_path / "out")
    out = build(dict(recipe, on_error="skip"), out_dir=tmp_path / "out")["output"]
    ds = precompile.open(out)
    assert len(ds) == 1 and ds.key(0) == "a.npz"
    want = np.clip(np.rint(good.astype(np.float64) * 32768), -32768, 32767) / 32768   # the documented rule
    assert _same(ds[0]["audio"], want.astype(np.float32))
