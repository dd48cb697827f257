"""Registered output formats. Importing this package registers the built-in ones."""
from __future__ import annotations

from .base import ShardWriter, Writer, WriterOptions
from . import hdf5  # noqa: F401  (registers "hdf5")

__all__ = ["ShardWriter", "Writer", "WriterOptions"]
