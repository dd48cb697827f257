"""Readers of built outputs. The build path never imports this package's torch parts.

The datasets themselves belong to their formats (``precompile.formats``); they are re-exported here."""
from __future__ import annotations

from ..errors import ShapeMismatchError
from ..formats import Batch, Dataset, FileDataset, H5Dataset, open_dataset

__all__ = ["Batch", "Dataset", "FileDataset", "H5Dataset", "ShapeMismatchError", "open_dataset"]
