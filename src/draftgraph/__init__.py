"""draftgraph: a small, fast LLM inference engine for lossless speculative decoding, with
attention metadata built inside CUDA graphs.

    from draftgraph import EngineConfig, LLMEngine, SamplingParams, SpecConfig
"""

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import EngineError, LLMEngine
from draftgraph.engine.request import RequestOutput
from draftgraph.engine.sampling import SamplingParams

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "EngineError",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "SpecConfig",
]
