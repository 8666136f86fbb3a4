"""Prompt-lookup n-gram proposer: draft the tokens that followed the last earlier occurrence
of the sequence's own suffix.

For n from max_n down to min_n, take the last n tokens (the suffix) and find the most recent
earlier occurrence: a window tokens[s : s + n] equal to the suffix with s + n <= len - 1, so it
ends before the suffix does (it may overlap it) and at least one token follows it. Propose
tokens[s + n : s + n + k], fewer where they run into the end. The longest n with a match wins;
no match gives no drafts.

On CUDA the drafter runs `kernels/ngram.py` (one launch; each request walks its own tokens,
not the table's width). `NgramProposer.propose` is its torch twin (static shapes, no host sync,
the CPU engine path); `propose_ref` is the plain-python one, used by tests.
`NgramDrafter` puts the proposer behind the drafter seam (spec/drafter.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftgraph.kernels._triton import triton_usable
from draftgraph.kernels.ngram import ngram_propose_triton
from draftgraph.spec.drafter import DraftContext, Drafter, Proposal

__all__ = ["NgramDrafter", "NgramProposer", "propose_ref"]


def propose_ref(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Drafts for one sequence (prompt + output so far); [] when no suffix recurs."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if length < n + 1:
            continue
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


class NgramProposer:
    """Prompt-lookup drafts of up to k tokens from suffix n-grams, min_n <= n <= max_n."""

    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        if min_n < 1:
            raise ValueError(f"n-gram min_n must be >= 1, got {min_n} (--ngram-min)")
        if max_n < min_n:
            raise ValueError(f"n-gram max_n ({max_n}) must be >= min_n ({min_n}) (--ngram-max)")
        if k < 1:
            raise ValueError(f"number of draft tokens k must be >= 1, got {k} "
                             "(--num-speculative-tokens)")
        self.min_n = min_n
        self.max_n = max_n
        self.k = k

    def propose_ref(self, tokens: list[int]) -> list[int]:
        return propose_ref(tokens, self.min_n, self.max_n, self.k)

    def propose_from_table(self, ctx: DraftContext, out: torch.Tensor | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts [bs, k] (into `out` when given) and counts [bs] for a step's requests, from
        the device token table: one Triton launch on CUDA, `propose` elsewhere."""
        table = ctx.token_table
        if table.is_cuda and triton_usable(table):  # one launch over the requests' own tokens
            return ngram_propose_triton(table, ctx.req_pool_indices, ctx.seq_lens, self.min_n,
                                        self.max_n, self.k, out=out)
        drafts, num = self.propose(table[ctx.req_pool_indices], ctx.seq_lens)
        return (drafts, num) if out is None else (out.copy_(drafts), num)

    def propose(self, token_buffer: torch.Tensor,
                lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts for a batch, sync-free.

        token_buffer [bs, L] int64: prompt + output so far, right-padded (padding is ignored);
        lens [bs] int64: valid tokens per row.
        Returns draft_tokens [bs, k] int64 (padded with 0) and num_draft_tokens [bs] int64.
        Cost O(bs * L * max_n) elementwise: one [bs, L] compare per suffix offset.
        """
        bs, width = token_buffer.shape
        device = token_buffer.device
        # NOTE: a candidate occurrence is indexed by its END e (last token). Its match length
        # with the suffix grows one offset d at a time: run_d[e] = all(tokens[e - j + 1] ==
        # tokens[len - j] for j in 1..d), so every n shares the work of the shorter ones.
        ends = torch.arange(width, device=device)[None, :]  # [1, L] int64
        before_suffix_end = ends <= (lens[:, None] - 2)  # [bs, L] bool: a token follows e
        run = torch.ones(bs, width, dtype=torch.bool, device=device)  # [bs, L] bool
        best_end = torch.full((bs,), -1, dtype=torch.int64, device=device)  # [bs] int64
        for d in range(1, self.max_n + 1):
            suffix_idx = lens - d  # [bs] int64
            suffix_tok = token_buffer.gather(1, suffix_idx.clamp_min(0)[:, None])  # [bs, 1]
            suffix_tok = torch.where(suffix_idx[:, None] >= 0, suffix_tok, -2)
            # tokens[e - d + 1] for every e, -1 before the start of the row
            shifted = F.pad(token_buffer, (d - 1, 0), value=-1)[:, :width]  # [bs, L] int64
            run = run & (shifted == suffix_tok)
            if d >= self.min_n:
                match = run & before_suffix_end  # [bs, L] bool: an n-gram match ending at e
                last_end = torch.where(match, ends, -1).amax(dim=1)  # [bs] int64, -1: none
                best_end = torch.where(last_end >= 0, last_end, best_end)  # longer n wins
        draft_idx = best_end[:, None] + 1 + torch.arange(self.k, device=device)[None, :]
        valid = (best_end[:, None] >= 0) & (draft_idx < lens[:, None])  # [bs, k] bool
        draft_tokens = token_buffer.gather(1, draft_idx.clamp(0, width - 1))
        draft_tokens = torch.where(valid, draft_tokens, 0)  # [bs, k] int64
        num_draft_tokens = valid.sum(dim=1)  # [bs] int64
        return draft_tokens, num_draft_tokens


class NgramDrafter(Drafter):
    """Prompt-lookup drafting from the device token table: point-mass drafts, no state."""

    name = "ngram"

    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        super().__init__(k)
        self.proposer = NgramProposer(min_n, max_n, k)

    def propose(self, ctx: DraftContext) -> Proposal:
        drafts, num_drafts = self.proposer.propose_from_table(ctx)
        return Proposal(drafts, torch.minimum(num_drafts, ctx.max_draft))  # [bs, k], [bs]

    def propose_ref(self, ctx: DraftContext) -> Proposal:
        bs = ctx.seq_lens.shape[0]
        drafts = torch.zeros(bs, self.k, dtype=torch.int64)
        num = torch.zeros(bs, dtype=torch.int64)
        rows, lens, cap = (ctx.req_pool_indices.tolist(), ctx.seq_lens.tolist(),
                           ctx.max_draft.tolist())
        for i in range(bs):
            d = self.proposer.propose_ref(ctx.token_table[rows[i], : lens[i]].tolist())[: cap[i]]
            drafts[i, : len(d)] = torch.tensor(d, dtype=torch.int64)
            num[i] = len(d)
        dev = ctx.seq_lens.device
        return Proposal(drafts.to(dev), num.to(dev))
