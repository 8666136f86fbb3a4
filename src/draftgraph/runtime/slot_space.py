"""The slot space: one per engine, shared by every model (target and drafters).

  allocator     PagedAllocator: which KV slots are free (page 0 is the dummy)
  req_pool      ReqToTokenPool: `req_to_token[row, pos]` = the KV slot of position pos
  token_table   [max_reqs + 1, max_context] int64: the token id at each position, written
                wherever a token is fed (device-side drafters read it)

NOTE: a slot id means the same position in every model's KV pool (`attention.kv_pool.KVPool`),
so one allocation, one `req_to_token` write and one free serve the target and all drafters.
"""

from __future__ import annotations

import torch

from draftgraph.config import CacheConfig, SchedulerConfig
from draftgraph.runtime.kv_cache import PagedAllocator, ReqToTokenPool

# CPU: a KV pool for the CPU use case (a few requests at a time), never smaller than one
# request of max_model_len; 8192 slots of SmolLM2-135M in fp32 are 360 MiB (was 32768: 1.4 GiB)
CPU_DEFAULT_KV_TOKENS = 8192
GPU_RESERVED_BYTES = 2 * 2**30  # activations, graphs, the allocator's slack


class SlotSpace:
    def __init__(self, num_slots: int, page_size: int, max_reqs: int, max_context_len: int,
                 device: torch.device) -> None:
        self.allocator = PagedAllocator(num_slots, page_size)
        self.req_pool = ReqToTokenPool(max_reqs, max_context_len, device)
        # [max_reqs + 1, max_context_len] int64
        self.token_table = torch.zeros_like(self.req_pool.req_to_token)

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots


def kv_slots(cache_cfg: CacheConfig, sched_cfg: SchedulerConfig, max_model_len: int,
             bytes_per_token: int, device: torch.device) -> int:
    """KV slots to allocate: the flag, else what fits (GPU free memory, every model's KV per
    token together) up to what max_num_seqs full-length requests could use, and never fewer
    than one request of max_model_len needs (plus the dummy page)."""
    one_request = max_model_len + 2 * cache_cfg.page_size
    want = max(sched_cfg.max_num_seqs * (max_model_len + cache_cfg.page_size), one_request)
    if cache_cfg.kv_cache_tokens is not None:
        return cache_cfg.kv_cache_tokens + cache_cfg.page_size
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * cache_cfg.gpu_memory_utilization) - GPU_RESERVED_BYTES
        fit = max(budget // bytes_per_token, 4096, one_request)
        return int(min(want, fit))
    return int(min(want, max(CPU_DEFAULT_KV_TOKENS, one_request)))
