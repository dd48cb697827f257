"""What the index's own checksums (``index_crc32``, issue 34) cost when a build is opened and first used.

One build of ``--samples`` keys (default 100,000; 2x2x1 uint8 rows, ``--shards`` shards) is written through
the project's HDF5 writer, and a copy of its index without ``index_crc32`` (an index written before the
checksums: the same code checks nothing). Each measured step runs on both indexes in turn (alternating, so
that the machine's load falls on both alike), warm page cache; the table gives the medians (wall time, and
this process's CPU time) and the ratio with/without:

- ``open``: ``precompile.open`` (the attributes and ``__shards__`` checked; the per-sample columns read, not
  yet checked);
- ``open + key(0)``: the first key served (the key column checked on this first use);
- ``open + keys``: every key decoded;
- ``open + copy(0)``: the copy column checked on first use;
- ``open + DirectReader``: what a Loader makes (``__chunks__`` read and checked);
- ``crc32 of the columns``: what checking the per-sample columns at open would have added (not done).

    PYTHONPATH=. python benchmarks/bench_index_checksum.py [--samples 100000] [--shards 10] [--repeats 31]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loader import write_store  # noqa: E402


def _interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, tuple[float, float]]:
    """(median wall seconds, median CPU seconds of this process) of each of ``fns``, run in turns (one of each
    per round). On a loaded machine the CPU time moves less than the wall time (waits for a core are not in it)."""
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[k].append((time.perf_counter() - t0, time.process_time() - c0))
    return {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--shards", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=31)
    args = ap.parse_args(argv)

    import h5py

    import precompile
    from precompile.formats import names as fmt
    from precompile.reader.direct import DirectReader

    rng = np.random.default_rng(0)
    tmp = tempfile.mkdtemp(prefix="bench-index-crc-")
    try:
        n = args.samples
        t0 = time.perf_counter()
        index = write_store(tmp, "k", rng.integers(0, 256, (n, 2, 2, 1), dtype=np.uint8), rng.integers(0, 10, n),
                            chunk_samples=1024, num_shards=args.shards)
        plain = index[:-3] + "-plain.h5"
        shutil.copyfile(index, plain)
        with h5py.File(plain, "r+") as f:
            del f.attrs[fmt.A_INDEX_CRC]
        with h5py.File(index, "r") as f:
            cols = [f[name][()] for name in (fmt.KEY_UTF8, fmt.KEY_OFFSETS, fmt.COPY)]
        col_bytes = sum(a.nbytes for a in cols)
        print(f"{n:,} keys in {args.shards} shards (written in {time.perf_counter() - t0:.1f} s); index "
              f"{os.path.getsize(index) / 2**20:.1f} MiB, its per-sample columns {col_bytes / 2**20:.2f} MiB; "
              f"medians of {args.repeats}, taken in turns; load average {os.getloadavg()[0]:.1f}")

        def opened(path: str, then: Callable[[Any], Any] | None = None) -> Callable[[], None]:
            def run() -> None:
                ds = precompile.open(path)
                if then is not None:
                    then(ds)
                ds.close()
            return run

        def reader(ds: Any) -> None:
            DirectReader(ds).close()

        steps = {"open": None, "open + key(0)": lambda ds: ds.key(0), "open + keys": lambda ds: ds.keys,
                 "open + copy(0)": lambda ds: ds.copy(0), "open + DirectReader": reader}
        rows = []
        for name, then in steps.items():
            t = _interleaved({"plain": opened(plain, then), "sealed": opened(index, then)}, args.repeats)
            rows.append((name, t["plain"], t["sealed"]))
        crc = _interleaved({"crc": lambda: [zlib.crc32(a) for a in cols]}, args.repeats)["crc"]
        base_open = rows[0][1]
        print()
        print("| step | without index_crc32 ms | with ms | ratio | CPU ms without | CPU ms with | CPU ratio |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, a, b in rows:
            print(f"| {name} | {a[0] * 1e3:.2f} | {b[0] * 1e3:.2f} | {b[0] / a[0]:.2f} | {a[1] * 1e3:.2f} | "
                  f"{b[1] * 1e3:.2f} | {b[1] / max(a[1], 1e-9):.2f} |")
        print(f"| crc32 of the per-sample columns (not done at open) | - | {crc[0] * 1e3:.2f} | "
              f"{(base_open[0] + crc[0]) / base_open[0]:.2f} (if at open) | - | {crc[1] * 1e3:.2f} | "
              f"{(base_open[1] + crc[1]) / max(base_open[1], 1e-9):.2f} (if at open) |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
