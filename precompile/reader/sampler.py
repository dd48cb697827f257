"""Sample orders for the Loader: sequential, full random permutation, block- or shard-shuffled; DDP shares.

Every order is a pure function of ``(seed, epoch)`` and the rows it is given:
the generator is ``seeding.stream(seed, epoch, MODE_STREAM)`` (``default_rng`` of that key), so
every rank of a distributed job computes the same global order, and a resumed
run the same order as the run it resumes. No global RNG is touched.

- ``sequential``: the rows as given.
- ``full``: a random permutation of the rows.
- ``block``: FFCV-style quasi-random order that reads whole chunks: the
  chunks are put in random order, cut into windows of ``window`` chunks, and
  the rows of each window are permuted among themselves. A batch then touches
  at most a few chunks, and every chunk is read exactly once per epoch.
- ``shard``: the same over whole shards: the shards in random order, ``window``
  shards at a time, their rows permuted among themselves. Every shard is read in
  one stretch of the epoch, so a build read from a URL through a cache smaller
  than the build fetches each shard once per epoch (``block`` visits a shard's
  chunks at random places of the epoch: each visit may fetch the shard again).

:func:`rank_share` cuts a global order into ``world_size`` disjoint, equal,
contiguous shares (padding by wrapping around to the start, or dropping the
tail), so a block-shuffled order stays block-local on every rank.
"""
from __future__ import annotations

from typing import Literal

import numpy as np

from ..seeding import stream

MODES = ("sequential", "full", "block", "shard")
DEFAULT_MODE = "full"
_STREAM = {"full": 1, "block": 2, "shard": 3}


def normalize_mode(shuffle: bool | str) -> str:
    """``False`` -> sequential, ``True`` -> the default mode (full); names pass through, checked."""
    if shuffle is False or shuffle is None:
        return "sequential"
    if shuffle is True:
        return DEFAULT_MODE
    if isinstance(shuffle, str) and shuffle in MODES:
        return shuffle
    raise ValueError(f"shuffle must be True, False or one of {', '.join(repr(m) for m in MODES)}; got {shuffle!r}")


def _rng(seed: int, epoch: int, mode: str) -> np.random.Generator:
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0 (got seed={seed}, epoch={epoch})")
    return stream(seed, epoch, _STREAM[mode])


def epoch_order(rows: np.ndarray, chunk_ids: np.ndarray | None, mode: str, seed: int, epoch: int,
                window: int = 8) -> np.ndarray:
    """The global order of ``rows`` for one epoch.

    ``chunk_ids[i]`` is the storage chunk of ``rows[i]`` (needed by ``block``), or its shard (``shard``).
    """
    rows = np.asarray(rows, dtype=np.int64)
    if mode == "sequential":
        return rows.copy()
    rng = _rng(seed, epoch, mode)
    if mode == "full":
        return rows[rng.permutation(len(rows))]
    if mode in ("block", "shard"):
        if chunk_ids is None or len(chunk_ids) != len(rows):
            raise ValueError(f"{mode} shuffling needs a {'chunk' if mode == 'block' else 'shard'} id per row")
        if window < 1:
            raise ValueError(f"window must be >= 1 {'chunk' if mode == 'block' else 'shard'}, got {window}")
        uniq, inv = np.unique(np.asarray(chunk_ids, dtype=np.int64), return_inverse=True)
        place = np.empty(len(uniq), dtype=np.int64)
        place[rng.permutation(len(uniq))] = np.arange(len(uniq))   # chunk -> its position in the new order
        win = place[inv] // window
        key = rng.random(len(rows))
        return rows[np.lexsort((key, win))]
    raise ValueError(f"unknown order {mode!r} (one of {', '.join(MODES)})")


def shard_ids(offsets: np.ndarray) -> np.ndarray:
    """The shard of every row of a build whose shards start at rows ``offsets`` (plus the end)."""
    counts = np.diff(np.asarray(offsets, dtype=np.int64))
    return np.repeat(np.arange(len(counts), dtype=np.int64), counts)


def rank_share(order: np.ndarray, rank: int, world_size: int,
               uneven: Literal["pad", "drop"] = "pad") -> np.ndarray:
    """Rank ``rank``'s contiguous share of ``order``; all shares have the same length.

    ``pad`` repeats rows from the start of the order to fill the last share
    (every row is seen; a few twice), ``drop`` leaves out the tail (no row
    twice; a few not seen this epoch).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size) and world_size >= 1 (got rank={rank}, "
                         f"world_size={world_size})")
    n = len(order)
    if world_size == 1:
        return order
    if uneven == "pad":
        per = -(-n // world_size)
        need = per * world_size - n
        if need:  # n > 0 here: an empty order needs no padding
            order = np.concatenate([order, np.resize(order, need)])
    elif uneven == "drop":
        per = n // world_size
    else:
        raise ValueError(f"uneven must be 'pad' or 'drop', got {uneven!r}")
    return order[rank * per:(rank + 1) * per]


def split_batches(order: np.ndarray, batch_size: int, drop_last: bool) -> list[np.ndarray]:
    """Consecutive batches of ``order``; the last one shorter unless ``drop_last``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n = len(order)
    end = n - n % batch_size if drop_last else n
    return [order[i:i + batch_size] for i in range(0, end, batch_size)]
