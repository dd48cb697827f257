"""The one source of randomness.

Every random draw in a build comes from :func:`rng_for`, seeded by the recipe
seed, a stable hash of the sample key and the copy index: no global RNG, no
worker seeds, nothing that depends on the job count or completion order. The
reader's draws (an epoch's order, a batch's device steps) come from
:func:`stream`, keyed by the seed, epoch, rank and batch.
"""
from __future__ import annotations

import hashlib

import numpy as np


def stable_hash(text: str) -> int:
    """A 64-bit hash of ``text`` that is the same in every process and run."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def rng_for(seed: int, key: str, copy: int = 0, *extra: int) -> np.random.Generator:
    """The generator for one sample copy (``extra`` separates sub-streams)."""
    return np.random.default_rng([int(seed), stable_hash(key), int(copy), *map(int, extra)])


def stream(*key: int) -> np.random.Generator:
    """The generator of a stream named by integers alone (the reader's: ``(seed, epoch, stream)`` for an epoch's
    order, ``(seed, epoch, rank, batch, step, 3)`` for a batch's device-step draws): ``default_rng`` of the key,
    so a stream is the same in every process, thread and run."""
    return np.random.default_rng([int(k) for k in key])


class LazyRng:
    """Stands in for :func:`rng_for`'s generator and creates it on first use.

    Seeding a generator costs tens of microseconds; most steps never draw, so a
    sample that meets no random step never pays for it. The draws are the same.
    """

    __slots__ = ("_args", "_rng")

    def __init__(self, seed: int, key: str, copy: int = 0):
        self._args = (seed, key, copy)
        self._rng: np.random.Generator | None = None

    def __getattr__(self, name: str):
        if self._rng is None:
            self._rng = rng_for(*self._args)
        return getattr(self._rng, name)
