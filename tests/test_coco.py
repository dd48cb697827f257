"""inputs.coco: COCO annotation files as inputs (precompile/inputs/coco/), checked against independent references:
the JSON read with the json module, pycocotools' own COCO API (annToMask), and the pixels of the shapes
sample_data/make_sample_data.py drew (each annotation in its own colour, recorded under ``color``)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import precompile
from precompile.errors import BuildError, DecodeError, MissingDependencyError, RecipeError

pytest.importorskip("pycocotools", reason="pycocotools (the coco extra) is not installed")
from pycocotools.coco import COCO  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "sample_data" / "coco"
JSON = SAMPLE / "annotations" / "instances.json"


def coco_recipe(root: Path, ann: Path, **coco) -> dict:
    return {"name": "coco", "seed": 3,
            "inputs": {"root": str(root), "coco": {"file": str(ann), **coco}},
            "output": {"format": "hdf5", "samples_per_shard": 3}}


def build(tmp_path: Path, recipe: dict, name: str = "out", **kw):
    rep = precompile.build(recipe, tmp_path / name, n_jobs=kw.pop("n_jobs", 1), **kw)
    index = tmp_path / name / (recipe["name"] + (".json" if recipe["output"]["format"] != "hdf5" else ".h5"))
    return rep, precompile.open(str(index))


def by_key(ds) -> dict[str, dict]:
    return {ds.key(i): ds[i] for i in range(len(ds))}


@pytest.fixture(scope="module")
def reference() -> dict:
    """The sample file read plainly: per file name, its image record and annotations in file order."""
    data = json.loads(JSON.read_text())
    out = {im["file_name"]: {"image": im, "anns": []} for im in data["images"]}
    names = {im["id"]: im["file_name"] for im in data["images"]}
    for a in data["annotations"]:
        out[names[a["image_id"]]]["anns"].append(a)
    out["__categories__"] = {c["id"]: c for c in data["categories"]}
    return out


@pytest.fixture
def sample_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "coco"
    shutil.copytree(SAMPLE, dst)
    return dst


# -- fields against the JSON and pycocotools ---------------------------------------------------------------

def test_boxes_and_labels_are_the_coco_boxes_converted_and_named(tmp_path, reference):
    rep, ds = build(tmp_path, coco_recipe(SAMPLE / "images", JSON))
    assert rep.num_samples == 8 and len(ds) == 8                     # the image with no annotations too
    cats = reference["__categories__"]
    assert ds.label_names == [cats[i]["name"] for i in sorted(cats)] == ["person", "car", "dog", "potted plant"]
    assert [c["id"] for c in ds.coco["categories"]] == [1, 3, 18, 64]
    assert ds.field_specs["boxes"] == {"kind": "boxes", "shape": [None, 4], "dtype": "float32", "of": "image"}
    assert ds.field_specs["box_labels"] == {"kind": "box_labels", "shape": [None], "dtype": "int64", "of": "boxes"}
    samples = by_key(ds)
    assert sorted(samples) == sorted(k for k in reference if not k.startswith("__"))
    assert {ds.key(i): ds.meta(i)["coco"]["image_id"] for i in range(len(ds))} == \
        {k: r["image"]["id"] for k, r in reference.items() if not k.startswith("__")}
    for key, s in samples.items():
        anns = [a for a in reference[key]["anns"] if not a["iscrowd"]]     # crowd: drop (the default)
        want = np.array([[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in anns)],
                        dtype=np.float32).reshape(-1, 4)
        assert s["boxes"].dtype == np.float32 and np.array_equal(s["boxes"], want), key
        assert [ds.label_names[i] for i in s["box_labels"]] == [cats[a["category_id"]]["name"] for a in anns]
        im = reference[key]["image"]
        assert s["image"].shape == (im["height"], im["width"], 3)
    assert samples["000000000104.png"]["boxes"].shape == (0, 4)
    assert samples["000000000104.png"]["box_labels"].shape == (0,)


def _reference_map(coco: COCO, iid: int, mode: str, crowd: str, dtype) -> np.ndarray:
    """The documented mask rule, painted from pycocotools' own annToMask: crowd regions first (ignore),
    then objects by decreasing pixel count, equal counts in file order."""
    info = coco.imgs[iid]
    out = np.zeros((info["height"], info["width"]), dtype=dtype)
    anns = coco.imgToAnns[iid]
    objs = [a for a in anns if crowd == "keep" or not a["iscrowd"]]
    for a in anns:
        if a["iscrowd"] and crowd == "ignore":
            out[coco.annToMask(a) > 0] = np.iinfo(dtype).max
    cat_ids = sorted(coco.cats)
    masks = [(i, a, coco.annToMask(a)) for i, a in enumerate(objs)]
    masks.sort(key=lambda t: -int(t[2].sum()))
    for i, a, m in masks:
        out[m > 0] = cat_ids.index(a["category_id"]) + 1 if mode == "semantic" else i + 1
    return out[..., None]


# pycocotools' own decode (the reference here) warns under numpy 2; precompile silences it in its own calls
@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
@pytest.mark.parametrize("mode, crowd", [("semantic", "drop"), ("semantic", "ignore"), ("instance", "keep"),
                                         ("instance", "ignore")])
def test_masks_equal_pycocotools_decode(tmp_path, mode, crowd):
    _, ds = build(tmp_path, coco_recipe(SAMPLE / "images", JSON, mask=mode, crowd=crowd))
    coco = COCO(str(JSON))
    dtype = np.uint8 if mode == "semantic" else np.uint16
    ids = {im["file_name"]: i for i, im in coco.imgs.items()}
    for key, s in by_key(ds).items():
        assert s["mask"].dtype == dtype
        assert np.array_equal(s["mask"], _reference_map(coco, ids[key], mode, crowd, dtype)), key
    assert ds.coco["mask_ignore"] == (np.iinfo(dtype).max if crowd == "ignore" else None)


def test_instance_mask_is_the_drawn_pixels_of_each_object(tmp_path, reference):
    """Independent of pycocotools: the generator painted each annotation's rectangles in its own colour,
    larger objects first; polygons and both RLE forms must give exactly those pixels."""
    _, ds = build(tmp_path, coco_recipe(SAMPLE / "images", JSON, mask="instance", crowd="keep"))
    checked = 0
    for key, s in by_key(ds).items():
        for i, a in enumerate(reference[key]["anns"]):
            drawn = (s["image"] == np.array(a["color"], dtype=np.uint8)).all(-1)
            assert drawn.any()
            assert np.array_equal(s["mask"][..., 0] == i + 1, drawn), (key, a["id"])
            checked += 1
    assert checked == 15


def test_crowd_policies(tmp_path, reference):
    crowd_ids = {a["id"] for k, r in reference.items() if not k.startswith("__") for a in r["anns"] if a["iscrowd"]}
    assert len(crowd_ids) == 2                       # one compressed, one uncompressed RLE
    for policy, boxes in (("drop", 13), ("ignore", 13), ("keep", 15)):
        _, ds = build(tmp_path, coco_recipe(SAMPLE / "images", JSON, crowd=policy), name=policy)
        assert sum(len(s["boxes"]) for s in by_key(ds).values()) == boxes
    key = "000000000103.png"
    s = by_key(ds)[key]
    a = reference[key]["anns"][0]
    assert a["iscrowd"] and s["boxes"][0].tolist() == [4, 4, 28, 24] and ds.label_names[s["box_labels"][0]] == "person"


def test_keypoints_round_trip_with_names_and_skeleton(tmp_path, reference):
    _, ds = build(tmp_path, coco_recipe(SAMPLE / "images", JSON, keypoints=True))
    cats = reference["__categories__"]
    assert ds.coco["keypoints"] == cats[1]["keypoints"] and ds.coco["skeleton"] == cats[1]["skeleton"]
    assert ds.field_specs["keypoints"]["shape"] == [None, 5, 3]
    n = 0
    for key, s in by_key(ds).items():
        anns = [a for a in reference[key]["anns"] if not a["iscrowd"]]
        want = np.array([np.reshape(a["keypoints"], (5, 3)) if "keypoints" in a else np.zeros((5, 3))
                         for a in anns], dtype=np.float32).reshape(-1, 5, 3)
        assert s["keypoints"].dtype == np.float32 and np.array_equal(s["keypoints"], want), key
        n += sum("keypoints" in a for a in anns)
    assert n == 4
    # each visible keypoint lies on its person's pixels (the generator put them at pixel centres inside)
    s = by_key(ds)["000000000102.png"]
    person = reference["000000000102.png"]["anns"][0]
    for x, y, v in s["keypoints"][0]:
        if v:
            assert (s["image"][int(y), int(x)] == person["color"]).all()


def test_png_output_round_trips_the_ragged_fields_like_hdf5(tmp_path):
    r = coco_recipe(SAMPLE / "images", JSON, keypoints=True, mask="instance")
    _, h5 = build(tmp_path, r, name="h5")
    r["output"]["format"] = "png"
    _, png = build(tmp_path, r, name="png")
    assert png.label_names == h5.label_names and png.coco == h5.coco
    a, b = by_key(h5), by_key(png)
    assert sorted(a) == sorted(b)
    for key in a:
        for f in ("image", "boxes", "box_labels", "keypoints", "mask"):
            assert a[key][f].dtype == b[key][f].dtype and np.array_equal(a[key][f], b[key][f]), (key, f)


@pytest.mark.parametrize("how", ["loky", "isolated", "dask"])
def test_same_bytes_for_any_job_count_backend_and_isolated_decoding(tmp_path, how):
    r = coco_recipe(SAMPLE / "images", JSON, mask="semantic", keypoints=True)
    _, one = build(tmp_path, r, name="one")
    if how == "dask":
        pytest.importorskip("distributed", reason="dask.distributed is not installed (extra 'dask')")
        _, other = build(tmp_path, r, name="other", n_jobs=2, scheduler="local")
    else:   # loky workers get the items pickled; the isolated helper decodes with the annotations kept here
        _, other = build(tmp_path, r, name="other", **({"n_jobs": 2} if how == "loky" else {"timeout_s": 60}))
    assert [s["checksums"] for s in one.shards] == [s["checksums"] for s in other.shards]


# -- scale: a JPEG decoded at a reduced scale ------------------------------------------------------------------

def test_reduced_jpeg_decode_scales_boxes_keypoints_and_mask(tmp_path):
    from PIL import Image

    (tmp_path / "img").mkdir()
    img = np.zeros((40, 64, 3), dtype=np.uint8)
    img[8:24, 16:48] = 200
    Image.fromarray(img).save(tmp_path / "img" / "a.jpg", quality=95)
    ann = {"images": [{"id": 1, "file_name": "a.jpg", "height": 40, "width": 64}],
           "categories": [{"id": 5, "name": "thing", "keypoints": ["c"], "skeleton": []}],
           "annotations": [{"id": 9, "image_id": 1, "category_id": 5, "bbox": [16, 8, 32, 16], "iscrowd": 0,
                            "segmentation": [[16, 8, 48, 8, 48, 24, 16, 24]], "keypoints": [31, 15, 2]}]}
    (tmp_path / "a.json").write_text(json.dumps(ann))
    r = coco_recipe(tmp_path / "img", tmp_path / "a.json", mask="semantic", keypoints=True)
    r["inputs"]["fields"] = {"image": {"decoder": "image", "reduce": 2}}
    _, ds = build(tmp_path, r)
    s = ds[0]
    assert s["image"].shape == (20, 32, 3)
    assert s["boxes"].tolist() == [[8, 4, 24, 12]] and s["keypoints"].tolist() == [[[15.5, 7.5, 2]]]
    want = np.zeros((20, 32, 1), dtype=np.uint8)
    want[4:12, 8:24] = 1
    assert np.array_equal(s["mask"], want)


def test_image_of_another_size_than_the_json_says_fails_that_input(tmp_path, sample_copy):
    from PIL import Image

    Image.new("RGB", (30, 20)).save(sample_copy / "images" / "000000000105.png")
    r = coco_recipe(sample_copy / "images", sample_copy / "annotations" / "instances.json")
    r["on_error"] = "skip"
    rep, ds = build(tmp_path, r)
    assert len(ds) == 7 and len(rep.failures) == 1
    f = rep.failures[0]
    assert f.path.endswith("000000000105.png") and f.stage == "decode"
    assert "the image is 20x30 (h x w) but the annotation file gives 48x64 for image id 105" in f.message


# -- errors --------------------------------------------------------------------------------------------

def _edit(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def _plan_error(tmp_path: Path, sample_copy: Path, **coco) -> RecipeError:
    r = coco_recipe(sample_copy / "images", sample_copy / "annotations" / "instances.json", **coco)
    with pytest.raises(RecipeError) as e:
        precompile.build(r, tmp_path / "out", n_jobs=1)
    assert not (tmp_path / "out" / "coco.h5").exists()
    return e.value


@pytest.mark.parametrize("edit, loc, message, key", [
    (lambda d: d["annotations"][3].update(image_id=999), "annotations[3]",
     "annotation id 4: image_id 999 is not in images", None),
    (lambda d: d["annotations"][0].update(category_id=2), "annotations[0]",
     "annotation id 1 (image id 101, '000000000101.png'): category_id 2 is not in categories", "101"),
    (lambda d: d["annotations"][5].update(bbox=[1, 2, -3, 4]), "annotations[5]",
     "annotation id 6 (image id 103, '000000000103.png'): bbox [1, 2, -3, 4] has a negative width or height", "103"),
    (lambda d: d["annotations"][1].pop("bbox"), "annotations[1]",
     "annotation id 2 (image id 101, '000000000101.png'): needs an integer id, image_id, category_id and bbox "
     "[x, y, w, h] of 4 numbers", "101"),
    (lambda d: d["annotations"][2].update(id=1), "annotations[2]",
     "annotation id 1 is listed twice (annotations[0] too)", None),
    (lambda d: d["images"][1].update(file_name="../x.png"), "images[1]",
     "image id 105: file_name '../x.png' must be a relative path inside inputs.root", "../x"),
    (lambda d: d["images"][1].update(file_name="./" + d["images"][0]["file_name"]), "images[1]",
     "image id 105: file_name './000000000102.png' names the file of image id 102 ('000000000102.png'), written "
     "another way (a sample key must be unique)", None),
    (lambda d: d["annotations"][1].update(keypoints=[1, 2]), "annotations[1]",
     "annotation id 2 (image id 101, '000000000101.png'): keypoints must be 15 numbers", "101"),
    (lambda d: d["annotations"][4]["segmentation"].update(size=[10, 10]), "annotations[4]",
     "annotation id 5 (image id 103, '000000000103.png'): RLE size [10, 10] is not its image's [height, width] "
     "[48, 64]", "103"),
])
def test_bad_annotations_are_errors_naming_file_image_and_annotation(tmp_path, sample_copy, edit, loc, message,
                                                                     key):
    """on_error: fail stops the plan at a bad entry, naming the file, the entry, the annotation and its image;
    on_error: skip fails only the image the entry belongs to (one whose image is unknown, or a duplicate id, is
    the file's error either way)."""
    ann = sample_copy / "annotations" / "instances.json"
    _edit(ann, lambda d: d["annotations"][1].update(category_id=1))     # annotation id 2: a person now
    _edit(ann, edit)
    e = _plan_error(tmp_path, sample_copy, keypoints=True, mask="semantic", crowd="keep")
    assert e.source == str(ann) and e.loc == loc and message in e.detail
    assert str(e).startswith(f"{ann}: {loc}: ")
    r = coco_recipe(sample_copy / "images", ann, keypoints=True, mask="semantic", crowd="keep")
    r["on_error"] = "skip"
    if key is None:
        with pytest.raises(RecipeError) as e2:
            precompile.build(r, tmp_path / "skip", n_jobs=1)
        assert e2.value.detail == e.detail
        return
    rep, ds = build(tmp_path, r, name="skip")
    (f,) = rep.failures
    assert f.key == (f"000000000{key}.png" if key.isdigit() else f"{key}.png")
    assert f.stage == "annotations" and f.message.endswith(f"{ann}: {loc}: {e.detail}")
    assert len(ds) == 7 and f.key not in [ds.key(i) for i in range(len(ds))]


def test_malformed_json_names_the_file_and_line(tmp_path, sample_copy):
    ann = sample_copy / "annotations" / "instances.json"
    ann.write_text('{"images": [\n  {"id": 1,, }]}')
    e = _plan_error(tmp_path, sample_copy)
    assert str(e) == f"{ann}: not valid JSON: line 2, column 12: Expecting property name enclosed in double quotes"


def test_missing_annotation_file_names_the_recipe_key(tmp_path):
    r = coco_recipe(SAMPLE / "images", tmp_path / "nope.json")
    with pytest.raises(RecipeError) as e:
        precompile.build(r, tmp_path / "out", n_jobs=1)
    assert e.value.loc == "inputs.coco.file"
    assert e.value.detail == f"cannot read the COCO annotation file {tmp_path / 'nope.json'}: No such file or directory"


def test_image_missing_on_disk_is_a_per_input_failure(tmp_path, sample_copy):
    (sample_copy / "images" / "000000000102.png").unlink()
    r = coco_recipe(sample_copy / "images", sample_copy / "annotations" / "instances.json")
    with pytest.raises(BuildError):
        precompile.build(r, tmp_path / "fail", n_jobs=1)
    r["on_error"] = "skip"
    rep, ds = build(tmp_path, r, name="skip")
    assert len(ds) == 7 and "000000000102.png" not in [ds.key(i) for i in range(len(ds))]
    (f,) = rep.failures
    assert f.path == str(sample_copy / "images" / "000000000102.png") and f.key == "000000000102.png"
    assert f.stage == "decode" and "input file is missing" in f.message


@pytest.mark.parametrize("inputs, loc, message", [
    ({"match": "{n}.png"}, "inputs.match", "does not apply with inputs.coco"),
    ({"fields": {"picture": {"decoder": "image"}}}, "inputs.coco.image", "'image' is not a field in inputs.fields"),
    ({"fields": {"image": {"decoder": "mask"}}}, "inputs.coco.image", "the annotations need an image field 'image'"),
    ({"fields": {"image": {"decoder": "image"}, "boxes": {"decoder": "image", "path": "{stem}.png"}}},
     "inputs.fields.boxes", "field 'boxes' clashes with a field inputs.coco adds (boxes, box_labels; and the meta key 'coco')"),
    ({"fields": {"image": {"decoder": "image", "path": "{name}.png"}}}, "inputs.fields.image.path",
     "uses capture(s) ['name'] that inputs.coco does not define"),
])
def test_recipe_errors(tmp_path, inputs, loc, message):
    r = coco_recipe(SAMPLE / "images", JSON)
    r["inputs"].update(inputs)
    with pytest.raises(RecipeError) as e:
        precompile.build(r, tmp_path / "out", n_jobs=1)
    assert e.value.loc == loc and message in e.value.detail


def test_keypoints_asked_of_a_file_without_them(tmp_path, sample_copy):
    ann = sample_copy / "annotations" / "instances.json"
    _edit(ann, lambda d: [c.pop("keypoints", None) for c in d["categories"]])
    e = _plan_error(tmp_path, sample_copy, keypoints=True)
    assert e.loc == "inputs.coco.keypoints" and e.detail == f"no category in {ann} has keypoints"


def test_missing_pycocotools_names_the_extra(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pycocotools", None)
    with pytest.raises(MissingDependencyError, match=r"pip install precompile\[coco\]"):
        precompile.build(coco_recipe(SAMPLE / "images", JSON, mask="semantic"), tmp_path / "out", n_jobs=1)
    rep, _ = build(tmp_path, coco_recipe(SAMPLE / "images", JSON), name="boxes_only")   # boxes need none
    assert rep.num_samples == 8


# -- incremental ----------------------------------------------------------------------------------------

def test_changed_annotation_rebuilds_only_its_shard(tmp_path, sample_copy):
    ann = sample_copy / "annotations" / "instances.json"
    r = coco_recipe(sample_copy / "images", ann, mask="instance")
    r["output"]["samples_per_shard"] = 2                                 # 4 shards of 2 images
    first, _ = build(tmp_path, r)
    assert first["shards"]["built"] == 4
    again, _ = build(tmp_path, r)
    assert again["shards"]["built"] == 0
    _edit(ann, lambda d: next(a for a in d["annotations"] if a["id"] == 12)["bbox"].__setitem__(0, 45))  # image 107
    rep, ds = build(tmp_path, r)
    assert rep["shards"]["built"] == 1 and rep["shards"]["skipped"] == 3
    assert by_key(ds)["000000000107.png"]["boxes"][1, 0] == 45
    _edit(ann, lambda d: next(a for a in d["annotations"] if a["id"] == 1)["segmentation"][0].__setitem__(0, 9))
    rep, _ = build(tmp_path, r)
    assert rep["shards"]["built"] == 1                                   # a polygon vertex: image 101's shard


def test_recipe_file_and_cli(tmp_path):
    """recipes/coco.yaml builds through the CLI (its resize moves the image and mask; boxes are moved by
    the geometric steps' rules)."""
    from click.testing import CliRunner

    from precompile.cli import main

    res = CliRunner().invoke(main, ["build", str(REPO / "recipes" / "coco.yaml"), "-o", str(tmp_path), "-j", "1"])
    assert res.exit_code == 0, res.output
    ds = precompile.open(str(tmp_path / "coco.h5"))
    assert len(ds) == 8 and ds.label_names == ["person", "car", "dog", "potted plant"]
    s = by_key(ds)["000000000105.png"]
    assert s["image"].shape == (96, 128, 3) and s["mask"].shape == (96, 128, 1)
    assert sorted(np.unique(s["mask"]).tolist()) == [0, 3, 4]            # dog (label 2) on the plant (label 3)


def test_short_form_defaults_and_schema(tmp_path):
    """`coco: FILE` is `coco: {file: FILE}` with the defaults, fields default to one image field, and the
    JSON Schema accepts what the parser accepts (and refuses an unknown option or crowd value)."""
    jsonschema = pytest.importorskip("jsonschema")
    from precompile.compiler.plan import make_plan
    from precompile.recipe import load_recipe
    from precompile.tools.schema import recipe_schema

    short = {"name": "c", "inputs": {"root": str(SAMPLE / "images"), "coco": str(JSON)}}
    rec = load_recipe(short)
    assert rec.model.inputs.coco.model_dump() == {"file": str(JSON), "image": "image", "mask": "none",
                                                  "keypoints": False, "crowd": "drop"}
    assert list(rec.model.inputs.fields) == ["image"] and rec.model.inputs.fields["image"].decoder == "image"
    assert "match" not in rec.resolved()["inputs"]
    plan = make_plan(rec)
    assert list(plan.specs) == ["image", "boxes", "box_labels"] and len(plan.items) == 8
    long = {"name": "c", "inputs": {"root": str(SAMPLE / "images"), "coco": {"file": str(JSON)}}}
    assert load_recipe(long).content_hash() == rec.content_hash()
    v = jsonschema.Draft202012Validator(recipe_schema())
    assert not list(v.iter_errors(short)) and not list(v.iter_errors(long))
    for bad in ({"file": str(JSON), "crowd": "maybe"}, {"file": str(JSON), "masks": "semantic"}):
        data = {**long, "inputs": {**long["inputs"], "coco": bad}}
        assert list(v.iter_errors(data))
        with pytest.raises(RecipeError) as e:
            load_recipe(data)
        assert e.value.loc.startswith("inputs.coco")


def test_more_fields_with_path_templates(tmp_path, sample_copy):
    """Fields beside the image find their files through {file_name}, {stem} and {image_id}."""
    import os

    (sample_copy / "by_id").mkdir()
    for name in os.listdir(sample_copy / "images"):
        shutil.copy(sample_copy / "images" / name, sample_copy / "by_id" / f"id{int(name[:-4])}.png")
    r = coco_recipe(sample_copy, sample_copy / "annotations" / "instances.json")    # root: the common folder
    r["inputs"]["fields"] = {"image": {"decoder": "image", "path": "images/{file_name}"},
                             "same": {"decoder": "image", "path": "images/{stem}.png"},
                             "by_id": {"decoder": "image", "path": "by_id/id{image_id}.png", "mode": "gray8"}}
    _, ds = build(tmp_path, r)
    assert sorted(by_key(ds)) == sorted(os.listdir(sample_copy / "images"))     # keys: the file names
    for s in by_key(ds).values():
        assert np.array_equal(s["same"], s["image"]) and s["by_id"].shape == s["image"].shape[:2] + (1,)
    r["inputs"]["fields"]["by_id"]["path"] = "../by_id/id{image_id}.png"            # a template out of the root
    with pytest.raises(RecipeError) as e:
        build(tmp_path, r, name="out2")
    assert e.value.loc == "inputs.fields.by_id.path" and e.value.detail.startswith(
        "must stay inside inputs.root (no leading '/' or '..')")


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_files_against_pycocotools(tmp_path, seed):
    """Random files: category ids with gaps listed in any order, annotations in any order over the images,
    free-form polygons (several per object), compressed and uncompressed RLE, crowd flags, images without
    annotations. Boxes, labels and instance masks against the JSON and pycocotools' COCO API."""
    from PIL import Image
    from pycocotools import mask as cocomask

    rng = np.random.default_rng(seed)
    h, w = 24, 32
    (tmp_path / "img").mkdir()
    cat_ids = sorted(rng.choice(np.arange(1, 100), size=5, replace=False).tolist())
    cats = [{"id": c, "name": f"c{c}"} for c in rng.permutation(cat_ids).tolist()]
    images = [{"id": int(i), "file_name": f"{i}.png", "height": h, "width": w} for i in rng.permutation(12) + 1]
    for im in images:
        Image.fromarray(np.zeros((h, w, 3), dtype=np.uint8)).save(tmp_path / "img" / im["file_name"])
    anns = []
    for aid in rng.permutation(40) + 1:
        x, y = rng.uniform(0, w - 4), rng.uniform(0, h - 4)
        bw, bh = rng.uniform(0, w - x), rng.uniform(0, h - y)
        polys = [[float(v) for v in np.stack([x + rng.uniform(0, bw, 5), y + rng.uniform(0, bh, 5)], 1).reshape(-1)]
                 for _ in range(int(rng.integers(1, 3)))]
        crowd = int(rng.random() < 0.2)
        seg = polys
        if crowd:
            m = cocomask.decode(cocomask.merge(cocomask.frPyObjects(polys, h, w)))
            seg = cocomask.encode(np.asfortranarray(m))
            seg = {"counts": seg["counts"].decode("ascii"), "size": [h, w]}
        anns.append({"id": int(aid), "image_id": int(rng.integers(1, 11)), "category_id": int(rng.choice(cat_ids)),
                     "bbox": [x, y, bw, bh], "iscrowd": crowd, "segmentation": seg})
    (tmp_path / "a.json").write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    _, ds = build(tmp_path, coco_recipe(tmp_path / "img", tmp_path / "a.json", mask="instance", crowd="keep"))
    coco = COCO(str(tmp_path / "a.json"))
    names = [f"c{c}" for c in cat_ids]
    assert ds.label_names == names and len(ds) == 12
    ids = {im["file_name"]: im["id"] for im in images}
    for key, s in by_key(ds).items():
        objs = coco.imgToAnns[ids[key]]
        want = np.array([[x, y, x + bw, y + bh] for x, y, bw, bh in (a["bbox"] for a in objs)], np.float32)
        assert np.array_equal(s["boxes"], want.reshape(-1, 4))
        assert [names[i] for i in s["box_labels"]] == [f"c{a['category_id']}" for a in objs]
        assert np.array_equal(s["mask"], _reference_map(coco, ids[key], "instance", "keep", np.uint16)), key


def test_reduce_auto_ahead_of_a_resize_keeps_the_mask_on_the_image(tmp_path):
    """The image decoder's default (reduce: auto) decodes a JPEG at 1/2 ahead of a resize to a quarter: the
    mask is made at the decoded size and the resize takes both to the same size."""
    from PIL import Image

    (tmp_path / "img").mkdir()
    img = np.zeros((40, 64, 3), dtype=np.uint8)
    img[8:24, 16:48] = 200
    Image.fromarray(img).save(tmp_path / "img" / "a.jpg", quality=95)
    ann = {"images": [{"id": 1, "file_name": "a.jpg", "height": 40, "width": 64}],
           "categories": [{"id": 5, "name": "thing"}],
           "annotations": [{"id": 9, "image_id": 1, "category_id": 5, "bbox": [16, 8, 32, 16], "iscrowd": 0,
                            "segmentation": [[16, 8, 48, 8, 48, 24, 16, 24]]}]}
    (tmp_path / "a.json").write_text(json.dumps(ann))
    r = coco_recipe(tmp_path / "img", tmp_path / "a.json", mask="semantic")
    r["steps"] = [{"resize": {"size": [10, 16]}}]
    rep, ds = build(tmp_path, r)
    # the decode scale, the source's size and the map back to it (decoded at 1/2, then resized to a half: x4)
    assert not rep.failures and ds.meta(0)["image"] == {"reduce": 2, "source_size": [40, 64],
                                                        "to_source": [[4.0, 0.0, 0.0], [0.0, 4.0, 0.0]]}
    s = ds[0]
    want = np.zeros((10, 16, 1), dtype=np.uint8)
    want[2:6, 4:12] = 1
    assert s["image"].shape == (10, 16, 3) and np.array_equal(s["mask"], want)
    assert ds.to_source(0, boxes=s["boxes"]).tolist() == [[16, 8, 48, 24]]   # the file's bbox [16, 8, 32, 16]


def test_string_image_ids_and_a_bad_image_record(tmp_path, sample_copy):
    """Some exports write image ids as strings: they work like integers (and reach the sample meta as they
    are); an image record without a size is a plan-time error naming it."""
    ann = sample_copy / "annotations" / "instances.json"

    def to_str(d):
        for im in d["images"]:
            im["id"] = f"img{im['id']}"
        for a in d["annotations"]:
            a["image_id"] = f"img{a['image_id']}"
    _edit(ann, to_str)
    _, ref = build(tmp_path, coco_recipe(SAMPLE / "images", JSON, mask="instance"), name="ints")
    _, ds = build(tmp_path, coco_recipe(sample_copy / "images", ann, mask="instance"), name="strs")
    assert [s["checksums"] for s in ds.shards] == [s["checksums"] for s in ref.shards]
    assert ds.meta(0)["coco"]["image_id"] == "img" + str(ref.meta(0)["coco"]["image_id"])
    _edit(ann, lambda d: d["images"][2].pop("height"))
    e = _plan_error(tmp_path, sample_copy)
    assert e.loc == "images[2]" and e.detail == ("image id 'img108' ('000000000108.png'): height and width must be "
                                                 "whole numbers from 1 to 2147483647, got None and 64")
    _edit(ann, lambda d: d["images"][2].pop("file_name"))
    e = _plan_error(tmp_path, sample_copy)
    assert e.loc == "images[2]" and e.detail == "an image needs an id (an integer or a string) and a file_name"


# -- EXIF orientation: the annotations describe the stored pixels, and move with them -----------------------

SQUARE_OBJECTS = [   # (x, y, w, h) on a 64x64 image, each painted in its own colour; edges on 8-pixel blocks
    ((8, 0, 16, 24), (230, 30, 30)), ((40, 8, 24, 8), (30, 230, 30)), ((16, 40, 8, 16), (30, 30, 230)),
    ((48, 48, 8, 8), (230, 230, 30))]


def _square_with_exif(tmp_path: Path, orientation: int) -> tuple[Path, Path]:
    """A 64x64 JPEG whose stored pixels hold SQUARE_OBJECTS (4:4:4, quality 95), with EXIF ``orientation``,
    and its COCO file: a box, a rectangle polygon and a keypoint at the centre of each object."""
    from PIL import Image

    img = np.zeros((64, 64, 3), np.uint8)
    anns = []
    for i, ((x, y, w, h), colour) in enumerate(SQUARE_OBJECTS):
        img[y:y + h, x:x + w] = colour
        anns.append({"id": i + 1, "image_id": 1, "category_id": 1, "bbox": [x, y, w, h], "iscrowd": 0,
                     "segmentation": [[x, y, x + w, y, x + w, y + h, x, y + h]],
                     "keypoints": [x + w / 2, y + h / 2, 2]})
    (tmp_path / "img").mkdir()
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(img).save(tmp_path / "img" / "sq.jpg", exif=exif.tobytes(), quality=95, subsampling=0)
    (tmp_path / "a.json").write_text(json.dumps({
        "images": [{"id": 1, "file_name": "sq.jpg", "height": 64, "width": 64}], "annotations": anns,
        "categories": [{"id": 1, "name": "thing", "keypoints": ["centre"], "skeleton": []}]}))
    return tmp_path / "img", tmp_path / "a.json"


def _nearest_colour(image: np.ndarray) -> np.ndarray:
    """Each pixel's object (1 + index into SQUARE_OBJECTS), or 0 for the black background."""
    palette = np.array([[0, 0, 0]] + [c for _, c in SQUARE_OBJECTS], np.float64)
    d = ((image[..., None, :].astype(np.float64) - palette) ** 2).sum(-1)
    return d.argmin(-1)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_moves_boxes_keypoints_and_mask_with_the_image(tmp_path, orientation):
    """A square JPEG turned by its EXIF orientation (the size check cannot notice a square): each box is the
    extent of its colour in the decoded (upright) image, each keypoint the centre of it, and `mask == i + 1`
    its pixels; the mask equals the stored pixels' mask turned by Pillow's own exif_transpose."""
    from PIL import Image, ImageOps

    root, ann = _square_with_exif(tmp_path, orientation)
    r = coco_recipe(root, ann, mask="instance", keypoints=True)
    if orientation in (2, 4, 5, 7):   # mirrored: which keypoints swap sides is unknown, so keypoints are refused
        r["on_error"] = "skip"
        with pytest.raises(BuildError, match="every input failed") as e:
            precompile.build(r, tmp_path / "kp", n_jobs=1)
        assert (f"stage annotations, field 'image': image id 1 ('sq.jpg') has labelled keypoints and its EXIF "
                f"orientation {orientation} mirrors the image") in str(e.value)
        assert "exif_transpose: false" in str(e.value)
        r = coco_recipe(root, ann, mask="instance")
    _, ds = build(tmp_path, r)
    s = ds[0]
    objects = _nearest_colour(s["image"])
    for i in range(len(SQUARE_OBJECTS)):
        ys, xs = np.nonzero(objects == i + 1)
        assert s["boxes"][i].tolist() == [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], (orientation, i)
        assert np.array_equal(s["mask"][..., 0] == i + 1, objects == i + 1), (orientation, i)
        if "keypoints" in s:
            assert s["keypoints"][i, 0].tolist() == [(xs.min() + xs.max() + 1) / 2, (ys.min() + ys.max() + 1) / 2, 2]
    stored = _, plain = build(tmp_path, coco_recipe(root, ann, mask="instance") | {
        "inputs": {"root": str(root), "coco": {"file": str(ann), "mask": "instance"},
                   "fields": {"image": {"decoder": "image", "exif_transpose": False}}}}, name="stored")
    assert stored and plain[0]["image"].shape == (64, 64, 3)
    exif = Image.Exif()
    exif[0x0112] = orientation
    m = Image.fromarray(plain[0]["mask"][..., 0].astype(np.uint8))
    m.info["exif"] = exif.tobytes()
    assert np.array_equal(s["mask"][..., 0], np.asarray(ImageOps.exif_transpose(m)))
    meta = dict(ds.meta(0).get("image", {}))   # (orientation 1: no turn, and the identity map is left out)
    assert meta.pop("orientation", 1) == orientation and meta.pop("source_size", [64, 64]) == [64, 64]
    assert set(meta) == ({"to_source"} if orientation != 1 else set())
    # the map back to the stored pixels: each decoded pixel's centre lands on the stored pixel of its colour
    T, hw = ds.source_map(0)
    assert hw == (64, 64)
    ys, xs = np.mgrid[0:64, 0:64]
    sx, sy = (T[:, :2] @ np.stack([xs.ravel() + 0.5, ys.ravel() + 0.5]) + T[:, 2:]).astype(int)
    assert np.array_equal(objects.ravel(), _nearest_colour(plain[0]["image"])[sy, sx])
    want = np.array([[x, y, x + w, y + h] for (x, y, w, h), _ in SQUARE_OBJECTS], np.float64)
    assert np.array_equal(ds.to_source(0, boxes=s["boxes"]), want)   # the file's boxes, the stored pixels'


def test_image_of_the_turned_size_names_the_orientation(tmp_path, sample_copy):
    """A JPEG stored 48x64 with EXIF orientation 6 now builds, its boxes turned; an image whose size fits
    neither way fails, saying what the decoder did."""
    from PIL import Image

    img = Image.open(sample_copy / "images" / "000000000101.png").convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6
    img.save(sample_copy / "images" / "000000000101.jpg", exif=exif.tobytes(), quality=95)
    ann = sample_copy / "annotations" / "instances.json"
    _edit(ann, lambda d: next(im for im in d["images"] if im["id"] == 101).update(file_name="000000000101.jpg"))
    r = coco_recipe(sample_copy / "images", ann)
    rep, ds = build(tmp_path, r, name="turned")
    s = by_key(ds)["000000000101.jpg"]
    x, y, w, h = json.loads(ann.read_text())["annotations"][0]["bbox"]
    assert not rep.failures and s["image"].shape == (64, 48, 3)
    assert s["boxes"][0].tolist() == [48 - (y + h), x, 48 - y, x + w]      # turned a quarter clockwise
    _edit(ann, lambda d: next(im for im in d["images"] if im["id"] == 101).update(height=40))
    r["on_error"] = "skip"
    rep, _ = build(tmp_path, r, name="wrong")
    (f,) = rep.failures
    assert f.message.endswith("the image is 64x48 (h x w) (turned by its EXIF orientation 6) but the annotation "
                              "file gives 40x64 for image id 101 ('000000000101.jpg'), so it should be 64x40")


# -- a reduced JPEG decode at a size not divisible by k ---------------------------------------------------

REDUCE_OBJECTS = [((900, 650, 125, 120), (230, 30, 30)), ((11, 21, 289, 179), (30, 230, 30)),
                  ((505, 301, 380, 300), (30, 30, 230))]


def _painted_1033x777(tmp_path: Path) -> tuple[Path, Path]:
    from PIL import Image

    img = np.zeros((777, 1033, 3), np.uint8)
    anns = []
    for i, ((x, y, w, h), colour) in enumerate(REDUCE_OBJECTS):
        img[y:y + h, x:x + w] = colour
        anns.append({"id": i + 1, "image_id": 1, "category_id": 1, "bbox": [x, y, w, h], "iscrowd": 0,
                     "segmentation": [[x, y, x + w, y, x + w, y + h, x, y + h]]})
    (tmp_path / "img").mkdir()
    Image.fromarray(img).save(tmp_path / "img" / "p.jpg", quality=95, subsampling=0)
    (tmp_path / "a.json").write_text(json.dumps({
        "images": [{"id": 1, "file_name": "p.jpg", "height": 777, "width": 1033}], "annotations": anns,
        "categories": [{"id": 1, "name": "thing"}]}))
    return tmp_path / "img", tmp_path / "a.json"


def _coverage(image: np.ndarray, colour) -> np.ndarray:
    """How much of each pixel is the painted colour (its projection on the colour, 0 = black background)."""
    c = np.asarray(colour, np.float64)
    return (image.astype(np.float64) @ c) / (c @ c)


def test_reduced_decode_at_a_size_not_divisible_by_k_keeps_boxes_on_the_image(tmp_path):
    """1033x777 -> 48x64 decodes at 1/8 (130x98 covering the whole source). Each box edge equals the painted
    colour's edge in the output (measured by the colour's mass across it) and the reduce: off build's box to
    0.05 px (before: coordinates divided by 8 put them up to 0.43 px off)."""
    root, ann = _painted_1033x777(tmp_path)
    r = coco_recipe(root, ann)
    r["steps"] = [{"resize": {"size": [48, 64]}}]
    _, auto = build(tmp_path, r, name="auto")
    assert auto.meta(0)["image"]["reduce"] == 8
    r["inputs"]["fields"] = {"image": {"decoder": "image", "reduce": "off"}}
    _, off = build(tmp_path, r, name="off")
    assert np.abs(auto[0]["boxes"] - off[0]["boxes"]).max() < 0.05
    img = auto[0]["image"]
    for (box, colour), got in zip(REDUCE_OBJECTS, auto[0]["boxes"]):
        cov = _coverage(img, colour)
        x1, y1, x2, y2 = got.tolist()
        rows, cols = slice(int(y1) + 2, int(y2) - 1), slice(int(x1) + 2, int(x2) - 1)
        edges = []   # each edge from the colour's mass in a window across it (robust to the resampling's blur)
        for lo, hi, prof in ((x1, x2, cov[rows].mean(0)), (y1, y2, cov[:, cols].mean(1))):
            a, b = max(int(lo) - 2, 0), int(lo) + 2
            edges.append(b - prof[a:b].sum() if int(lo) >= 2 else lo)
            c, d = int(hi) - 1, min(int(hi) + 3, len(prof))
            edges.append(c + prof[c:d].sum())
        want = [edges[0], edges[2], edges[1], edges[3]]
        assert np.abs(np.array(want) - got).max() < 0.15, (box, want, got.tolist())


def test_reduced_decode_samples_the_mask_at_the_reduced_pixels_centres(tmp_path):
    """reduce: 8 on 1033x777 gives 130x98 covering the source: the mask's pixel (i, j) shows the source at the
    reduced pixel's centre, so it agrees with the decoded image's colour wherever a pixel is mostly one
    object or background (before: every 8th source pixel, drifting by up to 7 source pixels)."""
    root, ann = _painted_1033x777(tmp_path)
    r = coco_recipe(root, ann, mask="instance")
    r["inputs"]["fields"] = {"image": {"decoder": "image", "reduce": 8}}
    _, ds = build(tmp_path, r)
    s = ds[0]
    assert s["image"].shape == (98, 130, 3) and s["mask"].shape == (98, 130, 1)
    sx, sy = 1033 / 130, 777 / 98
    checked = 0
    for i, ((x, y, w, h), colour) in enumerate(REDUCE_OBJECTS):
        # the analytic share of each reduced pixel's footprint inside the box, per axis
        fx = np.clip(np.minimum((np.arange(130) + 1) * sx, x + w) - np.maximum(np.arange(130) * sx, x), 0, sx) / sx
        fy = np.clip(np.minimum((np.arange(98) + 1) * sy, y + h) - np.maximum(np.arange(98) * sy, y), 0, sy) / sy
        share = fy[:, None] * fx[None, :]
        clear = (share > 0.7) | (share < 0.3)
        seen = _coverage(s["image"], colour) > 0.5
        assert np.array_equal((s["mask"][..., 0] == i + 1)[clear], seen[clear]), i
        assert np.array_equal(seen[clear], (share > 0.5)[clear]), i      # the image itself agrees
        checked += int(clear.sum())
    assert checked > 3 * 98 * 130 * 0.9


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
def test_a_sibling_field_at_full_size_beside_a_reduced_jpeg_keeps_the_boxes_on_the_image(tmp_path):
    """Fuzzer finding N1: docs/coco.md's sibling field (a label map beside the photo, by a path template) and the
    default reduce: auto. The photo decodes at 1/2, its label map at full size: the boxes are on the photo's grid
    (inputs.coco ties them to it), so the build runs, and after the resize the box is the extent of both the
    photo's painted object and the label map's object (before: every input failed, 'planar fields differ in
    size ... which one do the boxes annotate?')."""
    from PIL import Image

    (tmp_path / "img").mkdir()
    img = np.zeros((80, 128, 3), dtype=np.uint8)
    img[16:48, 32:96] = 200
    ids = np.zeros((80, 128), dtype=np.uint8)
    ids[16:48, 32:96] = 1
    Image.fromarray(img).save(tmp_path / "img" / "a.jpg", quality=95)
    Image.fromarray(ids).save(tmp_path / "img" / "a.ids.png")
    ann = {"images": [{"id": 1, "file_name": "a.jpg", "height": 80, "width": 128}],
           "categories": [{"id": 5, "name": "thing"}],
           "annotations": [{"id": 9, "image_id": 1, "category_id": 5, "bbox": [32, 16, 64, 32], "iscrowd": 0}]}
    (tmp_path / "a.json").write_text(json.dumps(ann))
    r = coco_recipe(tmp_path / "img", tmp_path / "a.json")
    r["inputs"]["fields"] = {"image": {"decoder": "image"}, "ids": {"decoder": "mask", "path": "{stem}.ids.png"}}
    r["steps"] = [{"resize": {"size": [20, 32]}}]
    rep, ds = build(tmp_path, r)
    assert not rep.failures and ds.meta(0)["image"]["reduce"] == 2
    assert ds.field_specs["boxes"]["of"] == "image"
    s = ds[0]
    np.testing.assert_allclose(s["boxes"], [[8, 4, 24, 12]], atol=1e-4)
    ys, xs = np.nonzero(s["ids"][..., 0] == 1)
    assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == (8, 4, 24, 12)
    ys, xs = np.nonzero(s["image"].mean(-1) > 100)
    assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == (8, 4, 24, 12)
