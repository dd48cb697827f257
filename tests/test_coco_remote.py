"""inputs.coco with the images under a remote root (a moto S3 server; the fixture is test_remote's): the same
samples as a local build, and a changed image object rebuilds only its shard."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

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
