"""The header every benchmark JSON starts with: date, command, device, versions."""

from __future__ import annotations

import datetime
import os
import platform
import sys

import torch


def run_header(device: str | None = None) -> dict:
    """device: as measured on (default: the CUDA device's name, else the CPU's threads)."""
    if device is None or device.startswith("cuda"):  # --device cuda: the GPU's name
        device = (torch.cuda.get_device_name() if torch.cuda.is_available()
                  else f"CPU ({torch.get_num_threads()} threads)")
    elif device == "cpu":
        device = f"CPU ({torch.get_num_threads()} threads)"
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        # engine switches set for the run (A/B arms such as DRAFTGRAPH_PDL=0)
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("DRAFTGRAPH_")},
    }


def model_shape(cfg) -> dict:
    """The shape fields of a ModelConfig that a benchmark's timings depend on."""
    return {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
            "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size}
