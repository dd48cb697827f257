"""Shuffled batches of 256 from 64x64x3 uint8 stores of 1, 100 and 5,000 shards: the Loader against in-memory gathers.

Contenders, all measured in this run on the same samples (warm page cache):

- ``in-memory gather, sorted`` (the limit): the whole set in one array,
  ``np.take(images, np.sort(batch), axis=0)``; ``unsorted``: the batch in the
  sampler's order. No ``out=`` argument: with ``mode="raise"`` numpy buffers
  ``out`` and the gather runs at about 0.6x (the old benchmark's handicap).
- ``Loader`` (CPU, full shuffle, default threads) on each store: the files
  mapped in one address range (the default), one map per shard (the gather
  before this benchmark's issue, ``USE_REGION`` off), and ``in_memory=True``;
  on the largest store also with 2 gather threads.
- ``DataLoader(H5Dataset)``, 0 workers, on the 100-shard store (h5py per sample).

The stores hold the same samples (``--samples``, default 80,000 = 938 MiB)
cut into 1, 100 and 5,000 shards (``--shards``), written through the project's
HDF5 writer. Every contender yields uint8 batches of 256 in a fresh random
order per repeat; the table gives the median samples/s over the repeats and
the ratios to both limits.

    PYTHONPATH=. python benchmarks/bench_loader.py [--quick] [--samples N] [--shards 1,100,5000] [--repeats R]

``--open-scale`` measures instead how opening and a shuffled epoch scale with the shard count (issue 20):
the same small samples (default 5,000 of 64x64x3) in 2, 375, 2,500 and 5,000 shards; per store the index
size, ``precompile.open`` and ``Loader(...)`` construction (with ``map_shards`` "all" and "lazy"), both
also through a copy of the index without its columnar copies (``__shards__``, ``__key_utf8__``: the entry
JSON parsed, every key read, as before them), ``Loader`` through an index without chunk tables either (h5py
opens every shard, as before issue 20), the first batch's latency, and a full-shuffle epoch (batches of
256) against the store of 2 shards and against a sorted ``np.take(images, idx, axis=0, out=buf,
mode="clip")`` of the same batches from private memory, with the minor page faults of a fresh Loader's
first epoch. Then ``--big`` samples (default 1,000,000 of 8x8x3, 100 shards): open and ``Loader(...)``
with and without the columnar copies, and the first batch. Medians over ``--repeats``, warm page cache.

    PYTHONPATH=. python benchmarks/bench_loader.py --open-scale [--samples 5000] [--shards 2,375,2500,5000] [--big N]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from timing import median_time  # noqa: E402

from precompile.formats import names as fmt  # noqa: E402
from precompile.sample import FieldSpec, Sample  # noqa: E402
from precompile.formats.hdf5 import Hdf5Format  # noqa: E402


def write_store(out_dir: str, name: str, images: np.ndarray, labels: np.ndarray, kind: str = "image",
                samples_per_shard: int = 8192, chunk_samples: int = 256, num_shards: int | None = None) -> str:
    """Write ``images``/``labels`` as a build (shards + index) through the project's HDF5 writer
    (``num_shards``: exactly that many shards, sizes differing by at most one, instead of ``samples_per_shard``)."""
    specs = {"image": FieldSpec(kind, tuple(images.shape[1:]), str(images.dtype)), "label": FieldSpec("label", (), "int64")}
    chunking = {"image": chunk_samples, "label": max(chunk_samples, 1024)}
    w = Hdf5Format()
    sdir = os.path.join(out_dir, fmt.shard_dir_name(name))
    os.makedirs(sdir, exist_ok=True)
    shards = []
    if num_shards:
        cuts = np.linspace(0, len(images), num_shards + 1).round().astype(int).tolist()
    else:
        cuts = [*range(0, len(images), samples_per_shard), len(images)]
    for si, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:])):
        fname = fmt.shard_file_name(si)
        sw = w.open_shard(os.path.join(sdir, fname), specs, f"bench-{si}", None, chunking)
        for i in range(lo, hi):
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




def _index_without_columns(index: str) -> str:
    """A copy of ``index`` beside it without the columnar copies of the entries and keys (as before them)."""
    import shutil

    import h5py

    other = index[:-3] + "-nocolumns.h5"
    shutil.copyfile(index, other)
    with h5py.File(other, "r+") as f:
        for name in (fmt.SHARD_TABLE, fmt.KEY_UTF8, fmt.KEY_OFFSETS):
            del f[name]
    return other


def _index_without_tables(index: str) -> str:
    """A copy of ``index`` beside it without the chunk tables or the columnar copies (as before issue 20)."""
    import h5py

    other = _index_without_columns(index)
    with h5py.File(other, "r+") as f:
        del f[fmt.CHUNKS]
        entries = fmt.loads(f.attrs[fmt.A_SHARDS])
        f.attrs[fmt.A_SHARDS] = fmt.dumps([{k: v for k, v in e.items() if k != fmt.E_CHUNKS} for e in entries])
    os.replace(other, index[:-3] + "-notables.h5")
    return index[:-3] + "-notables.h5"


def _open_timings(index: str, old: str, bs: int, reps: int, field: str = "image") -> dict[str, float]:
    """Median seconds: open and Loader (map_shards all / lazy), each also without the columnar copies; Loader
    over the index without tables (``old``; skipped when None); first batch."""
    import precompile
    from precompile.reader.loader import Loader

    plain = _index_without_columns(index)

    def make(path: str = index, how: str = "all") -> None:
        Loader(path, batch_size=bs, shuffle="full", seed=0, device="cpu", fields=[field], map_shards=how).close()

    def first_batch() -> float:
        loader = Loader(index, batch_size=bs, shuffle="full", seed=0, device="cpu", fields=[field],
                        map_shards="lazy")
        it = iter(loader)
        t0 = time.perf_counter()
        next(it)
        dt = time.perf_counter() - t0
        it.close()
        loader.close()
        return dt
    out = {"open": median_time(lambda: precompile.open(index).close(), reps),
           "open plain": median_time(lambda: precompile.open(plain).close(), reps),
           "all": median_time(make, reps), "all plain": median_time(lambda: make(plain), reps),
           "lazy": median_time(lambda: make(how="lazy"), reps),
           "lazy plain": median_time(lambda: make(plain, how="lazy"), reps),
           "first": statistics.median(first_batch() for _ in range(reps))}
    if old is not None:
        out["old"] = median_time(lambda: make(old), max(1, reps // 2))
    return out


def _epochs(indexes: dict[int, str], images: np.ndarray, bs: int, reps: int) -> dict[Any, list[float]]:
    """Samples/s of full-shuffle epochs (the limit: seconds), turn by turn (noise from other jobs spreads
    over all): the sorted ``np.take`` limit (key "limit"), each store's Loader after its first epoch
    (key k), and a fresh Loader's first epoch (key ("first", k): the shards' first page faults; its minor
    faults under ("faults", k))."""
    import resource

    from precompile.reader.loader import Loader

    n = len(images)
    buf = np.empty((bs, *images.shape[1:]), images.dtype)
    loaders = {k: Loader(p, batch_size=bs, shuffle="full", seed=0, device="cpu", fields=["image"])
               for k, p in indexes.items()}
    for loader in loaders.values():   # the first epoch of these loaders is not timed
        timed_passes(lambda _r, loader=loader: loader, n, 1)
    out: dict[Any, list[float]] = {"limit": [], **{k: [] for k in indexes}, **{("first", k): [] for k in indexes},
                                   **{("faults", k): [] for k in indexes}}
    for r in range(reps):
        perm = np.random.default_rng(r).permutation(n)
        t0 = time.perf_counter()
        for i in range(0, n, bs):
            idx = np.sort(perm[i:i + bs])
            np.take(images, idx, axis=0, out=buf[:len(idx)], mode="clip")
        out["limit"].append(time.perf_counter() - t0)
        for k, loader in loaders.items():
            loader.set_epoch(r + 1)
            out[k].append(timed_passes(lambda _r, loader=loader: loader, n, 1)[0])
            fresh = Loader(indexes[k], batch_size=bs, shuffle="full", seed=0, device="cpu", fields=["image"])
            fresh.set_epoch(r + 1)
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            out[("first", k)].append(timed_passes(lambda _r, fresh=fresh: fresh, n, 1)[0])
            out[("faults", k)].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            fresh.close()
    for loader in loaders.values():
        loader.close()
    return out


def open_scale(n: int, counts: list[int], reps: int, bs: int, where: str | None, big: int) -> None:
    """The --open-scale tables (see the module docstring)."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, n)
    tmp = tempfile.TemporaryDirectory(dir=where)
    print(f"{n} x 64x64x3 uint8 ({n * 12288 / 2**20:.0f} MiB) per store; batch {bs}, {reps} repeats, "
          f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}")
    indexes, opened = {}, {}
    for k in counts:
        index = indexes[k] = write_store(tmp.name, f"s{k}", images, labels, chunk_samples=min(256, n // k),
                                         num_shards=k)
        _warm(os.path.join(tmp.name, fmt.shard_dir_name(f"s{k}")))
        opened[k] = _open_timings(index, _index_without_tables(index), bs, reps)
    ep = _epochs(indexes, images, bs, reps)
    med = {key: statistics.median(v) for key, v in ep.items()}
    lim = n / med["limit"]
    cols = ("shards", "index KiB", "open ms", "open ms, no columns", "Loader ms", "Loader ms, no columns",
            "lazy ms", "lazy ms, no columns", "no tables ms", "1st batch ms", "epoch samples/s", "x 2 shards",
            "x sorted take", "1st epoch x 2 shards", "1st epoch faults")
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("-" * (len(c) + 2) for c in cols) + "|")
    base = counts[0]
    for k in counts:
        t = opened[k]
        vals = [k, f"{os.path.getsize(indexes[k]) / 1024:.0f}", *(f"{t[c] * 1e3:.1f}" for c in (
                "open", "open plain", "all", "all plain", "lazy", "lazy plain")), f"{t['old'] * 1e3:.0f}",
                f"{t['first'] * 1e3:.1f}", f"{med[k]:,.0f}", f"{med[k] / med[base]:.2f}", f"{med[k] / lim:.2f}",
                f"{med[('first', k)] / med[('first', base)]:.2f}", f"{med[('faults', k)]:.0f}"]
        print("| " + " | ".join(f"{v:>{len(c)}}" for v, c in zip(vals, cols)) + " |")
    print(f"\nsorted np.take from private memory: {lim:,.0f} samples/s (median of {reps})")
    tmp.cleanup()
    if big:
        big_open(big, reps, bs, where)


def _warm(folder: str) -> None:
    """Read every file under ``folder`` once (a warm page cache)."""
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            while f.read(1 << 24):
                pass


def big_open(n: int, reps: int, bs: int, where: str | None) -> None:
    """open, Loader() and the first batch of ``n`` samples of 8x8x3 in 100 shards, with and without the index's
    columnar copies."""
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)
    tmp = tempfile.TemporaryDirectory(dir=where)
    t0 = time.perf_counter()
    index = write_store(tmp.name, "big", images, rng.integers(0, 10, n), chunk_samples=1024, num_shards=100)
    _warm(os.path.join(tmp.name, fmt.shard_dir_name("big")))
    print(f"\n{n:,} samples of 8x8x3 in 100 shards (written in {time.perf_counter() - t0:.0f} s); index "
          f"{os.path.getsize(index) / 2**20:.1f} MiB, its columnar copies "
          f"{_columns_bytes(index) / 2**20:.1f} MiB; medians of {reps}, load average {os.getloadavg()[0]:.1f}")
    t = _open_timings(index, None, bs, reps)
    print("| | open ms | Loader ms | lazy ms | 1st batch ms |")
    print("|---|---:|---:|---:|---:|")
    print(f"| with the columnar copies | {t['open'] * 1e3:.1f} | {t['all'] * 1e3:.1f} | {t['lazy'] * 1e3:.1f} | "
          f"{t['first'] * 1e3:.1f} |")
    print(f"| without (as before) | {t['open plain'] * 1e3:.1f} | {t['all plain'] * 1e3:.1f} | "
          f"{t['lazy plain'] * 1e3:.1f} | - |")
    tmp.cleanup()


def _columns_bytes(index: str) -> int:
    import h5py

    with h5py.File(index, "r") as f:
        return sum(int(f[name].id.get_storage_size()) for name in (fmt.SHARD_TABLE, fmt.KEY_UTF8, fmt.KEY_OFFSETS))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--open-scale", action="store_true", help="opening and epoch cost against the shard count")
    ap.add_argument("--quick", action="store_true", help="small stores and few repeats (a smoke run)")
    ap.add_argument("--samples", type=int, default=None, help="samples per store (default 80000, quick 4096)")
    ap.add_argument("--shards", default=None, help="shard counts, comma-separated (default 1,100,5000; quick 1,256)")
    ap.add_argument("--repeats", type=int, default=None, help="passes per contender (default 5, quick 3)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--dir", default=None, help="where to write the stores (default: a temporary folder)")
    ap.add_argument("--big", type=int, default=None, help="--open-scale: samples of the large store (default "
                                                          "1000000, quick 20000; 0: none)")
    args = ap.parse_args(argv)
    if args.open_scale:
        open_scale(args.samples or 5000, [int(x) for x in (args.shards or "2,375,2500,5000").split(",")],
                   args.repeats or 5, args.batch_size, args.dir,
                   args.big if args.big is not None else (20_000 if args.quick else 1_000_000))
        return
    n = args.samples or (4096 if args.quick else 80000)
    reps = args.repeats or (3 if args.quick else 5)
    counts = [int(x) for x in (args.shards or ("1,256" if args.quick else "1,100,5000")).split(",")]
    bs = args.batch_size

    import torch
    from torch.utils.data import DataLoader

    import precompile
    from precompile.reader import direct
    from precompile.reader.loader import Loader

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, n)
    tmp = tempfile.TemporaryDirectory(dir=args.dir)
    print(f"{n} x 64x64x3 uint8 ({n * 12288 / 2**20:.0f} MiB) per store; batch {bs}, {reps} passes each, "
          f"torch threads {torch.get_num_threads()}, {os.cpu_count()} cpus")
    stores = {}
    for k in counts:
        per = -(-n // k)
        t0 = time.perf_counter()
        stores[k] = write_store(tmp.name, f"s{k}", images, labels, samples_per_shard=per, chunk_samples=min(256, per))
        ds = precompile.open(stores[k])
        for s in ds.shards:  # warm the page cache: every contender reads a warm cache
            with open(os.path.join(tmp.name, s["file"]), "rb") as f:
                while f.read(1 << 24):
                    pass
        print(f"store of {len(ds.shards)} shards ({per} samples each) written in {time.perf_counter() - t0:.1f} s")
        ds.close()

    rows: dict[str, list[float]] = {}

    def limit(r, sort):
        perm = np.random.default_rng(r).permutation(n)
        for i in range(0, n, bs):
            idx = perm[i:i + bs]
            yield np.take(images, np.sort(idx) if sort else idx, axis=0)

    # contenders take turns pass by pass, so that noise from other jobs spreads over all of them
    contenders = {"in-memory gather, sorted (limit)": lambda r: limit(r, True),
                  "in-memory gather, unsorted": lambda r: limit(r, False)}
    loaders = []
    for k in counts:
        variants = [("one region", True, False, None), ("map per shard", False, False, None),
                    ("in_memory", True, True, None)]
        if k == max(counts):  # gather threads: they pay off only where cores are idle
            variants += [("one region", True, False, 2), ("in_memory", True, True, 2)]
        for label, region, mem, threads in variants:
            direct.USE_REGION = region
            t0 = time.perf_counter()
            loader = Loader(stores[k], batch_size=bs, shuffle="full", seed=0, device="cpu", fields=["image"],
                            in_memory=mem, num_threads=threads)
            made = time.perf_counter() - t0
            direct.USE_REGION = True
            loaders.append(loader)

            def ld(r, loader=loader):
                loader.set_epoch(r)
                return loader
            contenders[f"{k} shards: Loader, {label} ({loader.num_threads} thr; made in {made:.1f} s)"] = ld
    if 100 in counts or counts:
        k = 100 if 100 in counts else counts[0]

        class Images(torch.utils.data.Dataset):
            def __init__(self, ds):
                self.ds = ds

            def __len__(self):
                return len(self.ds)

            def __getitem__(self, i):
                return self.ds[i]["image"]

        def dl(r, k=k):
            g = torch.Generator().manual_seed(r)
            return DataLoader(Images(precompile.open(stores[k], fields=["image"])), batch_size=bs, shuffle=True,
                              num_workers=0, generator=g)
        contenders[f"{k} shards: DataLoader(h5py per sample), 0 workers"] = dl
    for name in contenders:
        rows[name] = []
    for r in range(reps):
        for name, make in contenders.items():
            if "DataLoader" in name and r >= 1:
                continue  # slow and not the point: one pass
            rows[name].extend(timed_passes(lambda _r, make=make, r=r: make(r), n, 1))
    lim = statistics.median(rows["in-memory gather, sorted (limit)"])
    unl = statistics.median(rows["in-memory gather, unsorted"])
    print()
    print(f"| {'contender':<62} | {'samples/s (median)':>18} | {'x sorted':>8} | {'x unsorted':>10} |")
    print(f"|{'-' * 64}|{'-' * 20}|{'-' * 10}|{'-' * 12}|")
    for name, v in rows.items():
        m = statistics.median(v)
        print(f"| {name:<62} | {m:>18,.0f} | {m / lim:>8.2f} | {m / unl:>10.2f} |")
    print()
    for loader in loaders:
        loader.close()
    tmp.cleanup()


if __name__ == "__main__":
    main()
