"""Staged drafters: a proposal is `num_steps` forwards over the drafter's own executor (its KV
pool in the target's slot space), and chain drafters, the staged drafters of k small
autoregressive steps.

A proposal is

    begin -> for each step: stage_step (raw inputs) -> metadata -> run_step -> finish

`propose` runs it all in one piece, for one graph: step 0's metadata built, every later step's
advanced in place (`AttentionBackend.advance_metadata`). When the drafter's backend cannot do
that in a graph (`in_graph` is False), the step body (spec/step.py) cuts the proposal instead
into one captured graph per step with each step's metadata rebuilt eagerly between them
(`step_metadata`): the fallback, the A arm of the fused A/B. Both run the same code on the same
buffers, so they give the same drafts. A block drafter (spec/block.py) is a staged drafter of
one step.

Chain step i (0 <= i < num_steps) feeds one token per request at position seq_lens - 1 + i
(step 0: the last token; then the draft of step i - 1) into reserved_slots[:, i]:
decode-shaped metadata with seq_lens + i. A draft token is the drafter's argmax at
temperature 0, else a seeded draw from its processed distribution on STREAM_DRAFT at the
step's position; its probabilities go to rejection sampling (spec/verify.py).
"""

from __future__ import annotations

import torch

from draftgraph.attention.backend import ForwardBatch, Phase
from draftgraph.kernels.argmax import row_argmax
from draftgraph.kernels.sampling import draft_sample
from draftgraph.kernels.tokens import ChainSteps, draft_take, record_take
from draftgraph.runtime.sampling import STREAM_DRAFT
from draftgraph.spec.drafter import DraftContext, Drafter, Proposal


class StagedDrafter(Drafter):
    keeps_kv = True

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.executor = None  # the drafter's ModelExecutor, made in `bind`
        # a reduced draft vocabulary: its tokens' target ids [V'] int64 (None: the target's),
        # and each target token's column in it [V] int32 (-1 outside), for rejection sampling
        self.vocab: torch.Tensor | None = None
        self.draft_index: torch.Tensor | None = None
        self.target_vocab_size = 0

    def bind_vocab(self, head, target) -> None:
        """The head's LM head [V', H] and draft vocabulary: the target's whole LM head (under
        TP gathered once: a head is replicated, its logits too), or its rows `head.d2t`,
        gathered once here, for a reduced vocabulary."""
        self.lm_head = head.lm_head_weight(target.model.full_lm_head_weight()).contiguous()
        self.vocab = head.d2t if head.reduced_vocab else None
        self.target_vocab_size = target.config.vocab_size
        if self.vocab is not None:
            self.draft_index = torch.full((self.target_vocab_size,), -1, dtype=torch.int32,
                                          device=self.vocab.device)
            self.draft_index[self.vocab] = torch.arange(self.vocab.shape[0], dtype=torch.int32,
                                                        device=self.vocab.device)

    def sample_drafts(self, logits: torch.Tensor, ctx: DraftContext,
                      positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled drafts [bs] int64 (target ids) from logits [bs, V'] over the draft
        vocabulary, drawn at `positions` on STREAM_DRAFT, and the distribution they were
        drawn from, q [bs, V'] (softmax at the request's temperature, over V': rejection
        sampling reads it through `draft_index`); a temperature-0 request takes its argmax.
        Two launches on CUDA (`kernels.sampling.draft_sample`)."""
        cols, q = draft_sample(logits, ctx.temperature, ctx.seeds, positions, STREAM_DRAFT)
        return (self.vocab[cols] if self.vocab is not None else cols), q

    def target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [bs, V'] over the draft vocabulary onto the target's [bs, V] (-inf outside
        `vocab`); the logits themselves without a reduced vocabulary. (Drafting builds no
        such rows; tests and tools read a step's logits this way.)"""
        if self.vocab is None:
            return logits
        full = logits.new_full((logits.shape[0], self.target_vocab_size), float("-inf"))
        return full.index_copy_(1, self.vocab, logits)

    def draft_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy drafts [...] int64 (target ids) of logits [..., V'] over the draft
        vocabulary: the argmax over V', mapped, with no [..., V] row built."""
        tok = row_argmax(logits)
        return self.vocab[tok] if self.vocab is not None else tok

    @property
    def num_steps(self) -> int:
        raise NotImplementedError

    def steps_for(self, tree: bool) -> int:
        """Forwards in a proposal of a step that drafts a tree (`DraftContext.tree`) or not;
        a tree drafter's two differ (spec/tree.py)."""
        return self.num_steps

    @property
    def in_graph(self) -> bool:
        """Whether its backend builds every step's metadata inside one graph (the fused
        proposal); read from the backend's capabilities."""
        raise NotImplementedError

    @property
    def fallback_reason(self) -> str:
        """What the backend lacks, for the fallback's log line."""
        raise NotImplementedError

    def begin(self, ctx: DraftContext) -> None:
        pass

    def stage_step(self, ctx: DraftContext, i: int) -> None:
        raise NotImplementedError

    def step_fb(self, ctx: DraftContext, i: int) -> ForwardBatch:
        """Step i's forward (over the inputs `stage_step` staged)."""
        raise NotImplementedError

    def step_metadata(self, ctx: DraftContext, i: int) -> None:
        """The fallback: step i's metadata rebuilt eagerly."""
        self.executor.backend.build_metadata(self.step_fb(ctx, i))

    def run_step(self, ctx: DraftContext, i: int, fb: ForwardBatch) -> None:
        raise NotImplementedError

    def finish(self, ctx: DraftContext) -> Proposal:
        raise NotImplementedError

    def propose(self, ctx: DraftContext) -> Proposal:
        """The fused proposal: metadata built for step 0, then advanced in place."""
        backend = self.executor.backend
        self.begin(ctx)
        for i in range(self.steps_for(ctx.tree)):
            self.stage_step(ctx, i)
            fb = self.step_fb(ctx, i)
            if i == 0:
                backend.build_metadata(fb)
            else:
                backend.advance_metadata(fb)
            self.run_step(ctx, i, fb)
        return self.finish(ctx)


class ChainDrafter(StagedDrafter):
    def __init__(self, k: int) -> None:
        super().__init__(k)
        self._probs: list[torch.Tensor] = []  # per step [bs, V] of the proposal being built

    @property
    def num_steps(self) -> int:
        """Forwards per proposal (the draft model feeds its last draft too: k + 1)."""
        return self.k

    @property
    def in_graph(self) -> bool:
        return self.executor.backend.draft_step_update

    @property
    def fallback_reason(self) -> str:
        return "backend lacks draft_step_update"

    def alloc_steps(self, max_bs: int, device: torch.device) -> None:
        """The chain's persistent per-step inputs."""
        m, dev = max_bs, device
        self.step_ids = torch.zeros(m, dtype=torch.int64, device=dev)  # [max_bs] int64
        self.step_seq_lens = torch.ones(m, dtype=torch.int64, device=dev)  # [max_bs] int64
        # NOTE: contiguous: kernels index out_cache_loc densely, and reserved_slots[:, i] is a
        # strided column
        self.step_loc = torch.zeros(m, dtype=torch.int64, device=dev)  # [max_bs] int64
        self.ones = torch.ones(m, dtype=torch.int64, device=dev)
        self.drafts = torch.zeros(m, self.k, dtype=torch.int64, device=dev)
        self.steps = ChainSteps(self.step_ids, self.step_seq_lens, self.step_loc, self.drafts)

    # ---- the pieces of a proposal (each graph-safe) -----------------------------------------
    def begin(self, ctx: DraftContext) -> None:
        self.step_ids[: ctx.seq_lens.shape[0]].copy_(ctx.last_tokens)
        self._probs = []

    def stage_step(self, ctx: DraftContext, i: int) -> None:
        """Step 0's KV lengths and slots; a later step's were staged by the previous step's
        `take` (with its draft: one launch on the GPU)."""
        if i == 0:
            bs = ctx.seq_lens.shape[0]
            self.step_seq_lens[:bs].copy_(ctx.seq_lens)
            self.step_loc[:bs].copy_(ctx.reserved_slots[:, 0])

    def step_fb(self, ctx: DraftContext, i: int) -> ForwardBatch:
        bs = ctx.seq_lens.shape[0]
        return ForwardBatch(Phase.DRAFT_CHAIN, self.step_ids[:bs], ctx.req_pool_indices,
                            self.step_seq_lens[:bs], self.ones[:bs], self.step_loc[:bs],
                            self.executor.meta)

    def take(self, ctx: DraftContext, i: int, logits: torch.Tensor) -> torch.Tensor:
        """Draft i [bs] from logits [bs, V'] over the drafter's vocabulary (the target's, or
        `vocab`'s tokens): recorded, fed next, and the next step's KV lengths and slots
        staged (a greedy take is one combine launch after the argmax's chunks on the GPU:
        `kernels.tokens.draft_take`). A draw keeps its distribution over V' for rejection
        sampling."""
        stage = i + 1 < self.steps_for(ctx.tree)
        if ctx.greedy:
            return draft_take(logits, self.vocab, i, ctx.seq_lens, ctx.reserved_slots,
                              self.steps, stage)
        tok, q = self.sample_drafts(logits, ctx, self.step_seq_lens[: logits.shape[0]])
        self._probs.append(q)
        return record_take(tok, i, ctx.seq_lens, ctx.reserved_slots, self.steps, stage)

    def finish(self, ctx: DraftContext) -> Proposal:
        bs = ctx.seq_lens.shape[0]
        probs = torch.stack(self._probs, dim=1) if self._probs else None  # [bs, k, V']
        return Proposal(self.drafts[:bs], torch.clamp(ctx.max_draft, max=self.k), probs,
                        self.draft_index if probs is not None else None)
