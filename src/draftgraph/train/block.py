"""Training a DSpark-style block head (models/block_head.py) against the engine's own target
forward; data, the frozen target (`TargetOracle`) and the optimizer loop are train/loop.py's.

The training forward computes what the block drafter (spec/block.py) computes at inference,
for many blocks at once. A block anchored at position a of a sequence t_0 .. t_{L-1} is the
drafter's block of a request at seq_lens n = a + 1: rows [t_a, m, ..., m] (m = mask_token_id,
block_size = g rows) at positions a .. a + g - 1; every head layer's queries are the block's
rows, its keys and values the context K/V of positions max(0, a - W) .. a - 1 (the layer's k/v
projections of the context feature `head.context(S_p)` of the target's captured streams, RoPE
at p) followed by the block rows' own, seen non-causally by every row. Anchors are sampled per
sequence among the response (a in prompt_len .. L - 2: the first block at inference is anchored
at the target's first response token), `anchors` per sequence per step (at most `max_blocks`
per step), and all blocks of a batch run as one attention per layer: each sequence's queries
(its blocks' rows) against its context keys and all its blocks' own keys, under a mask (context
key p visible to the block at a when a - W <= p < a; block keys only to their own block).

DSpark loss, per draft j = 1 .. g - 1 (row j predicts t_{a+j}):
  0.1 x CE(head logits, t_{a+j}: the target's greedy token, the regenerated response)
  + 0.9 x TV(head distribution, the target's distribution at a + j - 1)
  + BCE(confidence head, accepted_j), accepted_j = drafts 1 .. j all equal the target's
    greedy tokens (the head's own argmax, detached: exactly the greedy verify's outcome, since
    with teacher forcing a draft that matches makes the Markov head's input the true token);
each row weighted exp(-(j - 1) / g) (DFlash's position decay), averaged over the valid rows
(a + j <= L - 1). The Markov head reads the true token before row j (teacher forcing); the
confidence head reads the detached hidden state and Markov embedding (it calibrates; it does
not steer the drafts). History per step: the loss and its three parts, top-1 agreement per
draft position, the mean greedy accept length of the step's blocks (1 + the leading drafts
that match; no max_draft cap, no confidence cut) and, with a confidence head, the accept
length and draft count after its cut at `confidence_threshold`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftgraph.kernels.ops import rope_ref
from draftgraph.models.block_head import BlockHead
from draftgraph.train.loop import (
    LoopConfig,
    OracleBatch,
    Sequence,
    TrainState,
    rms,
    train_loop,
    walk_rounds,
)


@dataclass
class BlockTrainConfig(LoopConfig):
    anchors: int = 16  # blocks per sequence per step (fewer when its response is short)
    max_blocks: int = 1024  # blocks per step at most (a batch of many short sequences)
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    bce_weight: float = 1.0


def position_weights(block_size: int, device=None) -> torch.Tensor:
    """[block_size - 1] fp32: draft j's loss weight exp(-(j - 1) / block_size)."""
    j = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(j - 1) / block_size)


def sample_anchors(seqs: list[Sequence], anchors: int, gen: torch.Generator, device,
                   max_blocks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [B, A] int64, valid [B, A] bool): up to `anchors` distinct positions per
    sequence in prompt_len .. len - 2 (and at most max(1, max_blocks // B) of them: a step's
    blocks stay under max_blocks, or one per sequence), A = the most any sequence got."""
    if max_blocks is not None:
        anchors = min(anchors, max(1, max_blocks // len(seqs)))
    picks = []
    for s in seqs:
        lo, hi = s.prompt_len, len(s.ids) - 2
        n = max(0, hi - lo + 1)
        picks.append((torch.randperm(n, generator=gen)[:anchors] + lo).sort().values
                     if n else torch.zeros(0, dtype=torch.int64))
    a = max(1, max(len(p) for p in picks))
    out = torch.zeros(len(seqs), a, dtype=torch.int64)
    valid = torch.zeros(len(seqs), a, dtype=torch.bool)
    for i, p in enumerate(picks):
        out[i, : len(p)] = p
        valid[i, : len(p)] = True
    return out.to(device), valid.to(device)


def _rope_k(k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """RoPE of keys alone [T, Hkv, D] (rope_ref with a one-head query riding along)."""
    return rope_ref(k[:, :1], k, positions, cos_sin)[1]


def block_forward(head: BlockHead, embed_w: torch.Tensor, streams: torch.Tensor,
                  tokens: torch.Tensor, anchors: torch.Tensor,
                  valid: torch.Tensor) -> torch.Tensor:
    """The head's hidden states after its final norm, [B, A, g, H], of the blocks anchored at
    `anchors` [B, A] (valid [B, A] bool; invalid blocks attend to themselves alone) of the
    sequences `tokens` [B, S] whose captured target streams are `streams` [B, S, n * H]."""
    hc, cfg = head.head_config, head.config
    eps, g, w = cfg.rms_norm_eps, hc.block_size, hc.window
    b, s = tokens.shape
    a = anchors.shape[1]
    dev = tokens.device
    cos_sin = head.cos_sin_cache
    ctx = rms(head.fc(streams), head.hidden_norm.weight, eps)  # [B, S, H] context features
    ctx_pos = torch.arange(s, device=dev).repeat(b)  # [B * S]
    offs = torch.arange(g, device=dev)
    blk_pos = (anchors[:, :, None] + offs).reshape(b, a * g)  # [B, A * g] block positions
    ids = torch.full((b, a, g), hc.mask_token_id, dtype=torch.int64, device=dev)
    ids[:, :, 0] = tokens.gather(1, anchors)
    x = F.embedding(ids.reshape(b, a * g), embed_w)  # [B, A * g, H]
    # the mask [B, 1, A * g, S + A * g], True = visible: context keys in the block's window,
    # and the keys of the row's own block
    p = torch.arange(s, device=dev)
    anc = anchors[:, :, None, None]  # [B, A, 1, 1]
    see_ctx = ((p >= anc - w) & (p < anc) & valid[:, :, None, None]).expand(b, a, g, s)
    own = torch.eye(a, dtype=torch.bool, device=dev)[None, :, None, :, None]
    see_blk = own.expand(b, a, g, a, g).reshape(b, a, g, a * g)
    mask = torch.cat([see_ctx, see_blk], dim=-1).reshape(b, 1, a * g, s + a * g)
    residual = x
    for layer in head.layers:
        attn = layer.self_attn
        hq, hk, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        wq, wk, wv = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
        bias = attn.qkv_proj.bias
        bq, bk, bv = bias.split([attn.q_size, attn.kv_size, attn.kv_size]) if bias is not None \
            else (None, None, None)
        # the context K/V, as inject_kv writes it (no input norm)
        kc = _rope_k(F.linear(ctx, wk, bk).reshape(b * s, hk, d), ctx_pos, cos_sin)
        vc = F.linear(ctx, wv, bv).reshape(b, s, hk, d)
        h = rms(residual, layer.input_layernorm.weight, eps)
        q, kb = rope_ref(F.linear(h, wq, bq).reshape(b * a * g, hq, d),
                         F.linear(h, wk, bk).reshape(b * a * g, hk, d),
                         blk_pos.reshape(-1), cos_sin)
        vb = F.linear(h, wv, bv).reshape(b, a * g, hk, d)
        keys = torch.cat([kc.view(b, s, hk, d), kb.view(b, a * g, hk, d)], dim=1)
        values = torch.cat([vc, vb], dim=1)
        rep = hq // hk
        keys = keys.transpose(1, 2).repeat_interleave(rep, dim=1)  # [B, Hq, S + A g, D]
        values = values.transpose(1, 2).repeat_interleave(rep, dim=1)
        q = q.view(b, a * g, hq, d).transpose(1, 2)  # [B, Hq, A g, D]
        o = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype),
                                           attn_mask=mask, scale=d ** -0.5)
        o = o.transpose(1, 2).reshape(b, a * g, attn.q_size)
        residual = residual + F.linear(o, attn.o_proj.weight)
        gate, up = F.linear(rms(residual, layer.post_attention_layernorm.weight, eps),
                            layer.mlp.gate_up_proj.weight).chunk(2, dim=-1)
        residual = residual + F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight)
    return rms(residual, head.norm.weight, eps).view(b, a, g, -1)


def draft_logits(head: BlockHead, hidden: torch.Tensor, lm_w: torch.Tensor,
                 prev: torch.Tensor) -> torch.Tensor:
    """Rows 1 .. g - 1 of `hidden` [..., g, H] -> draft logits [..., g - 1, V] fp32, the
    Markov head's correction for `prev` [..., g - 1] (the token before each draft) added."""
    logits = F.linear(hidden[..., 1:, :], lm_w).float()
    if head.markov_in is not None:
        logits = logits + head.markov(prev)
    return logits


def confidence_logit(head: BlockHead, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """The confidence head before its sigmoid ([..., g - 1] fp32; accept_prob = sigmoid of it),
    over detached inputs."""
    x = hidden[..., 1:, :].detach()
    if head.markov_in is not None:
        x = torch.cat([x, head.markov_in(prev).detach().to(x.dtype)], dim=-1)
    return head.confidence(x).float().squeeze(-1)


def dspark_loss(head: BlockHead, embed_w: torch.Tensor, lm_w: torch.Tensor,
                batch: OracleBatch, anchors: torch.Tensor, valid: torch.Tensor,
                cfg: BlockTrainConfig) -> tuple[torch.Tensor, dict]:
    """The loss of the blocks at `anchors` [B, A] (valid [B, A]) of `batch`, and the step's
    metrics (see the module docstring)."""
    hc = head.head_config
    g = hc.block_size
    tokens = batch.padded("tokens")
    b, s = tokens.shape
    dev = tokens.device
    lens = torch.tensor([len(x.ids) for x in batch.seqs], device=dev)
    hidden = block_forward(head, embed_w, batch.padded("streams"), tokens, anchors, valid)
    pos = anchors[:, :, None] + torch.arange(1, g, device=dev)  # [B, A, g - 1] drafts' positions
    rows = valid[:, :, None] & (pos < lens[:, None, None])  # a token to predict
    at = pos.clamp_max(s - 1)
    labels = tokens.gather(1, at.view(b, -1)).view_as(at)  # the target's greedy tokens
    prev = tokens.gather(1, (at - 1).view(b, -1)).view_as(at)  # the token before each draft
    logits = draft_logits(head, hidden, lm_w, prev)  # [B, A, g - 1, V]
    off = torch.tensor(batch.offsets, device=dev)[:, None, None]
    with torch.no_grad():  # the target's distribution at a + j - 1, which predicts a + j
        idx = (off + at - 1).clamp(0, batch.logits.shape[0] - 1)  # [B, A, g - 1] rows of T
        p_t = F.softmax(batch.logits[idx].float(), dim=-1)
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(at)
    tv = 0.5 * (F.softmax(logits, dim=-1) - p_t).abs().sum(-1)
    with torch.no_grad():
        match = (logits.argmax(-1) == labels) & rows
        accepted = match.to(torch.int64).cumprod(-1).bool()  # drafts 1 .. j all match
    wts = position_weights(g, dev) * rows
    norm = wts.sum().clamp_min(1e-6)
    part = {"ce": (ce * wts).sum() / norm, "tv": (tv * wts).sum() / norm}
    loss = cfg.ce_weight * part["ce"] + cfg.tv_weight * part["tv"]
    conf = None
    if head.confidence is not None:
        z = confidence_logit(head, hidden, prev)
        bce = F.binary_cross_entropy_with_logits(z, accepted.float(), reduction="none")
        part["bce"] = (bce * wts).sum() / norm
        loss = loss + cfg.bce_weight * part["bce"]
        conf = z.detach().sigmoid()
    with torch.no_grad():
        n_rows = rows.sum((0, 1)).clamp_min(1)
        blocks = valid.sum().clamp_min(1)
        metrics = {k: v.item() for k, v in part.items()}
        metrics["agree"] = (match.sum((0, 1)) / n_rows).tolist()
        metrics["accept_estimate"] = 1 + accepted.sum().item() / blocks.item()
        if conf is not None:
            kept = ((conf >= hc.confidence_threshold) & rows).to(torch.int64).cumprod(-1)
            metrics["accept_cut"] = 1 + (accepted & kept.bool()).sum().item() / blocks.item()
            metrics["drafts_cut"] = kept.sum().item() / blocks.item()
        metrics["blocks"] = int(valid.sum())
    return loss, metrics


@torch.no_grad()
def replay_blocks(head: BlockHead, embed_w: torch.Tensor, lm_w: torch.Tensor,
                  batch: OracleBatch, max_blocks: int) -> list[dict]:
    """Greedy block speculation walked along each sequence of `batch` (the target's own
    greedy outputs) as the engine runs it (`walk_rounds`): the block anchored at every
    response position (at most max_blocks blocks per forward), its leading drafts that equal
    the sequence, and with a confidence head the drafts its cut keeps. Per sequence, the
    engine's statistics. Exact for acceptance: inside the matched prefix the Markov and
    confidence heads read the true tokens, which are the drafts (the count of drafts proposed
    past a mismatch can differ)."""
    hc = head.head_config
    g, dev = hc.block_size, embed_w.device
    tokens, streams = batch.padded("tokens"), batch.padded("streams")
    s = tokens.shape[1]
    out = []
    for i, x in enumerate(batch.seqs):
        leads, kept = [], []
        for lo in range(x.prompt_len, len(x.ids) - 1, max_blocks):
            anchors = torch.arange(lo, min(len(x.ids) - 1, lo + max_blocks), device=dev)[None]
            hidden = block_forward(head, embed_w, streams[i : i + 1], tokens[i : i + 1],
                                   anchors, torch.ones_like(anchors, dtype=torch.bool))
            pos = anchors[:, :, None] + torch.arange(1, g, device=dev)  # [1, A, g - 1]
            rows = pos < len(x.ids)
            at = pos.clamp_max(s - 1)
            labels = tokens[i : i + 1].gather(1, at.view(1, -1)).view_as(at)
            prev = tokens[i : i + 1].gather(1, (at - 1).view(1, -1)).view_as(at)
            logits = draft_logits(head, hidden, lm_w, prev)
            match = (logits.argmax(-1) == labels) & rows
            leads += match.to(torch.int64).cumprod(-1).sum(-1)[0].tolist()
            if head.confidence is not None:
                conf = confidence_logit(head, hidden, prev).sigmoid()
                keep = (conf >= hc.confidence_threshold) & rows
                kept += keep.to(torch.int64).cumprod(-1).sum(-1)[0].tolist()
        out.append(walk_rounds(leads, x.prompt_len, len(x.ids), g - 1,
                               kept if head.confidence is not None else None))
    return out


def default_mask_token_id(tokenizer, embed_weight: torch.Tensor | None, vocab_size: int) -> int:
    """A reserved special token of the target's tokenizer that chat text never contains, for
    the block's mask rows: among the tokenizer's special tokens, not BOS / EOS / end of turn and
    not in the chat template, with an embedding of ordinary size (a zero or untrained row, like
    some of Llama 3's reserved tokens, would make every mask row alike), preferring names with
    "reserved" or "unused", then the highest id (SmolLM2: 16, <empty_output>). Without a
    tokenizer (random weights), the last id of the vocabulary."""
    if tokenizer is None:
        return vocab_size - 1
    template = tokenizer.chat_template or ""
    taken = set(tokenizer.eos_token_ids) | {tokenizer.bos_token_id}
    added = tokenizer.backend.get_added_tokens_decoder()  # {id: AddedToken}
    cands = [(i, t.content) for i, t in added.items()
             if t.special and i < vocab_size and i not in taken and t.content not in template]
    if embed_weight is not None and cands:
        norms = embed_weight.detach()[: vocab_size].float().norm(dim=-1)
        typical = norms.median().item()
        cands = [(i, c) for i, c in cands if norms[i].item() >= 0.5 * typical]
    if not cands:
        return vocab_size - 1
    return max(cands, key=lambda ic: (("reserved" in ic[1]) or ("unused" in ic[1]), ic[0]))[0]


def train_block_head(head: BlockHead, target_model, seqs: list[Sequence],
                     cfg: BlockTrainConfig, out_dir: str, device, dtype, backend: str,
                     progress: bool = True, eval_seqs: list[Sequence] | None = None,
                     export=None) -> TrainState:
    """Train `head` in place (fp32 master weights) for cfg.steps steps over `seqs` with the
    DSpark loss; writes checkpoint.pt, head/, history.json and loss.png to out_dir; resumes
    from out_dir/checkpoint.pt when it is there. Anchors are drawn from a generator seeded by
    (cfg.seed, step), so a resumed run draws what the uninterrupted one would have. With
    `eval_seqs`, the same loss on them every cfg.eval_every steps, the best head in `best/`.
    `export` (head -> head): what the saved heads are made from the trained one, e.g. its
    reduced-vocabulary form (`models.heads.reduce_vocab`)."""
    if not isinstance(head, BlockHead):
        raise ValueError(f"train_block_head trains block heads, got {type(head).__name__}")
    head.head_config.validate_for(target_model.config)
    embed_w = target_model.embed_tokens.weight.detach()
    lm_w = target_model.lm_head_weight.detach()

    def loss_fn(batch: OracleBatch, step: int):
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        anchors, valid = sample_anchors(batch.seqs, cfg.anchors, gen, embed_w.device,
                                       cfg.max_blocks)
        loss, metrics = dspark_loss(head, embed_w, lm_w, batch, anchors, valid, cfg)
        if step < 0:  # a held-out batch: the engine's walk along it, every position anchored
            walks = replay_blocks(head, embed_w, lm_w, batch, cfg.max_blocks)
            rounds = sum(w["num_drafts"] for w in walks)
            metrics["accept_replayed"] = 1 + sum(w["num_accepted_tokens"]
                                                 for w in walks) / max(rounds, 1)
            metrics["rounds"] = rounds
        return loss, metrics

    return train_loop(head, target_model, seqs, cfg, out_dir, device, dtype, backend, loss_fn,
                      desc="train block head",
                      loss_label="DSpark loss (0.1 CE + 0.9 TV + BCE, position-weighted)",
                      agree_label="top-1 agree, draft {}", agree_first=1, min_response=2,
                      progress=progress, eval_seqs=eval_seqs, export=export)

