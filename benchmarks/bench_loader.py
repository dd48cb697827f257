"""Shuffled batches of 256 from a 64x64x3 uint8 store: the Loader against a DataLoader and the memory limit.

Contenders, all measured in this run on the same store (warm page cache):

- ``numpy gather from memory`` (the limit): the whole store in one array,
  ``np.take(data, batch, axis=0, out=buf)`` into a reused buffer, one thread.
- ``DataLoader(H5Dataset)`` with 0 and 2 workers: the backbone's map-style
  dataset (h5py per sample, chunk cache off) under torch's default collate.
- ``Loader`` (CPU, no pinning): full shuffle and block shuffle, default threads.

Every contender yields uint8 batches of 256 in a fresh random order per
repeat; the table gives the median samples/s over the repeats and the ratio
to the limit. The store is written through the project's HDF5 writer (chunks
of 256 samples = 3 MiB, as in notes/hdf5-fast-reads.md).

    PYTHONPATH=. python benchmarks/bench_loader.py [--quick] [--samples N] [--repeats R]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from precompile import format as fmt  # noqa: E402
from precompile.sample import FieldSpec, Sample  # noqa: E402
from precompile.writers.hdf5 import Hdf5Writer  # noqa: E402


def write_store(out_dir: str, name: str, images: np.ndarray, labels: np.ndarray, kind: str = "image",
                samples_per_shard: int = 8192, chunk_samples: int = 256) -> str:
    """Write ``images``/``labels`` as a build (shards + index) through the project's HDF5 writer."""
    specs = {"image": FieldSpec(kind, tuple(images.shape[1:]), str(images.dtype)), "label": FieldSpec("label", (), "int64")}
    chunking = {"image": chunk_samples, "label": max(chunk_samples, 1024)}
    w = Hdf5Writer()
    sdir = os.path.join(out_dir, fmt.shard_dir_name(name))
    os.makedirs(sdir, exist_ok=True)
    shards = []
    for si, lo in enumerate(range(0, len(images), samples_per_shard)):
        fname = fmt.shard_file_name(si)
        sw = w.open_shard(os.path.join(sdir, fname), specs, f"bench-{si}", None, chunking)
        for i in range(lo, min(lo + samples_per_shard, len(images))):
            sw.add(Sample(key=f"{i:07d}", fields={"image": images[i], "label": np.int64(labels[i])},
                          kinds={"image": kind, "label": "label"}))
        info = sw.close()
        shards.append({"file": f"{fmt.shard_dir_name(name)}/{fname}", "num_samples": info["num_samples"],
                       "key": f"bench-{si}", "checksums": info["checksums"], "bytes": info["bytes"]})
    index = os.path.join(out_dir, name + ".h5")
    attrs = {fmt.A_FORMAT: fmt.FORMAT_NAME, fmt.A_VERSION: fmt.FORMAT_VERSION, fmt.A_OUTPUT: "hdf5",
             fmt.A_FIELDS: {f: s.to_json() for f, s in specs.items()}, fmt.A_LABELS: [], fmt.A_RECIPE: {},
             fmt.A_SEED: 0, fmt.A_COPIES: 0, fmt.A_SHARDS: shards}
    w.finalize(index, shards, specs, attrs)
    return index


def timed_passes(make_iter, n_samples: int, repeats: int) -> list[float]:
    """samples/s of ``repeats`` passes; each pass consumes one iterator and touches each batch."""
    out = []
    for r in range(repeats):
        it = make_iter(r)
        t0 = time.perf_counter()
        seen = 0
        for b in it:
            x = b["image"] if isinstance(b, dict) else b
            seen += int(x.shape[0])
        out.append(seen / (time.perf_counter() - t0))
        assert seen == n_samples, (seen, n_samples)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small store and few repeats (a smoke run)")
    ap.add_argument("--samples", type=int, default=None, help="samples in the store (default 16384, quick 4096)")
    ap.add_argument("--repeats", type=int, default=None, help="passes per contender (default 5, quick 3)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--dir", default=None, help="where to write the store (default: a temporary folder)")
    args = ap.parse_args(argv)
    n = args.samples or (4096 if args.quick else 16384)
    reps = args.repeats or (3 if args.quick else 5)
    bs = args.batch_size

    import torch
    from torch.utils.data import DataLoader

    import precompile
    from precompile.reader.loader import Loader

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, n)
    tmp = tempfile.TemporaryDirectory(dir=args.dir)
    t0 = time.perf_counter()
    index = write_store(tmp.name, "bench64", images, labels)
    print(f"store: {n} x 64x64x3 uint8 ({n * 12288 / 2**20:.0f} MiB), written in {time.perf_counter() - t0:.1f} s; "
          f"batch {bs}, {reps} passes each, torch threads {torch.get_num_threads()}, {os.cpu_count()} cpus")
    # warm the page cache (every contender reads a warm cache)
    ds = precompile.open(index)
    for s in ds.shards:
        with open(os.path.join(os.path.dirname(index), s["file"]), "rb") as f:
            while f.read(1 << 24):
                pass
    rows = {}

    buf = np.empty((bs, 64, 64, 3), np.uint8)

    def numpy_limit(r):
        perm = np.random.default_rng(r).permutation(n)
        for i in range(0, n, bs):
            idx = perm[i:i + bs]
            out = buf[:len(idx)]
            np.take(images, idx, axis=0, out=out)
            yield out

    rows["numpy gather from memory (limit)"] = timed_passes(numpy_limit, n, reps)

    class Images(torch.utils.data.Dataset):
        def __init__(self, ds):
            self.ds = ds

        def __len__(self):
            return len(self.ds)

        def __getitem__(self, i):
            return self.ds[i]["image"]

    for workers in (0, 2):
        def dl(r, workers=workers):
            g = torch.Generator().manual_seed(r)
            return DataLoader(Images(precompile.open(index, fields=["image"])), batch_size=bs, shuffle=True,
                              num_workers=workers, generator=g)
        rows[f"DataLoader(h5py per sample), {workers} workers"] = timed_passes(dl, n, max(1, reps - 2))

    for mode in ("full", "block"):
        loader = Loader(index, batch_size=bs, shuffle=mode, seed=0, device="cpu", fields=["image"])

        def ld(r, loader=loader):
            loader.set_epoch(r)
            return loader
        rows[f"Loader shuffle={mode} (cpu, {loader.num_threads} threads)"] = timed_passes(ld, n, reps)
        if mode == "full":
            wait = loader.stats
    limit = statistics.median(rows["numpy gather from memory (limit)"])
    print()
    print(f"| {'contender':<44} | {'samples/s (median)':>18} | {'MB/s':>7} | {'x limit':>7} |")
    print(f"|{'-' * 46}|{'-' * 20}|{'-' * 9}|{'-' * 9}|")
    for name, v in rows.items():
        m = statistics.median(v)
        print(f"| {name:<44} | {m:>18,.0f} | {m * 12288 / 1e6:>7,.0f} | {m / limit:>7.2f} |")
    print()
    print(f"Loader (full) self-measured wait, last pass: {wait.summary()}")
    full = statistics.median(rows[next(k for k in rows if k.startswith("Loader shuffle=full"))])
    print(f"Loader full shuffle / limit = {full / limit:.2f} (target >= 0.6): {'PASS' if full / limit >= 0.6 else 'FAIL'}")
    ds.close()
    tmp.cleanup()


if __name__ == "__main__":
    main()
