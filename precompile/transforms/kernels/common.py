"""Helpers the kernels of several domains share."""
from __future__ import annotations

import numpy as np


def load_cv2():
    import cv2

    return cv2


def dtype_clip(f: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return np.clip(np.rint(f), info.min, info.max).astype(dtype)
    return f.astype(dtype)
