"""ModelRunner: owns the model, the KV pools, the metadata buffers and the attention backend,
and runs one forward of a batch described by raw inputs.

A step batch is flat: request r contributes `extend_lens[r]` tokens (a prefill chunk, the single
decode token, or 1 + drafts in a verify step); `logit_indices` names the tokens whose next-token
logits are needed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from draftgraph.attention.backend import ForwardBatch, Phase, TorchBackend
from draftgraph.attention.metadata import MetadataBuffers
from draftgraph.config import CacheConfig, SchedulerConfig
from draftgraph.distributed.parallel import min_over_ranks
from draftgraph.distributed.worker import tp_driver
from draftgraph.models.llama import LlamaForCausalLM
from draftgraph.runtime.kv_cache import KVPool, PagedAllocator, ReqToTokenPool

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_TOKENS = 32768


@dataclass
class StepBatch:
    """Host-side description of one forward (what the scheduler decided)."""

    phase: Phase
    input_ids: list[int]
    req_pool_indices: list[int]
    seq_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: list[int]
    logit_indices: list[int]


def make_backend(name: str, kv_pool: KVPool, req_to_token: torch.Tensor, model_cfg,
                 max_bs: int, max_num_tokens: int, dtype: torch.dtype, device: torch.device,
                 num_q_heads: int | None = None):
    """`num_q_heads`: the query heads this rank attends over (default: all of the model's)."""
    scale = model_cfg.head_dim ** -0.5
    if name == "torch":
        return TorchBackend(kv_pool, req_to_token, model_cfg.sliding_window, scale)
    if name == "triton":
        from draftgraph.attention.triton_backend import TritonBackend

        return TritonBackend(kv_pool, req_to_token, model_cfg.sliding_window, scale,
                             max_bs=max_bs,
                             num_q_heads=num_q_heads or model_cfg.num_attention_heads,
                             device=device)
    raise ValueError(f"unknown attention backend {name!r} (torch, triton)")


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache_cfg: CacheConfig,
                 sched_cfg: SchedulerConfig, max_model_len: int, device: torch.device,
                 dtype: torch.dtype, backend: str, extra_tokens_per_req: int = 0) -> None:
        cfg = model.config
        # TP: rank 0 sends these arguments to ranks > 0, which build the same runner and then
        # follow its steps (distributed/worker.py); None without tensor parallelism
        self.tp_driver = tp_driver(model.tp, dict(
            cache_cfg=cache_cfg, sched_cfg=sched_cfg, max_model_len=max_model_len, dtype=dtype,
            backend=backend, extra_tokens_per_req=extra_tokens_per_req))
        self.model = model
        self.config = cfg
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.max_num_seqs = sched_cfg.max_num_seqs
        # a verify step feeds up to 1 + k tokens per request
        self.max_num_tokens = max(sched_cfg.max_num_batched_tokens,
                                  sched_cfg.max_num_seqs * (1 + extra_tokens_per_req))
        # TP: every rank's pool has the same slots (rank 0's allocator picks them)
        num_slots = min_over_ranks(self._kv_slots(cache_cfg, sched_cfg, max_model_len),
                                   model.tp)
        self.allocator = PagedAllocator(num_slots, cache_cfg.page_size)
        self.req_pool = ReqToTokenPool(sched_cfg.max_num_seqs, max_model_len + cache_cfg.page_size
                                       + extra_tokens_per_req, device)
        self.kv_pool = KVPool(cfg.num_hidden_layers, self.allocator.num_slots,
                              model.num_local_kv_heads, cfg.head_dim, dtype, device)
        kv_capacity = self.allocator.num_slots + self.max_num_tokens * 2
        self.meta = MetadataBuffers(sched_cfg.max_num_seqs, self.max_num_tokens, kv_capacity,
                                    cfg.sliding_window, device)
        self.backend = make_backend(backend, self.kv_pool, self.req_pool.req_to_token, cfg,
                                    sched_cfg.max_num_seqs, self.max_num_tokens, dtype, device,
                                    num_q_heads=model.num_local_heads)
        logger.info("KV cache: %d slots (%.1f MiB), page size %d, backend %s",
                    self.allocator.usable_slots, self.kv_pool.bytes() / 2**20,
                    cache_cfg.page_size, self.backend.name)

        # token ids of every live sequence by position, for device-side drafting:
        # [max_reqs + 1, max_model_len + k + 1] int64, written wherever a token is fed
        self.token_table = torch.zeros_like(self.req_pool.req_to_token)
        self.graphs = None  # StepGraphRunner for decode (k = 0)
        self.spec_graphs = None  # StepGraphRunner for speculative steps (k drafts)

    def init_graphs(self, metadata_in_graph: bool | None = None, num_draft_tokens: int = 0,
                    proposer=None) -> None:
        """Capture decode graphs (and speculative-step graphs when k > 0) for every batch
        bucket up to max_num_seqs. CUDA only."""
        from draftgraph.runtime.graph_runner import StepGraphRunner

        if self.tp_driver is not None:  # TP: ranks > 0 capture the same graphs
            self.tp_driver.send_init_graphs(dict(metadata_in_graph=metadata_in_graph,
                                                 num_draft_tokens=num_draft_tokens,
                                                 proposer=proposer))
        self.graphs = StepGraphRunner(self, self.max_num_seqs,
                                      metadata_in_graph=metadata_in_graph)
        self.graphs.capture()
        if num_draft_tokens:
            self.spec_graphs = StepGraphRunner(self, self.max_num_seqs, num_draft_tokens,
                                               proposer, metadata_in_graph)
            self.spec_graphs.capture()

    def _kv_slots(self, cache_cfg: CacheConfig, sched_cfg: SchedulerConfig,
                  max_model_len: int) -> int:
        cfg = self.config
        want = sched_cfg.max_num_seqs * (max_model_len + cache_cfg.page_size)
        if cache_cfg.kv_cache_tokens is not None:
            return cache_cfg.kv_cache_tokens + cache_cfg.page_size
        bytes_per_token = (2 * cfg.num_hidden_layers * self.model.num_local_kv_heads * cfg.head_dim
                           * torch.tensor([], dtype=self.dtype).element_size())
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cache_cfg.gpu_memory_utilization) - 2 * 2**30
            fit = max(budget // bytes_per_token, 4096)
            return int(min(want, fit))
        return int(min(want, CPU_DEFAULT_KV_TOKENS))

    def forward_batch(self, sb: StepBatch) -> ForwardBatch:
        dev = self.device

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=dev)

        return ForwardBatch(
            phase=sb.phase,
            input_ids=t(sb.input_ids),
            req_pool_indices=t(sb.req_pool_indices),
            seq_lens=t(sb.seq_lens),
            extend_lens=t(sb.extend_lens),
            out_cache_loc=t(sb.out_cache_loc),
            meta=self.meta,
        )

    @torch.inference_mode()
    def forward(self, sb: StepBatch) -> torch.Tensor:
        """Run one eager forward; returns logits [len(logit_indices), vocab] fp32."""
        if self.tp_driver is not None:  # TP: ranks > 0 run the same forward
            self.tp_driver.send_forward(sb)
        fb = self.forward_batch(sb)
        self.backend.build_metadata(fb)
        self.token_table[fb.req_pool_indices[fb.meta.token_req[: fb.num_tokens]],
                         fb.positions] = fb.input_ids
        hidden = self.model(fb.input_ids, fb, self.backend)
        if not sb.logit_indices:
            return hidden.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        idx = torch.tensor(sb.logit_indices, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden[idx])
