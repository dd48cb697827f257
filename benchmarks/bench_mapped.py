"""Mapped reads against in-memory ones, per gather thread: where the gap came from, and the Loader before and after.

Three tables, all on a warm page cache, one gather thread, the same shuffled batches (rows sorted within a
batch, as the Loader does) of ``--batch`` samples:

1. **Arrays** (one raw store file, 12 KiB or 192 KiB rows, two epochs from a map opened just before the
   first): ``in-memory`` (the store read into a numpy array, gathered into a numpy slot: the limit);
   ``mmap`` and ``preadv`` (no map: ``os.preadv`` of each row, which releases the GIL) into a numpy slot
   (numpy starts a large array 16 bytes into a page; a map starts on one) and into a page-aligned slot;
   ``MAP_POPULATE`` (page tables filled at ``mmap``, time included) into a page-aligned slot.
2. **Offsets**: the same ``np.take`` of 192 KiB rows from page-aligned private memory into slots placed
   ``d`` bytes past a page boundary: what the destination's offset from the source, modulo 4 KiB, costs.
3. **First touch** (``--first-touch``): the same 80 MB as 1, 50 or 5,000 files, mapped side by side into
   one reserved range as the Loader maps shards (``direct.Region``), then one byte read per 4 KiB page:
   the time and page faults of that first touch per file, against a ``MADV_POPULATE_READ`` of the whole
   range (the kernel's own loop over the same faults, no trap per fault) and a second touch.
4. **Loader** (``--loader``): stores written through the project's writer (64x64x3 and 256x256x3, 8
   shards), ``Loader(num_threads=1, prefetch=1)``: mapped files as before this change (numpy batch buffers,
   and rows of many chunk alignments gathered through one strided fancy index), mapped now, and
   ``in_memory=True``; ratios to in-memory and to a sorted ``np.take`` from private memory.

GB/s or samples/s are medians of ``--repeats`` interleaved turns (load from other jobs hits every
contender alike).

    PYTHONPATH=. python benchmarks/bench_mapped.py [--quick] [--repeats R] [--first-touch] [--loader]
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from precompile.reader.direct import page_aligned_empty  # noqa: E402


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


def run_contender(name: str, path: str, shape: tuple, batches: list[np.ndarray], slots: dict) -> list[float]:
    """Seconds of epoch 1 (map opened just before) and epoch 2."""
    slot = slots["aligned" if "aligned" in name else "numpy"]
    t0 = time.perf_counter()
    m = None
    if name == "in-memory":
        arr = np.fromfile(path, np.uint8).reshape(shape)
        t0 = time.perf_counter()
    elif name.startswith("preadv"):
        fd = os.open(path, os.O_RDONLY)
    else:
        flags = getattr(mmap, "MAP_POPULATE", 0) if name.startswith("MAP_POPULATE") else 0
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | flags, prot=mmap.PROT_READ)
        arr = np.frombuffer(m, np.uint8).reshape(shape)
    out = []
    for _ in range(2):
        if name.startswith("preadv"):
            gather_preadv(fd, int(np.prod(shape[1:])), batches, slot)
        else:
            gather_array(arr, batches, slot)
        out.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
    if name.startswith("preadv"):
        os.close(fd)
    if m is not None:
        del arr
        m.close()
    return out


ARRAY_CONTENDERS = ["in-memory", "mmap", "mmap, aligned slot", "MAP_POPULATE, aligned slot", "preadv",
                    "preadv, aligned slot"]


def arrays_table(sample: int, mb: int, batch: int, reps: int) -> None:
    row = 3 * sample * sample
    n = mb * 2 ** 20 // row
    shape = (n, 3, sample, sample)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "store.bin")
        np.random.default_rng(0).integers(0, 255, shape, dtype=np.uint8).tofile(path)
        np.fromfile(path, np.uint8)   # warm the page cache
        batches = epoch_batches(n, batch, 1)
        nbytes = len(batches) * batch * row
        slots = {"numpy": np.empty((batch,) + shape[1:], np.uint8),
                 "aligned": page_aligned_empty((batch,) + shape[1:], np.uint8)}
        times: dict[str, list[list[float]]] = {k: [] for k in ARRAY_CONTENDERS}
        for _ in range(reps):
            for k in ARRAY_CONTENDERS:
                times[k].append(run_contender(k, path, shape, batches, slots))
    print(f"\n{n} samples of 3x{sample}x{sample} ({n * row / 1e6:.0f} MB), batches of {batch}, 1 thread; numpy slot "
          f"{slots['numpy'].ctypes.data % mmap.PAGESIZE} bytes into a page")
    print("| contender | epoch 1 GB/s | epoch 2 GB/s | epoch 1 / in-memory | epoch 2 / in-memory |")
    print("|---|---:|---:|---:|---:|")
    base = [statistics.median(t[e] for t in times["in-memory"]) for e in (0, 1)]
    for k in ARRAY_CONTENDERS:
        med = [statistics.median(t[e] for t in times[k]) for e in (0, 1)]
        print(f"| {k} | {nbytes / med[0] / 1e9:.2f} | {nbytes / med[1] / 1e9:.2f} | "
              f"{base[0] / med[0]:.2f} | {base[1] / med[1]:.2f} |")


def offsets_table(reps: int, quick: bool) -> None:
    row, n = 3 * 256 * 256, 256 if quick else 1024
    src = page_aligned_empty((n, row), np.uint8)
    src[:] = np.random.default_rng(0).integers(0, 255, (n, row), dtype=np.uint8)
    idx = np.sort(np.random.default_rng(1).permutation(n)[:256])
    offsets = [0, 8, 16, 32, 64, 2048, 4080]
    outs = {d: page_aligned_empty((256 * row + 4096,), np.uint8)[d:d + 256 * row].reshape(256, row) for d in offsets}
    times: dict[int, list[float]] = {d: [] for d in offsets}
    for _ in range(max(reps, 5)):
        for d in offsets:
            t0 = time.perf_counter()
            np.take(src, idx, axis=0, out=outs[d], mode="clip")
            times[d].append(time.perf_counter() - t0)
    print("\n192 KiB rows, 256 of them from page-aligned private memory into a slot d bytes past a page boundary")
    print("| d (destination - source, mod 4 KiB) | " + " | ".join(str(d) for d in offsets) + " |")
    print("|---|" + "---:|" * len(offsets))
    print("| GB/s | " + " | ".join(f"{256 * row / statistics.median(times[d]) / 1e9:.1f}" for d in offsets) + " |")


def loader_table(reps: int, quick: bool, batch: int) -> None:
    from bench_loader import timed_passes, write_store
    from precompile.reader import direct, feed
    from precompile.reader.loader import Loader

    print(f"\nLoader, 1 gather thread, prefetch 1, batches of {batch}, full shuffle; load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| store | contender | samples/s | x in_memory | x sorted take |")
    print("|---|---|---:|---:|---:|")
    for side, n in ((64, 4096 if quick else 32768), (256, 512 if quick else 4096)):
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, (n, side, side, 3), dtype=np.uint8)
        with tempfile.TemporaryDirectory() as tmp:
            path = write_store(tmp, f"s{side}", images, rng.integers(0, 10, n), samples_per_shard=max(1, n // 8),
                               chunk_samples=min(256, max(1, (2 << 20) // images[0].nbytes)))
            out = np.empty((batch, side, side, 3), np.uint8)

            def limit(r):
                perm = np.random.default_rng(r).permutation(n)
                for i in range(0, n, batch):
                    idx = np.sort(perm[i:i + batch])
                    yield np.take(images, idx, axis=0, out=out[:len(idx)], mode="clip")

            def make(in_memory: bool = False) -> Loader:
                return Loader(path, batch_size=batch, shuffle="full", seed=0, device="cpu", fields=["image"],
                              num_threads=1, prefetch=1, in_memory=in_memory)

            with _before(feed, direct):
                loaders = {"mapped, before": make()}
            loaders.update({"mapped": make(), "in_memory": make(True)})
            rows: dict[str, list[float]] = {"sorted take": [], **{k: [] for k in loaders}}
            for r in range(-1, reps):   # pass -1: each Loader's first (buffers, page tables), not timed
                if r >= 0:
                    rows["sorted take"].extend(timed_passes(lambda _r, r=r: limit(r), n, 1))
                for name, loader in loaders.items():
                    loader.set_epoch(r + 1)
                    with _before(feed, direct, name == "mapped, before"):
                        got = timed_passes(lambda _r, loader=loader: loader, n, 1)
                    if r >= 0:
                        rows[name].extend(got)
            med = {k: statistics.median(v) for k, v in rows.items()}
            for name in rows:
                print(f"| {side}x{side}x3, {n} samples | {name} | {med[name]:,.0f} | "
                      f"{med[name] / med['in_memory']:.2f} | {med[name] / med['sorted take']:.2f} |")
            for loader in loaders.values():
                loader.close()


def _touch(region) -> tuple[float, int]:
    """Seconds and minor faults of reading one byte per page of ``region``'s whole range."""
    import resource

    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    int(region.array[::mmap.PAGESIZE].sum())
    return time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def first_touch_table(reps: int, quick: bool) -> None:
    import ctypes

    from precompile.reader.direct import Region

    total = (8 if quick else 80) << 20
    libc = Region._lib()
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    print(f"\n{total >> 20} MiB in N files, mapped into one range (direct.Region), one byte read per 4 KiB page; "
          f"medians of {reps}")
    print("| files | KiB each | first touch ms | faults | us per file | MADV_POPULATE_READ ms | us per file | "
          "second touch ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as d:
        for count in (1, 50, 500 if quick else 5000):
            sub = os.path.join(d, str(count))
            os.makedirs(sub)
            size = total // count
            paths = [os.path.join(sub, f"{i:05d}.bin") for i in range(count)]
            data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
            for p in paths:
                data.tofile(p)
                np.fromfile(p, np.uint8)   # warm
            got: dict[str, list[float]] = {"touch": [], "faults": [], "populate": [], "again": []}
            for _ in range(reps):
                for populate in (False, True):
                    region = Region.reserve(paths, [size] * count)
                    for i in range(count):
                        region.map_slot(i)
                    if populate:
                        t0 = time.perf_counter()
                        if libc.madvise(region.addr, region.size, 22) != 0:   # MADV_POPULATE_READ (Linux 5.14)
                            got["populate"].append(float("nan"))
                        else:
                            got["populate"].append(time.perf_counter() - t0)
                    else:
                        dt, faults = _touch(region)
                        got["touch"].append(dt)
                        got["faults"].append(faults)
                        got["again"].append(_touch(region)[0])
                    del region
            med = {k: statistics.median(v) for k, v in got.items()}
            print(f"| {count} | {size >> 10} | {med['touch'] * 1e3:.2f} | {med['faults']:.0f} | "
                  f"{med['touch'] / count * 1e6:.1f} | {med['populate'] * 1e3:.2f} | "
                  f"{med['populate'] / count * 1e6:.1f} | {med['again'] * 1e3:.2f} |")


class _before:
    """The Loader's gather as before this change, while active: buffers from ``np.empty`` (16 bytes into a page)
    and rows of many chunk alignments through one strided fancy index (``VIEW_ALL_BYTES`` off)."""

    def __init__(self, feed, direct, on: bool = True):
        self.feed, self.direct, self.on = feed, direct, on
        try:   # where VIEW_ALL_BYTES lives: reader/views.py since issue 36, reader/direct.py before
            from precompile.reader import views as knobs
        except ImportError:
            knobs = direct
        self.knobs = knobs

    def __enter__(self) -> None:
        if self.on:
            self.old = (self.feed.page_aligned_empty, self.direct.page_aligned_empty, self.knobs.VIEW_ALL_BYTES)
            self.feed.page_aligned_empty = self.direct.page_aligned_empty = lambda shape, dtype: np.empty(shape, dtype)
            self.knobs.VIEW_ALL_BYTES = 1 << 62

    def __exit__(self, *exc) -> None:
        if self.on:
            self.feed.page_aligned_empty, self.direct.page_aligned_empty, self.knobs.VIEW_ALL_BYTES = self.old


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--mb", type=int, default=None, help="store size in MB for the array table (default 384, "
                                                        "quick 64)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--first-touch", action="store_true", help="also the first-touch table (80 MB in 1 to 5,000 files)")
    ap.add_argument("--loader", action="store_true", help="also the Loader table (writes two stores)")
    args = ap.parse_args(argv)
    reps = args.repeats or (2 if args.quick else 5)
    print(f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}")
    for sample in (64, 256):
        arrays_table(sample, args.mb or (64 if args.quick else 384), args.batch, reps)
    offsets_table(reps, args.quick)
    if args.first_touch:
        first_touch_table(reps, args.quick)
    if args.loader:
        loader_table(reps, args.quick, args.batch)


if __name__ == "__main__":
    main()
