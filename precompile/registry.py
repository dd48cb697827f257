"""Name -> class registries for decoders, steps and output formats (``WRITERS``: :class:`precompile.formats.base.Format` subclasses).

Registering a name twice is an error; looking up an unknown name lists the
close matches (as MONAI's ``look_up_option`` does).
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from .errors import UnknownName

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str | None = None) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            key = name or getattr(obj, "name")
            old = self._items.get(key)
            if old is not None and not _same_definition(old, obj):
                raise ValueError(f"{self.kind} {key!r} is already registered by {self._items[key]!r}")
            self._items[key] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise UnknownName(self.kind, name, list(self._items)) from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._items.items())


def _same_definition(a: object, b: object) -> bool:
    """True when ``b`` is ``a`` defined again by re-importing its module (a plugin whose source changed)."""
    return (getattr(a, "__module__", None) == getattr(b, "__module__", 0)
            and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", 0))


DECODERS: Registry = Registry("decoder")
STEPS: Registry = Registry("step")
WRITERS: Registry = Registry("output format")


def load_builtins() -> None:
    """Import the modules that register the built-in decoders, steps and output formats."""
    from . import decoders, formats, transforms  # noqa: F401
