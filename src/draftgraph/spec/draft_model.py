"""A separate draft model (`--speculative draft --draft-model M`): a chain of k small decode
steps inside the speculative step, over the draft model's own KV pool in the shared slot space.

Step i (0 <= i <= k) feeds one token per request at position seq_lens - 1 + i (step 0: the
last token; then the draft of step i - 1) into reserved_slots[:, i]: decode-shaped metadata
with seq_lens + i, built for step 0 and advanced for each later step
(`AttentionBackend.advance_metadata`: inside the graph for a backend with
`draft_step_update`, an eager rebuild, logged once, otherwise). The draft token is the draft
model's argmax at temperature 0, else a seeded draw from its processed distribution on
STREAM_DRAFT at the draft's own position; its probabilities go to rejection sampling.

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

from draftgraph.attention.backend import ForwardBatch, Phase
from draftgraph.runtime.executor import ModelExecutor
from draftgraph.runtime.sampling import STREAM_DRAFT, processed_probs, sample_from_probs
from draftgraph.runtime.schema import StepBatch
from draftgraph.spec.drafter import DraftContext, Drafter, Proposal

logger = logging.getLogger(__name__)


class DraftModelDrafter(Drafter):
    name = "draft"
    keeps_kv = True

    def __init__(self, model, k: int) -> None:
        super().__init__(k)
        self.model = model
        self.executor: ModelExecutor | None = None

    def bind(self, target: ModelExecutor) -> None:
        tv, dv = target.config.vocab_size, self.model.config.vocab_size
        if tv != dv:
            raise ValueError(f"--draft-model has a vocabulary of {dv} tokens, the target "
                             f"{tv}: a draft model must share the target's vocabulary")
        self.executor = ModelExecutor(self.model, target.slots, target.max_bs,
                                      target.max_num_tokens, target.device, target.dtype,
                                      target.backend.name)
        ex, dev, m = self.executor, target.device, target.max_bs
        # persistent per-step inputs of the chain
        self.step_ids = torch.zeros(m, dtype=torch.int64, device=dev)  # [max_bs] int64
        self.step_seq_lens = torch.ones(m, dtype=torch.int64, device=dev)  # [max_bs] int64
        # NOTE: contiguous: kernels index out_cache_loc densely, and reserved_slots[:, i] is a
        # strided column
        self.step_loc = torch.zeros(m, dtype=torch.int64, device=dev)  # [max_bs] int64
        self.ones = torch.ones(m, dtype=torch.int64, device=dev)
        self.drafts = torch.zeros(m, self.k, dtype=torch.int64, device=dev)
        logger.info("draft model: %d layers, KV pool %.1f MiB",
                    self.model.config.num_hidden_layers, ex.kv_pool.bytes() / 2**20)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        from draftgraph.runtime.executor import kv_bytes_per_token

        return kv_bytes_per_token(self.model, dtype)

    def observe(self, sb: StepBatch) -> None:
        """An eager target forward: the draft model writes its KV for the same tokens."""
        self.executor.forward(StepBatch(sb.phase, sb.input_ids, sb.req_pool_indices,
                                        sb.seq_lens, sb.extend_lens, sb.out_cache_loc, []))

    def propose(self, ctx: DraftContext) -> Proposal:
        ex, k = self.executor, self.k
        bs = ctx.seq_lens.shape[0]
        backend, model = ex.backend, self.model
        ids = self.step_ids[:bs]
        ids.copy_(ctx.last_tokens)
        probs = []
        seq_lens, loc = self.step_seq_lens[:bs], self.step_loc[:bs]
        for i in range(k + 1):
            torch.add(ctx.seq_lens, i, out=seq_lens)
            loc.copy_(ctx.reserved_slots[:, i])
            fb = ForwardBatch(Phase.DRAFT_CHAIN, ids, ctx.req_pool_indices, seq_lens,
                              self.ones[:bs], loc, ex.meta)
            if i == 0:
                backend.build_metadata(fb)
            else:
                backend.advance_metadata(fb)
            if i == k:  # the last draft's KV only
                model(ids, fb, backend, final_norm=False)
                break
            logits = model.compute_logits(*model(ids, fb, backend, final_norm=False))
            tok = logits.argmax(dim=-1)  # [bs] int64
            if not ctx.greedy:
                p = processed_probs(logits, ctx.temperature, ctx.top_p, ctx.top_k)  # [bs, V]
                drawn = sample_from_probs(p, ctx.seeds, seq_lens, STREAM_DRAFT)
                tok = torch.where(ctx.temperature > 0, drawn, tok)
                probs.append(p)
            self.drafts[:bs, i].copy_(tok)
            ids.copy_(tok)
        num = torch.clamp(ctx.max_draft, max=k)
        return Proposal(self.drafts[:bs], num,
                        torch.stack(probs, dim=1) if probs else None)  # [bs, k, V]
