"""The decoder interface: a small class with a name, a Params model and ``decode``.

A decoder turns one input path (a file, or a folder for a DICOM series) into
one or more named arrays plus JSON metadata, and declares their specs before
anything is decoded (``output_specs``). Decoders raise only :class:`DecodeError`.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict

from ..errors import DecodeError
from ..sample import FieldSpec

DEFAULT_INPUT_BYTES = 1 << 30   # limits.input_bytes: what one input may take in memory while it is decoded


def fmt_bytes(n: int) -> str:
    """``n`` bytes in words: exact count plus the binary unit (``1073741824 bytes (1.0 GiB)``)."""
    for unit, k in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n} bytes ({n / k:.1f} {unit})"
    return f"{n} bytes"


def check_budget(path: str, what: str, nbytes: int, budget: int) -> None:
    """Refuse one input before anything is allocated: its header declares ``what`` (e.g. ``9000x9000x3
    pixels``), which would take ``nbytes`` to decode, more than the per-input ``budget``."""
    if nbytes > budget:
        raise DecodeError(f"declares {what}: decoding it needs {fmt_bytes(int(nbytes))}, over the per-input "
                          f"budget of {fmt_bytes(int(budget))} (limits.input_bytes)", path=path, stage="decode")


class DecoderParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False,  # a NaN option is a typo, never a value
                              defer_build=True)  # validators built on first use: only the decoders a recipe names


class Decoder:
    name: ClassVar[str]
    kind: ClassVar[str]
    Params: ClassVar[type[DecoderParams]] = DecoderParams
    reads_dirs: ClassVar[bool] = False   # True: the input path is a folder (DICOM series)
    max_bytes: int = DEFAULT_INPUT_BYTES  # the per-input memory budget; the recipe sets it (limits.input_bytes)
    #: a folder decoder's check of each file it finds inside its folder before opening it: the path rule
    #: (inputs.paths.InputRoot.check: raises DecodeError for a file that resolves out of inputs.root); the
    #: shard task sets it for a local folder, None for a remote one's temporary copy
    inner_check: Optional[Callable[[str], Any]] = None

    def __init__(self, params: DecoderParams | None = None):
        self.params = params if params is not None else self.Params()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params!r})"

    # -- override one of these pairs ------------------------------------------
    def spec(self) -> FieldSpec:
        raise NotImplementedError

    def read(self, path: str) -> np.ndarray | tuple[np.ndarray, dict[str, Any]]:
        raise NotImplementedError

    def output_specs(self, field: str) -> dict[str, FieldSpec]:
        """Specs of the arrays this decoder makes for recipe field ``field``."""
        return {field: self.spec()}

    def decode(self, path: str, field: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Decode ``path`` into ``{array name: array}`` and JSON metadata."""
        out = self.read(path)
        if isinstance(out, tuple):
            arr, meta = out
        else:
            arr, meta = out, {}
        return {field: arr}, meta
