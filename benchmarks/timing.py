"""What the benchmarks share: the median wall time of a call, over repeats (seconds)."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    """The median over ``repeats`` calls of ``fn()``'s wall time, in seconds."""
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
