"""``precompile.hf``: a build as a Hugging Face ``datasets.Dataset`` (values and types equal to the
build's) and a ``datasets.Dataset`` as a build's inputs (bytes equal to building the same files)."""
from __future__ import annotations

import importlib.util
import io

import numpy as np
import pytest
from PIL import Image

if importlib.util.find_spec("datasets") is None:
    pytest.skip("Hugging Face datasets is not installed (extra 'hf': pip install 'precompile[hf]')",
                allow_module_level=True)

import datasets  # noqa: E402

import precompile  # noqa: E402
from conftest import REPO, image_recipe, make_image_tree  # noqa: E402
from precompile import build  # noqa: E402
from precompile.hf import build_from_hf, to_hf  # noqa: E402

# datasets' own deprecations (and those of the libraries it calls) are not ours
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


def test_to_hf_rows_equal_the_build(tmp_path):
    root = make_image_tree(tmp_path / "data", per_class=3)
    recipe = image_recipe(root, copies=1, steps=[{"resize": {"size": [12, 16]}}, {"random_flip": {}}])
    build(recipe, out_dir=tmp_path / "out")
    path = tmp_path / "out" / "imgs.h5"
    ds = precompile.open(path)
    hf = to_hf(path, cache_dir=str(tmp_path / "cache"))
    assert isinstance(hf, datasets.Dataset) and len(hf) == len(ds) == 12
    assert hf.features["label"] == datasets.ClassLabel(names=["cat", "dog"])
    assert hf.features["image"] == datasets.Image()
    hf = hf.with_format("numpy")
    for i in range(len(ds)):
        assert hf[i]["__key__"] == ds.key(i) and int(hf[i]["__copy__"]) == ds.copy(i)
        assert hf[i]["image"].dtype == np.uint8 and np.array_equal(hf[i]["image"], ds[i]["image"])
        assert int(hf[i]["label"]) == int(ds[i]["label"])
    only = to_hf(path, fields=["label"], cache_dir=str(tmp_path / "cache"))
    assert set(only.column_names) == {"__key__", "__copy__", "label"}
    with pytest.raises(ValueError, match="no field 'nope'"):
        to_hf(path, fields=["nope"])
    # a rebuild with other bytes is not served stale from the cache
    build(image_recipe(root, copies=1, steps=[{"resize": {"size": [12, 16]}}, {"random_flip": {}}], seed=99),
          out_dir=tmp_path / "out")
    again = to_hf(path, cache_dir=str(tmp_path / "cache")).with_format("numpy")
    ds = precompile.open(path)
    assert all(np.array_equal(again[i]["image"], ds[i]["image"]) for i in range(len(ds)))


def _noise_build(tmp_path, mode: str, size=(48, 64), per_class: int = 5, steps=()):
    """Noise PNGs (what no compression shrinks: the bytes bound's worst case) built in ``mode``."""
    from PIL import Image

    rng = np.random.default_rng(1)
    root = tmp_path / "noise"
    for c in ("a", "b"):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = size if steps else (size[0] + 3 * i, size[1] - 2 * i)   # no steps: variable sizes
            if not (root / c / f"{i}.png").exists():
                Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / c / f"{i}.png")
    r = {"name": f"noise-{mode}", "inputs": {"root": str(root), "match": "{label}/{name}.png",
                                             "fields": {"image": {"decoder": "image", "mode": mode}},
                                             "label": {"capture": "label"}},
         "steps": list(steps), "output": {"format": "hdf5", "samples_per_shard": 4}}
    return build(r, out_dir=tmp_path / "out")["output"]


@pytest.mark.parametrize("mode", ["gray8", "rgb8", "rgba8", "gray16"])
@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "variable"])
def test_to_hf_stores_the_pixels_once_with_equal_values(tmp_path, mode, fixed):
    """Issue 35: image fields become ``Image`` columns (lossless PNG): every pixel equal in its own dtype (one
    channel comes back (H, W)), and the column's bytes within 1.2x of the build's pixel bytes on noise, which
    no compression shrinks (``Array3D`` stored an int32 offset beside each pixel: 5x gray8, 2.3x rgb8)."""
    path = _noise_build(tmp_path, mode, steps=[{"resize": {"size": [48, 64]}}] if fixed else [])
    ds = precompile.open(path)
    assert ds.variable("image") is not fixed
    hf = to_hf(path, cache_dir=str(tmp_path / "cache"))
    assert hf.features["image"] == datasets.Image()
    arrays = hf.with_format("numpy")
    stored = 0
    for i in range(len(ds)):
        want = ds[i]["image"]
        got = arrays[i]["image"]
        assert got.dtype == want.dtype, (i, got.dtype, want.dtype)
        np.testing.assert_array_equal(got, want[..., 0] if want.shape[2] == 1 else want, err_msg=f"row {i}")
        stored += want.nbytes
    assert hf[0]["image"].size == ds[0]["image"].shape[1::-1]   # a PIL image, (width, height)
    ratio = hf.data.column("image").nbytes / stored
    assert ratio <= 1.2, f"{mode}: the Image column holds {ratio:.2f}x the build's pixel bytes"


def test_to_hf_keeps_arrays_a_png_cannot_hold():
    """Only what a PNG holds exactly goes to an ``Image`` column: float images, 2-channel and 16-bit colour
    arrays, non-image kinds keep their array features."""
    from precompile.hf import hf_feature

    assert hf_feature({"kind": "mask", "shape": [8, 8, 1], "dtype": "uint16"}) == datasets.Image()
    assert hf_feature({"kind": "image", "shape": [None, None, 3], "dtype": "uint8"}) == datasets.Image()
    for spec in ({"kind": "image", "shape": [8, 8, 3], "dtype": "float32"},
                 {"kind": "image", "shape": [8, 8, 3], "dtype": "uint16"},
                 {"kind": "image", "shape": [8, 8, 2], "dtype": "uint8"},
                 {"kind": "flow", "shape": [8, 8, 2], "dtype": "float32"},
                 {"kind": "video", "shape": [2, 8, 8, 3], "dtype": "uint8"}):
        assert not isinstance(hf_feature(spec), datasets.Image), spec
    # a fixed shape of 2+ dimensions: one flat fixed-size list; 1-D: a fixed-size list; a variable shape of 2+
    # dimensions: one flat list (its shape in a column of its own); ragged annotations: nested lists
    f32 = datasets.Value("float32")
    assert hf_feature({"kind": "image", "shape": [8, 8, 3], "dtype": "float32"}) == datasets.List(f32, length=192)
    assert hf_feature({"kind": "volume", "shape": [2, 3, 4, 5, 6, 7], "dtype": "float32"}) == \
        datasets.List(f32, length=5040)                     # more dimensions than Array5D's
    assert hf_feature({"kind": "index", "shape": [3], "dtype": "float32"}) == datasets.List(f32, length=3)
    assert hf_feature({"kind": "boxes", "shape": [None, 4], "dtype": "float32"}) == datasets.List(datasets.List(f32))
    from precompile.hf import shape_feature, variable_flat

    for spec in ({"kind": "flow", "shape": [None, None, 2], "dtype": "float32"},
                 {"kind": "flow_valid", "shape": [None, None, 1], "dtype": "uint8"},
                 {"kind": "video", "shape": [8, None, None, 3], "dtype": "float32"},
                 {"kind": "image", "shape": [None, None, 3], "dtype": "float32"},   # no PNG holds it
                 {"kind": "audio", "shape": [1, None], "dtype": "float32"},
                 {"kind": "volume", "shape": [None, 64, 64], "dtype": "float32"}):
        assert variable_flat(spec) and hf_feature(spec) == datasets.List(datasets.Value(spec["dtype"])), spec
        assert shape_feature(spec) == datasets.List(datasets.Value("int32"), length=len(spec["shape"]))
    for spec in ({"kind": "boxes", "shape": [None, 4], "dtype": "float32"},
                 {"kind": "keypoints", "shape": [None, 17, 3], "dtype": "float32"},
                 {"kind": "box_labels", "shape": [None], "dtype": "int64"},
                 {"kind": "mask", "shape": [None, None, 1], "dtype": "uint8"},      # an Image column
                 {"kind": "flow", "shape": [8, 8, 2], "dtype": "float32"},
                 {"kind": "target", "shape": [None], "dtype": "float32"}):          # 1-D: a list is its shape
        assert not variable_flat(spec), spec
    assert hf_feature({"kind": "keypoints", "shape": [None, 17, 3], "dtype": "float32"}) == \
        datasets.List(datasets.List(datasets.List(f32)))
    assert hf_feature({"kind": "target", "shape": [None], "dtype": "float32"}) == datasets.List(f32)
    assert hf_feature({"kind": "audio", "shape": [0, 5], "dtype": "float32"}) == \
        datasets.List(datasets.List(f32))                   # Arrow has no fixed-size list of length 0


def _array_columns(hf) -> dict:
    """Each column's Arrow type, down to its values: what the bytes pay for."""
    import pyarrow as pa

    out = {}
    for name in hf.column_names:
        t, kinds = hf.data.schema.field(name).type, []
        while pa.types.is_list(t) or pa.types.is_fixed_size_list(t) or pa.types.is_large_list(t) or \
                isinstance(t, pa.ExtensionType):
            if isinstance(t, pa.ExtensionType):
                kinds.append("extension")
                t = t.storage_type
                continue
            kinds.append(t.list_size if pa.types.is_fixed_size_list(t) else "list")
            t = t.value_type
        out[name] = kinds
    return out


@pytest.mark.parametrize("recipe, arrays", [
    ("flow", {"flow": (32, 48, 2), "flow_valid": (32, 48, 1)}),          # float32 vectors (NaN unknown), its mask
    ("video", {"video": (8, 32, 32, 3), "frames": (8,)}),                 # uint8 clips, int32 frame indices
    ("ct_lung", {"ct": (16, 32, 32), "lung": (16, 32, 32), "corner": (3,)}),   # float32 CT patches, uint8 mask
    ("audio", {"audio": (1, 8000)}),                                        # float32 windows, channels first
])
def test_to_hf_stores_fixed_shape_arrays_at_the_builds_size(tmp_path, recipe, arrays):
    """Issue 35: a fixed-shape array field (flow, clips, volumes and patches, audio windows, index vectors)
    becomes one fixed-size list of its values in C order: no offsets, so the column holds the build's bytes
    (``Array3D`` and the like keep an int32 offset per innermost list: 1.5x a flow's, 2.4x an RGB clip's, 5x a
    flow_valid mask's), with the shape in ``info.description`` (``shapes``). Every sample, reshaped, comes
    back from ``with_format("numpy", dtype=None)`` in its own dtype and shape with the build's exact bits (NaN
    included); a slice of rows is one (N, size) array."""
    path = build(str(REPO / "recipes" / f"{recipe}.yaml"), out_dir=tmp_path / "out")["output"]
    ds = precompile.open(path)
    hf = to_hf(path, cache_dir=str(tmp_path / "cache"))
    assert len(hf) == len(ds) > 1
    for f in arrays:
        ratio = hf.data.column(f).nbytes / sum(ds[i][f].nbytes for i in range(len(ds)))
        assert ratio <= 1.2, f"{recipe}.{f}: the column holds {ratio:.2f}x the build's bytes"
    kinds = _array_columns(hf)
    for f, shape in arrays.items():
        assert tuple(ds.field_specs[f]["shape"]) == shape
        assert kinds[f] == [int(np.prod(shape))], (f, kinds[f])     # one fixed-size list, nothing else
        assert hf.features[f] == datasets.List(datasets.Value(ds.field_specs[f]["dtype"]), length=int(np.prod(shape)))
    from precompile.hf import shapes

    assert shapes(hf) == {f: s for f, s in arrays.items() if len(s) > 1}
    assert shapes(hf.select([1, 0])) == shapes(hf)           # the description travels with the dataset
    one = next(iter(arrays))
    assert shapes(to_hf(path, fields=[one], cache_dir=str(tmp_path / "cache"))) == \
        ({one: arrays[one]} if len(arrays[one]) > 1 else {})
    arrays_hf = hf.with_format("numpy", dtype=None)
    for i in range(len(ds)):
        want, got = ds[i], arrays_hf[i]
        assert got["__key__"] == ds.key(i)
        for f, shape in arrays.items():
            g = got[f].reshape(shape)
            assert g.dtype == want[f].dtype and g.shape == want[f].shape, (f, i, g.dtype, g.shape)
            assert g.tobytes() == want[f].tobytes(), (f, i)
    if recipe == "flow":
        assert any(np.isnan(ds[i]["flow"]).any() for i in range(len(ds)))   # the unknown vectors came through
    # the whole column at once: one array in the field's dtype, every sample's values in a row
    whole = ds.batch(range(len(ds)))
    for f, shape in arrays.items():
        col = arrays_hf[:][f]
        assert col.shape == (len(ds), int(np.prod(shape))) and col.dtype == whole[f].dtype
        assert col.reshape(-1, *shape).tobytes() == whole[f].tobytes()


def _variable_inputs(tmp_path, recipe: str) -> dict:
    """``recipes/<recipe>.yaml`` without its resize (and crop): over files of a few sizes in ``tmp_path``
    (flow with unknown vectors; short videos), so each sample keeps its own height and width."""
    import av
    import yaml
    from PIL import Image

    from precompile.decoders.flo import write_flo

    rng = np.random.default_rng(3)
    root = tmp_path / "in"
    root.mkdir()
    sizes = [(20, 30), (27, 12), (20, 30), (36, 24)]      # a mask of 20x30: 600 bytes, 16 more a row
    if recipe == "flow":
        for i, (h, w) in enumerate(sizes):
            f = rng.normal(0, 3, (h, w, 2)).astype(np.float32)
            f[: h // 2, : w // 3] = np.nan                         # unknown: NaN in flow, 0 in flow_valid
            write_flo(str(root / f"p{i}_flow.flo"), f)
            for k in (1, 2):
                Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"p{i}_img{k}.png")
    else:
        for i, (h, w) in enumerate([(16, 24), (32, 16)]):
            with av.open(str(root / f"v{i}.mp4"), "w") as c:
                s = c.add_stream("libx264", rate=25)
                s.width, s.height, s.pix_fmt = w, h, "yuv420p"
                for _ in range(20):
                    frame = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                    for pkt in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                        c.mux(pkt)
                for pkt in s.encode():
                    c.mux(pkt)
    r = yaml.safe_load((REPO / "recipes" / f"{recipe}.yaml").read_text())
    r["inputs"]["root"] = str(root)
    r["steps"] = [s for s in r["steps"] if not {"resize", "center_crop"} & set(s)]
    return r


@pytest.mark.parametrize("recipe, arrays", [
    ("flow", {"flow": (None, None, 2), "flow_valid": (None, None, 1)}),  # float32 vectors (NaN unknown), its mask
    ("video", {"video": (8, None, None, 3)}),                             # uint8 clips of each video's size
])
def test_to_hf_stores_variable_shape_arrays_at_the_builds_size(tmp_path, recipe, arrays):
    """Issue 35: an array field of a variable shape (flow or clips built without a resize) becomes one
    variable-length list of its values in C order plus ``<field>__shape``, a fixed-size list of its int32
    dimensions: the column pair holds the build's bytes and a few per row (nested lists paid an int32 offset
    per innermost list: 1.5x a flow's, 2.35x an RGB clip's, 5x a flow_valid mask's). Every sample comes back
    through ``precompile.hf.array`` (and by hand, reshaped by its shape column) in its own dtype and shape
    with the build's exact bits, NaN included; ``shapes`` gives the plan's shape, None where rows differ."""
    from precompile.hf import array, shapes

    path = build(_variable_inputs(tmp_path, recipe), out_dir=tmp_path / "out")["output"]
    ds = precompile.open(path)
    hf = to_hf(path, cache_dir=str(tmp_path / "cache"))
    assert len(hf) == len(ds) > 1
    for f, shape in arrays.items():
        assert tuple(ds.field_specs[f]["shape"]) == shape and ds.variable(f)
        assert len({ds[i][f].shape for i in range(len(ds))}) > 1, f        # the rows do differ in shape
        assert hf.features[f] == datasets.List(datasets.Value(ds.field_specs[f]["dtype"]))
        assert hf.features[f + "__shape"] == datasets.List(datasets.Value("int32"), length=len(shape))
        assert _array_columns(hf)[f] == ["list"] and _array_columns(hf)[f + "__shape"] == [len(shape)]
        stored = sum(ds[i][f].nbytes for i in range(len(ds)))
        col = hf.data.column(f).nbytes + hf.data.column(f + "__shape").nbytes
        assert col / stored <= 1.2, f"{recipe}.{f}: the columns hold {col / stored:.2f}x the build's bytes"
    assert shapes(hf) == arrays
    assert shapes(hf.select([1, 0])) == arrays                # the description travels with the dataset
    one = next(iter(arrays))
    only = to_hf(path, fields=[one], cache_dir=str(tmp_path / "cache"))
    assert set(only.column_names) == {"__key__", one, one + "__shape"} and shapes(only) == {one: arrays[one]}
    as_np, as_py = hf.with_format("numpy", dtype=None), hf
    for i in range(len(ds)):
        want, row = ds[i], as_np[i]
        assert row["__key__"] == ds.key(i)
        for f in arrays:
            by_hand = row[f].reshape(row[f + "__shape"])
            for got in (by_hand, array(hf, row, f), array(hf, as_py[i], f)):   # numpy rows, python lists
                assert got.dtype == want[f].dtype and got.shape == want[f].shape, (f, i, got.dtype, got.shape)
                assert got.tobytes() == want[f].tobytes(), (f, i)
    if recipe == "flow":
        assert all(np.isnan(ds[i]["flow"]).any() for i in range(len(ds)))   # the unknown vectors came through


def test_array_needs_the_shape_of_a_variable_column(tmp_path):
    """``array`` reshapes by the row's shape column; a variable column whose shape column was dropped is an error
    naming both, not a flat array taken for the sample."""
    from precompile.hf import array

    r = _variable_inputs(tmp_path, "flow")
    path = build(r, out_dir=tmp_path / "out")["output"]
    hf = to_hf(path, fields=["flow_valid"], cache_dir=str(tmp_path / "cache"))
    want, got = precompile.open(path)[1]["flow_valid"], array(hf, hf[1], "flow_valid")
    assert got.shape == want.shape == (27, 12, 1) and got.tobytes() == want.tobytes()
    assert array(hf, hf[1], "__key__") == np.asarray(precompile.open(path).key(1))
    cut = hf.remove_columns(["flow_valid__shape"])
    with pytest.raises(ValueError, match=r"column 'flow_valid' has a variable shape \(None, None, 1\) and the row "
                                         r"has no 'flow_valid__shape' column"):
        array(cut, cut[1], "flow_valid")
    # a field named like another's shape column is refused, named, before anything is written
    r["inputs"]["fields"]["flow__shape"] = r["inputs"]["fields"].pop("img2")
    r["name"] = "clash"
    clash = build(r, out_dir=tmp_path / "out")["output"]
    with pytest.raises(ValueError, match=r"clash.h5: field 'flow' has a variable shape and its shape column "
                                         r"'flow__shape' is the name of another column"):
        to_hf(clash, cache_dir=str(tmp_path / "cache"))


def test_shapes_reads_only_its_own_description():
    from precompile.hf import shapes

    hf = datasets.Dataset.from_dict({"x": [[1.0, 2.0]]})
    assert shapes(hf) == {}
    hf.info.description = "a dataset of one row"             # someone else's description: no shapes, no error
    assert shapes(hf) == {}
    hf.info.description = '{"precompile_shapes": {"x": [1, 2], "gone": [3, 4]}}'
    assert shapes(hf) == {"x": (1, 2)}                        # a column no longer there is left out
    hf.info.description = '{"precompile_shapes": {"x": [null, 2]}}'
    assert shapes(hf) == {"x": (None, 2)}                     # a variable dimension


def test_build_from_an_hf_dataset_equals_building_its_files(tmp_path):
    root = make_image_tree(tmp_path / "data", per_class=3)
    files = sorted(p for p in root.rglob("*.*"))
    hf = datasets.Dataset.from_dict(
        {"img": [str(p) for p in files], "label": [0 if p.parent.name == "cat" else 1 for p in files],
         "caption": [f"a {p.parent.name}" for p in files]},
        features=datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog"]),
                                    "caption": datasets.Value("string")}))
    steps = [{"resize": {"size": [16, 16]}}]
    recipe = {"name": "fromhf", "inputs": {"fields": {"img": {"decoder": "image", "mode": "rgb8"}},
                                           "columns": {"label": {"column": "label", "kind": "label"},
                                                       "caption": {"column": "caption", "kind": "text"}}},
              "steps": steps, "output": {"samples_per_shard": 4}}
    rep = build_from_hf(hf, recipe, out_dir=tmp_path / "out")
    assert rep["num_samples"] == len(files)
    got = precompile.open(tmp_path / "out" / "fromhf.h5")
    assert got.label_names == ["cat", "dog"]
    build(image_recipe(root, steps=steps), out_dir=tmp_path / "ref")      # the same files, from their folder
    ref = precompile.open(tmp_path / "ref" / "imgs.h5")
    by_file = {ref.key(i): ref[i] for i in range(len(ref))}
    for i, p in enumerate(files):   # row i of the dataset: key 0000000i, the bytes of its file
        s = got[i]
        assert got.key(i) == f"{i:08d}"
        want = by_file[p.relative_to(root).as_posix()]
        assert np.array_equal(s["img"], want["image"]) and s["label"] == want["label"]
        assert s["caption"] == f"a {p.parent.name}"
    # nothing changed: nothing rebuilt (the staged files keep their bytes and times)
    rep = build_from_hf(hf, recipe, out_dir=tmp_path / "out")
    assert rep["up_to_date"]
    # a changed row: only its shard rebuilds
    hf2 = hf.map(lambda r, i: {"caption": "changed" if i == 5 else r["caption"]}, with_indices=True)
    rep = build_from_hf(hf2, recipe, out_dir=tmp_path / "out")
    assert rep["shards"]["built"] == 1
    assert precompile.open(tmp_path / "out" / "fromhf.h5")[5]["caption"] == "changed"
    # and back: the build as an HF dataset
    back = to_hf(tmp_path / "out" / "fromhf.h5", cache_dir=str(tmp_path / "cache"))
    assert back.features["label"].names == ["cat", "dog"] and back[5]["caption"] == "changed"


def test_build_from_hf_refuses_inputs_it_sets(tmp_path):
    from precompile.errors import RecipeError

    hf = datasets.Dataset.from_dict({"x": [1, 2]})
    with pytest.raises(RecipeError, match="inputs.root is set from the dataset"):
        build_from_hf(hf, {"name": "n", "inputs": {"root": "."}}, out_dir=tmp_path)


def _record_batches(hf) -> list[int]:
    """The rows of each Arrow record batch of ``hf``'s cache files, read with pyarrow (datasets writes Arrow
    IPC streams)."""
    import pyarrow as pa

    rows = []
    for f in hf.cache_files:
        with pa.memory_map(f["filename"]) as src:
            rows += [b.num_rows for b in pa.ipc.open_stream(src)]
    return rows


def test_to_hf_writer_batch_size_reaches_the_arrow_file_and_keeps_the_values(tmp_path):
    """``to_hf(..., writer_batch_size=N)``: each Arrow record batch of the written file holds N rows (the last
    the rest), whatever the layout the same values; another N is not served from the cache of the first."""
    path = build(str(REPO / "recipes" / "flow.yaml"), out_dir=tmp_path / "out")["output"]   # 4 pairs
    ds = precompile.open(path)
    n = len(ds)
    got = {}
    for rows in (1, 3, None):
        hf = to_hf(path, cache_dir=str(tmp_path / "cache"), writer_batch_size=rows)
        per = rows or n     # default: rows of 32x48 flow are small, every row in one batch
        assert _record_batches(hf) == [min(per, n - lo) for lo in range(0, n, per)], rows
        got[rows] = hf.with_format("numpy", dtype=None)[:]
    for rows in (1, 3):
        assert set(got[rows]) == set(got[None]) >= {"__key__", "flow", "flow_valid"}
        for c, want in got[None].items():
            a = got[rows][c]
            assert a.dtype == want.dtype and a.shape == want.shape, (rows, c)
            assert (a.tobytes() == want.tobytes()) if a.dtype != object else (a.tolist() == want.tolist()), (rows, c)
    assert got[None]["flow"].reshape(-1, 32, 48, 2).tobytes() == ds.batch(range(n))["flow"].tobytes()


def test_to_hf_default_writer_batch_size_follows_the_row_size(tmp_path, monkeypatch):
    """The default keeps a record batch to about ``WRITER_BATCH_BYTES`` of stored rows (so its int32 list and
    PNG offsets stay far under 2^31 values): rows of a 32x48x2 float32 flow, its 32x48x1 uint8 mask and two
    32x48x3 uint8 frames take 12,288 + 1,536 + 2 x 4,608 bytes, and no less than each shard's bytes a row;
    at most 1,000 rows, at least 1."""
    from precompile import hf as hfmod

    path = build(str(REPO / "recipes" / "flow.yaml"), out_dir=tmp_path / "out")["output"]
    ds = precompile.open(path)
    names = list(ds.field_specs)
    fixed = sum(int(np.prod(s["shape"])) * np.dtype(s["dtype"]).itemsize for s in ds.field_specs.values())
    per_shard = max(s["bytes"] / s["num_samples"] for s in ds.shards)
    assert hfmod.row_bytes(ds, names) == int(max(fixed, per_shard)) >= 12288 + 1536 + 2 * 4608
    assert hfmod.default_writer_batch_size(ds, names) == 1000            # 256 MiB of ~25 KB rows: over 1,000
    row = hfmod.row_bytes(ds, names)
    monkeypatch.setattr(hfmod, "WRITER_BATCH_BYTES", 2 * row + 1)        # two rows a record batch
    assert hfmod.default_writer_batch_size(ds, names) == 2
    assert _record_batches(to_hf(path, cache_dir=str(tmp_path / "cache"))) == [2] * (len(ds) // 2) + [1] * (len(ds) % 2)
    monkeypatch.setattr(hfmod, "WRITER_BATCH_BYTES", row // 2)            # a row larger than the target: one a batch
    assert hfmod.default_writer_batch_size(ds, names) == 1
    # a volume of 512^3 float32 (512 MiB a row) is one row a batch; 224x224x3 uint8 images 1,000
    monkeypatch.setattr(hfmod, "WRITER_BATCH_BYTES", 256 << 20)

    class Spec:
        def __init__(self, shape, dtype):
            self.field_specs = {"x": {"kind": "volume", "shape": shape, "dtype": dtype}}
            self.shards = []

    assert hfmod.default_writer_batch_size(Spec([512, 512, 512], "float32"), ["x"]) == 1
    assert hfmod.default_writer_batch_size(Spec([64, 256, 256], "float32"), ["x"]) == 16
    assert hfmod.default_writer_batch_size(Spec([224, 224, 3], "uint8"), ["x"]) == 1000


@pytest.mark.parametrize("bad", [0, -3, 2.5, "100", True])
def test_to_hf_writer_batch_size_is_checked(tmp_path, bad):
    with pytest.raises(ValueError) as e:
        to_hf(tmp_path / "nothing.h5", writer_batch_size=bad)
    assert str(e.value) == (f"to_hf: writer_batch_size must be a whole number of rows >= 1 (or None: from the "
                            f"rows' size), got {str(bad)!r}")


def _png_cells(n: int) -> list[dict]:
    out = []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(np.full((4, 6, 3), 40 * i, np.uint8)).save(buf, "PNG")
        out.append({"bytes": buf.getvalue(), "path": None})
    return out


@pytest.mark.parametrize("column", ["../../escaped", "a/../../../escaped", "table.parquet", "x" * 300, "/abs"])
def test_build_from_hf_column_names_stay_inside_the_output(tmp_path, column):
    """A column's name is the dataset's data: its staged files (``<column>/<row>.png``) went where the name led,
    ``../../escaped`` two folders above the output (before the recipe was even read), ``table.parquet`` into a
    folder that then blocked the table. Such a column gets a folder named by its hash."""
    out = tmp_path / "a" / "b" / "out"
    hf = datasets.Dataset.from_dict({column: _png_cells(2), "label": [0, 1]},
                                    features=datasets.Features({column: datasets.Image(),
                                                                "label": datasets.Value("int64")}))
    recipe = {"name": "t", "inputs": {"fields": {"img": {"decoder": "image", "mode": "rgb8", "path": "{" + column + "}"}},
                                      "columns": {"label": {"column": "label", "kind": "label"}}}}
    try:
        build_from_hf(hf, recipe, out_dir=out)
    except Exception as e:   # the recipe may refuse the template; nothing may be written outside ``out`` first
        assert "inputs.fields.img.path" in str(e), e
    else:   # a name a template takes: the build reads the staged files
        got = precompile.open(out / "t.h5")
        assert [int(got[i]["img"][0, 0, 0]) for i in range(2)] == [0, 40]
    outside = [p for p in tmp_path.rglob("*") if out not in p.parents and p != out and p not in out.parents]
    assert outside == []


def test_build_from_hf_refuses_a_name_that_leaves_the_output(tmp_path):
    from precompile.errors import RecipeError

    hf = datasets.Dataset.from_dict({"img": _png_cells(1)}, features=datasets.Features({"img": datasets.Image()}))
    out = tmp_path / "x" / "out"
    with pytest.raises(RecipeError, match=r"build_from_hf: the recipe's name '\.\./evil' must be letters"):
        build_from_hf(hf, {"name": "../evil", "inputs": {"fields": {"img": {"decoder": "image"}}}}, out_dir=out)
    assert [p for p in tmp_path.rglob("*") if "evil" in p.name] == []


@pytest.mark.parametrize("name", ["photo." + "z" * 300, "photo.p g", "photo.png\u200b"])
def test_build_from_hf_takes_a_media_suffix_only_when_it_is_a_plain_one(tmp_path, name):
    """A cell's ``path`` only lends the staged file its suffix: a 300-letter one made a file name too long to
    create (OSError), and odd characters went into the file name. Those are sniffed from the bytes instead."""
    cells = [dict(c, path=name) for c in _png_cells(2)]
    hf = datasets.Dataset.from_dict({"img": cells}, features=datasets.Features({"img": datasets.Image()}))
    build_from_hf(hf, {"name": "t", "inputs": {"fields": {"img": {"decoder": "image", "mode": "rgb8"}}}},
                  out_dir=tmp_path)
    assert sorted(p.name for p in (tmp_path / "t.hf-input" / "img").iterdir()) == ["00000000.png", "00000001.png"]
    got = precompile.open(tmp_path / "t.h5")
    assert [int(got[i]["img"][0, 0, 0]) for i in range(2)] == [0, 40]


def test_build_from_hf_stages_video_and_nifti_columns(tmp_path):
    """``Video`` and ``Nifti`` columns hold files as ``Image`` and ``Audio`` ones do: they were read as other
    columns, which decoded them (a video asked for torchcodec: ImportError). Staged as files, a row's sample
    equals the same file built from a folder, from a path cell (``.nii.gz`` kept whole, which nibabel needs)
    and from a bytes-only cell (suffix sniffed)."""
    import av
    import nibabel as nib

    if not all(hasattr(datasets, n) for n in ("Video", "Nifti")):
        pytest.skip(f"datasets {datasets.__version__} has no Video / Nifti feature")
    rng = np.random.default_rng(5)
    root = tmp_path / "in"
    root.mkdir()
    with av.open(str(root / "v.mp4"), "w") as c:
        s = c.add_stream("mpeg4", rate=10)
        s.width, s.height, s.pix_fmt = 16, 16, "yuv420p"
        for k in range(6):
            f = np.full((16, 16, 3), 30 * k, np.uint8)
            for pkt in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    vol = rng.integers(-1000, 1000, (5, 6, 7)).astype(np.int16)
    nib.save(nib.Nifti1Image(vol, np.eye(4)), str(root / "n.nii.gz"))
    nii_bytes = (root / "n.nii.gz").read_bytes()
    vid_bytes = (root / "v.mp4").read_bytes()
    hf = datasets.Dataset.from_dict(
        {"video": [str(root / "v.mp4"), {"bytes": vid_bytes, "path": None}],
         "vol": [str(root / "n.nii.gz"), {"bytes": nii_bytes, "path": None}]},
        features=datasets.Features({"video": datasets.Video(), "vol": datasets.Nifti()}))
    fields = {"video": {"decoder": "video"}, "vol": {"decoder": "nifti"}}
    build_from_hf(hf, {"name": "t", "inputs": {"fields": fields}}, out_dir=tmp_path / "out")
    staged = sorted(p.relative_to(tmp_path / "out" / "t.hf-input").as_posix()
                    for p in (tmp_path / "out" / "t.hf-input").rglob("0*"))
    assert staged == ["video/00000000.mp4", "video/00000001.mp4", "vol/00000000.nii.gz", "vol/00000001.nii.gz"]
    got = precompile.open(tmp_path / "out" / "t.h5")
    for field, ext in (("video", "mp4"), ("vol", "nii.gz")):   # the same file, built from a folder
        build({"name": field, "inputs": {"root": str(root), "match": "{name}." + ext,
                                         "fields": {field: fields[field]}}}, out_dir=tmp_path / "ref")
        ref = precompile.open(tmp_path / "ref" / f"{field}.h5")[0][field]
        for i in range(2):
            assert np.array_equal(got[i][field], ref), (field, i)
    assert got[0]["video"].shape[0] == 6                             # every frame
    assert np.array_equal(np.squeeze(got[1]["vol"]), vol.T.astype(got[1]["vol"].dtype))   # (z, y, x) of nibabel's


def test_build_from_hf_names_the_column_a_table_cannot_hold_and_the_row_without_a_file(tmp_path):
    """A list of images is no media column (only Image/Audio/Video/Nifti are staged): its decoded PIL images
    reached pyarrow, which said "Could not convert <PIL...>" and named no column. A None media cell said
    "got NoneType"."""
    from precompile.errors import RecipeError

    cells = _png_cells(2)
    recipe = {"name": "t", "inputs": {"fields": {"img": {"decoder": "image"}}}}
    hf = datasets.Dataset.from_dict({"img": cells, "more": [[cells[0]], [cells[1]]]},
                                    features=datasets.Features({"img": datasets.Image(),
                                                                "more": datasets.List(datasets.Image())}))
    with pytest.raises(RecipeError, match=r"hf dataset column 'more' \(List\(Image.*cannot go into the staged table "
                                          r".*drop the column \(dataset.remove_columns\) or cast it"):
        build_from_hf(hf, recipe, out_dir=tmp_path / "a")
    hf = datasets.Dataset.from_dict({"img": [cells[0], None]}, features=datasets.Features({"img": datasets.Image()}))
    with pytest.raises(RecipeError, match=r"hf dataset column 'img', row 1: no file \(the cell is None\)"):
        build_from_hf(hf, recipe, out_dir=tmp_path / "b")
