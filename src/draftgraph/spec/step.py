"""The speculative step body: the same for every drafter, and with no drafter the decode step.

  record last tokens -> propose (drafter) -> pack 1 + d tokens per request -> verify metadata
  for the active counts -> target forward -> accept (the one sampling tail, spec.verify.emit)
  -> after_accept (drafter)

A `GraphSet` (runtime/graph_set.py) captures it per batch bucket, or runs it eagerly (CPU).

Raw inputs (`StepBody.inputs`), per request: the last token (or -(j + 1): the last token row
j of the previous replay emitted, async scheduling), req_pool_indices, seq_lens (tokens
including the last, un-cached one), max_draft (0..k), top_k, seeds, reserved_slots [1 + 2k]
(the KV slots of positions seq_lens - 1 onwards: the last token and the drafts take the first
1 + k; a speculative step launched before the previous one was read is staged as if that one
emitted one token, and shifts on the device by what it did emit: kernels/tokens.py), seq_limit
(min(prompt + max_tokens, max_model_len): the device's cap on max_draft after such a shift),
temperature, top_p.
Results (`StepBody.outputs`): tokens [1 + k] (-1 past accept_lens), accept_lens, num_drafts,
logprobs [1 + k].

Decode (no drafter) feeds the raw inputs straight to the forward (one token per request);
accept_lens (1) and num_drafts (0) are constants written once; the greedy tail writes the
argmax and its logprob straight into the outputs, and the final norm runs in the LM head.

Fallback: a backend without `in_graph_metadata` gets its metadata rebuilt eagerly between the
step's two captured parts (logged once, naming the backend); the A arm of the A/B. A staged
drafter (spec/chain.py: a chain's k steps, a block's one) whose backend cannot build its
steps' metadata in the graph has its steps cut into one captured part each, its metadata
rebuilt eagerly between them (logged once too).
"""

from __future__ import annotations

import logging

import torch

from draftgraph.attention.backend import ForwardBatch, Phase
from draftgraph.attention.metadata import MetadataBuffers, RowPaths
from draftgraph.kernels.argmax import argmax_lse
from draftgraph.kernels.tokens import AheadInputs, record_last_tokens
from draftgraph.runtime.sampling import sample
from draftgraph.runtime.schema import Field, Lanes
from draftgraph.spec.chain import StagedDrafter
from draftgraph.spec.drafter import Acceptance, DraftContext, Drafter
from draftgraph.spec.tree import accept_tree, ancestors
from draftgraph.spec.verify import emit, step_extras

logger = logging.getLogger(__name__)


def step_inputs(max_bs: int, k: int, controls: bool = False) -> Lanes:
    """controls: also the sampling controls' lanes (spec/extras.py, runtime/controls.py)."""
    extra = [Field("min_tokens"), Field("prompt_lens"), Field("num_logit_bias"),
             *(Field(f"{p}_penalty", dtype=torch.float32)
               for p in ("presence", "frequency", "repetition"))] if controls else []
    return Lanes(max_bs, [
        Field("input_ids"), Field("req_pool_indices"), Field("seq_lens"), Field("max_draft"),
        Field("top_k"), Field("seeds"), Field("reserved_slots", 1 + 2 * k), Field("seq_limit"),
        Field("temperature", dtype=torch.float32), Field("top_p", dtype=torch.float32), *extra])


def step_outputs(max_bs: int, k: int, top_n: int = 0) -> Lanes:
    """top_n > 0: also the top_n alternatives of every emitted row (spec/extras.py)."""
    extra = [Field("top_ids", (1 + k) * top_n),
             Field("top_logprobs", (1 + k) * top_n, torch.float32)] if top_n else []
    return Lanes(max_bs, [
        Field("tokens", 1 + k), Field("accept_lens"), Field("num_drafts"),
        Field("logprobs", 1 + k, torch.float32), *extra])


class StepBody:
    """One step over the target executor; `drafter` None is plain decoding."""

    # padded rows: the dummy request row 0, slot 0, one token, greedy
    padding = {"seq_lens": 1, "top_p": 1.0}

    def __init__(self, target, drafter: Drafter | None = None,
                 metadata_in_graph: bool | None = None, use_graphs: bool = True,
                 fused_draft: bool | None = None) -> None:
        self.target = target
        self.model = target.model
        self.backend = target.backend
        self.device = target.device
        self.drafter = drafter
        self.k = drafter.k if drafter is not None else 0
        self.name = f"{drafter.name} k={self.k}" if drafter is not None else "decode"
        max_bs = target.max_bs
        self.inputs = step_inputs(max_bs, self.k)
        self.outputs = step_outputs(max_bs, self.k)
        can = self.backend.in_graph_metadata
        self.metadata_in_graph = can if metadata_in_graph is None else (metadata_in_graph and can)
        if not self.metadata_in_graph and use_graphs:
            logger.warning(
                "attention backend %r: metadata is rebuilt eagerly before each graph replay "
                "(%s)", self.backend.name,
                "requested" if can else "backend lacks in_graph_metadata")
        T, dev = 1 + self.k, self.device
        # persistent, step-written forward inputs of a verify step
        self.packed_ids = torch.zeros(max_bs * T, dtype=torch.int64, device=dev)
        self.packed_loc = torch.zeros(max_bs * T, dtype=torch.int64, device=dev)
        self.extend_lens = torch.ones(max_bs, dtype=torch.int64, device=dev)
        self.verify_seq_lens = torch.ones(max_bs, dtype=torch.int64, device=dev)
        # the proposal, kept in persistent buffers: with the eager-metadata fallback it crosses
        # from one captured part to the next
        self.draft_tokens = torch.zeros(max_bs, self.k, dtype=torch.int64, device=dev)
        # [max_bs, 1 + k] int64: this step's KV slots, resolved from the staged 1 + 2k
        self.slots = torch.zeros(max_bs, T, dtype=torch.int64, device=dev)
        self.num_drafts = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.draft_slot = torch.arange(self.k, device=dev)  # [k]
        self.no_token = torch.zeros((), dtype=torch.int64, device=dev)
        # NOTE: a drafter is bound once per target: every body that drafts with it (a graph
        # set and its twins) shares its buffers and state, so each request's draft state is
        # the same whichever body runs its step (a second bind would leave graphs captured
        # over the first buffers)
        first_body = drafter is not None and drafter.bound_to is not target
        if first_body:
            drafter.bind(target)
            drafter.bound_to = target
            if drafter.keeps_kv:  # its KV follows every eager target forward
                target.observers.append(drafter)
        # a staged drafter's steps run in one piece when its backend builds their metadata in
        # the graph; otherwise one captured graph per step, metadata rebuilt eagerly between
        self.fused_draft = False
        if isinstance(drafter, StagedDrafter):
            can = drafter.in_graph
            self.fused_draft = can if fused_draft is None else (fused_draft and can)
            if not self.fused_draft and use_graphs and first_body:  # once, not per twin
                logger.warning(
                    "attention backend %r: the %s drafter's %d step(s) replay one graph each, "
                    "metadata rebuilt eagerly before each (%s)",
                    drafter.executor.backend.name, drafter.name, drafter.num_steps,
                    "requested" if can else drafter.fallback_reason)
        # the last proposal's draft distributions [bs, k, V'] and their vocabulary's index
        self._draft_probs: torch.Tensor | None = None
        self._draft_index: torch.Tensor | None = None
        self.drafts_trees = drafter is not None and drafter.drafts_trees
        if self.drafts_trees:
            self._alloc_tree(max_bs, drafter.num_steps)

    def _alloc_tree(self, max_bs: int, depth: int) -> None:
        """A tree verify's rows (spec/tree.py): every request's 1 + k rows as decode rows of
        their own lists, for batches of up to the drafter's tree_max_bs requests, with their
        own metadata buffers."""
        dev, m, T = self.device, min(self.drafter.tree_max_bs, max_bs), 1 + self.k
        r = m * T
        self.tree_depth = depth
        # request row, KV length and path base of each row, one staging write for the three
        # (a dead row's: the dummy row 0, length 1, base 1)
        self.t_rows = torch.zeros(3, r, dtype=torch.int64, device=dev)
        self.t_req, self.t_seq, self.t_base = (self.t_rows[i] for i in range(3))
        self.t_dead = torch.tensor([0, 1, 1], dtype=torch.int64, device=dev)[:, None, None]
        self.t_ones = torch.ones(r, dtype=torch.int64, device=dev)
        self.t_path = torch.zeros(r, depth, dtype=torch.int64, device=dev)
        # per request and row [m, 1 + k]: parent row, whether it may be accepted, depth, and
        # its ancestors' rows [.., depth]
        self.t_parents = torch.zeros(m, T, dtype=torch.int64, device=dev)
        self.t_live = torch.zeros(m, T, dtype=torch.bool, device=dev)
        self.t_depths = torch.zeros(m, T, dtype=torch.int64, device=dev)
        self.t_anc = torch.zeros(m, T, depth, dtype=torch.int64, device=dev)
        ctx_len = self.backend.req_to_token.shape[1]
        self.tree_meta = MetadataBuffers(r, r, r * ctx_len, self.backend.sliding_window, dev)

    def tree_step(self, bs: int) -> bool:
        """Whether a step of `bs` requests drafts and verifies a tree (static per graph): no
        top-N or controls (their tails read a chain), and room for the rows."""
        return (self.drafts_trees and "top_ids" not in self.out
                and "repetition_penalty" not in self.raw
                and bs <= self.drafter.tree_max_bs)

    def bind(self, raw: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> None:
        """The graph set's persistent raw-input and result buffers."""
        self.raw, self.out = raw, out
        if self.k == 0:  # decode emits one token per request and drafts none, every step
            out["accept_lens"].fill_(1)
            out["num_drafts"].zero_()

    def read(self, host: dict, bs: int) -> list[tuple[list[int], list[float], int, list]]:
        """Per request: (emitted tokens, their logprobs, drafts proposed, per emitted token
        its (top ids, top logprobs), or [] when the body computes no top-N)."""
        tokens, acc = host["tokens"][:bs].tolist(), host["accept_lens"][:bs].tolist()
        lps, nd = host["logprobs"][:bs].tolist(), host["num_drafts"][:bs].tolist()
        if "top_ids" not in host:
            return [(tokens[j][: acc[j]], lps[j][: acc[j]], nd[j], []) for j in range(bs)]
        n = host["top_ids"].shape[1] // (1 + self.k)
        ids, tlp = host["top_ids"][:bs], host["top_logprobs"][:bs]
        return [(tokens[j][: acc[j]], lps[j][: acc[j]], nd[j],
                 [(ids[j, i * n:(i + 1) * n].tolist(), tlp[j, i * n:(i + 1) * n].tolist())
                  for i in range(acc[j])]) for j in range(bs)]

    # ---- the body ---------------------------------------------------------------------------
    def parts(self, bs: int, greedy: bool) -> list:
        verify_meta = (lambda: self.backend.build_metadata(self._fb(bs)), False)
        verify = (lambda: self._forward_and_accept(bs, greedy), True)
        if self.k and not self.fused_draft and isinstance(self.drafter, StagedDrafter):
            return self._staged_parts(bs, greedy) + ([] if self.metadata_in_graph
                                                     else [verify_meta, verify])
        if self.metadata_in_graph:
            return [(lambda: self._step(bs, greedy), True)]
        return [(lambda: self._prepare(bs, greedy), True), verify_meta, verify]

    def _staged_parts(self, bs: int, greedy: bool) -> list:
        """The unfused proposal: record + step 0's inputs | for each step: its metadata (eager),
        then the step and the next step's inputs (captured); the last step packs the
        proposal, and verifies too when verify metadata is built in the graph."""
        d, n = self.drafter, self.drafter.num_steps

        def first():
            ctx = self._record(bs, greedy)
            d.begin(ctx)
            d.stage_step(ctx, 0)

        def step(i: int):
            ctx = self._ctx(bs, greedy)
            d.run_step(ctx, i, d.step_fb(ctx, i))
            if i + 1 < n:
                d.stage_step(ctx, i + 1)
                return
            self._pack(ctx, d.finish(ctx))
            if self.metadata_in_graph:
                self.backend.build_metadata(self._fb(bs))
                self._forward_and_accept(bs, greedy)

        parts = [(first, True)]
        for i in range(n):
            parts += [(lambda i=i: d.step_metadata(self._ctx(bs, greedy), i), False),
                      (lambda i=i: step(i), True)]
        return parts

    def _ctx(self, bs: int, greedy: bool = True) -> DraftContext:
        v = self.raw
        return DraftContext(v["req_pool_indices"][:bs], v["seq_lens"][:bs],
                            v["input_ids"][:bs], v["max_draft"][:bs],
                            self.target.slots.token_table, v["temperature"][:bs],
                            v["seeds"][:bs], self.slots[:bs] if self.k else
                            v["reserved_slots"][:bs], v["top_p"][:bs], v["top_k"][:bs], greedy,
                            self.tree_step(bs))

    def _fb(self, bs: int) -> ForwardBatch:
        v, meta = self.raw, self.target.meta
        if self.tree_step(bs):  # every row a decode row with its own list
            r = bs * (1 + self.k)
            return ForwardBatch(Phase.DECODE, self.packed_ids[:r], self.t_req[:r],
                                self.t_seq[:r], self.t_ones[:r], self.packed_loc[:r],
                                self.tree_meta, paths=RowPaths(self.t_path[:r], self.t_base[:r]))
        if self.k == 0:  # decode reads the raw inputs themselves: one token per request
            return ForwardBatch(Phase.DECODE, v["input_ids"][:bs], v["req_pool_indices"][:bs],
                                v["seq_lens"][:bs], self.extend_lens[:bs],
                                v["reserved_slots"][:bs, 0], meta)
        n = bs * (1 + self.k)
        return ForwardBatch(Phase.VERIFY, self.packed_ids[:n], v["req_pool_indices"][:bs],
                            self.verify_seq_lens[:bs], self.extend_lens[:bs],
                            self.packed_loc[:n], meta)

    def _record(self, bs: int, greedy: bool) -> DraftContext:
        """Last tokens staged as -(j + 1) are the last token row j of the previous replay
        emitted (async scheduling): resolved in place (a speculative step's seq_lens, KV
        slots and max_draft with them), then recorded in the token table."""
        ctx, v = self._ctx(bs, greedy), self.raw
        ahead = AheadInputs(v["reserved_slots"][:bs], self.slots[:bs], ctx.max_draft,
                            v["seq_limit"][:bs]) if self.k else None
        record_last_tokens(ctx.last_tokens, self.out["tokens"], self.out["accept_lens"],
                           ctx.token_table, ctx.req_pool_indices, ctx.seq_lens, ahead)
        return ctx

    def _prepare(self, bs: int, greedy: bool = True) -> None:
        """Last tokens resolved and recorded; drafts; the packed 1 + d tokens of each
        request (on the device)."""
        ctx = self._record(bs, greedy)
        if self.k:
            self._pack(ctx, self.drafter.propose(ctx))

    def _keep(self, bs: int, prop) -> None:
        """The proposal's drafts, 0 past each request's count (drafters leave there whatever
        their steps past the budget made: dead rows' reads), so a step's recorded drafts are
        its own."""
        self.num_drafts[:bs].copy_(prop.num_drafts)
        torch.where(self.draft_slot < prop.num_drafts[:, None], prop.draft_tokens,
                    self.no_token, out=self.draft_tokens[:bs])

    def _pack(self, ctx: DraftContext, prop) -> None:
        """The proposal kept; the packed 1 + d tokens of each request and their slots."""
        if prop.parents is not None:
            self._pack_tree(ctx, prop)
            return
        T = 1 + self.k
        bs = ctx.seq_lens.shape[0]
        table = ctx.token_table
        self._keep(bs, prop)
        self._draft_probs, self._draft_index = prop.draft_probs, prop.draft_index
        rows, seq, last = ctx.req_pool_indices, ctx.seq_lens, ctx.last_tokens
        ext = 1 + prop.num_drafts
        self.extend_lens[:bs].copy_(ext)
        self.verify_seq_lens[:bs].copy_(seq + prop.num_drafts)
        qo_end = ext.cumsum(0)
        start = qo_end - ext
        t = torch.arange(bs * T, device=self.device)
        r = torch.searchsorted(qo_end, t, right=True).clamp_max(bs - 1)  # [bs*T] request
        j = t - start[r]  # [bs*T] index inside the request's 1 + d tokens
        live = j < ext[r]
        jc = j.clamp(0, T - 1)
        cand = torch.where(j == 0, last[r], prop.draft_tokens[r, (jc - 1).clamp_min(0)])
        self.packed_ids[: bs * T].copy_(torch.where(live, cand, 0))
        self.packed_loc[: bs * T].copy_(torch.where(live, ctx.reserved_slots[r, jc], 0))
        # the drafts' token ids at their positions (rows past a request's length are rewritten
        # before they are ever read); dead slots go to the dummy row 0
        table[torch.where(live, rows[r], 0), torch.where(live, seq[r] - 1 + jc, 0)] = \
            self.packed_ids[: bs * T]

    def _pack_tree(self, ctx: DraftContext, prop) -> None:
        """A tree's rows: request b's last token and its k drafts at rows b(1 + k) + i, each
        at position t + depth into its own reserved slot, its list the request's keys up to
        t, then its path (its ancestors' slots and its own); rows past the request's draft
        budget (and padded requests' drafts) go to the dummy row 0, slot 0."""
        bs, T = ctx.seq_lens.shape[0], 1 + self.k
        r = bs * T
        self._keep(bs, prop)
        self._draft_probs, self._draft_index = None, None
        zero = torch.zeros(bs, 1, dtype=torch.int64, device=self.device)
        depths = torch.cat([zero, prop.depths], dim=1)  # [bs, T]
        parents = torch.cat([zero, prop.parents], dim=1)
        live = depths <= ctx.max_draft[:, None]
        self.t_parents[:bs].copy_(parents)
        self.t_live[:bs].copy_(live)
        n = ctx.seq_lens[:, None]
        self.packed_ids[:r].copy_(torch.cat([ctx.last_tokens[:, None],
                                             self.draft_tokens[:bs]], dim=1).flatten())
        self.packed_loc[:r].copy_(torch.where(live, ctx.reserved_slots, 0).flatten())
        rows = torch.stack([ctx.req_pool_indices[:, None].expand(bs, T), n + depths,
                            n.expand(bs, T)])
        self.t_rows[:, :r].copy_(torch.where(live, rows, self.t_dead).view(3, r))
        anc = ancestors(parents, depths, self.tree_depth)  # [bs, T, D] rows
        self.t_anc[:bs].copy_(anc)
        self.t_depths[:bs].copy_(depths)
        self.t_path[:r].copy_(ctx.reserved_slots.gather(1, anc.reshape(bs, -1)).view(r, -1))
        # the request's packed rows: T each (the catch-up reads its features by this)
        self.verify_seq_lens[:bs].copy_(ctx.seq_lens + self.k)

    def _accept_tree(self, bs: int, logits: torch.Tensor, greedy: bool) -> None:
        """Acceptance along the tree against the target's token after every row (its argmax,
        or in a sampled step the very draw plain sampling makes at that position: a child is
        taken iff it carries it, the point-mass rule of `verify.rejection_sample`, so the
        emitted tokens are plain sampling's); the emitted run (the path's drafts, then the
        target's token after the last) with the logprobs of the raw distribution; the
        accepted nodes' K and V copied to the slots of their positions (reserved slot j for
        depth j) in every target layer, those slots recorded at their positions, the accepted
        drafts in the token table; the drafter's after_accept reads the path."""
        T, D, o = 1 + self.k, self.tree_depth, self.out
        ctx = self._ctx(bs, greedy)
        tokens = torch.cat([ctx.last_tokens[:, None], self.draft_tokens[:bs]], dim=1)
        argmax, lse = argmax_lse(logits)  # [bs * T] each: one pass over every row
        nxt = argmax
        if not greedy:  # a row at depth d draws the token of position seq_lens + d
            v = self.raw
            nxt = sample(logits, v["temperature"][:bs].repeat_interleave(T),
                         v["top_p"][:bs].repeat_interleave(T),
                         v["top_k"][:bs].repeat_interleave(T),
                         v["seeds"][:bs].repeat_interleave(T),
                         (ctx.seq_lens[:, None] + self.t_depths[:bs]).flatten(), argmax)
        path, lens = accept_tree(tokens, self.t_parents[:bs], self.t_anc[:bs],
                                 self.t_depths[:bs], self.t_live[:bs], nxt.view(bs, T))
        rows = torch.arange(bs, device=self.device)[:, None] * T + path  # [bs, 1 + D]
        emitted = nxt[rows]  # row j's token: the draft at depth j + 1 on the path
        j = torch.arange(1 + D, device=self.device)
        out = torch.where(j < lens[:, None], emitted, -1)
        o["tokens"][:bs, : 1 + D].copy_(out)
        o["tokens"][:bs, 1 + D :].fill_(-1)
        o["logprobs"][:bs, : 1 + D].copy_(logits[rows, emitted] - lse[rows])
        o["accept_lens"][:bs].copy_(lens)
        o["num_drafts"][:bs].copy_(self.num_drafts[:bs])
        # depth j's accepted node into reserved slot j (a node's row is >= its depth, and
        # every source is read before any slot is written); j >= the accept length: itself
        took = j[None, 1:] < lens[:, None]  # [bs, D]
        slots = ctx.reserved_slots
        dst = slots[:, 1 : 1 + D]
        self.target.kv_pool.copy_slots(torch.where(took, slots.gather(1, path[:, 1:]), dst)
                                       .flatten(), dst.flatten())
        rec = j[None, 1:] <= ctx.max_draft[:, None]
        req = torch.where(rec, ctx.req_pool_indices[:, None], 0)
        pos = torch.where(rec, ctx.seq_lens[:, None] - 1 + j[1:], 0)
        self.backend.req_to_token[req, pos] = torch.where(rec, dst, 0)
        ctx.token_table[torch.where(took, req, 0), torch.where(took, pos, 0)] = \
            torch.where(took, emitted[:, :D], 0)
        self.drafter.after_accept(ctx, Acceptance(out, lens, self.verify_seq_lens[:bs],
                                                  self._fb(bs), path))

    def _forward_and_accept(self, bs: int, greedy: bool) -> None:
        v, T = self.raw, 1 + self.k
        fb = self._fb(bs)
        if self.tree_step(bs):  # every row a logit row
            x, residual = self.model(fb.input_ids, fb, self.backend, final_norm=False,
                                     capture=self.target.capture)
            self._accept_tree(bs, self.model.compute_logits(x, residual), greedy)
            return
        if T == 1:  # every row is a logit row: the final norm goes into the LM head kernel
            logits = self.model.compute_logits(*self.model(fb.input_ids, fb, self.backend,
                                                           final_norm=False))
            drafts, num_drafts, probs = self.draft_tokens[:bs], self.num_drafts[:bs], None
        else:
            # the final norm goes into the LM head kernel, as for decode rows
            x, residual = self.model(fb.input_ids, fb, self.backend, final_norm=False,
                                     capture=self.target.capture)
            qo_start = self.extend_lens[:bs].cumsum(0) - self.extend_lens[:bs]
            idx = (qo_start[:, None] + torch.arange(T, device=self.device)).clamp_max(
                bs * T - 1).flatten()
            logits = self.model.compute_logits(x[idx], residual[idx])  # [bs * T, V] fp32
            drafts, num_drafts = self.draft_tokens[:bs], self.num_drafts[:bs]
            probs = self._draft_probs
        o = self.out
        tokens, accept_lens, _ = emit(
            logits, drafts, num_drafts, probs, v["temperature"][:bs], v["top_p"][:bs],
            v["top_k"][:bs], v["seeds"][:bs], v["seq_lens"][:bs], greedy,
            out_tokens=o["tokens"][:bs], out_logprobs=o["logprobs"][:bs],
            draft_index=self._draft_index if probs is not None else None,
            **step_extras(v, o, bs, self.target.controls))
        if T == 1:  # accept_lens (1) and num_drafts (0) were written once, at bind
            return
        o["accept_lens"][:bs].copy_(accept_lens)
        o["num_drafts"][:bs].copy_(num_drafts)
        self.drafter.after_accept(self._ctx(bs, greedy),
                                  Acceptance(tokens, accept_lens, self.verify_seq_lens[:bs],
                                             fb))

    def _step(self, bs: int, greedy: bool) -> None:
        self._prepare(bs, greedy)
        self.backend.build_metadata(self._fb(bs))
        self._forward_and_accept(bs, greedy)


class BodyFactory:
    """A picklable `(executor) -> StepBody` (TP ranks > 0 build the same bodies from it)."""

    def __init__(self, drafter: Drafter | None = None, metadata_in_graph: bool | None = None,
                 use_graphs: bool = True, fused_draft: bool | None = None) -> None:
        self.drafter = drafter
        self.metadata_in_graph = metadata_in_graph
        self.use_graphs = use_graphs
        self.fused_draft = fused_draft

    def __call__(self, target) -> StepBody:
        return StepBody(target, self.drafter, self.metadata_in_graph, self.use_graphs,
                        self.fused_draft)
