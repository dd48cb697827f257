"""Builds written to S3 against builds written to a local folder, measured in the same run (issue 19).

The store is moto's S3 server in its own process on 127.0.0.1 (``python -m moto.server``): what it
measures is precompile's request pattern and the upload path (a shard built in a local staging folder,
uploaded with its ``.entry.json`` sidecar, then deleted; the index uploaded last), with a loopback
network and moto's in-memory store; a real store adds its latency and bandwidth on top. The recipe: a
generated tree of ``--inputs`` PNG images (128x128 RGB), resized to 96x96, ``--per-shard`` per shard.

Cases, each built ``--repeats`` times into a fresh folder / prefix, local and S3 alternating:

- a full build with ``-j 1`` and ``-j 2``;
- a no-change rebuild (S3: one listing and the index, no lock, nothing written);
- a resume: a build killed after its last shard was uploaded, before the index (the index and report
  deleted): every shard is kept (local: read from the file; S3: from its sidecar) and the index written;
- for scale, the upload alone: every file of the local build PUT to the store, one after the other.

moto runs on the same (2-core) machine as the build, so its own CPU time is in the S3 numbers.

Then finalize alone, local: the index written from the shards' parts (what the writers return, as a
build now does) against reopening every shard file for them (what finalize did before), over
``--finalize-shards`` shards of 16 samples, same run, same shards; the two indexes must be equal.

    PYTHONPATH=. python benchmarks/bench_remote_build.py [--inputs 480] [--per-shard 32] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import median_time  # noqa: E402

BUCKET = "bench-out"


def make_inputs(root: str, n: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(n):
        d = os.path.join(root, "ab"[i % 2])
        os.makedirs(d, exist_ok=True)
        small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        Image.fromarray(small).resize((128, 128), Image.BILINEAR).save(os.path.join(d, f"{i:05d}.png"))


def recipe(root: str, per_shard: int) -> dict:
    return {"name": "bench", "seed": 1,
            "inputs": {"root": root, "match": "{label}/{name}.png", "label": {"capture": "label"},
                       "fields": {"image": {"decoder": "image", "mode": "rgb8"}}},
            "steps": [{"resize": {"size": [96, 96]}}], "output": {"format": "hdf5", "samples_per_shard": per_shard}}


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def _s3(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def _drop_index(where: str, client: Any) -> None:
    """What a build killed after its last upload leaves: no index, no report."""
    for n in ("bench.h5", "bench.report.json"):
        if where.startswith("s3://"):
            client.delete_object(Bucket=BUCKET, Key=f"{where[len('s3://' + BUCKET) + 1:]}/{n}")
        else:
            os.remove(os.path.join(where, n))


def measure(run: Callable[[str], Any], prepare: Callable[[str], None], targets: list[str]) -> float:
    """Median seconds of ``run(target)`` over the targets, each prepared first (untimed)."""
    times = []
    for t in targets:
        prepare(t)
        t0 = time.perf_counter()
        run(t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _upload_alone(folder: str, endpoint: str, repeats: int) -> float:
    """Median seconds to PUT every file of a built local output to the store (s3fs, sequentially): what any
    uploader of these bytes pays, for scale."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
    files = [os.path.join(d, n) for d, _, ns in os.walk(folder) for n in ns]
    return median_time(lambda: [fs.put_file(p, f"{BUCKET}/alone/{os.path.relpath(p, folder)}") for p in files],
                       repeats)


def build_table(a: argparse.Namespace, base: str, endpoint: str) -> list[tuple[str, float, float]]:
    import precompile

    r = recipe(os.path.join(base, "in"), a.per_shard)
    client = _s3(endpoint)
    so = {"endpoint_url": endpoint}
    rows = []

    def where(kind: str, case: str, i: int) -> str:
        return f"s3://{BUCKET}/{case}-{i}" if kind == "s3" else os.path.join(base, f"{case}-{i}")

    def build(t: str, **kw: Any) -> Any:
        return precompile.build(r, out_dir=t, storage_options=so if t.startswith("s3://") else None, **kw)

    for case, jobs in (("full -j 1", 1), ("full -j 2", 2)):
        for kind in ("local", "s3"):   # untimed: loky's workers started, both paths' imports done
            build(where(kind, "warm" + case.replace(" ", ""), 0), n_jobs=jobs)
        got: dict[str, list[float]] = {"local": [], "s3": []}
        for i in range(a.repeats):
            for kind in ("local", "s3"):
                t = where(kind, case.replace(" ", ""), i)
                got[kind].append(measure(lambda t: build(t, n_jobs=jobs), lambda t: None, [t]))
        rows.append((case, statistics.median(got["local"]), statistics.median(got["s3"])))
    done = {k: where(k, "full-j2", 0) for k in ("local", "s3")}
    rows.append(("(upload alone: the local build's files, one PUT each, in one process)", 0.0,
                 _upload_alone(done["local"], endpoint, a.repeats)))
    rows.append(("no-change rebuild", *(median_time(lambda k=k: build(done[k]), a.repeats)
                                        for k in ("local", "s3"))))
    resumed = [measure(lambda t: build(t, n_jobs=2), lambda t: _drop_index(t, client),
                       [where(k, "full-j1", i) for i in range(a.repeats)]) for k in ("local", "s3")]
    rows.append(("resume (all shards there, no index)", *resumed))
    return rows


def finalize_table(a: argparse.Namespace, base: str) -> list[tuple[int, float, float, bool]]:
    """(shards, seconds from parts, seconds reopening the shards, same index)."""
    import h5py

    from precompile.formats import names as fmt
    from precompile.formats.hdf5 import Hdf5Format
    from precompile.kinds import Kind
    from precompile.sample import FieldSpec, Sample

    specs = {"image": FieldSpec(kind=Kind.of("image"), shape=(32, 32, 3), dtype="uint8")}
    f = Hdf5Format()
    out = []
    for n_shards in a.finalize_shards:
        folder = os.path.join(base, f"fin-{n_shards}")
        os.makedirs(os.path.join(folder, "x.shards"))
        rng = np.random.default_rng(0)
        entries, parts = [], []
        for s in range(n_shards):
            name = fmt.shard_file_name(s)
            w = f.open_shard(os.path.join(folder, "x.shards", name), specs, f"k{s}", f.Options(), {"image": 16})
            for i in range(16):
                w.add(Sample(key=f"s{s}/{i}", fields={"image": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)},
                             kinds={"image": "image"}, meta={}))
            info = w.close()
            parts.append(info.pop("parts"))
            entries.append({"file": f"x.shards/{name}", "key": f"k{s}", **info})
        paths = {"parts": os.path.join(folder, "a.h5"), "reopen": os.path.join(folder, "b.h5")}
        t_parts = median_time(lambda: f.finalize(paths["parts"], entries, specs, {}, parts), a.repeats)
        t_open = median_time(lambda: f.finalize(paths["reopen"], entries, specs, {}, None), a.repeats)
        with h5py.File(paths["parts"]) as x, h5py.File(paths["reopen"]) as y:
            same = all(np.array_equal(x[k][()], y[k][()]) for k in (fmt.KEY, fmt.COPY, fmt.META, fmt.CHUNKS))
        out.append((n_shards, t_parts, t_open, same))
        shutil.rmtree(folder)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", type=int, default=480)
    ap.add_argument("--per-shard", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--finalize-shards", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    base = tempfile.mkdtemp(prefix="bench_remote_", dir=a.dir)
    proc, endpoint = start_moto()
    try:
        _s3(endpoint).create_bucket(Bucket=BUCKET)
        make_inputs(os.path.join(base, "in"), a.inputs)
        mb = a.inputs * 96 * 96 * 3 / 1e6
        shards = -(-a.inputs // a.per_shard)
        print(f"{a.inputs} inputs, {shards} shards, {mb:.1f} MB of samples; medians of {a.repeats}; "
              f"load {os.getloadavg()[0]:.2f} at start\n")
        print("| case | local s | s3 (moto, loopback) s | s3 / local |\n|---|---|---|---|")
        for case, lo, rs in build_table(a, base, endpoint):
            print(f"| {case} | {lo:.3f} | {rs:.3f} | {rs / lo:.2f} |" if lo else f"| {case} | | {rs:.3f} | |")
        print("\n| shards | finalize from parts s | finalize reopening shards s | reopen / parts | same index |\n"
              "|---|---|---|---|---|")
        for n, tp, to, same in finalize_table(a, base):
            print(f"| {n} | {tp:.3f} | {to:.3f} | {to / tp:.2f} | {same} |")
        print(f"\nload {os.getloadavg()[0]:.2f} at end")
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
