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

import dataclasses
import logging

import torch

from draftgraph.attention.backend import ForwardBatch, Phase
from draftgraph.attention.metadata import MetadataBuffers, RowPaths
from draftgraph.kernels.argmax import argmax_lse
from draftgraph.kernels.tokens import AheadInputs, ChainPack, pack_chain, record_last_tokens
from draftgraph.kernels.tree import TreeContext, TreeOutputs, TreeVerify, tree_accept, tree_pack
from draftgraph.runtime.sampling import sample
from draftgraph.runtime.schema import Field, Lanes
from draftgraph.spec.chain import StagedDrafter
from draftgraph.spec.drafter import Acceptance, DraftContext, Drafter
from draftgraph.spec.verify import emit, step_extras

logger = logging.getLogger(__name__)


def step_inputs(max_bs: int, k: int, controls: bool = False) -> Lanes:
    """controls: also the sampling controls' lanes (spec/extras.py, runtime/controls.py)."""
    extra = [Field("min_tokens"), Field("prompt_lens"), Field("num_logit_bias"),
             Field("num_allowed"), Field("num_bad_words"),
             *(Field(f"{p}_penalty", dtype=torch.float32)
               for p in ("presence", "frequency", "repetition")),
             Field("min_p", dtype=torch.float32)] if controls else []
    return Lanes(max_bs, [
        Field("input_ids"), Field("req_pool_indices"), Field("seq_lens"), Field("max_draft"),
        Field("top_k"), Field("seeds"), Field("reserved_slots", 1 + 2 * k), Field("seq_limit"),
        Field("temperature", dtype=torch.float32), Field("top_p", dtype=torch.float32), *extra])


def step_outputs(max_bs: int, k: int, top_n: int = 0) -> Lanes:
    """top_n > 0: also the top_n alternatives of every emitted row (spec/extras.py).
    tokens and accept_lens have max_bs spare rows past the requests': a prefill run behind a
    launched step writes its first tokens there (column 0; accept length left at 0 or 1,
    read as 1), and the step after refers to them as to any row, -(max_bs + i + 1)
    (engine/first_tokens.py)."""
    extra = [Field("top_ids", (1 + k) * top_n),
             Field("top_logprobs", (1 + k) * top_n, torch.float32)] if top_n else []
    return Lanes(max_bs, [
        Field("tokens", 1 + k, rows=2 * max_bs), Field("accept_lens", rows=2 * max_bs),
        Field("num_drafts"),
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
        # request b's logit row j: its packed row (clamped past the last)
        self.logit_rows = torch.zeros(max_bs * T, dtype=torch.int64, device=dev)
        self.pack = ChainPack(self.draft_tokens, self.num_drafts, self.extend_lens,
                              self.verify_seq_lens, self.packed_ids, self.packed_loc,
                              self.logit_rows)
        # a chain step verifies 1 + chain_k rows a request: k, except for a tree drafter,
        # whose steps without a tree draft a chain of at most D (1 + k rows each would be
        # the tree's: 44 instead of 5 at 8x5:27+g16 with the chain of 4). Its outputs then
        # go through buffers 1 + chain_k wide, copied into the results' first columns.
        self.chain_k = drafter.chain_k if drafter is not None else 0
        self.chain_out: dict[str, torch.Tensor] = {}
        if self.chain_k < self.k:
            self.chain_drafts = torch.zeros(max_bs, self.chain_k, dtype=torch.int64,
                                            device=dev)
            self.chain_pack = dataclasses.replace(self.pack, draft_tokens=self.chain_drafts)
        else:
            self.chain_drafts, self.chain_pack = self.draft_tokens, self.pack
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
            self._alloc_tree(max_bs, drafter.reach)

    def _alloc_tree(self, max_bs: int, depth: int) -> None:
        """A tree verify's rows (spec/tree.py): every request's 1 + k rows as decode rows of
        their own lists, for batches of up to the drafter's tree_max_bs requests, with their
        own metadata buffers; packed and accepted by kernels/tree.py."""
        dev, m, T = self.device, min(self.drafter.tree_max_bs, max_bs), 1 + self.k
        r = m * T
        self.tree_depth = depth

        def buf(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=dev)

        # rows [3, r]: request row, KV length and path base of each row (a dead row's: the
        # dummy row 0, length 1, base 1)
        self.tv = TreeVerify(self.draft_tokens, self.num_drafts, self.packed_ids,
                             self.packed_loc, buf(3, r), buf(r, depth), buf(m, T),
                             buf(m, T, dtype=torch.int8), buf(m, T), buf(m, T, depth),
                             self.verify_seq_lens, buf(m, 1 + depth), buf(2, m * depth))
        self.t_req, self.t_seq, self.t_base = (self.tv.rows[i] for i in range(3))
        self.t_ones = torch.ones(r, dtype=torch.int64, device=dev)
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
        if self.chain_k < self.k:  # a chain step's results, 1 + chain_k rows a request
            t = 1 + self.chain_k
            width = {"tokens": t, "logprobs": t}
            if "top_ids" in out:
                n = out["top_ids"].shape[1] // (1 + self.k)
                width.update(top_ids=t * n, top_logprobs=t * n)
            self.chain_out = {name: out[name].new_zeros(out[name].shape[0], w)
                              for name, w in width.items()}

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
        d = self.drafter
        n = d.steps_for(self.tree_step(bs))

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
                                self.tree_meta, paths=RowPaths(self.tv.path[:r], self.t_base[:r]))
        if self.k == 0:  # decode reads the raw inputs themselves: one token per request
            return ForwardBatch(Phase.DECODE, v["input_ids"][:bs], v["req_pool_indices"][:bs],
                                v["seq_lens"][:bs], self.extend_lens[:bs],
                                v["reserved_slots"][:bs, 0], meta)
        n = bs * (1 + self.chain_k)
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

    def _pack(self, ctx: DraftContext, prop) -> None:
        """The proposal kept (0 past each request's count: drafters leave there whatever
        their steps past the budget made, dead rows' reads, so a step's recorded drafts are
        its own); the packed 1 + d tokens of each request, their slots and logit rows, the
        drafts' token ids at their positions (`kernels.tokens.pack_chain`: rows past a
        request's length are rewritten before they are ever read)."""
        if prop.parents is not None:
            self._pack_tree(ctx, prop)
            return
        kc, probs = self.chain_k, prop.draft_probs
        self._draft_probs = probs[:, :kc] if probs is not None else None
        self._draft_index = prop.draft_index
        pack_chain(prop.draft_tokens[:, :kc], prop.num_drafts, ctx.last_tokens, ctx.seq_lens,
                   ctx.req_pool_indices, ctx.reserved_slots, ctx.token_table, self.chain_pack)

    def _pack_tree(self, ctx: DraftContext, prop) -> None:
        """A tree's rows (`kernels.tree.tree_pack`): request b's last token and its k drafts
        at rows b(1 + k) + i, each at position t + depth into its own reserved slot, its list
        the request's keys up to t, then its path (its ancestors' slots and its own); rows
        past the request's draft budget (and padded requests' drafts) go to the dummy row 0,
        slot 0; the drafts kept, 0 past the count (as `_pack`)."""
        self._draft_probs, self._draft_index = None, None
        tree_pack(prop.draft_tokens, prop.num_drafts, prop.parents, prop.depths,
                  ctx.last_tokens, self._tree_ctx(ctx), self.tv)

    @staticmethod
    def _tree_ctx(ctx: DraftContext) -> TreeContext:
        return TreeContext(ctx.seq_lens, ctx.req_pool_indices, ctx.max_draft,
                           ctx.reserved_slots)

    def _accept_tree(self, bs: int, logits: torch.Tensor, greedy: bool) -> None:
        """Acceptance along the tree against the target's token after every row (its argmax,
        or in a sampled step the very draw plain sampling makes at that position: a child is
        taken iff it carries it, the point-mass rule of `verify.rejection_sample`, so the
        emitted tokens are plain sampling's): `kernels.tree.tree_accept` writes the emitted
        run with the raw distribution's logprobs, the path, the positions' slots and the
        accepted drafts in the token table; then the accepted nodes' K and V are copied to
        the slots of their positions (reserved slot j for depth j) in every target layer, and
        the drafter's after_accept reads the path."""
        T, D, o = 1 + self.k, self.tree_depth, self.out
        ctx = self._ctx(bs, greedy)
        argmax, lse = argmax_lse(logits)  # [bs * T] each: one pass over every row
        nxt = argmax
        if not greedy:  # a row at depth d draws the token of position seq_lens + d
            v = self.raw
            nxt = sample(logits, v["temperature"][:bs].repeat_interleave(T),
                         v["top_p"][:bs].repeat_interleave(T),
                         v["top_k"][:bs].repeat_interleave(T),
                         v["seeds"][:bs].repeat_interleave(T),
                         (ctx.seq_lens[:, None] + self.tv.depths[:bs]).flatten(), argmax)
        tree_accept(nxt, logits, lse, self._tree_ctx(ctx), self.tv, self.backend.req_to_token,
                    ctx.token_table, TreeOutputs(o["tokens"][:bs], o["logprobs"][:bs],
                                                 o["accept_lens"][:bs], o["num_drafts"][:bs]))
        self.target.kv_pool.copy_slots(self.tv.copy[0, : bs * D], self.tv.copy[1, : bs * D])
        self.drafter.after_accept(ctx, Acceptance(o["tokens"][:bs], o["accept_lens"][:bs],
                                                  self.verify_seq_lens[:bs], self._fb(bs),
                                                  self.tv.accepted[:bs],
                                                  self.tv.copy[:, : bs * D]))

    def _forward_and_accept(self, bs: int, greedy: bool) -> None:
        v, T = self.raw, 1 + self.chain_k
        fb = self._fb(bs)
        if self.tree_step(bs):  # every row a logit row
            x, residual = self.model(fb.input_ids, fb, self.backend, final_norm=False,
                                     capture=self.target.capture)
            self._accept_tree(bs, self.model.compute_logits(x, residual), greedy)
            return
        if T == 1:  # every row is a logit row: the final norm goes into the LM head kernel
            logits = self.model.compute_logits(*self.model(fb.input_ids, fb, self.backend,
                                                           final_norm=False))
            drafts, num_drafts, probs = self.chain_drafts[:bs], self.num_drafts[:bs], None
        else:
            # the final norm goes into the LM head kernel, as for decode rows
            x, residual = self.model(fb.input_ids, fb, self.backend, final_norm=False,
                                     capture=self.target.capture)
            idx = self.logit_rows[: bs * T]
            logits = self.model.compute_logits(x[idx], residual[idx])  # [bs * T, V] fp32
            drafts, num_drafts = self.chain_drafts[:bs], self.num_drafts[:bs]
            probs = self._draft_probs
        o = self.out
        c = self.chain_out or o  # results 1 + chain_k wide (copied into o's below)
        extras = step_extras(v, c, bs, self.target.controls)
        _, accept_lens, _ = emit(
            logits, drafts, num_drafts, probs, v["temperature"][:bs], v["top_p"][:bs],
            v["top_k"][:bs], v["seeds"][:bs], v["seq_lens"][:bs], greedy,
            out_tokens=c["tokens"][:bs], out_logprobs=c["logprobs"][:bs],
            draft_index=self._draft_index if probs is not None else None, **extras)
        for name, buf in self.chain_out.items():
            o[name][:bs, : buf.shape[1]].copy_(buf[:bs])
        if T == 1:  # accept_lens (1) and num_drafts (0) were written once, at bind
            return
        o["accept_lens"][:bs].copy_(accept_lens)
        o["num_drafts"][:bs].copy_(num_drafts)
        self.drafter.after_accept(self._ctx(bs, greedy),
                                  Acceptance(o["tokens"][:bs], accept_lens,
                                             self.verify_seq_lens[:bs], fb))

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
