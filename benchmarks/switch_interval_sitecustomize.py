"""Copied to a PYTHONPATH folder as sitecustomize.py by benchmarks/gil_gpu.sh: every Python
process started there (the API server and the spawned engine process) takes the GIL switch
interval DG_SWITCH_INTERVAL (seconds; CPython's default 0.005) when it is set."""
import os
import sys

if os.environ.get("DG_SWITCH_INTERVAL"):
    sys.setswitchinterval(float(os.environ["DG_SWITCH_INTERVAL"]))
