"""Registered output formats. Importing this package registers the built-in ones:
``hdf5`` (fixed and variable-shape fields), ``png`` and ``bmp`` (image files),
``wav`` (audio files)."""
from __future__ import annotations

from .base import FolderOptions, FolderWriter, ShardWriter, Writer, WriterOptions
from . import hdf5  # noqa: F401  (registers "hdf5")
from . import image_files  # noqa: F401  (registers "png", "bmp")
from . import wav  # noqa: F401  (registers "wav")

__all__ = ["FolderOptions", "FolderWriter", "ShardWriter", "Writer", "WriterOptions"]
