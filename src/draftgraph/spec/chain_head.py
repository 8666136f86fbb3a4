"""The EAGLE-3-style chain head as a drafter (`--speculative chain --draft-head PATH`): k chain
steps (spec/chain.py) of the head (models/chain_head.py) over its own KV pool in the shared slot
space, reading the target's hidden states.

The head's entry at position p reads (feature of p - 1, token at p), so a request keeps one
feature on the device between steps: `last_feat[row]`, the target's feature of the position
before its last token. Step 0 feeds (last_feat, last token) at the last token's position; step
i > 0 feeds (the head's own stream of step i - 1, draft i - 1) at the next.

After the verify forward (`after_accept`), the target's features of the verified positions are
in the capture buffer (HiddenCapture, written by the verify forward itself). For a request at
seq_lens n whose accept length is a, the emitted tokens E_0 .. E_{a-1} sit at positions
n .. n + a - 1; the chain wrote positions n .. n + a - 2 from the head's own streams, so the
catch-up rewrites them from the target's features F_{n-1} .. F_{n+a-3} (the KV alone: the last
layer stops at its store), and last_feat becomes F_{n+a-2}. It runs as a fixed-shape extend of k
entries per request (positions n .. n + k - 1, the request's reserved slots): the entries past
a - 2 are rejected or pending positions, rewritten before anything reads them. So the head
never attends to an entry that was computed from a rejected token or from its own guess of a
feature that the target has since computed.
A tree's verify (spec/tree.py) packs its rows otherwise: the features are read along the
accepted path (`Acceptance.path`), and the extend has one entry per draft step (its depth).

Eager target forwards (prefill chunks, mixed steps) reach `observe`, which writes the head's
entries of the same tokens from the features that forward captured.
"""

from __future__ import annotations

import logging

import torch

from draftgraph.attention.backend import ForwardBatch, Phase
from draftgraph.kernels.tokens import CatchUp, stage_catch_up
from draftgraph.models.chain_head import ChainHead
from draftgraph.runtime.executor import ModelExecutor
from draftgraph.runtime.schema import StepBatch
from draftgraph.spec.chain import ChainDrafter
from draftgraph.spec.drafter import Acceptance, DraftContext

logger = logging.getLogger(__name__)


class ChainHeadDrafter(ChainDrafter):
    name = "chain"
    needs_hidden_states = True

    def __init__(self, head: ChainHead, k: int, catch_up: bool = True) -> None:
        super().__init__(k)
        self.head = head
        # NOTE: catch_up=False is the broken drafter the tests prove they catch
        self.catch_up = catch_up

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        c = self.head.config
        return (2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
                * torch.tensor([], dtype=dtype).element_size())

    def bind(self, target: ModelExecutor) -> None:
        self.modules_to(target.device)  # a TP rank > 0 received it on the CPU
        head = self.head
        head.head_config.validate_for(target.config)
        self.target_model = target.model
        self.executor = ModelExecutor(head, target.slots, target.max_bs, target.max_num_tokens,
                                      target.device, target.dtype, target.backend.name,
                                      tensor_core_rows=target.tensor_core_rows,
                                      rows_per_request=target.rows_per_request)
        self.capture = target.capture_hidden(tuple(head.head_config.hidden_layer_ids))
        self.bind_vocab(head, target)
        m, dev, dt = target.max_bs, target.device, target.dtype
        h = head.config.hidden_size
        rows = target.slots.token_table.shape[0]
        # per request row: the target's feature of the position before its last token
        self.last_feat = torch.zeros(rows, h, dtype=dt, device=dev)  # [max_reqs + 1, H]
        self.step_feat = torch.zeros(m, h, dtype=dt, device=dev)  # [max_bs, H] chain input
        # the catch-up extend's raw inputs: an entry per position a step may accept, per
        # request (`reach`); a tree drafter's chain steps accept fewer (`chain_k`): their
        # catch-up reads a prefix of the same buffers, m * chain_k long
        s = self.reach
        cu = CatchUp(*(torch.zeros(m * s, dtype=torch.int64, device=dev) for _ in range(2)),
                     torch.ones(m, dtype=torch.int64, device=dev),
                     torch.zeros(m * s, dtype=torch.int64, device=dev),
                     torch.zeros(m, dtype=torch.int64, device=dev))
        self.cu = {e: (CatchUp(cu.ids[: m * e], cu.loc[: m * e], cu.seq,
                               cu.feat_rows[: m * e], cu.last_rows),
                       torch.full((m,), e, dtype=torch.int64, device=dev))
                   for e in {s, self.chain_k}}
        self.alloc_steps(m, dev)
        logger.info("chain head: %d layer(s), target layers %s, draft vocabulary %d, KV pool "
                    "%.1f MiB", head.config.num_hidden_layers,
                    list(head.head_config.hidden_layer_ids),
                    head.head_config.draft_vocab_size or target.config.vocab_size,
                    self.executor.kv_pool.bytes() / 2**20)

    @property
    def reach(self) -> int:
        """The most drafts a step accepts (one path's): the catch-up's entries a request."""
        return self.num_steps

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target_model.embed_tokens(ids)

    # ---- the chain ------------------------------------------------------------------------
    def begin(self, ctx: DraftContext) -> None:
        super().begin(ctx)
        self.step_feat[: ctx.seq_lens.shape[0]].copy_(self.last_feat[ctx.req_pool_indices])

    def head_step(self, feat: torch.Tensor, fb: ForwardBatch) -> tuple[torch.Tensor,
                                                                        torch.Tensor]:
        """One forward of the head over fb's rows fed `feat`: (logits [rows, V'] over its
        draft vocabulary, the next feature [rows, H])."""
        x, residual = self.head(self._embed(fb.input_ids), feat, fb, self.executor.backend)
        return self.head.logits(x, residual, self.lm_head)

    def run_step(self, ctx: DraftContext, i: int, fb: ForwardBatch) -> None:
        feat = self.step_feat[: fb.bs]
        logits, stream = self.head_step(feat, fb)
        self.take(ctx, i, logits)
        feat.copy_(stream)

    # ---- catch-up ---------------------------------------------------------------------------
    def after_accept(self, ctx: DraftContext, accept: Acceptance) -> None:
        # entries a request: a tree's reach, a chain's k
        bs, m = ctx.seq_lens.shape[0], self.reach if accept.path is not None else self.chain_k
        total = accept.verify_fb.input_ids.shape[0]  # the verify's rows
        feats = self.head.features(self.capture.out[:total])  # [rows, H]
        # the entries' tokens, slots and feature rows (a chain's packed rows 0 .. m, a tree's
        # path's), and the row of each request's new last feature: one launch on the GPU
        cu, ext = self.cu[m]
        stage_catch_up(accept.tokens, accept.accept_lens, accept.verify_seq_lens, ctx.seq_lens,
                       ctx.reserved_slots, accept.path, total, cu)
        if self.catch_up:
            ids = cu.ids[: bs * m]
            fb = ForwardBatch(Phase.EXTEND, ids, ctx.req_pool_indices, cu.seq[:bs],
                              ext[:bs], cu.loc[: bs * m], self.executor.meta)
            self.executor.backend.build_metadata(fb)
            self.head.write_kv(self._embed(ids), feats[cu.feat_rows[: bs * m]], fb,
                               self.executor.backend)
        self.last_feat[ctx.req_pool_indices] = feats[cu.last_rows[:bs]]

    def observe(self, sb: StepBatch) -> None:
        """An eager target forward captured the features of its tokens: the head writes its
        entries (feature of the previous position, token) for the same positions."""
        ex = self.executor
        fb = ex.forward_batch(sb)
        ex.backend.build_metadata(fb)
        meta, t = fb.meta, fb.num_tokens
        feats = self.head.features(self.capture.out[:t])  # [T, H]
        req = meta.token_req[:t]
        rows = fb.req_pool_indices
        first = torch.arange(t, device=feats.device) == meta.qo_indptr[:-1][req]
        prev = torch.cat([feats[:1], feats[:-1]])
        inp = torch.where(first[:, None], self.last_feat[rows[req]], prev)
        inp = torch.where((fb.positions == 0)[:, None], 0, inp)
        self.head.write_kv(self._embed(fb.input_ids), inp, fb, ex.backend)
        self.last_feat[rows] = feats[meta.qo_indptr[1 : fb.bs + 1] - 1]
