"""A stop asked for by a signal (Ctrl-C, SIGTERM), kept until the build sees it.

Python runs a signal's handler between two bytecodes of whatever the main thread is running: when that is a
weakref callback or a ``__del__`` (h5py and numpy run many while a shard is written), the KeyboardInterrupt the
handler raises is printed as "Exception ignored in ..." and dropped, and the build went on to the end as if no
Ctrl-C had come. The CLI's handler therefore also records the stop here (:func:`request`), and the build's safe
points (after each input, each shard, each wait for a worker) raise it again (:func:`check`).
"""
from __future__ import annotations

_PENDING: list[int] = []


def request(signum: int) -> None:
    """Record a stop asked for by ``signum``."""
    _PENDING.append(signum)


def clear() -> None:
    """Forget a recorded stop (the CLI's build ended, by it or otherwise)."""
    _PENDING.clear()


def check() -> None:
    """Raise KeyboardInterrupt when a stop was recorded and not yet raised where it could not be lost."""
    if _PENDING:
        raise KeyboardInterrupt
