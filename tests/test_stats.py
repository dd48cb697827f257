"""``precompile stats``: streaming per-channel stats equal numpy's over the whole output, stored safely, used by the Loader."""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

import precompile
from precompile import build
from precompile.cli import main
from precompile.tools import stats as st
from precompile.tools.verify import verify


REPO = Path(__file__).resolve().parents[1]
EXT = {"images_png": ".json"}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("stats_out")
    res = {}
    for name in ("images", "images_png", "images_native", "flow", "ct_lung", "audio", "video"):
        build(REPO / "recipes" / f"{name}.yaml", out_dir=out)
        res[name] = out / (name + EXT.get(name, ".h5"))
    return res


def _whole(path: Path, field: str) -> list[np.ndarray]:
    ds = precompile.open(path, fields=[field])
    return [ds[i][field] for i in range(len(ds))]


def _numpy_stats(arrays: list[np.ndarray], axis: int | None) -> dict[str, np.ndarray]:
    """Reference: every value of the field in one float64 array (channels, values)."""
    if axis is None:
        x = np.concatenate([a.reshape(-1) for a in arrays]).astype(np.float64)[None]
    else:
        x = np.concatenate([np.moveaxis(a, axis, -1).reshape(-1, a.shape[axis]) for a in arrays]).astype(np.float64).T
    return {"mean": np.nanmean(x, axis=1), "std": np.nanstd(x, axis=1), "min": np.nanmin(x, axis=1),
            "max": np.nanmax(x, axis=1), "count": np.isfinite(x).sum(axis=1), "nonfinite": (~np.isfinite(x)).sum(axis=1)}


@pytest.mark.parametrize("name,field,axis", [
    ("images", "image", -1), ("images", "label", None), ("images_png", "image", -1),
    ("images_native", "image", -1), ("flow", "flow", -1), ("flow", "flow_valid", -1),
    ("ct_lung", "ct", None), ("ct_lung", "lung", None), ("audio", "audio", 0), ("video", "video", -1),
])
def test_equals_numpy_over_the_whole_output(outputs, name, field, axis):
    res = st.compute_stats(outputs[name], fields=[field])
    got = res["fields"][field]
    arrays = _whole(outputs[name], field)
    want = _numpy_stats(arrays, None if axis is None else (axis if axis >= 0 else arrays[0].ndim - 1))
    assert got["channels"] == len(want["mean"])
    for k in ("mean", "std", "min", "max"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=1e-12, err_msg=k)
    assert got["count"] == want["count"].tolist() and got["nonfinite"] == want["nonfinite"].tolist()
    assert res["num_samples"] == len(arrays)
    if name == "flow" and field == "flow":
        assert sum(got["nonfinite"]) > 0  # the unknown vectors are left out, not averaged as NaN


def test_class_counts_for_labels_and_masks(outputs):
    res = st.compute_stats(outputs["images"], fields=["label"])
    ds = precompile.open(outputs["images"])
    labels = np.array([int(ds[i]["label"]) for i in range(len(ds))])
    ids, counts = np.unique(labels, return_counts=True)
    assert res["fields"]["label"]["classes"] == [
        {"id": int(i), "count": int(c), "name": ds.label_names[int(i)]} for i, c in zip(ids, counts)]
    res = st.compute_stats(outputs["ct_lung"], fields=["lung"])
    m = np.concatenate([a.reshape(-1) for a in _whole(outputs["ct_lung"], "lung")])
    ids, counts = np.unique(m, return_counts=True)
    assert res["fields"]["lung"]["classes"] == [{"id": int(i), "count": int(c)} for i, c in zip(ids, counts)]
    assert "classes" not in st.compute_stats(outputs["images"], fields=["image"])["fields"]["image"]


def test_streaming_blocks_give_the_same_result(outputs):
    big = st.compute_stats(outputs["flow"], block_bytes=1 << 30)
    tiny = st.compute_stats(outputs["flow"], block_bytes=1)  # one sample per block
    for f in big["fields"]:
        for k in ("mean", "std", "min", "max", "count"):
            np.testing.assert_allclose(tiny["fields"][f][k], big["fields"][f][k], rtol=1e-12, err_msg=(f, k))


def test_reads_in_bounded_blocks_never_the_whole_field(outputs, monkeypatch):
    from precompile.formats.hdf5 import H5Dataset

    sizes: list[int] = []
    real = H5Dataset.batch

    def spy(self, indices, pad=False):
        idx = list(indices)
        sizes.append(len(idx))
        return real(self, idx, pad)

    monkeypatch.setattr(H5Dataset, "batch", spy)
    per_sample = 64 * 64 * 3 * 8                       # one image as float64
    res = st.compute_stats(outputs["images"], fields=["image"], block_bytes=5 * per_sample)
    assert max(sizes) == 5 and sum(sizes) == res["num_samples"] == 36 and len(sizes) == 8


def test_accumulator_is_exact_where_naive_float32_sums_drift():
    rng = np.random.default_rng(0)
    x = (1e4 + rng.normal(0, 1, (300_000, 2))).astype(np.float32)
    acc = st.Accumulator(2)
    for lo in range(0, len(x), 7_001):
        acc.add(x[lo:lo + 7_001])
    r = acc.result()
    np.testing.assert_allclose(r["mean"], x.astype(np.float64).mean(0), rtol=1e-13)
    np.testing.assert_allclose(r["std"], x.astype(np.float64).std(0), rtol=1e-9)


def test_stored_in_the_index_without_breaking_verify_or_rebuilds(tmp_path):
    recipe = REPO / "recipes" / "images.yaml"
    build(recipe, out_dir=tmp_path)
    path = tmp_path / "images.h5"
    shard_bytes = {p: Path(p).read_bytes() for p in glob.glob(str(tmp_path / "images.shards" / "*.h5"))}
    res = st.stats(path)
    with h5py.File(path, "r") as f:
        stored = json.loads(f.attrs["stats"])
    assert stored == json.loads(json.dumps(res))
    assert st.read_stats(path) == stored
    assert {p: Path(p).read_bytes() for p in shard_bytes} == shard_bytes      # shards untouched
    assert not glob.glob(str(tmp_path / "*.tmp-*"))
    assert verify(path).ok and precompile.open(path)[0]["image"].shape == (64, 64, 3)
    # a second field's stats join the first's
    st.stats(path, fields=["label"])
    assert set(st.read_stats(path)["fields"]) == {"image", "label"}
    # a rebuild with nothing to do leaves the index alone: the stats (of the same shards) stay
    rep = build(recipe, out_dir=tmp_path)
    assert rep["up_to_date"] and rep["shards"]["built"] == 0 and rep["shards"]["skipped"] == len(shard_bytes)
    assert verify(path).ok and set(st.read_stats(path)["fields"]) == {"image", "label"}
    # a rebuild that writes shards writes a fresh index, and the stats it held are computed again
    # for the new shards (the same fields), so a Loader's mean="stats" keeps working
    rep = build(recipe, out_dir=tmp_path, force=True)
    assert rep["shards"]["built"] == len(shard_bytes) and "stats" in rep["stage_seconds"]
    again = st.read_stats(path)
    assert verify(path).ok and set(again["fields"]) == {"image", "label"}
    assert again["shard_keys"] == [s["key"] for s in precompile.open(path).shards]
    assert again == json.loads(json.dumps(st.compute_stats(path, fields=["image", "label"])))


def test_folder_output_keeps_stats_in_its_json_index(tmp_path):
    build(REPO / "recipes" / "images_png.yaml", out_dir=tmp_path)
    path = tmp_path / "images_png.json"
    before = json.loads(path.read_text())
    res = st.stats(path)
    after = json.loads(path.read_text())
    assert after["attrs"].pop("stats") == json.loads(json.dumps(res))
    assert after == before                                          # nothing else changed
    ds = precompile.open(path)
    assert json.loads(ds.attrs["stats"]) == st.read_stats(ds) and len(ds) == 36


def test_loader_stats_normalisation_equals_explicit_values(outputs):
    torch = pytest.importorskip("torch")
    from precompile.reader.loader import Loader

    path = outputs["images"]
    st.stats(path)
    s = st.read_stats(path)["fields"]["image"]
    kw = dict(batch_size=8, shuffle=False, device="cpu", dtype="float32", fields=["image"], num_threads=0)
    a = Loader(path, mean="stats", std="stats", **kw)
    b = Loader(path, mean=[m / 255 for m in s["mean"]], std=[v / 255 for v in s["std"]], **kw)
    for xa, xb in zip(a, b):
        assert torch.equal(xa["image"], xb["image"])
    x = torch.cat([batch["image"] for batch in Loader(path, mean="stats", std="stats", **kw)]).double()
    np.testing.assert_allclose(x.mean((0, 1, 2)).numpy(), 0, atol=1e-5)   # standardised over the whole output
    np.testing.assert_allclose(x.std((0, 1, 2), unbiased=False).numpy(), 1, atol=1e-5)
    with pytest.raises(ValueError, match="numbers or 'stats'"):
        Loader(path, mean="auto", std="stats", **kw)


def test_loader_refuses_missing_or_stale_stats(tmp_path):
    pytest.importorskip("torch")
    from precompile.reader.loader import Loader

    build(REPO / "recipes" / "images.yaml", out_dir=tmp_path)
    path = tmp_path / "images.h5"
    kw = dict(batch_size=4, device="cpu", dtype="float32", fields=["image"], num_threads=0)
    with pytest.raises(st.StatsError, match="has no stats; run `precompile stats"):
        Loader(path, mean="stats", std="stats", **kw)
    res = st.compute_stats(path)
    res["shard_keys"] = ["something", "else"]
    st.write_stats(path, res)
    with pytest.raises(st.StatsError, match="before the output was rebuilt"):
        Loader(path, mean="stats", std="stats", **kw)


def test_a_running_build_blocks_writing(tmp_path):
    import fcntl

    build(REPO / "recipes" / "images.yaml", out_dir=tmp_path)
    fd = os.open(tmp_path / "images.shards" / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(st.StatsError, match="a build of this output is running"):
            st.stats(tmp_path / "images.h5")
    finally:
        os.close(fd)
    assert st.read_stats(tmp_path / "images.h5") is None


def test_cli(outputs, tmp_path):
    r = CliRunner().invoke(main, ["stats", str(outputs["images"]), "--field", "label", "--no-write"])
    assert r.exit_code == 0, r.output
    assert "classes 0=beach: 12, 1=forest: 12, 2=night: 12" in r.output
    r = CliRunner().invoke(main, ["stats", str(outputs["flow"]), "--field", "flow", "--json", "--no-write"])
    assert r.exit_code == 0
    assert json.loads(r.output) == json.loads(json.dumps(st.compute_stats(outputs["flow"], fields=["flow"])))
    r = CliRunner().invoke(main, ["stats", str(outputs["images"]), "--field", "nope"])
    assert r.exit_code == 2 and "no field 'nope'" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["stats", str(tmp_path / "missing.h5")])
    assert r.exit_code == 5 and "no such file" in r.output


@pytest.mark.parametrize("remap", [False, True])
def test_declared_classes_never_seen_are_counted_as_zero(tmp_path, remap):
    """Exactly the declared classes are listed: a mask's ``classes: [0, 2, 5, 7]`` gives those four ids
    (or their positions 0..3 with ``remap``), never 0..max; a label's class names."""
    from PIL import Image

    from conftest import make_image_tree, write_recipe

    data = make_image_tree(tmp_path / "data", classes=("cat", "dog"), per_class=2)
    for i in range(2):
        m = np.zeros((40, 56), np.uint8)
        m[5:15, 5:25] = 2
        m[20:30, 30:50] = 5
        for c in ("cat", "dog"):
            Image.fromarray(m).save(data / c / f"{i:03d}.seg.bmp")
    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": "seg", "inputs": {
            "root": str(data), "match": "{label}/{name}.{ext}", "where": {"ext": "jpg|png"},
            "fields": {"image": {"decoder": "image"},
                       "seg": {"decoder": "mask", "classes": [0, 2, 5, 7], "remap": remap,
                               "path": "{label}/{name}.seg.bmp"}},
            "label": {"capture": "label", "classes": ["bird", "cat", "dog"]}},
        "output": {"format": "hdf5", "samples_per_shard": 4}})
    build(recipe, out_dir=tmp_path / "out")
    res = st.compute_stats(tmp_path / "out" / "seg.h5", fields=["label", "seg"])
    assert res["fields"]["label"]["classes"] == [{"id": 0, "count": 0, "name": "bird"},
                                                 {"id": 1, "count": 2, "name": "cat"},
                                                 {"id": 2, "count": 2, "name": "dog"}]
    per = 40 * 56
    seg = {c["id"]: c["count"] for c in res["fields"]["seg"]["classes"]}
    if remap:
        assert seg == {0: 4 * (per - 200 - 200), 1: 4 * 200, 2: 4 * 200, 3: 0}
    else:
        assert seg == {0: 4 * (per - 200 - 200), 2: 4 * 200, 5: 4 * 200, 7: 0}


def test_stats_of_a_mask_declared_with_sparse_ids_lists_four_classes(tmp_path):
    """The issue's case: ``classes: [0, 3, 7, 200]`` is four classes (not 201), in the spec, the
    stored field spec, the stats and the CLI table."""
    from PIL import Image

    from conftest import write_recipe
    from precompile import load_recipe
    from precompile.compiler.plan import make_plan

    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        m = np.zeros((8, 10), np.uint8)
        m[:4, :5] = (3, 7, 200)[i]
        Image.fromarray(m).save(data / f"{i}.png")
    recipe = write_recipe(tmp_path / "r.yaml", {
        "name": "seg", "inputs": {"root": str(data), "match": "{name}.png",
                                  "fields": {"seg": {"decoder": "mask", "classes": [0, 3, 7, 200]}}},
        "output": {"format": "hdf5"}})
    spec = make_plan(load_recipe(str(recipe))).specs["seg"]
    assert (spec.classes, spec.class_ids) == (4, (0, 3, 7, 200))
    assert spec.describe() == "mask (?, ?, 1) uint8, 4 classes"
    build(recipe, out_dir=tmp_path / "out")
    out = tmp_path / "out" / "seg.h5"
    from precompile.formats import open_dataset
    assert open_dataset(out).field_specs["seg"]["class_ids"] == [0, 3, 7, 200]
    r = CliRunner().invoke(main, ["stats", str(out)])
    assert r.exit_code == 0, r.output
    assert f"classes 0: {3 * 80 - 3 * 20}, 3: 20, 7: 20, 200: 20\n" in r.output + "\n"


def _image_recipe(tmp_path: Path, **over) -> tuple[dict, Path]:
    from conftest import image_recipe, make_image_tree

    root = make_image_tree(tmp_path / "data")
    out = tmp_path / "out"
    return image_recipe(root, **over), out


def test_recipe_stats_true_computes_them_with_the_build_and_after_every_rebuild(tmp_path):
    recipe, out = _image_recipe(tmp_path, stats=True)
    rep = build(recipe, out_dir=out)
    path = out / "imgs.h5"
    assert "stats" in rep["stage_seconds"]
    res = st.read_stats(path)
    assert set(res["fields"]) == {"image", "label"}             # every field
    assert res == json.loads(json.dumps(st.compute_stats(path)))
    # an up-to-date rebuild writes nothing: not even the index
    before = path.read_bytes()
    rep = build(recipe, out_dir=out)
    assert rep["up_to_date"] and path.read_bytes() == before
    # a changed input: one shard rebuilt, the stats follow the new shards
    img = sorted((tmp_path / "data").rglob("*.png"))[0]
    from PIL import Image

    Image.new("RGB", (40, 40), (255, 0, 0)).save(img)
    rep = build(recipe, out_dir=out)
    assert 0 < rep["shards"]["built"] < rep["shards"]["total"]
    new = st.read_stats(path)
    assert new["shard_keys"] == [s["key"] for s in precompile.open(path).shards] != res["shard_keys"]
    assert new["fields"]["image"]["mean"] != res["fields"]["image"]["mean"]
    assert new == json.loads(json.dumps(st.compute_stats(path)))
    # stats that went stale by other means are made current by the next (up-to-date) build
    st.write_stats(path, {**new, "shard_keys": ["stale"]})
    rep = build(recipe, out_dir=out)
    assert rep["up_to_date"] and st.read_stats(path) == new


def test_stats_key_changes_no_shard(tmp_path):
    from precompile.compiler.keys import recipe_key
    from precompile.recipe import load_recipe

    recipe, out = _image_recipe(tmp_path)
    assert recipe_key(load_recipe(recipe)) == recipe_key(load_recipe({**recipe, "stats": True}))
    rep = build(recipe, out_dir=out)
    assert st.read_stats(out / "imgs.h5") is None and "stats" not in rep["stage_seconds"]
    rep = build(recipe, out_dir=out, stats=True)      # the flag on a finished output: shards stay, stats come
    assert rep["shards"]["built"] == 0
    assert set(st.read_stats(out / "imgs.h5")["fields"]) == {"image", "label"}


def test_build_cli_stats_flag_and_the_loader(tmp_path):
    torch = pytest.importorskip("torch")
    from precompile.reader.loader import Loader
    from conftest import write_recipe

    recipe, out = _image_recipe(tmp_path)
    rfile = write_recipe(tmp_path / "r.yaml", recipe)
    r = CliRunner().invoke(main, ["build", str(rfile), "-o", str(out), "--stats", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert ", stats " in r.output
    path = out / "imgs.h5"
    s = st.read_stats(path)["fields"]["image"]
    kw = dict(batch_size=4, shuffle=False, device="cpu", dtype="float32", fields=["image"], num_threads=0)
    x = torch.cat([b["image"] for b in Loader(path, mean="stats", std="stats", **kw)]).double()
    np.testing.assert_allclose(x.mean((0, 1, 2)).numpy(), 0, atol=1e-5)
    assert len(s["mean"]) == 3


def test_split_outputs_each_get_their_stats(tmp_path):
    recipe, out = _image_recipe(tmp_path, stats=True, split={"fractions": {"train": 0.7, "val": 0.3}})
    build(recipe, out_dir=out)
    idx = sorted(out.glob("imgs.*.h5"))
    assert len(idx) == 2
    for p in idx:
        res = st.read_stats(p)
        assert res is not None and res["num_samples"] == len(precompile.open(p))
        assert res == json.loads(json.dumps(st.compute_stats(p)))
