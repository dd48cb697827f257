"""What the full-disk guard costs: HDF5 shard writing with disk blocks claimed ahead of HDF5
(``posix_fallocate``, then a trim to the superblock's end of file) against the same writer with claiming
switched off, measured in the same run.

Each case writes ``--shards`` shards of ``--samples`` samples of one fixed-shape uint8 field through
``Hdf5Format.open_shard`` (the build's own writer: chunks, columns, fsync, rename), into a fresh folder,
``--repeats`` times; the table gives the median seconds per shard, MB/s, and the ratio claimed / unclaimed
(1.00 = free). The bytes of both are compared (they must be equal).

    PYTHONPATH=. python benchmarks/bench_faults.py [--dir DIR] [--samples 256] [--shards 8] [--repeats 5]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from precompile.formats import hdf5
from precompile.formats.hdf5 import Hdf5Format
from precompile.kinds import Kind
from precompile.sample import FieldSpec, Sample

CASES = [("64x64x3", (64, 64, 3)), ("224x224x3", (224, 224, 3))]


def _write(folder: str, shape: tuple[int, ...], n: int, shards: int) -> tuple[float, str]:
    """Seconds per shard, and a digest of every shard's bytes."""
    spec = {"image": FieldSpec(kind=Kind.of("image"), shape=shape, dtype="uint8")}
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
    fmt = Hdf5Format()
    h = hashlib.sha256()
    t0 = time.perf_counter()
    for s in range(shards):
        path = os.path.join(folder, f"shard-{s:05d}.h5")
        w = fmt.open_shard(path, spec, f"key{s}", fmt.Options(), {"image": 16})
        for i in range(n):
            w.add(Sample(key=f"k{s}_{i:05d}", fields={"image": data[i]}, kinds={"image": "image"}, meta={}))
        w.close()
    dt = (time.perf_counter() - t0) / shards
    for s in range(shards):
        with open(os.path.join(folder, f"shard-{s:05d}.h5"), "rb") as f:
            h.update(f.read())
    return dt, h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench_faults_", dir=a.dir)
    supported = hasattr(os, "posix_fallocate")
    print(f"{'sample':<11} {'MB/shard':>8} {'unclaimed s':>12} {'claimed s':>10} {'MB/s unclaimed':>15} "
          f"{'MB/s claimed':>13} {'ratio':>6} {'same bytes':>10}")
    try:
        for name, shape in CASES:
            times: dict[bool, list[float]] = {False: [], True: []}
            digests: dict[bool, str] = {}
            for r in range(a.repeats):
                for claim in (False, True):   # alternate, so drift in the machine's load hits both
                    folder = os.path.join(base, f"{name}-{claim}-{r}")
                    os.makedirs(folder)
                    hdf5._Claim.supported_here = claim and supported
                    dt, digests[claim] = _write(folder, shape, a.samples, a.shards)
                    times[claim].append(dt)
                    shutil.rmtree(folder)
            mb = a.samples * int(np.prod(shape)) / 1e6
            u, c = statistics.median(times[False]), statistics.median(times[True])
            print(f"{name:<11} {mb:>8.1f} {u:>12.4f} {c:>10.4f} {mb / u:>15.0f} {mb / c:>13.0f} {c / u:>6.2f} "
                  f"{str(digests[False] == digests[True]):>10}")
    finally:
        hdf5._Claim.supported_here = supported
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
