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


# ---- programmatic dependent launch (Hopper and later) -------------------------------------
# A kernel launched with `pdl_kwargs(t)` may be scheduled while the kernel before it in the
# stream (or graph) still runs: every one of its programs must call `pdl_wait(PDL)` before any
# load or store (early exits too), which waits for that kernel to finish with its writes
# visible, then lets the next PDL kernel be scheduled; so at most two kernels overlap, the
# second parked at its wait. What it saves is the launch between dependent kernels: on an
# H100, decode 0.611 -> 0.578 ms (SmolLM2-135M, batch 1) and 5.567 -> 5.477 (Llama-3.1-8B).
# Prefetching the weights into L2 before the wait was measured too and lost (8B: 6.30 ms).
# DRAFTGRAPH_PDL=0 turns it off (A/B); off on the CPU, under the interpreter, before sm_90.
PDL_ENV = "DRAFTGRAPH_PDL"
_PDL_DEVICES: dict = {}


def pdl_on(t) -> bool:
    """Whether kernels launched on tensor `t`'s device use programmatic dependent launch."""
    if not (HAS_TRITON and t.is_cuda) or interpreting() or os.environ.get(PDL_ENV, "1") == "0":
        return False
    dev = t.device.index
    if dev not in _PDL_DEVICES:
        import torch

        _PDL_DEVICES[dev] = (torch.cuda.get_device_capability(t.device)[0] >= 9
                             and _gdc_wait is not None)
    return _PDL_DEVICES[dev]


def pdl_kwargs(t) -> dict:
    """Launch keywords of a PDL-aware kernel on `t`'s device: its PDL constexpr, and Triton's
    launch_pdl option when on."""
    return {"PDL": True, "launch_pdl": True} if pdl_on(t) else {"PDL": False}


try:  # Triton >= 3.3 on CUDA
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
except ImportError:  # pragma: no cover - older Triton or no Triton
    _gdc_wait = None

if HAS_TRITON:

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Wait for the kernel before to finish (its writes visible), then let the next start."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

else:  # pragma: no cover - exercised only without triton
    pdl_wait = None
