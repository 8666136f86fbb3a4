"""draftgraph: a small, fast LLM inference engine for lossless speculative decoding, with
attention metadata built inside CUDA graphs.

    from draftgraph import EngineConfig, LLMEngine, SamplingParams, SpecConfig

The names below are imported on first use, so a module that needs none of them (the
`bench serve` client's processes, `draftgraph --version`) does not pay for importing torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CacheConfig": "draftgraph.config",
    "EngineConfig": "draftgraph.config",
    "SchedulerConfig": "draftgraph.config",
    "SpecConfig": "draftgraph.config",
    "EngineError": "draftgraph.engine.engine",
    "LLMEngine": "draftgraph.engine.engine",
    "RequestOutput": "draftgraph.engine.request",
    "SamplingParams": "draftgraph.engine.sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'draftgraph' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
