"""What the fused-chain tests share (tests/test_fused.py, tests/test_fused_outside.py): triton imported once, under
its interpreter on a machine without a GPU (``TRITON_INTERPRET=1`` must be set when triton is first imported:
its own library is made for the interpreter then; it is set for that import only, and per test by the
``interpret`` fixture for the CPU dispatch), the kernels made, and the steps bound to an RGB image field.
Importing it skips the importing test module where triton is not installed."""
from __future__ import annotations

import os

import pytest
import torch

#: where the kernels run in this test process: compiled for the GPU where there is one, else the interpreter
DEV = "cuda" if torch.cuda.is_available() else "cpu"
_before = os.environ.get("TRITON_INTERPRET")
if DEV == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton  # noqa: F401
except ImportError as e:   # (the reason names the import's own error: a broken install reads differently)
    pytest.skip(f"triton does not import ({type(e).__name__}: {e}): the fused kernels (and Triton's interpreter, "
                "which runs them on the CPU) need it (pip install 'precompile[fused]')", allow_module_level=True)
from precompile.reader import augment, fused, gpu  # noqa: E402

try:
    fused.kernels()   # made now, under the interpreter on the CPU
finally:
    if _before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _before

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


@pytest.fixture
def interpret(monkeypatch):
    """Triton's interpreter on, for this test only: a CPU batch may take the fused kernels (the Loader's other
    tests keep the eager path on the CPU), and triton's first launch reads it too."""
    if DEV == "cpu":   # (never where the kernels are compiled: triton's compiler reads it too)
        if not fused.interpreted():
            pytest.skip("triton was imported before this module without TRITON_INTERPRET=1, so its kernels are "
                        "not the interpreter's and cannot run on the CPU in this process")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("PRECOMPILE_FUSED", raising=False)


def bind(steps: list, hw: tuple[int, int], fields: dict | None = None) -> list:
    """``steps`` parsed and bound to ``fields`` ({name: (kind, shape)}; default one (H, W, 3) image)."""
    steps = augment.parse_steps(steps)
    fields = fields or {"image": ("image", (*hw, 3))}
    gpu.bind_steps(steps, {f: {"kind": k} for f, (k, _) in fields.items()}, {f: s for f, (_, s) in fields.items()})
    return steps
