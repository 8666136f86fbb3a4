"""Optional Triton import.

Kernel modules import `triton` / `tl` from here, so `import draftgraph...` works without
Triton installed: the kernels then exist as stubs that raise on launch, and every caller
takes the plain-torch reference path.

NOTE: Triton decides between compiled and interpreted kernels when a kernel is decorated, so
`TRITON_INTERPRET=1` must be set before the first kernel module is imported.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

    class _MissingKernel:
        def __init__(self, fn):
            self.__name__ = fn.__name__

        def __getitem__(self, _grid):
            raise RuntimeError(f"{self.__name__} needs Triton (pip install draftgraph[triton])")

    def _jit(fn=None, **_kwargs):
        return _MissingKernel(fn) if fn is not None else _MissingKernel

    triton = SimpleNamespace(jit=_jit)
    tl = SimpleNamespace(constexpr=object)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable(t) -> bool:
    """Whether a Triton kernel may run on tensor `t`: CUDA tensors, or any in interpreter mode."""
    return HAS_TRITON and (t.is_cuda or interpreting())


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def compiled_for_cpu_missing(kernel) -> bool:
    """True when `kernel` was decorated for a GPU but no GPU is present: it was imported
    before TRITON_INTERPRET=1 was set, so it cannot run here."""
    import torch

    return (HAS_TRITON and not torch.cuda.is_available()
            and type(kernel).__name__ != "InterpretedFunction")
