"""Kernels that take a step's request count `bs` must not specialise on it.

Triton compiles a kernel anew for an integer argument equal to 1 or divisible by 16. A step's
request count takes every value, and a step the CUDA graphs do not cover (a prefill above the
captured token buckets, whose graphs always pass max_bs + 1 rows) would compile a new variant in
the middle of serving: on an H200 that stalled one request's first token by ~0.9 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# Runs outside the interpreter (which keeps no specialisation flags): decorating compiles nothing.
LIST_KERNELS = r"""
import importlib, json, pkgutil, triton
import draftgraph.kernels as K
out = {}
for m in pkgutil.iter_modules(K.__path__):
    mod = importlib.import_module("draftgraph.kernels." + m.name)
    for name, obj in vars(mod).items():
        if isinstance(obj, triton.runtime.jit.JITFunction):
            out[m.name + "." + name] = {p.name: bool(p.do_not_specialize) for p in obj.params}
print(json.dumps(out))
"""


def test_request_count_is_never_specialised():
    env = dict(os.environ, TRITON_INTERPRET="0")
    res = subprocess.run([sys.executable, "-c", LIST_KERNELS], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    kernels = json.loads(res.stdout)
    with_bs = {k: v["bs"] for k, v in kernels.items() if "bs" in v}
    # the extend attention, the metadata scans and the async token record all take bs
    assert {"attention._extend_kernel", "metadata._scan_inplace_kernel",
            "tokens._record_last_tokens_kernel"} <= set(with_bs)
    assert all(with_bs.values()), [k for k, v in with_bs.items() if not v]
