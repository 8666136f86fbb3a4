"""The DSpark-style block head as a drafter (`--speculative block --draft-head PATH`): one
parallel forward of the head (models/block_head.py) drafts a whole block, over its own KV pool
in the shared slot space, reading the target's hidden states.

A staged drafter (spec/chain.py) of one step. For a request at seq_lens n the step feeds the
block [last token, mask, ..., mask] (block_size tokens) at positions n - 1 .. n + block_size - 2
into its reserved slots (reserved_slots [bs, 1 + k], k = block_size - 1): phase DRAFT_BLOCK,
whose metadata (positions, and a list per request of the last `window` context slots followed
by the block's own slots, seen non-causally by every row of the block) the Triton backend
builds inside the graph from req_pool_indices, seq_lens and the reserved slots, and a backend
without `in_graph_metadata` eagerly before the step's replay (the fallback, logged once).

Draft j (1 <= j <= k) is taken from block row j: argmax at temperature 0, else a seeded draw
from the processed distribution at the position the chain uses for it (STREAM_DRAFT), with its
probabilities for rejection sampling. With a Markov head the drafts are taken left to right,
row j's logits corrected by the token before it; with a confidence head a request's active
draft count stops at the first draft under the head's threshold (and at max_draft).

The head's context K/V lives at the target's slots of the positions before the block. After
the verify forward (`after_accept`) the target's captured streams of the verified tokens (the
last token and its drafts, positions n - 1 .. n - 1 + d) are injected as the head's context
K/V at their slots (one fixed-shape pass over the verify's packed tokens): the accepted ones
are the context of the next block; the rejected ones sit at positions the next block starts
at or past, in slots that are freed, and are never in any window. The block's own K/V at the
same slots is overwritten by that injection before any later block reads it. Eager target
forwards (prefill chunks, mixed steps) reach `observe`, which injects their tokens.

An n-gram branch (`--speculative-tree 1xK:K+gG`, K = block size - 1): beside the block's chain
of K drafts, a prompt-lookup chain of up to G drafts from the root (spec/ngram.py's rule, one
launch), verified as a two-branch tree by the step body's tree verify (spec/tree.py: every
row a decode row with its own key list, the deepest accepted row decides, the accepted
nodes' target K/V copied to their positions' slots). In such steps the block drafts its
argmax whatever the request's temperature (a sampled tree step takes a child iff it carries
plain sampling's draw, which an argmax meets most often); the injection runs over every
verify row (each into its node's slot, at its position) and the same copy list then moves
the accepted nodes' head K/V to their positions' slots. Steps of more than `tree_max_bs`
requests, or with top-N or penalties, draft the block alone (`chain_k` = K).

A tree of the block's rows (`--speculative-tree WxD:N+gG`, W > 1, D <= K <= N + G: the
block's rows write their K/V into the verify rows' slots; `_grow`): EAGLE-2's dynamic tree
(spec/tree.py) with row d of the one block forward in place of the chain head's step d:
depth d's W best nodes each take the W likeliest tokens of row d with their own token in the
Markov term, and the N best nodes are verified, the branch beside them. On one GPU
(flags.auto_block_tree) 4x7:27+g16 drafts the shipped head 2.00x / 2.66x plain decoding on
MT-Bench / HumanEval against the branch alone's 1.69x / 2.20x (H100, batch 1).
"""

from __future__ import annotations

import logging

import torch

from draftgraph.attention.backend import ForwardBatch, Phase
from draftgraph.config import TREE_MAX_BS, TreeShape
from draftgraph.kernels.tree import (
    TreeContext,
    top_logprobs,
    tree_buffers,
    tree_grow,
    tree_pick,
)
from draftgraph.models.block_head import BlockHead
from draftgraph.runtime.executor import ModelExecutor
from draftgraph.runtime.schema import StepBatch
from draftgraph.spec.chain import StagedDrafter
from draftgraph.spec.drafter import Acceptance, DraftContext, Proposal
from draftgraph.spec.ngram import NgramProposer

logger = logging.getLogger(__name__)


class BlockHeadDrafter(StagedDrafter):
    name = "block"
    needs_hidden_states = True

    def __init__(self, head: BlockHead, block_size: int | None = None,
                 confidence_threshold: float | None = None, inject: bool = True,
                 tree: TreeShape | None = None, ngram_n: tuple[int, int] = (1, 4),
                 max_bs: int = TREE_MAX_BS, chain: int | None = None) -> None:
        cfg = head.head_config
        self.block_size = block_size or cfg.block_size
        if not 2 <= self.block_size <= 17:
            raise ValueError(f"--block-size must be in 2..17 (1..16 drafts), got "
                             f"{self.block_size}")
        self.nb = nb = self.block_size - 1  # the block's drafts
        # NOTE: the block's forward writes its block_size rows' K/V into a request's reserved
        # slots, 1 + k of them (k = the verified drafts): a tree must verify at least nb
        if tree is not None and not (tree.depth <= nb <= tree.verified and (
                tree.width > 1 or tree.depth == tree.nodes == nb)):
            raise ValueError(f"--speculative block with a block of {nb}: --speculative-tree "
                             f"1x{nb}:{nb}+gG (the block and an n-gram branch) or WxD:N+gG "
                             f"with W > 1, D <= {nb} and N + G >= {nb} (a tree of the block's "
                             f"rows), got {tree}")
        self.tree = tree
        # k: the drafts a step verifies, the block's (or its tree's) and an n-gram branch's
        super().__init__(tree.verified if tree is not None else nb)
        g = tree.ngram if tree is not None else 0
        self.branch = NgramProposer(*ngram_n, g) if g else None
        self.drafts_trees = tree is not None
        self.tree_max_bs = max_bs  # larger steps draft the block alone
        # the drafts a step without a tree verifies: the block's first `chain` (default all)
        self.chain = nb if chain is None else chain
        if not 1 <= self.chain <= nb:
            raise ValueError(f"a block of {nb} drafts verifies 1..{nb} of them in a chain "
                             f"step, got {chain}")
        self.head = head
        self.threshold = (cfg.confidence_threshold if confidence_threshold is None
                          else confidence_threshold)
        # NOTE: inject=False is the broken drafter the tests prove they catch
        self.inject = inject

    @property
    def num_steps(self) -> int:
        return 1

    @property
    def chain_k(self) -> int:
        return self.chain  # a step without a tree verifies the block's first `chain`

    @property
    def reach(self) -> int:
        return self.tree.reach  # the deeper of the block (or its tree) and the branch

    @property
    def in_graph(self) -> bool:
        return self.executor.backend.in_graph_metadata

    @property
    def fallback_reason(self) -> str:
        return "backend lacks in_graph_metadata"

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        c = self.head.config
        return (2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
                * torch.tensor([], dtype=dtype).element_size())

    def bind(self, target: ModelExecutor) -> None:
        self.modules_to(target.device)  # a TP rank > 0 received it on the CPU
        head, hc = self.head, self.head.head_config
        hc.validate_for(target.config)
        self.target_model = target.model
        self.target_meta = target.meta
        self.executor = ModelExecutor(head, target.slots, target.max_bs, target.max_num_tokens,
                                      target.device, target.dtype, target.backend.name,
                                      tensor_core_rows=target.tensor_core_rows,
                                      rows_per_request=target.rows_per_request)
        self.executor.meta.add_block_lists(hc.window, self.block_size)
        self.capture = target.capture_hidden(tuple(hc.hidden_layer_ids))
        self.bind_vocab(head, target)
        m, g, dev = target.max_bs, self.block_size, target.device
        # the block's raw inputs: [last token, mask, ..., mask] per request, its slots
        self.block_ids = torch.full((m, g), hc.mask_token_id, dtype=torch.int64,
                                    device=dev)  # [max_bs, block_size] int64
        self.block_loc = torch.zeros(m * g, dtype=torch.int64, device=dev)
        self.block_seq_lens = torch.ones(m, dtype=torch.int64, device=dev)
        self.block_lens = torch.full((m,), g, dtype=torch.int64, device=dev)
        # the proposal [3, m, k] (drafts, parents, depths): the block's chain of nb drafts
        # (or its tree's n nodes, `_grow`), then the branch's chain from the root (parents:
        # 0 the last token, i: draft i - 1)
        n = self.tree.nodes if self.tree is not None else self.nb
        j = torch.arange(self.k, device=dev)
        self.prop = torch.zeros(3, m, self.k, dtype=torch.int64, device=dev)
        self.prop[1] = torch.where((j == 0) | (j == n), 0, j)
        self.prop[2] = torch.where(j < n, j + 1, j - n + 1)
        self.drafts = self.prop[0]  # [max_bs, k] int64
        if self.tree is not None and self.tree.width > 1:  # a tree of the block's rows:
            # the chain tree's buffers, with no head-step features (0 columns; `_grow`)
            self.bufs, self.node_depth = tree_buffers(self.tree.width, self.tree.depth, m, 0,
                                                      torch.float32, dev)
            # its beams run no rows, so write no KV: the grow stages their slots from zeros
            # (any number of beam rows, where a chain head's must fit its verify rows' slots)
            self.beam_slots = torch.zeros(m, 1 + (self.tree.depth - 1) * self.tree.width,
                                          dtype=torch.int64, device=dev)
        self.num_drafts = torch.zeros(m, dtype=torch.int64, device=dev)
        self._probs: torch.Tensor | None = None  # [bs, nb, V] of the proposal being built
        logger.info("block head: %d layer(s), block size %d, window %d, target layers %s, "
                    "Markov rank %d, confidence %s, draft vocabulary %d, KV pool %.1f MiB",
                    head.config.num_hidden_layers, g, hc.window, list(hc.hidden_layer_ids),
                    hc.markov_rank, f"cut < {self.threshold}" if hc.confidence else "off",
                    hc.draft_vocab_size or target.config.vocab_size,
                    self.executor.kv_pool.bytes() / 2**20)

    # ---- the block ------------------------------------------------------------------------
    def stage_step(self, ctx: DraftContext, i: int) -> None:
        bs = ctx.seq_lens.shape[0]
        self.block_ids[:bs, 0].copy_(ctx.last_tokens)
        self.block_loc[: bs * self.block_size].view(bs, -1).copy_(
            ctx.reserved_slots[:, : self.block_size])
        torch.add(ctx.seq_lens, self.nb, out=self.block_seq_lens[:bs])

    def step_fb(self, ctx: DraftContext, i: int = 0) -> ForwardBatch:
        bs, g = ctx.seq_lens.shape[0], self.block_size
        return ForwardBatch(Phase.DRAFT_BLOCK, self.block_ids[:bs].flatten(),
                            ctx.req_pool_indices, self.block_seq_lens[:bs],
                            self.block_lens[:bs], self.block_loc[: bs * g], self.executor.meta)

    def run_step(self, ctx: DraftContext, i: int, fb: ForwardBatch) -> None:
        head, bs, k = self.head, fb.bs, self.nb
        hidden = head(self.target_model.embed_tokens(fb.input_ids), fb, self.executor.backend)
        rows = hidden.view(bs, self.block_size, -1)[:, 1:]  # [bs, k, H]: drafts 1..k
        # the drafts this step verifies at most: a step without a tree, the first `chain`
        # (their logits, draws and doubts alone)
        n = k if ctx.tree else self.chain
        rows = rows[:, :n].reshape(bs * n, -1)
        logits = head.logits(rows, self.lm_head).view(bs, n, -1)
        if ctx.tree and self.tree.width > 1:
            self._grow(ctx, logits)
            return
        markov = head.markov_in is not None
        probs, prev = [], ctx.last_tokens
        greedy = ctx.greedy or ctx.tree  # a tree step's drafts are argmaxes (module note)
        if greedy and not markov:  # every draft at once
            self.drafts[:bs, :n].copy_(self.draft_argmax(logits))
        else:
            for j in range(n):  # left to right: the Markov head reads the draft before
                lj = logits[:, j] + head.markov(prev) if markov \
                    else logits[:, j]  # [bs, V']
                if greedy:
                    tok = self.draft_argmax(lj)  # [bs] int64
                else:
                    tok, q = self.sample_drafts(lj, ctx, ctx.seq_lens + j)
                    probs.append(q)
                self.drafts[:bs, j].copy_(tok)
                prev = tok
        self._probs = torch.stack(probs, dim=1) if probs else None
        count = torch.clamp(ctx.max_draft, max=n)
        if head.confidence is not None:  # cut at the first draft the head doubts
            before = torch.cat([ctx.last_tokens[:, None], self.drafts[:bs, : n - 1]], dim=1)
            conf = head.accept_prob(rows, before.flatten()).view(bs, n)  # [bs, n] fp32
            sure = (conf >= self.threshold).to(torch.int64).cumprod(dim=1).sum(dim=1)
            count = torch.minimum(count, sure)
        self.num_drafts[:bs].copy_(count)

    def _grow(self, ctx: DraftContext, logits: torch.Tensor) -> None:
        """A tree of the block's rows (EAGLE-2's dynamic tree, spec/tree.py): depth d's W best
        nodes (by cumulative draft log-probability) each take the W likeliest tokens of row
        d with their own token in the Markov term, so only that term differs between the
        children of siblings (the offline walk's `BlockTree`, benchmarks/tree_accept.py). The
        growing and the rows' top-W are the chain tree's kernels (`tree_grow` with no
        head-step features to stage, `top_logprobs`)."""
        bs, w, head = ctx.seq_lens.shape[0], self.tree.width, self.head
        tctx = TreeContext(ctx.seq_lens, ctx.req_pool_indices, ctx.max_draft,
                           self.beam_slots[:bs])
        for d in range(self.tree.depth):
            if d == 0:
                prev, lg = ctx.last_tokens, logits[:, 0]  # [bs, V']
            else:  # the beam's tokens, staged by the last grow
                prev, lg = self.bufs.t_ids[: bs * w], logits[:, d].repeat_interleave(w, 0)
            if head.markov_in is not None:
                lg = lg + head.markov(prev)
            top_lp, top_idx = top_logprobs(lg, w)
            tree_grow(d, top_lp, top_idx, self.vocab, self.bufs.t_feat[: lg.shape[0]],
                      self.bufs, tctx, stage=d + 1 < self.tree.depth)
        self._probs = None

    def finish(self, ctx: DraftContext) -> Proposal:
        bs = ctx.seq_lens.shape[0]
        if not ctx.tree:
            return Proposal(self.drafts[:bs], self.num_drafts[:bs], self._probs,
                            self.draft_index if self._probs is not None else None)
        drafts, parents, depths = self.prop[:, :bs]
        n, g = self.tree.nodes, self.tree.ngram
        if self.tree.width > 1:  # the best n nodes of the tree, in depth order
            live = tree_pick(self.bufs.node_score[:bs], self.bufs.node_tok[:bs],
                             self.bufs.node_parent[:bs], self.node_depth, ctx.max_draft, n, g,
                             (drafts[:, :n], parents[:, :n], depths[:, :n]))[3]
        else:  # the block's chain; the branch counts when the whole block does (as a tree's
            # pick counts it: kernels.tree.tree_pick), within the request's budget
            c = self.num_drafts[:bs]
            live = torch.where(c == n, n + torch.clamp(ctx.max_draft, max=g), c)
        if g:
            self.branch.propose_from_table(ctx, drafts[:, n:])
        return Proposal(drafts, live, parents=parents, depths=depths)

    # ---- KV injection -----------------------------------------------------------------------
    def after_accept(self, ctx: DraftContext, accept: Acceptance) -> None:
        """The verified tokens' context K/V, from the streams the verify forward captured."""
        if not self.inject:
            return
        fb = accept.verify_fb
        self.head.inject_kv(self.capture.out[: fb.num_tokens], fb, self.executor.backend)
        if accept.copy is not None:  # a tree's accepted nodes: to their positions' slots
            self.executor.kv_pool.copy_slots(accept.copy[0], accept.copy[1])

    def observe(self, sb: StepBatch) -> None:
        """An eager target forward captured the streams of its tokens: inject them."""
        if not self.inject:
            return
        ex = self.executor
        fb = ex.forward_batch(sb)
        ex.backend.build_metadata(fb)
        self.head.inject_kv(self.capture.out[: fb.num_tokens], fb, ex.backend)
