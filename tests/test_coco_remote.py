"""inputs.coco with the images under a remote root (a moto S3 server; the fixture is test_remote's): the same
samples as a local build, and a changed image object rebuilds only its shard."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import precompile
from test_remote import BUCKET, s3, upload_tree  # noqa: F401  (s3: the fixture; skips without s3fs/moto)

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data" / "coco"


def test_remote_images_build_like_local_ones(tmp_path, s3):  # noqa: F811
    url, client = s3
    upload_tree(client, SAMPLE / "images", "coco-images")
    ann = SAMPLE / "annotations" / "instances.json"
    local = {"name": "c", "inputs": {"root": str(SAMPLE / "images"), "coco": {"file": str(ann), "mask": "instance"}},
             "output": {"samples_per_shard": 2}}
    remote = json.loads(json.dumps(local))
    remote["inputs"]["root"] = f"s3://{BUCKET}/coco-images"
    remote["inputs"]["storage_options"] = {"endpoint_url": url, "anon": True}
    precompile.build(local, tmp_path / "local", n_jobs=1)
    rep = precompile.build(remote, tmp_path / "remote", n_jobs=1)
    assert rep["shards"]["built"] == 4
    a, b = precompile.open(str(tmp_path / "local" / "c.h5")), precompile.open(str(tmp_path / "remote" / "c.h5"))
    assert len(a) == len(b) == 8
    for i in range(8):
        assert a.key(i) == b.key(i)
        for f in ("image", "boxes", "box_labels", "mask"):
            np.testing.assert_array_equal(a[i][f], b[i][f])
    client.put_object(Bucket=BUCKET, Key="coco-images/000000000107.png", ACL="public-read",
                      Body=(SAMPLE / "images" / "000000000101.png").read_bytes())
    rep = precompile.build(remote, tmp_path / "remote", n_jobs=1)
    assert rep["shards"]["built"] == 1 and rep["shards"]["skipped"] == 3


def test_remote_annotation_file_is_read_once_and_kept(tmp_path, s3, monkeypatch):  # noqa: F811
    """inputs.coco.file at a URL: the same samples as the local file; a no-change rebuild reads the kept parse
    (one HEAD request for the ETag, no parse); a new upload is parsed again; a missing object names the URL."""
    from precompile.inputs.coco import parse as coco
    from precompile.errors import PlanError

    url, client = s3
    ann = (SAMPLE / "annotations" / "instances.json").read_bytes()
    client.put_object(Bucket=BUCKET, Key="coco-ann/instances.json", Body=ann, ACL="public-read")
    parses = []
    real = coco.read_json
    monkeypatch.setattr(coco, "read_json", lambda path, recipe: parses.append(path) or real(path, recipe))
    file = str(SAMPLE / "annotations" / "instances.json")
    local = {"name": "c", "inputs": {"root": str(SAMPLE / "images"), "coco": {"file": file, "mask": "instance"}},
             "output": {"samples_per_shard": 2}}
    remote = json.loads(json.dumps(local))
    remote["inputs"]["coco"]["file"] = f"s3://{BUCKET}/coco-ann/instances.json"
    remote["inputs"]["storage_options"] = {"endpoint_url": url, "anon": True}
    precompile.build(local, tmp_path / "local", n_jobs=1)
    rep = precompile.build(remote, tmp_path / "remote", n_jobs=1)
    assert rep["shards"]["built"] == 4 and parses == [file, f"s3://{BUCKET}/coco-ann/instances.json"]
    a, b = precompile.open(str(tmp_path / "local" / "c.h5")), precompile.open(str(tmp_path / "remote" / "c.h5"))
    for i in range(len(a)):
        assert a.key(i) == b.key(i)
        for f in ("image", "boxes", "box_labels", "mask"):
            np.testing.assert_array_equal(a[i][f], b[i][f])
    assert precompile.build(remote, tmp_path / "remote")["up_to_date"] and len(parses) == 2
    data = json.loads(ann)
    data["annotations"][0]["bbox"][0] += 1   # the first image's box: its shard only
    client.put_object(Bucket=BUCKET, Key="coco-ann/instances.json", Body=json.dumps(data).encode(), ACL="public-read")
    rep = precompile.build(remote, tmp_path / "remote")
    assert len(parses) == 3 and rep["shards"]["built"] == 1 and rep["shards"]["skipped"] == 3
    remote["inputs"]["coco"]["file"] = f"s3://{BUCKET}/coco-ann/nope.json"
    with pytest.raises(PlanError, match=rf"^COCO annotation file 's3://{BUCKET}/coco-ann/nope.json' does not exist$"):
        precompile.build(remote, tmp_path / "remote")
