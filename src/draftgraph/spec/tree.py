"""Draft trees (EAGLE-2's dynamic tree, greedy): a chain head drafts a tree of `nodes` tokens
and the target verifies them all in one forward; the deepest path the target agrees with is
accepted (`--speculative-tree WxD:N`).

Growing a tree (`TreeHeadDrafter`, every piece a fixed-shape device op, so it captures):
step 0 is the chain's (the last token at its position, one row a request), its W likeliest
tokens the depth-1 nodes; step d = 1 .. D - 1 runs the head on the W nodes of depth d with the
best cumulative draft log-probability (the beam), each row proposing its W likeliest
children. Of the W + (D - 1) W^2 nodes, the `nodes` best by cumulative score are drafted, in
depth order (node ids are depth-major and a child never outscores its parent, so the best
keep every kept node's parent). A step's bookkeeping after the head's forward (its rows' top-W
log-probabilities, `kernels.tree.top_logprobs`: two launches; scoring its nodes and staging
the next beam's rows, `tree_grow`: one) and the final pick (`tree_pick`: one) are Triton
kernels on the GPU.

An n-gram branch ("WxD:N+gG", `_branch`): after the pick, a prompt-lookup chain of up to
G drafts from the token table (spec/ngram.py's rule, `kernels.ngram`: one launch) is appended
as drafts N .. N + G - 1, a chain from the root. Nothing merges it into the tree: where it
repeats the tree's nodes both are verified and the deepest accepted row decides, so it costs
its G verify rows and one launch, no head step (offline at 33 rows, 8x5:27+g5 against 8x5:32:
+2.7 % / +5.2 % accept on MT-Bench / HumanEval; benchmarks/NOTES.md, stop 46). A branch
longer than the tree is deep reaches past it (G > D): the step's tree buffers, its acceptance
walk and the head's catch-up span the `reach`, max(D, G), drafts a path may accept (the
CLI's default, 8x5:27+g16: +12 % / +22 % accept length over g5 on the real default model,
MT-Bench / HumanEval, H100; stop 48).

A tree row is a decode row with a list of its own (`attention.metadata.RowPaths`): its
request's keys below the last token's position + 1, then the slots of its ancestors and its
own at positions t + 1 .. t + depth. So neither the head's steps nor the target's verify need
an attention mask, and a verify row on the accepted path attends to exactly the keys its
decode row would.

The verify (spec/step.py): `kernels.tree.tree_pack` lays the proposal out as the verify's
rows (one launch on the GPU); after the forward, `tree_accept` (one launch) finds what walking
from the root to the child whose token is the target's token after the current row (its
argmax, or a sampled step's draw), D times, would reach (`accept_tree`, its twin's core: a
fixed number of ops, no walk); the emitted tokens are the path's drafts and the target's token
after the last, exactly plain decoding's. The step body then copies the accepted nodes' K and
V to the slots of their positions (a depth-j node's KV into reserved slot j, in every target
layer) and the positions record those slots, so the sequence's cache is the chain layout
again; the head's catch-up reads the target's features along the path.

Sampled steps draft trees too (the same top-W children): the target's token after each row
is then the very draw plain sampling makes at that position (seeded by it), and a child is
taken iff it carries that draw: the point-mass rule of `verify.rejection_sample` along a
tree, so a sampled request emits plain sampling's tokens. Steps with top-N or sampling
controls, and batches of more than `tree_max_bs` requests, draft the head's chain instead
(`chain`, --num-draft-tokens, at most D: 4 by default, which at batch 16 and 32 costs 0.90x
the chain of 5's round on an H100 for ~3 % less acceptance, benchmarks/NOTES.md, stop 48),
its catch-up `chain_k` entries a request: the step body decides (`StepBody.tree_step`) and
says so in `DraftContext.tree`.
"""

from __future__ import annotations

import logging

import torch

from draftgraph.attention.backend import ForwardBatch, Phase
from draftgraph.attention.metadata import MetadataBuffers, RowPaths
from draftgraph.config import TREE_MAX_BS, TreeShape
from draftgraph.kernels.tree import (
    TreeContext,
    top_logprobs,
    tree_buffers,
    tree_grow,
    tree_pick,
)
from draftgraph.spec.chain_head import ChainHeadDrafter
from draftgraph.spec.drafter import DraftContext, Proposal
from draftgraph.spec.ngram import NgramProposer

logger = logging.getLogger(__name__)


class TreeHeadDrafter(ChainHeadDrafter):
    """A chain head drafting trees (module docstring); its k is the tree's verified nodes."""

    name = "chain-tree"
    drafts_trees = True

    def __init__(self, head, shape: TreeShape, catch_up: bool = True,
                 max_bs: int = TREE_MAX_BS, ngram_n: tuple[int, int] = (1, 4),
                 chain: int | None = None) -> None:
        shape.check_beams()
        super().__init__(head, shape.verified, catch_up)
        self.shape = shape
        self.tree_max_bs = max_bs  # larger steps draft a chain
        # that chain's drafts: `chain` (--num-draft-tokens), at most the tree's depth
        self.chain = min(chain or shape.depth, shape.depth)
        # the n-gram branch's drafts (module docstring): suffixes of ngram_n[0] .. [1] tokens
        self.branch = NgramProposer(*ngram_n, shape.ngram) if shape.ngram else None

    @property
    def num_steps(self) -> int:
        return self.shape.depth

    @property
    def reach(self) -> int:
        return self.shape.reach  # an n-gram branch may reach past the tree's depth

    @property
    def chain_k(self) -> int:
        return self.chain  # steps without a tree draft this chain

    def steps_for(self, tree: bool) -> int:
        return self.shape.depth if tree else self.chain

    def bind(self, target) -> None:
        super().bind(target)
        w, dev = self.shape.width, target.device
        m = min(self.tree_max_bs, target.max_bs)
        # the nodes, the beam, and the beam rows of a step (one per request and beam entry):
        # their raw inputs, input features and own metadata (tree rows)
        self.bufs, self.node_depth = tree_buffers(w, self.shape.depth, m,
                                                  self.step_feat.shape[1],
                                                  self.step_feat.dtype, dev)
        r = m * w
        # request row, KV length, slot and path base of each row, staged together (a dead
        # row's: the dummy row 0, length 1, slot 0, base 1)
        self.t_req, self.t_seq, self.t_loc, self.t_base = self.bufs.t_rows
        self.t_ones = torch.ones(r, dtype=torch.int64, device=dev)
        # the proposal [m, N + G] (drafts, parents, depths): the pick writes columns :N, the
        # n-gram branch's drafts columns N:, whose parents (the root, then the previous draft's
        # row) and depths (1 .. G) never change
        n, g = self.shape.nodes, self.shape.ngram
        self.prop = torch.zeros(3, m, n + g, dtype=torch.int64, device=dev)
        j = torch.arange(g, device=dev)
        self.prop[1, :, n:] = torch.where(j == 0, 0, n + j)
        self.prop[2, :, n:] = j + 1
        ctx_len = target.backend.req_to_token.shape[1]
        self.tree_meta = MetadataBuffers(r, r, r * ctx_len, target.backend.sliding_window, dev)
        logger.info("draft trees %s in steps of up to %d requests (larger and extras steps "
                    "draft a chain of %d)", self.shape, m, self.chain)

    # ---- the proposal (tree or chain: `ctx.tree`, never state left by an earlier call, which
    # would be the last captured graph's when the fallback rebuilds a step's metadata); step
    # 0 is staged as the chain's, a tree's step i > 0 by step i - 1's grow (it holds the
    # streams), a chain's by its take ------------------------------------------------------
    def step_fb(self, ctx: DraftContext, i: int) -> ForwardBatch:
        if i == 0 or not ctx.tree:
            return super().step_fb(ctx, i)
        bs = ctx.seq_lens.shape[0]
        r = bs * self.shape.width
        return ForwardBatch(Phase.DRAFT_CHAIN, self.bufs.t_ids[:r], self.t_req[:r],
                            self.t_seq[:r], self.t_ones[:r], self.t_loc[:r], self.tree_meta,
                            paths=RowPaths(self.bufs.beam_path[i % 2, :bs].view(r, -1),
                                           self.t_base[:r]))

    def run_step(self, ctx: DraftContext, i: int, fb: ForwardBatch) -> None:
        if not ctx.tree:
            super().run_step(ctx, i, fb)
            return
        feat = self.step_feat[: fb.bs] if i == 0 else self.bufs.t_feat[: fb.bs]
        self._expand(ctx, i, *self.head_step(feat, fb))

    def _expand(self, ctx: DraftContext, i: int, logits: torch.Tensor,
                stream: torch.Tensor) -> None:
        """Each row's W likeliest children, scored by cumulative log-probability; unless this
        is the last step, the W best of them staged as the next step's rows."""
        top_lp, top_idx = top_logprobs(logits, self.shape.width)  # [rows, W]
        tree_grow(i, top_lp, top_idx, self.vocab, stream, self.bufs,
                  TreeContext(ctx.seq_lens, ctx.req_pool_indices, ctx.max_draft,
                              ctx.reserved_slots), stage=i + 1 < self.shape.depth)

    def finish(self, ctx: DraftContext) -> Proposal:
        if not ctx.tree:  # a chain (extras, or a batch too large for tree rows)
            prop = super().finish(ctx)  # chain_k columns of drafts (and distributions) count
            prop.num_drafts = torch.clamp(ctx.max_draft, max=self.chain)
            return prop
        bs, n, g = ctx.seq_lens.shape[0], self.shape.nodes, self.shape.ngram
        drafts, parents, depths = self.prop[:, :bs]
        _, _, _, live = tree_pick(
            self.bufs.node_score[:bs], self.bufs.node_tok[:bs], self.bufs.node_parent[:bs],
            self.node_depth,
            ctx.max_draft, n, g, (drafts[:, :n], parents[:, :n], depths[:, :n]))
        if g:
            self._branch(ctx, drafts[:, n:])
        return Proposal(drafts, live, parents=parents, depths=depths)

    def _branch(self, ctx: DraftContext, out: torch.Tensor) -> None:
        """The n-gram branch's G drafts into out [bs, G] (the proposal's last columns: a chain
        from the root, draft N + j at depth j + 1). Drafts that repeat the tree's nodes are
        verified twice, harmlessly (the deepest accepted row wins); the 0-padding past the
        match (or with no match) is verified as token 0, accepted only where the target's
        token is 0. The pick's count leads over the branch too: N + its drafts within the
        budget when every tree node is in it, else the tree's (`tree_pack` then verifies the
        branch as 0s)."""
        self.branch.propose_from_table(ctx, out)
