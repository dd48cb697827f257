"""The Loader's conversion on the CPU (uint8 -> float32, x * a[c] + b[c]): ``gpu.Convert`` as it is (a contiguous
(..., W, C) batch scaled as rows of W * C values against coefficients repeated W times) against the same
arithmetic broadcast along the last axis of C = 3 values (the conversion before; torch's CPU kernels do not
vectorise a broadcast of 3). The same bits (checked); medians of paired runs, the two taking turns.

    PYTHONPATH=. python benchmarks/bench_convert.py [--threads 1,2] [--repeats 15]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from precompile.reader.gpu import Convert  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def broadcast_c(conv: Convert, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The baseline: C coefficients broadcast along the last axis."""
    a, b = conv._coeffs(x.device, x.shape[-1])
    return out.copy_(x).mul_(a).add_(b)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="torch intra-op thread counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    print(f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}; medians of {args.repeats}")
    print()
    print("| batch | torch threads | broadcast of C ms | rows of W*C ms | speed-up (paired) |")
    print("|---|---:|---:|---:|---:|")
    for t in (int(v) for v in args.threads.split(",")):
        torch.set_num_threads(t)
        for n, s in ((1280, 32), (256, 64), (256, 224)):
            x = torch.randint(0, 256, (n, s, s, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
            out = torch.empty(x.shape, dtype=torch.float32)
            conv = Convert(torch.float32, MEAN, STD, scale=1 / 255)
            ref = broadcast_c(conv, x, out).clone()
            assert torch.equal(conv(x, out=out).view(torch.int32), ref.view(torch.int32)), "not the same bits"
            old, new = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                broadcast_c(conv, x, out)
                old.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                conv(x, out=out)
                new.append(time.perf_counter() - t0)
            up = statistics.median(a / b for a, b in zip(old, new))
            print(f"| {n} x {s}x{s}x3 | {t} | {statistics.median(old) * 1e3:.2f} | {statistics.median(new) * 1e3:.2f} "
                  f"| {up:.2f} |")
    print()
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
