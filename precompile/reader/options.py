"""The Loader's option groups: the order of a pass, the DDP distribution, the device conversion.

Each group is a frozen dataclass that checks its values when made (the same
messages the Loader has always given); the Loader builds them from its flat
keywords, so ``precompile.Loader(path, batch_size=..., shuffle=..., seed=...,
dtype=..., mean=..., rank=..., ...)`` stays the documented call.

- :class:`Order`: which rows, in which order, in which batches
  (``shuffle``/``seed``/``block_window``/``sort_batches``/``drop_last``).
- :class:`Distribution`: this rank's share (``rank``/``world_size``/``uneven``).
- :class:`Conversion`: what the device makes of stored fields
  (``dtype``/``mean``/``std``/``channels_first``/``convert_fields``); the
  torch side (:class:`~precompile.reader.gpu.Convert` per field) is built from it
  by :func:`precompile.reader.feed.converts_for`.

No torch here: the groups hold plain values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

from ..errors import echo
from ..optschema import flag
from .sampler import normalize_mode

CONVERT_KINDS = ("image", "video")
#: the kinds convert_fields may name (their values are measurements); the others hold ids, counts or text
CONVERTIBLE = ("image", "video", "volume", "audio", "flow", "target")
IDS = {"mask": "class or instance ids", "volume_mask": "class ids", "flow_valid": "0/1 validity",
       "label": "class ids", "index": "indices", "boxes": "pixel coordinates, NaN-padded",
       "box_labels": "class ids", "keypoints": "pixel coordinates and visibility flags", "text": "strings"}


def whole(value: Any, name: str) -> int:
    """``value`` as an int when it is a whole number (an int, a numpy integer, or a float such as ``4.0`` from a
    config file); anything else (``2.5``, ``"4"``, ``True``, NaN) is a ``ValueError`` naming ``name``: ``int()``
    would truncate ``world_size=2.5`` to 2, or make ``seed=1.5`` the same stream as ``seed=1``, without a word."""
    import numbers

    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not ok and isinstance(value, numbers.Real) and not isinstance(value, bool):
        ok = float(value).is_integer()
    if not ok:
        from ..errors import echo

        raise ValueError(f"{name} must be a whole number, got {echo(value, 80)}")
    return int(value)


@dataclass(frozen=True)
class Order:
    """The order of a pass: ``mode`` (``shuffle`` as given: True, False, ``"full"``, ``"block"`` or ``"shard"``;
    stored normalised to ``"sequential" | "full" | "block" | "shard"``), with ``seed`` and the epoch;
    ``block_window`` chunks (``"shard"``: shards) are mixed at a time."""

    mode: bool | str = True
    seed: int = 0
    block_window: int = 8
    sort_batches: bool = True
    drop_last: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "seed", whole(self.seed, "seed"))
        object.__setattr__(self, "block_window", whole(self.block_window, "block_window"))
        if int(self.seed) < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if int(self.block_window) < 1:
            raise ValueError(f"block_window must be >= 1 chunk, got {self.block_window}")
        object.__setattr__(self, "mode", normalize_mode(self.mode))
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "block_window", int(self.block_window))
        object.__setattr__(self, "sort_batches", flag(self.sort_batches, "sort_batches"))
        object.__setattr__(self, "drop_last", flag(self.drop_last, "drop_last"))


@dataclass(frozen=True)
class Distribution:
    """This rank's disjoint, equal share of every epoch: ``uneven`` pads (``"pad"``) or drops the tail.
    ``source`` says where rank and world size came from: ``"given"``, ``"default"`` (one process) or
    ``"torch.distributed"`` (an initialised process group, see :meth:`resolve`)."""

    rank: int = 0
    world_size: int = 1
    uneven: Literal["pad", "drop"] = "pad"
    source: str = "given"

    def __post_init__(self) -> None:
        if self.uneven not in ("pad", "drop"):
            raise ValueError(f"uneven must be 'pad' or 'drop', got {echo(self.uneven)}")
        object.__setattr__(self, "rank", whole(self.rank, "rank"))
        object.__setattr__(self, "world_size", whole(self.world_size, "world_size"))
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size) (got rank={self.rank}, world_size={self.world_size})")
        object.__setattr__(self, "rank", int(self.rank))
        object.__setattr__(self, "world_size", int(self.world_size))

    @classmethod
    def resolve(cls, rank: int | None, world_size: int | None, uneven: Literal["pad", "drop"] = "pad") -> "Distribution":
        """Rank and world size as given, else from an initialised ``torch.distributed`` process group (so
        every DDP rank reads its own share without being told), else one process. A value given that
        contradicts the process group is a ``ValueError``: it would read the wrong share silently."""
        group = process_group()
        if group is None:
            if rank is None and world_size is not None and world_size != 1:   # every process would read rank 0's
                raise ValueError(f"world_size={world_size} without rank (and no initialised torch.distributed process "
                                 f"group): give this process's rank, or leave both out")
            src = "default" if rank is None and world_size is None else "given"
            return cls(0 if rank is None else rank, 1 if world_size is None else world_size, uneven, src)
        g_rank, g_world = group
        if (rank is not None and int(rank) != g_rank) or (world_size is not None and int(world_size) != g_world):
            raise ValueError(f"rank={rank}, world_size={world_size} contradict the initialised torch.distributed "
                             f"process group (rank {g_rank} of {g_world}); leave them out to use the group's")
        return cls(g_rank, g_world, uneven, "torch.distributed")


def process_group() -> tuple[int, int] | None:
    """``(rank, world size)`` of an initialised default ``torch.distributed`` process group, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


@dataclass(frozen=True)
class Conversion:
    """The device conversion: ``dtype`` (None keeps the stored dtype; with ``mean``/``std`` it is float32, as
    normalised values need a float type), per-channel ``mean``/``std`` (numbers or ``"stats"``), ``channels_first``
    NCHW views (with or without ``dtype``), and the fields it applies to (``convert_fields``; default: the loaded
    image/video fields, see :meth:`fields_of`)."""

    dtype: Any = None
    mean: Sequence[float] | float | str | None = None
    std: Sequence[float] | float | str | None = None
    channels_first: bool = False
    convert_fields: Sequence[str] | None = None

    def __post_init__(self) -> None:
        from ..sample import field_list

        if self.dtype is None and (self.mean is not None or self.std is not None):
            object.__setattr__(self, "dtype", "float32")
        object.__setattr__(self, "convert_fields", field_list(self.convert_fields, "convert_fields"))
        object.__setattr__(self, "channels_first", flag(self.channels_first, "channels_first"))
        if self.convert_fields and self.dtype is None and not self.channels_first:
            raise ValueError(f"convert_fields={echo(self.convert_fields)} without a dtype, mean/std or channels_first "
                             f"converts nothing; give dtype='float32' (or mean and std)")

    def fields_of(self, loaded: Sequence[str], specs: dict[str, dict]) -> list[str]:
        """The loaded fields to convert; a named field that is not loaded is a ``ValueError``."""
        if self.convert_fields is None:
            return [f for f in loaded if specs[f].get("kind") in CONVERT_KINDS]
        for f in self.convert_fields:
            if f not in loaded:
                raise ValueError(f"convert_fields: {echo(f)} is not loaded (loaded: {', '.join(loaded)})")
            kind = specs[f].get("kind")
            if kind in IDS:   # a float of ids: a class 3 became (3 - mean) / std, a 0/1 mask 0 or 1/255
                raise ValueError(f"convert_fields: {f!r} is a {kind} field ({IDS[kind]}), which the conversion "
                                 f"(uint8 / 255, then (x - mean) / std, as floats) would make into other numbers; "
                                 f"it converts {', '.join(CONVERTIBLE)} fields: leave {f!r} out")
        return list(self.convert_fields)

    def check_norm(self) -> None:
        for name, v in (("mean", self.mean), ("std", self.std)):
            if isinstance(v, str) and v != "stats":
                raise ValueError(f"{name} must be numbers or 'stats' (from `precompile stats`), got {echo(v)}")
