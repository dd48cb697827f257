"""A real dask cluster: a ``dask scheduler`` and two ``dask worker`` processes started on 127.0.0.1 as
separate programs (not LocalCluster), each worker with its own --local-directory and no output folder shared:
the build writes to a moto S3 server, and its shards and index are byte-identical to a local ``-j 2`` build.
The workers get credentials from their environment (as on a cluster) but not the endpoint: the parent's
``AWS_ENDPOINT_URL`` travels with each task. Every process started here is stopped here."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import precompile
from conftest import image_recipe, make_image_tree
from test_remote import s3  # noqa: F401  (the module's moto server)

pytest.importorskip("distributed", reason="dask.distributed is not installed (extra 'dask')")
pytest.importorskip("s3fs", reason="s3fs is not installed (extra 's3')")

REPO = Path(__file__).resolve().parents[1]
OUT = "precompile-cluster-out"


def _start(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", *args], stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _address(sched_file: Path, log: Path) -> str:
    """The scheduler's address from its scheduler file, once the file is there and whole."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            return json.loads(sched_file.read_text())["address"]
        except (OSError, ValueError, KeyError):   # not written yet, or half written
            time.sleep(0.05)
    raise AssertionError(f"the scheduler did not start: {log.read_text()}")


@pytest.fixture
def cluster(tmp_path):
    """(scheduler address, [worker local directories]): one scheduler and two single-threaded workers."""
    from distributed import Client

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
    env.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_EC2_METADATA_DISABLED="true",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    sched_file = tmp_path / "scheduler.json"
    procs = [_start(["distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                     "--scheduler-file", str(sched_file)], tmp_path / "scheduler.log", env)]
    dirs = [tmp_path / f"worker{i}" for i in (1, 2)]
    try:
        address = _address(sched_file, tmp_path / "scheduler.log")
        for i, d in enumerate(dirs, 1):
            d.mkdir()
            procs.append(_start(["distributed.cli.dask_worker", address, "--host", "127.0.0.1", "--nthreads", "1",
                                 "--nworkers", "1", "--no-dashboard", "--local-directory", str(d)],
                                tmp_path / f"worker{i}.log", env))
        with Client(address, timeout="20s") as c:
            c.wait_for_workers(2, timeout=30)
        yield address, dirs
    finally:
        _stop(procs)


def test_a_cluster_of_separate_processes_builds_to_s3_byte_identical_to_local(tmp_path, s3, cluster, monkeypatch):  # noqa: F811
    endpoint, client = s3
    address, dirs = cluster
    client.create_bucket(Bucket=OUT)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)   # the parent's only: it travels with the tasks
    r = image_recipe(make_image_tree(tmp_path / "data", per_class=6))
    r["output"]["samples_per_shard"] = 2
    local = precompile.build(r, out_dir=tmp_path / "local", n_jobs=2)
    rep = precompile.build(r, out_dir=f"s3://{OUT}/run", scheduler=address)
    assert rep["shards"] == local["shards"] == {"total": 6, "built": 6, "skipped": 0, "reused": 0, "failed": 0}
    got = {}
    for o in client.list_objects_v2(Bucket=OUT, Prefix="run/")["Contents"]:
        got[o["Key"][len("run/"):]] = client.get_object(Bucket=OUT, Key=o["Key"])["Body"].read()
    want = {p.relative_to(tmp_path / "local").as_posix(): p.read_bytes() for p in (tmp_path / "local").rglob("*.h5")}
    assert len(want) == 7 and {k: v for k, v in got.items() if k.endswith(".h5")} == want
    # the workers built in their own local directories and left nothing behind there
    assert not [p for d in dirs for p in d.rglob("shard-*")]
    assert not list((tmp_path / "local").glob("*.tmp-*"))
