"""``precompile stats`` names the classes of a field wherever the build names them (issue 35): a label's and a
box label's ids by ``label_names``, and a COCO semantic mask's by its categories (mask value = box label + 1);
checked against the annotation file itself and numpy's counts of the stored pixels."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import precompile
from precompile.cli import main
from precompile.tools import stats as st

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def coco(tmp_path_factory) -> Path:
    pytest.importorskip("pycocotools", reason="the semantic mask needs pycocotools (extra 'coco')")
    out = tmp_path_factory.mktemp("coco_stats")
    precompile.build(REPO / "recipes" / "coco.yaml", out_dir=out)
    return out / "coco.h5"


def test_a_coco_semantic_masks_classes_are_named_by_category(coco):
    ann = json.loads((REPO / "sample_data" / "coco" / "annotations" / "instances.json").read_text())
    names = [c["name"] for c in sorted(ann["categories"], key=lambda c: c["id"])]   # label k = k-th by id
    ds = precompile.open(coco)
    pixels = np.concatenate([ds[i]["mask"].ravel() for i in range(len(ds))])
    res = st.compute_stats(coco, ["mask", "box_labels"])
    mask = {c["id"]: c for c in res["fields"]["mask"]["classes"]}
    assert sorted(mask) == list(range(len(names) + 1))                  # background and every category
    for v, c in mask.items():
        assert c["count"] == int((pixels == v).sum())
        assert c.get("name") == (names[v - 1] if v else None)          # 0 is the background: no category
    boxes = {c["id"]: c.get("name") for c in res["fields"]["box_labels"]["classes"]}
    assert boxes == dict(enumerate(names))
    assert st.class_names(ds, "mask") == {k + 1: n for k, n in enumerate(names)}
    assert st.class_names(ds, "image") == {}


def test_precompile_stats_prints_the_names(coco):
    res = CliRunner().invoke(main, ["stats", str(coco), "--field", "mask", "--no-write"])
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if ln.strip().startswith("classes"))
    assert "1=person: " in line and "4=potted plant: " in line and line.split(", ")[0].strip().startswith("classes 0: ")


def test_an_instance_mask_is_not_named(tmp_path):
    pytest.importorskip("pycocotools", reason="the instance mask needs pycocotools (extra 'coco')")
    import yaml

    r = yaml.safe_load((REPO / "recipes" / "coco.yaml").read_text())
    r["inputs"]["coco"]["mask"] = "instance"
    r["inputs"]["root"] = str(REPO / "sample_data" / "coco" / "images")
    r["inputs"]["coco"]["file"] = str(REPO / "sample_data" / "coco" / "annotations" / "instances.json")
    precompile.build(r, out_dir=tmp_path)
    res = st.compute_stats(tmp_path / "coco.h5", ["mask"])
    assert all("name" not in c for c in res["fields"]["mask"]["classes"])   # instance numbers, not classes
