"""Readers of built outputs. The build path never imports this package's torch parts."""
from __future__ import annotations

from .dataset import Batch, Dataset, FileDataset, H5Dataset, ShapeMismatchError, open_dataset

__all__ = ["Batch", "Dataset", "FileDataset", "H5Dataset", "ShapeMismatchError", "open_dataset"]
