"""What a tree of drafts would give a chain head's acceptance (issue 14), before building one.

    python benchmarks/tree_accept.py --head src/draftgraph/heads/smollm2-135m-chain \\
        --sets benchmarks/data/accept_sets_smollm2_ids.json --num-prompts 40 \\
        --trees 1x4:4,2x4:8,4x5:16,8x6:32 --out r.json

Greedy, the default model, CPU fp32. The target's own greedy outputs (plain decoding, 128
tokens, or up to the EOS with --stop-at-eos, as bench_accept.py's) are walked as the engine
walks them (`train.loop.walk_rounds`): a round starting at the last emitted token t drafts a
tree and accepts the deepest path whose tokens equal the sequence's next ones, then emits one
more. The tree is EAGLE-2's dynamic tree: the head's step at depth d runs on the `width` nodes
of depth d with the best cumulative draft log-probability (its beam), each proposing its
`width` most likely children; after `depth` steps the `nodes` best nodes of all depths by
cumulative log-probability are the drafts the target would verify in one forward of 1 + nodes
rows (a tree mask). A node at depth d reads (its parent's stream, its token) at position t + d
and attends to the sequence's level-0 entries up to t and to its own ancestors' entries, the
way chain step d attends (the training loss's `_ttt_attend`); so width 1 with nodes = depth =
k is the engine's chain of k, and the `1xK:K` tree's accept length must equal the chain
replay's (`train.chain.replay_acceptance`, printed beside it as a check).

A block head (`--head` of kind block) grows the same trees from its one forward
(`BlockTree`); its `1x7:7` tree is the engine's block of 8 without a confidence cut.

Tree "WxD:N": width W, depth D, N verified nodes; "+gG": with a branch of the n-gram
drafter's (prompt lookup, n = 4 .. 1) up to G drafts from the root, verified beside the N
nodes (a round accepts the deeper of the two); "0xD:0+gG": the n-gram drafter alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from _meta import model_shape, run_header
from bench_accept import pick

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.kernels.ops import rope_ref
from draftgraph.models.heads import head_kind, load_head
from draftgraph.models.loader import load_model
from draftgraph.spec.ngram import propose_ref
from draftgraph.train.block import block_forward
from draftgraph.train.chain import _mlp_block, replay_acceptance, ttt_loss
from draftgraph.train.loop import TargetOracle, walk_rounds
from draftgraph.train.loop import rms as _rms


class TreeDrafter:
    """A chain head's forward over draft-tree nodes (eager, any number of layers)."""

    def __init__(self, head, embed_w: torch.Tensor, lm_w: torch.Tensor) -> None:
        self.head, self.embed_w, self.lm_w = head, embed_w, lm_w
        self.eps = head.config.rms_norm_eps

    def _attend(self, attn, qkv, pos, ctx_kv, tree_kv, visible):
        """q/k/v of N nodes at positions pos; keys: ctx_kv (k, v [C, Hkv, D], all visible) and
        the tree's entries so far plus these (tree_kv, extended in place; `visible` [N, M]
        masks them: ancestors and self). Returns [N, q_size]."""
        n = qkv.shape[0]
        hq, hk, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = rope_ref(q.reshape(n, hq, d), k.reshape(n, hk, d), pos, self.head.cos_sin_cache)
        v = v.reshape(n, hk, d)
        tree_kv[0] = torch.cat([tree_kv[0], k]) if tree_kv[0] is not None else k
        tree_kv[1] = torch.cat([tree_kv[1], v]) if tree_kv[1] is not None else v
        keys = torch.cat([ctx_kv[0], tree_kv[0]]).repeat_interleave(hq // hk, dim=1)
        vals = torch.cat([ctx_kv[1], tree_kv[1]]).repeat_interleave(hq // hk, dim=1)
        scores = torch.einsum("nhd,mhd->hnm", q.float(), keys.float()) * d ** -0.5
        mask = torch.cat([torch.ones(n, ctx_kv[0].shape[0], dtype=torch.bool), visible], 1)
        scores = scores.masked_fill(~mask[None], float("-inf"))
        o = torch.einsum("hnm,mhd->nhd", torch.softmax(scores, -1), vals.float())
        return o.reshape(n, attn.q_size).to(qkv.dtype)

    def _layers(self, feats, tokens, pos, ctx, tree, visible):
        """The head's layers over N entries: (stream [N, H])."""
        first = self.head.layers[0]
        emb = _rms(F.embedding(tokens, self.embed_w), first.input_layernorm.weight, self.eps)
        x = torch.cat([emb, _rms(feats, first.hidden_norm.weight, self.eps)], dim=-1)
        stream = feats
        for li, layer in enumerate(self.head.layers):
            attn = layer.self_attn
            if li == 0:
                qkv = F.linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias)
            else:
                qkv = F.linear(_rms(stream, layer.input_layernorm.weight, self.eps),
                               attn.qkv_proj.weight, attn.qkv_proj.bias)
            o = self._attend(attn, qkv, pos, ctx[li], tree[li], visible)
            stream = _mlp_block(layer, F.linear(o, attn.o_proj.weight) + stream, self.eps)
        return stream

    def context(self, streams: torch.Tensor, ids: list[int]):
        """Level 0 over a whole sequence (causal): per layer its (k, v) [S, Hkv, D], and the
        level-0 stream [S, H] (position p: the head's step 0 of a round starting at p)."""
        s = len(ids)
        feats = self.head.fc(streams)
        feat_in = torch.cat([torch.zeros_like(feats[:1]), feats[:-1]])
        pos = torch.arange(s)
        tree = [[None, None] for _ in self.head.layers]
        # no context: the sequence's entries are a chain of "tree nodes", each seeing the
        # earlier ones and itself
        ctx = [(torch.zeros(0, L.self_attn.num_kv_heads, L.self_attn.head_dim),) * 2
               for L in self.head.layers]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        out = self._layers(feat_in, torch.tensor(ids), pos, ctx, tree, causal)
        return [tuple(kv) for kv in tree], out

    def logp(self, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities [N, V'], the target id of each draft-vocabulary entry)."""
        logits = F.linear(_rms(stream, self.head.norm.weight, self.eps), self.lm_w)
        d2t = self.head.d2t if self.head.reduced_vocab else torch.arange(logits.shape[-1])
        return torch.log_softmax(logits.float(), -1), d2t

    def grow(self, ctx_kv, ctx_stream, t: int, width: int, depth: int):
        """The tree of a round at t: (parent, token, score) per node (parent -1: the root,
        token a target id, score the cumulative draft log-probability) and the stream of
        every expanded node (node -> [H])."""
        ctx = [(k[: t + 1], v[: t + 1]) for k, v in ctx_kv]
        tree = [[None, None] for _ in self.head.layers]
        # the tree's nodes: parent (-1: the root), token, cumulative draft log-probability;
        # the expanded ones also have entries in `tree` (keys and values), in expansion order
        parent, token, score = [], [], []
        lp, d2t = self.logp(ctx_stream[t : t + 1])
        top = lp[0].topk(width)
        for v, i in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            parent.append(-1), token.append(int(d2t[i])), score.append(v)
        entry_of: dict[int, int] = {}  # node -> its row in the tree's entries
        streams_of: dict[int, torch.Tensor] = {}  # expanded node -> its stream [H]
        anc_rows: list[list[int]] = []  # per entry: entry rows of its ancestors and itself
        frontier = list(range(len(token)))  # depth-1 nodes to expand
        for d in range(1, depth):
            beam = sorted(frontier, key=lambda i: -score[i])[:width]
            rows0 = len(anc_rows)
            for i in beam:
                p = parent[i]
                anc_rows.append((anc_rows[entry_of[p]] if p >= 0 else []) + [len(anc_rows)])
                entry_of[i] = len(anc_rows) - 1
            m = len(anc_rows)
            visible = torch.zeros(len(beam), m, dtype=torch.bool)
            for r, row in enumerate(range(rows0, m)):
                visible[r, anc_rows[row]] = True
            feats = torch.stack([ctx_stream[t] if parent[i] < 0 else streams_of[parent[i]]
                                 for i in beam])
            out = self._layers(feats, torch.tensor([token[i] for i in beam]),
                               torch.full((len(beam),), t + d), ctx, tree, visible)
            for r, i in enumerate(beam):
                streams_of[i] = out[r]
            lp, d2t = self.logp(out)
            top = lp.topk(width, dim=-1)
            frontier = []
            for r, i in enumerate(beam):
                for v, j in zip(top.values[r].tolist(), top.indices[r].tolist(), strict=True):
                    parent.append(i), token.append(int(d2t[j])), score.append(score[i] + v)
                    frontier.append(len(token) - 1)
        return parent, token, score, streams_of

    def lead(self, ctx_kv, ctx_stream, ids: list[int], t: int, width: int, depth: int,
             nodes: int, cap: int) -> int:
        """The round at t: the deepest verified tree path equal to ids[t + 1 ..] (<= cap)."""
        parent, token, score, _ = self.grow(ctx_kv, ctx_stream, t, width, depth)
        return _deepest(parent, token, score, ids, t, nodes, cap)


class BlockTree:
    """The same trees from a block head (DSpark-style: one forward drafts rows 1 .. g - 1 of
    the block anchored at t; row j's logits gain the Markov head's term for the token before
    it): a node at depth d takes row d - 1's logits with its parent's token as the Markov
    head's input, so only the Markov term differs between siblings' children. Over the
    head's draft vocabulary (`d2t`), as the engine drafts; no confidence cut (the shipped
    head's threshold is 0: it keeps every draft)."""

    def __init__(self, head, embed_w: torch.Tensor, target_lm: torch.Tensor) -> None:
        self.head, self.embed_w = head, embed_w
        self.lm_w = head.lm_head_weight(target_lm)  # [V', H]
        self.d2t = head.d2t if head.reduced_vocab else torch.arange(self.lm_w.shape[0])

    def context(self, streams: torch.Tensor, ids: list[int], prompt_len: int):
        """(draft logits before the Markov term of the block anchored at every response
        position [A, g - 1, V'], the first anchor)."""
        anchors = torch.arange(prompt_len, len(ids) - 1)[None]
        hidden = block_forward(self.head, self.embed_w, streams[None], torch.tensor([ids]),
                               anchors, torch.ones_like(anchors, dtype=torch.bool))[0]
        return F.linear(hidden[:, 1:], self.lm_w).float(), prompt_len

    def grow(self, base, first, t: int, prev: int, width: int, depth: int):
        rows = base[t - first]  # [g - 1, V']
        depth = min(depth, rows.shape[0])

        def children(j: int, prev_ids: list[int]):
            lg = rows[j].expand(len(prev_ids), -1)
            if self.head.markov_in is not None:
                lg = lg + self.head.markov(torch.tensor(prev_ids))
            return torch.log_softmax(lg, -1).topk(width, dim=-1)

        parent, token, score = [], [], []
        frontier = [-1]
        for d in range(depth):
            beam = frontier if d == 0 else sorted(frontier, key=lambda i: -score[i])[:width]
            top = children(d, [prev if i < 0 else token[i] for i in beam])
            frontier = []
            for r, i in enumerate(beam):
                for v, j in zip(top.values[r].tolist(), top.indices[r].tolist(), strict=True):
                    parent.append(i), token.append(int(self.d2t[j]))
                    score.append((score[i] if i >= 0 else 0.0) + v)
                    frontier.append(len(token) - 1)
        return parent, token, score, {}

    def lead(self, base, first, ids: list[int], t: int, width: int, depth: int, nodes: int,
             cap: int) -> int:
        parent, token, score, _ = self.grow(base, first, t, ids[t], width, depth)
        return _deepest(parent, token, score, ids, t, nodes, cap)


def _deepest(parent, token, score, ids, t, nodes, cap) -> int:
    """The deepest path of the `nodes` best nodes whose tokens equal ids[t + 1 ..] (<= cap)."""
    chosen = set(sorted(range(len(token)), key=lambda i: -score[i])[:nodes])
    cur, a = -1, 0
    while a < cap:
        nxt = [i for i in chosen if parent[i] == cur and token[i] == ids[t + a + 1]]
        if not nxt:
            break
        cur, a = nxt[0], a + 1
    return a


class _Leads:
    """`walk_rounds`' leads, each computed when the walk reads it (where a round starts)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __getitem__(self, i: int) -> int:
        return self.fn(i)


def ngram_lead(ids: list[int], t: int, k: int, cap: int, min_n: int = 1,
               max_n: int = 4) -> int:
    """The round at t of the engine's n-gram drafter (prompt lookup over ids[: t + 1]): its
    leading drafts equal to ids[t + 1 ..] (<= cap)."""
    drafts = propose_ref(ids[: t + 1], min_n, max_n, k)
    a = 0
    while a < min(cap, len(drafts)) and drafts[a] == ids[t + a + 1]:
        a += 1
    return a


def walk(drafter, context, ids, prompt_len, width, depth, nodes, ngram: int = 0) -> dict:
    """`walk_rounds` with the tree's leads; context: the drafter's `context` of the
    sequence; `ngram` > 0: the tree gains a branch of the n-gram drafter's (up to `ngram`)
    drafts from the root (verified beside the tree's nodes; a branch longer than the tree is
    deep reaches past it: offline only, the engine takes G <= D). Returns rounds (that
    drafted), accepted (tokens) and steps (all)."""
    last = len(ids) - 1

    def lead(i: int) -> int:
        t = prompt_len + i
        cap = min(depth, last - t - 1)
        a = drafter.lead(*context, ids, t, width, depth, nodes, cap) if nodes else 0
        return max(a, ngram_lead(ids, t, ngram, min(ngram, last - t - 1))) if ngram else a

    s = walk_rounds(_Leads(lead), prompt_len, len(ids), max(depth, ngram))
    return {"rounds": s["num_drafts"], "accepted": s["num_accepted_tokens"],
            "steps": s["steps"]}


def parse_trees(spec: str) -> list[tuple[int, int, int, int]]:
    """"WxD:N" trees, "WxD:N+gG" with an n-gram branch of up to G drafts; "0xD:0+gG": the
    n-gram drafter alone (k = G)."""
    out = []
    for part in spec.split(","):
        part, _, g = part.partition("+g")
        wd, n = part.split(":")
        w, d = wd.split("x")
        out.append((int(w), int(d), int(n), int(g or 0)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--head", required=True)
    ap.add_argument("--sets", required=True)
    ap.add_argument("--only", default=None, help="comma-separated set names (default: all)")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--trees", default="1x4:4,2x4:8,4x5:16,8x6:32")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="end each output at its EOS, as bench_accept.py does (default: "
                         "max-tokens tokens each, as accept_replay.py)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    loaded = load_model(a.model, device="cpu")
    model = loaded.model
    head = load_head(a.head, model.config)
    block = head_kind(a.head) == "block"
    drafter = (BlockTree(head, model.embed_tokens.weight, model.lm_head_weight) if block
               else TreeDrafter(head, model.embed_tokens.weight,
                                head.lm_head_weight(model.lm_head_weight)))
    trees = parse_trees(a.trees)
    with open(a.sets) as f:
        sets = json.load(f)
    out = {"benchmark": "tree_accept", **run_header(), "model": a.model, "head": a.head,
           "max_tokens": a.max_tokens, "model_shape": model_shape(loaded.config),
           "trees": a.trees, "ignore_eos": not a.stop_at_eos, "sets": {}}
    oracle = TargetOracle(model, head.head_config.hidden_layer_ids, 2048, 1, 2048, "cpu",
                          torch.float32, "torch")
    for name, prompts in sets.items():
        if a.only and name not in a.only.split(","):
            continue
        prompts = pick(prompts, a.num_prompts, "spread")
        engine = LLMEngine(EngineConfig(
            model=a.model, device="cpu", cache=CacheConfig(kv_cache_tokens=len(prompts) * 1200),
            scheduler=SchedulerConfig(max_num_seqs=len(prompts), max_num_batched_tokens=16384)),
            loaded=loaded)
        t0 = time.time()
        outs = engine.generate(prompts, SamplingParams(max_tokens=a.max_tokens, temperature=0,
                                                       ignore_eos=not a.stop_at_eos))
        del engine
        print(f"{name}: {len(prompts)} plain outputs in {time.time() - t0:.0f} s", flush=True)
        name_of = {tr: f"{tr[0]}x{tr[1]}:{tr[2]}" + (f"+g{tr[3]}" if tr[3] else "")
                   for tr in trees}
        sums = {name_of[tr]: {"rounds": 0, "accepted": 0, "steps": 0} for tr in trees}
        chain = {"num_drafts": 0, "num_accepted_tokens": 0}
        for prompt, o in zip(prompts, outs, strict=True):
            ids = list(prompt) + o.token_ids
            streams, logits = oracle([ids])
            context = (drafter.context(streams, ids, len(prompt)) if block
                       else drafter.context(streams, ids))
            for tr in trees:
                r = walk(drafter, context, ids, len(prompt), *tr)
                for key in r:
                    sums[name_of[tr]][key] += r[key]
            if block:  # no chain replay to check against: its 1x(g-1) tree is the block
                continue
            mask = torch.zeros(1, len(ids), dtype=torch.bool)
            mask[0, len(prompt) - 1 : len(ids) - 1] = True
            _, _, preds = ttt_loss(head, model.embed_tokens.weight, drafter.lm_w, streams[None],
                                   logits[None], torch.tensor([ids]), mask, 4, 0.8)
            c = replay_acceptance(preds[:, 0], ids, len(prompt), 4)
            for key in chain:
                chain[key] += c[key]
        print(f"{name}: walked in {time.time() - t0:.0f} s", flush=True)
        res = {"num_prompts": len(prompts)}
        if not block:
            res["chain_k4_replayed"] = 1 + chain["num_accepted_tokens"] / chain["num_drafts"]
        for key, s in sums.items():
            res[key] = {"accept_length": 1 + s["accepted"] / max(s["rounds"], 1),
                        "tokens_per_step": (s["accepted"] + s["steps"]) / max(s["steps"], 1),
                        **s}
        out["sets"][name] = res
        print(name, json.dumps({k: (round(v["accept_length"], 3) if isinstance(v, dict)
                                    else round(v, 3) if isinstance(v, float) else v)
                                for k, v in res.items()}), flush=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
