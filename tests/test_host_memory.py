"""The CPU path's allocator setting (runtime/host_memory.py): megabyte activations freed and
allocated again come from the heap, not as fresh pages that fault on first touch."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = r"""
import resource, sys, torch
import draftgraph.engine.engine  # what an engine's process has imported (its heap's start)
from draftgraph.runtime.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() and keep_freed_memory()  # idempotent
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def layer_of_activations():
    blocks = [torch.ones(768 * 1024) for _ in range(40)]  # 40 x 3 MiB, each written
    del blocks
layer_of_activations()
before = faults()
for _ in range(3):
    layer_of_activations()
print(faults() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_activations_are_reused_without_page_faults():
    def faults(arm: str) -> int:
        r = subprocess.run([sys.executable, "-c", CHILD, arm], capture_output=True, text=True,
                           check=True)
        return int(r.stdout.strip().splitlines()[-1])

    # 3 rounds x 120 MiB: about 92k pages if every block came fresh from the OS
    assert faults("keep") < 5000 < 20000 < faults("default")
