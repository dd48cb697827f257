"""Readers of built outputs. The build path never imports this package's torch parts."""
from __future__ import annotations

from .dataset import H5Dataset, open_dataset

__all__ = ["H5Dataset", "open_dataset"]
