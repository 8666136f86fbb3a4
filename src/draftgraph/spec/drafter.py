"""The drafter seam: what every drafter (n-gram, chain head, draft model, block head) gives
the speculative step body (spec/step.py).

A drafter declares
  k                     the most draft tokens it proposes per request and step;
  needs_hidden_states   whether the verify forward must keep the target's hidden states for it;
  keeps_kv              whether it keeps a KV cache of every position (a draft model, a chain
                        head): then it must see every token the target sees, so every decode
                        step is a speculative step and eager forwards reach it via `observe`;
and implements
  bind(target)          allocate its persistent buffers (and its KV pool over the target's slot
                        space: a slot id means the same position in every pool);
  propose(ctx)          graph-safe (no host read, no allocation that changes addresses): draft
                        tokens [bs, k], active counts [bs] (<= ctx.max_draft), and draft
                        probabilities [bs, k, V] or None for point-mass drafts;
  propose_ref(ctx)      the eager twin: the same values from plain code, for tests and CPU;
  after_accept(ctx, accept)  fix its own state after acceptance (draft-KV catch-up, KV
                        injection at the accepted slots); a no-op for n-gram;
  kv_bytes_per_token(dtype)  its KV per slot (0 without a pool), so the slot space fits it;
  observe(step_batch)   an eager target forward ran (prefill chunk, mixed step): catch up.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from draftgraph.attention.backend import ForwardBatch


@dataclass
class DraftContext:
    """What a drafter reads in a step: views of the step's persistent device buffers."""

    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64: tokens of each sequence including the last one
    last_tokens: torch.Tensor  # [bs] int64: the last token (resolved), at seq_lens - 1
    max_draft: torch.Tensor  # [bs] int64: drafts each request may verify now (0..k)
    token_table: torch.Tensor  # [max_reqs + 1, max_context] int64: token ids by position
    temperature: torch.Tensor  # [bs] fp32: a probabilistic drafter samples at T > 0
    seeds: torch.Tensor  # [bs] int64
    reserved_slots: torch.Tensor | None = None  # [bs, 1 + k] int64: this step's KV slots
    top_p: torch.Tensor | None = None  # [bs] fp32
    top_k: torch.Tensor | None = None  # [bs] int64
    greedy: bool = True  # every row has temperature 0 (known on the host, static per graph)
    tree: bool = False  # a drafter that `drafts_trees` drafts a tree this step (static too)


@dataclass
class Proposal:
    draft_tokens: torch.Tensor  # [bs, k] int64, anything past num_drafts (never read)
    num_drafts: torch.Tensor  # [bs] int64 in 0..max_draft
    draft_probs: torch.Tensor | None = None  # [bs, k, V] fp32, None: point-mass drafts
    # [V] int32: draft_probs is [bs, k, V'] over the drafter's reduced vocabulary, and this
    # the column there of each target token (-1: probability 0); None: over the target's
    draft_index: torch.Tensor | None = None
    # a tree of drafts (spec/tree.py), in depth order: each draft's parent row (0: the last
    # token, i: draft i - 1) and depth [bs, k] int64; None: a chain
    parents: torch.Tensor | None = None
    depths: torch.Tensor | None = None


@dataclass
class Acceptance:
    """What after_accept learns: the verify step's outcome, on the device."""

    tokens: torch.Tensor  # [bs, k + 1] int64: emitted tokens, -1 past accept_lens
    accept_lens: torch.Tensor  # [bs] int64: accepted drafts + 1
    verify_seq_lens: torch.Tensor  # [bs] int64: KV length after the verify forward
    # the verify forward itself: its packed tokens' slots (out_cache_loc) and positions, the
    # rows of the target's hidden-state capture (dead packed tokens: slot 0, position 0)
    verify_fb: ForwardBatch | None = None
    # a tree's verify: the accepted path's packed rows [bs, 1 + depth] (depth j's row at j; a
    # chain's row j is j) and the packed rows per request; None: a chain
    path: torch.Tensor | None = None
    # a tree's verify: the K/V moves [2, n] int64 (source slots, destination slots) that put
    # the accepted nodes at their positions' slots, done in the target's pool already
    copy: torch.Tensor | None = None


class Drafter:
    name = "drafter"
    needs_hidden_states = False
    keeps_kv = False
    # whether it runs under tensor parallelism: every rank runs the same drafter on the same
    # (replicated) inputs, TP rank 0 sending it to the others with the step bodies
    runs_under_tp = True
    drafts_trees = False  # proposes trees (Proposal.parents) when DraftContext.tree says so
    bound_to = None  # the target executor `bind` was called with (once)

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"number of draft tokens must be >= 1, got {k} "
                             "(--num-draft-tokens)")
        self.k = k

    @property
    def chain_k(self) -> int:
        """Drafts a step without a tree proposes at most (its verify's rows a request: 1 +
        chain_k): k, except for a tree drafter's chain (spec/tree.py)."""
        return self.k

    def bind(self, target) -> None:
        """Allocate persistent buffers (`target`: the target's ModelExecutor, whose slot
        space, batch size and device to share); called once, before any capture."""

    def __getstate__(self) -> dict:
        """Pickled for TP ranks > 0 (with the step bodies, before `bind`): its modules travel
        on the CPU (a CUDA tensor would unpickle onto the sender's GPU); a drafter's `bind`
        moves them to its rank's device (`modules_to`)."""
        state = self.__dict__.copy()
        for key, value in state.items():
            if isinstance(value, torch.nn.Module):
                state[key] = copy.deepcopy(value).cpu()
        return state

    def modules_to(self, device: torch.device) -> None:
        """Its modules onto `device` (a no-op where they are already)."""
        for value in self.__dict__.values():
            if isinstance(value, torch.nn.Module):
                value.to(device)

    def propose(self, ctx: DraftContext) -> Proposal:
        raise NotImplementedError

    def propose_ref(self, ctx: DraftContext) -> Proposal:
        """The eager twin of `propose` (default: the same code, run eagerly)."""
        return self.propose(ctx)

    def observe(self, step_batch) -> None:
        """An eager target forward ran; a drafter that `keeps_kv` writes its own KV for it."""

    def after_accept(self, ctx: DraftContext, accept: Acceptance) -> None:
        """Fix the drafter's state after acceptance (graph-safe); n-gram has none."""

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 0
