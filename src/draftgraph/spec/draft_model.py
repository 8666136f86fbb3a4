"""A separate draft model (`--speculative draft --draft-model M`): a chain (spec/chain.py) of
k + 1 small decode steps inside the speculative step, over the draft model's own KV pool in the
shared slot space.

Step k only writes the KV of the last draft (no LM head): with every draft accepted, that
position is inside the sequence next round and nothing else would feed it.

So the draft KV needs no repair after acceptance: a slot's KV depends only on the token at its
position, and every drafted token was fed; accepted drafts are the drafted tokens, the first
position past them is fed again (as the next step's last token) before anything reads it, and
rejected positions lie past seq_lens and are never read. The draft model must only see every
token the target sees: eager forwards (prefill chunks, mixed steps) reach it through
`observe`, and every decode step of an engine with this drafter is a speculative step
(`keeps_kv`).
"""

from __future__ import annotations

import logging

import torch

from draftgraph.attention.backend import ForwardBatch
from draftgraph.runtime.executor import ModelExecutor
from draftgraph.runtime.schema import StepBatch
from draftgraph.spec.chain import ChainDrafter
from draftgraph.spec.drafter import DraftContext

logger = logging.getLogger(__name__)


class DraftModelDrafter(ChainDrafter):
    name = "draft"
    runs_under_tp = False  # its model would need sharding like the target's: not built

    def __init__(self, model, k: int) -> None:
        super().__init__(k)
        self.model = model

    @property
    def num_steps(self) -> int:
        return self.k + 1

    def bind(self, target: ModelExecutor) -> None:
        tv, dv = target.config.vocab_size, self.model.config.vocab_size
        if tv != dv:
            raise ValueError(f"--draft-model has a vocabulary of {dv} tokens, the target "
                             f"{tv}: a draft model must share the target's vocabulary")
        self.executor = ModelExecutor(self.model, target.slots, target.max_bs,
                                      target.max_num_tokens, target.device, target.dtype,
                                      target.backend.name,
                                      tensor_core_rows=target.tensor_core_rows,
                                      rows_per_request=target.rows_per_request)
        self.alloc_steps(target.max_bs, target.device)
        logger.info("draft model: %d layers, KV pool %.1f MiB",
                    self.model.config.num_hidden_layers, self.executor.kv_pool.bytes() / 2**20)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        from draftgraph.runtime.executor import kv_bytes_per_token

        return kv_bytes_per_token(self.model, dtype)

    def observe(self, sb: StepBatch) -> None:
        """An eager target forward: the draft model writes its KV for the same tokens."""
        self.executor.forward(StepBatch(sb.phase, sb.input_ids, sb.req_pool_indices,
                                        sb.seq_lens, sb.extend_lens, sb.out_cache_loc, []))

    def run_step(self, ctx: DraftContext, i: int, fb: ForwardBatch) -> None:
        model, ids = self.model, fb.input_ids
        if i == self.k:  # the last draft's KV only
            model(ids, fb, self.executor.backend, final_norm=False)
            return
        self.take(ctx, i, model.compute_logits(*model(ids, fb, self.executor.backend,
                                                      final_norm=False)))
