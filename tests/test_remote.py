"""Remote inputs through fsspec, offline: a moto S3 server on 127.0.0.1 holds the images. Listed once at
plan time; same bytes as a local build; an unchanged bucket rebuilds nothing; a changed object rebuilds
its shard only; missing extras and credentials in a recipe are clear errors."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import precompile
from conftest import image_recipe, index_shards, make_image_tree, write_recipe
from precompile.errors import MissingDependencyError, PlanError, RecipeError

pytest.importorskip("s3fs", reason="s3fs is not installed (extra 's3')")
pytest.importorskip("moto.server", reason="moto is not installed (test dependency)")

BUCKET = "precompile-test-data"


# The moto server runs in its own process, as a real store does: a server thread inside the test process would be
# forked with it (DataLoader workers, multiprocessing) while it may hold a lock or be importing, and a forked
# child that needs that lock waits for ever. Its werkzeug request log goes to a file (Server.requests).
SERVER = r"""
import logging, sys
from moto.server import ThreadedMotoServer
log = logging.getLogger("werkzeug")   # one line per request served, to the file the test names
handler = logging.FileHandler(sys.argv[1])
handler.setFormatter(logging.Formatter("%(message)s"))
log.addHandler(handler)
log.setLevel(logging.INFO)
log.propagate = False
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
host, port = server.get_host_and_port()
print(host, port, flush=True)
sys.stdin.read()   # serves until the test closes stdin (or ends, however it ends)
server.stop()
"""


class Server(tuple):
    """``(endpoint, boto3 client)``; ``requests()`` the request lines the server logged so far (werkzeug's)."""

    log: Path

    def requests(self) -> list[str]:
        return self.log.read_text().splitlines()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 (a free port) in a process of its own, a bucket, and a boto3 client for
    uploads."""
    import boto3

    old = {k: os.environ.get(k) for k in ("AWS_EC2_METADATA_DISABLED",)}
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"  # never ask a cloud metadata service for credentials
    log = tmp_path_factory.mktemp("moto") / "requests.log"
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(log)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline().split()
        if len(line) != 2:
            raise RuntimeError(f"the moto server did not start (exit status {proc.wait(timeout=30)})")
        url = f"http://{line[0]}:{line[1]}"
        client = boto3.client("s3", endpoint_url=url, aws_access_key_id="test", aws_secret_access_key="test",
                              region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        server = Server((url, client))
        server.log = log
        yield server
    finally:
        proc.stdin.close()   # the server stops
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def upload_tree(client, local: Path, prefix: str) -> None:
    for p in sorted(local.rglob("*")):
        if p.is_file():
            client.put_object(Bucket=BUCKET, Key=f"{prefix}/{p.relative_to(local).as_posix()}", Body=p.read_bytes(),
                              ACL="public-read")


def remote_recipe(root: str, endpoint: str) -> dict:
    r = image_recipe(Path("unused"))
    r["inputs"]["root"] = root
    r["inputs"]["storage_options"] = {"endpoint_url": endpoint, "anon": True}
    r["output"]["samples_per_shard"] = 2
    return r


def same_samples(a: Path, b: Path) -> None:
    """Two outputs hold the same samples (shard files differ only in their keys: remote fingerprints are
    ETags, local ones sizes and mtimes)."""
    da, db = precompile.open(a / "imgs.h5"), precompile.open(b / "imgs.h5")
    assert len(da) == len(db) > 0
    for i in range(len(da)):
        assert da.key(i) == db.key(i) and da.meta(i) == db.meta(i)
        for f in ("image", "label"):
            np.testing.assert_array_equal(da[i][f], db[i][f])


def shards(out: Path) -> dict[str, bytes]:
    return {n: p.read_bytes() for n, p in index_shards(out / "imgs.h5").items()}


def test_s3_build_matches_local_and_rebuilds_only_what_changed(tmp_path, s3):
    endpoint, client = s3
    local = make_image_tree(tmp_path / "data", per_class=3)
    upload_tree(client, local, "run1/images")
    rf = write_recipe(tmp_path / "remote.yaml", remote_recipe(f"s3://{BUCKET}/run1/images", endpoint))
    lf_data = image_recipe(local)
    lf_data["output"]["samples_per_shard"] = 2
    lf = write_recipe(tmp_path / "local.yaml", lf_data)

    rep = precompile.build(rf, out_dir=tmp_path / "remote")
    assert rep["num_samples"] == 6 and rep["shards"] == {"total": 3, "built": 3, "skipped": 0, "reused": 0,
                                                          "failed": 0}
    precompile.build(lf, out_dir=tmp_path / "local")
    same_samples(tmp_path / "remote", tmp_path / "local")
    ds = precompile.open(tmp_path / "remote" / "imgs.h5")
    assert ds.key(0) == "cat/000.jpg" and ds.label_names == ["cat", "dog"]

    # no change: nothing rebuilt
    again = precompile.build(rf, out_dir=tmp_path / "remote")
    assert again["shards"]["built"] == 0 and again["shards"]["skipped"] == 3

    # change one object (dog/001.png is in the last shard): only that shard is rebuilt
    other = make_image_tree(tmp_path / "other", per_class=3, seed=5)
    shutil.copy(other / "dog" / "001.png", local / "dog" / "001.png")
    client.put_object(Bucket=BUCKET, Key="run1/images/dog/001.png", Body=(local / "dog" / "001.png").read_bytes(),
                      ACL="public-read")
    before = shards(tmp_path / "remote")
    changed = precompile.build(rf, out_dir=tmp_path / "remote", n_jobs=2)
    assert changed["shards"]["built"] == 1 and changed["shards"]["skipped"] == 2
    after = shards(tmp_path / "remote")
    assert [n for n in after if after[n] != before[n]] == ["shard-00002"]
    precompile.build(lf, out_dir=tmp_path / "local")
    same_samples(tmp_path / "remote", tmp_path / "local")
    # -j2 from scratch: the same bytes
    precompile.build(rf, out_dir=tmp_path / "remote_j2", n_jobs=2)
    assert shards(tmp_path / "remote_j2") == after


def test_remote_errors(tmp_path, s3, monkeypatch):
    endpoint, client = s3
    local = make_image_tree(tmp_path / "data", per_class=2)
    upload_tree(client, local, "run2/images")
    client.put_object(Bucket=BUCKET, Key="run2/images/dog/zzz.png", Body=b"not a png", ACL="public-read")
    r = remote_recipe(f"s3://{BUCKET}/run2/images", endpoint)
    r["inputs"]["where"] = {"ext": "png"}
    rep = precompile.build(write_recipe(tmp_path / "r.yaml", r), out_dir=tmp_path / "out", on_error="skip")
    assert rep["skipped_inputs"] == 1
    msg = rep["failures"][0]["message"]
    assert msg.startswith(f"s3://{BUCKET}/run2/images/dog/zzz.png, stage decode, field 'image': ") and "fetch" not in msg

    r = remote_recipe(f"s3://{BUCKET}/run2/images", endpoint)
    r["inputs"]["storage_options"]["secret"] = "abc"
    with pytest.raises(RecipeError, match=r"inputs.storage_options: .*'secret' looks like a credential"):
        precompile.load_recipe(r)
    r = image_recipe(local)
    r["inputs"]["storage_options"] = {"anon": True}
    with pytest.raises(RecipeError, match="storage_options apply only to a remote root"):
        precompile.load_recipe(r)
    with pytest.raises(PlanError, match=f"no inputs under 's3://{BUCKET}/no/such/prefix' match"):
        precompile.build(remote_recipe(f"s3://{BUCKET}/no/such/prefix", endpoint), out_dir=tmp_path / "x")

    import fsspec  # noqa: F401

    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "s3", raising=False)  # forget the loaded class
    monkeypatch.setitem(sys.modules, "s3fs", None)
    with pytest.raises(MissingDependencyError, match=r"reading s3:// needs s3fs: pip install 'precompile\[s3\]'"):
        precompile.build(remote_recipe(f"s3://{BUCKET}/run2/images", endpoint), out_dir=tmp_path / "y")
    monkeypatch.setitem(sys.modules, "fsspec", None)
    from precompile.storage import remote

    with pytest.raises(MissingDependencyError, match=r"remote inputs need fsspec: pip install 'precompile\[gcs\]'"):
        remote.filesystem("gs://bucket/x")


def test_remote_nifti_volume(tmp_path, s3):
    nib = pytest.importorskip("nibabel")
    endpoint, client = s3
    vol = np.arange(4 * 5 * 6, dtype=np.int16).reshape(6, 5, 4)
    nib.save(nib.Nifti1Image(vol, np.diag([1.0, 2.0, 3.0, 1.0])), str(tmp_path / "ct.nii.gz"))
    client.put_object(Bucket=BUCKET, Key="vols/case1/ct.nii.gz", Body=(tmp_path / "ct.nii.gz").read_bytes(),
                      ACL="public-read")
    r = {"name": "vols", "inputs": {"root": f"s3://{BUCKET}/vols", "match": "{case}/ct.nii.gz",
                                    "storage_options": {"endpoint_url": endpoint, "anon": True},
                                    "fields": {"ct": {"decoder": "nifti"}}}}
    rep = precompile.build(r, out_dir=tmp_path / "out")
    assert rep["num_samples"] == 1
    ds = precompile.open(tmp_path / "out" / "vols.h5")
    np.testing.assert_array_equal(ds[0]["ct"], vol.transpose(2, 1, 0).astype(np.float32))
    assert ds.meta(0)["ct"]["spacing"] == [3.0, 2.0, 1.0]


def test_missing_credentials_name_the_store_and_what_to_set(tmp_path, s3, monkeypatch):
    # no credentials anywhere (environment, files, metadata service) and no `anon`: a clear PlanError, not botocore's
    endpoint, client = s3
    upload_tree(client, make_image_tree(tmp_path / "data", per_class=1), "run3/images")
    for k in [k for k in os.environ if k.startswith("AWS_") and k != "AWS_EC2_METADATA_DISABLED"]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    r = remote_recipe(f"s3://{BUCKET}/run3/images", endpoint)
    del r["inputs"]["storage_options"]["anon"]
    with pytest.raises(PlanError, match=rf"input root 's3://{BUCKET}/run3/images': no credentials for s3:// "
                                        rf"\(NoCredentialsError: .*\); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        precompile.build(r, out_dir=tmp_path / "out")
    assert not (tmp_path / "out" / "imgs.h5").exists()


@pytest.mark.parametrize("steps", [
    [{"clips": {"length": 4, "stride": 6}}, {"resize": {"size": [24, 32]}}],   # clips: a remote video decodes whole
    [{"resize": {"size": [24, 32]}}, {"clips": {"length": 4, "stride": 6}}],
    [{"resize": {"size": [24, 32]}}],                                             # frame steps on the fetched copy
], ids=["clips-resize", "resize-clips", "resize"])
def test_remote_videos_build_as_local_ones(tmp_path, s3, steps):
    """Videos at a URL are fetched to a temporary copy for their decode: with ``clips`` they are decoded whole
    (the copy is gone before the clips would be read), and cut as a local video's stream is; a per-frame
    resize runs on each frame of the copy. The samples equal a local build's."""
    sys.path.insert(0, os.path.dirname(__file__))
    from test_video import _dump, _write_av

    endpoint, client = s3
    local = tmp_path / "videos"
    local.mkdir()
    _write_av(local / "a.mp4", 30, fps=25)
    _write_av(local / "b.mp4", 12, fps=25, size=(80, 60))
    prefix = f"videos-{'-'.join(next(iter(s)) for s in steps)}"
    upload_tree(client, local, prefix)

    def recipe(root: str) -> dict:
        r = {"name": "v", "inputs": {"root": root, "match": "{name}.mp4", "fields": {"video": {"decoder": "video"}}},
             "steps": steps, "output": {"format": "hdf5", "samples_per_shard": 2}}
        if root.startswith("s3://"):
            r["inputs"]["storage_options"] = {"endpoint_url": endpoint, "anon": True}
        return r

    precompile.build(recipe(str(local)), out_dir=tmp_path / "local")
    rep = precompile.build(recipe(f"s3://{BUCKET}/{prefix}"), out_dir=tmp_path / "remote")
    assert rep["failures"] == []
    want = _dump(tmp_path / "local" / "v.h5")
    assert len(want) >= 2 and _dump(tmp_path / "remote" / "v.h5") == want
