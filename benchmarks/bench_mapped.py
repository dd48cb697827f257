"""Mapped reads and the page-fault tax: one gather thread, a warm page cache, one store file of raw samples.

Each contender gathers the same shuffled batches (rows sorted within a batch, as the Loader does) of
``--batch`` samples into one preallocated slot, for two epochs, from a map opened just before the first:

- ``in-memory``: the whole store read into private memory first (the read not timed): the limit;
- ``mmap``: a plain shared read-only map (numpy over ``mmap.mmap``), ``np.take`` into the slot;
- ``mmap+WILLNEED`` / ``mmap+RANDOM``: the same after ``madvise`` of the whole map;
- ``MAP_POPULATE``: the map made with its page tables filled at ``mmap`` time (time included);
- ``preadv``: no map: ``os.preadv`` of each row straight into the slot (releases the GIL).

The table gives GB/s per epoch (median of ``--repeats``) and the ratio to in-memory.

    PYTHONPATH=. python benchmarks/bench_mapped.py [--quick] [--sample 64|256] [--repeats R]
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time

import numpy as np


def epoch_batches(n: int, batch: int, seed: int) -> list[np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    return [np.sort(order[i:i + batch]) for i in range(0, n - batch + 1, batch)]


def gather_array(arr: np.ndarray, batches: list[np.ndarray], slot: np.ndarray) -> None:
    for idx in batches:
        np.take(arr, idx, axis=0, out=slot[:len(idx)], mode="clip")


def gather_preadv(fd: int, row: int, batches: list[np.ndarray], slot: np.ndarray) -> None:
    views = [memoryview(slot[i].reshape(-1)) for i in range(len(slot))]
    for idx in batches:
        for j, i in enumerate(idx.tolist()):
            os.preadv(fd, [views[j]], i * row)


def open_map(path: str, shape: tuple, flags: int = 0, advice: int | None = None):
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | flags, prot=mmap.PROT_READ)
    if advice is not None:
        m.madvise(advice)
    return m, np.frombuffer(m, np.uint8).reshape(shape)


def run_contender(name: str, path: str, shape: tuple, batches: list[np.ndarray], slot: np.ndarray) -> list[float]:
    """Seconds of epoch 1 (map opened just before) and epoch 2."""
    t0 = time.perf_counter()
    m = None
    if name == "in-memory":
        arr = np.fromfile(path, np.uint8).reshape(shape)
        t0 = time.perf_counter()
    elif name == "preadv":
        fd = os.open(path, os.O_RDONLY)
    else:
        flags = getattr(mmap, "MAP_POPULATE", 0) if name == "MAP_POPULATE" else 0
        advice = {"mmap+WILLNEED": mmap.MADV_WILLNEED, "mmap+RANDOM": mmap.MADV_RANDOM}.get(name)
        m, arr = open_map(path, shape, flags, advice)
    out = []
    for _ in range(2):
        if name == "preadv":
            gather_preadv(fd, int(np.prod(shape[1:])), batches, slot)
        else:
            gather_array(arr, batches, slot)
        out.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
    if name == "preadv":
        os.close(fd)
    if m is not None:
        del arr
        m.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sample", type=int, default=64, help="sample side: 64 (12 KiB) or 256 (192 KiB)")
    ap.add_argument("--mb", type=int, default=None, help="store size in MB (default 768, quick 96)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args(argv)
    reps = args.repeats or (2 if args.quick else 5)
    row = 3 * args.sample * args.sample
    n = (args.mb or (96 if args.quick else 768)) * 2 ** 20 // row
    shape = (n, 3, args.sample, args.sample)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "store.bin")
        np.random.default_rng(0).integers(0, 255, shape, dtype=np.uint8).tofile(path)
        np.fromfile(path, np.uint8)   # warm the page cache
        batches = epoch_batches(n, args.batch, 1)
        nbytes = len(batches) * args.batch * row
        slot = np.empty((args.batch,) + shape[1:], np.uint8)
        names = ["in-memory", "mmap", "mmap+WILLNEED", "mmap+RANDOM", "MAP_POPULATE", "preadv"]
        times: dict[str, list[list[float]]] = {k: [] for k in names}
        for _ in range(reps):
            for k in names:   # interleaved: load on the machine hits every contender alike
                times[k].append(run_contender(k, path, shape, batches, slot))
    print(f"{n} samples of 3x{args.sample}x{args.sample} ({n * row / 1e6:.0f} MB), batches of {args.batch}, 1 thread")
    print("| contender | epoch 1 GB/s | epoch 2 GB/s | epoch 1 / in-memory | epoch 2 / in-memory |")
    print("|---|---:|---:|---:|---:|")
    base = [statistics.median(t[e] for t in times["in-memory"]) for e in (0, 1)]
    for k in names:
        med = [statistics.median(t[e] for t in times[k]) for e in (0, 1)]
        print(f"| {k} | {nbytes / med[0] / 1e9:.2f} | {nbytes / med[1] / 1e9:.2f} | "
              f"{base[0] / med[0]:.2f} | {base[1] / med[1]:.2f} |")


if __name__ == "__main__":
    main()
