"""Training a chain head (models/chain_head.py) against the engine's own target forward.

Data, the frozen target (`TargetOracle`: the head's inputs and soft labels from the target's
own extend forward) and the optimizer loop are train/loop.py's, shared with the block trainer.

EAGLE-3-style training-time test over `ttt_steps` levels, as the head drafts at inference:
level 0 at position p reads (target feature of p - 1, token p), as a chain's step 0 does at the
last token; level j reads (level j - 1's own stream at p - 1, token p) and attends to the
level-0 entries up to p - j plus its own chain's entries at p - j + 1 .. p (levels 1 .. j), the
way chain step j sees the sequence's entries and the chain's own. Every level predicts the
target's distribution at p (forward KL, level j weighted decay ** j), on response positions.
Top-1 agreement with the target per level estimates acceptance. Heads of any number of
layers train the same way (every layer runs at every level; the first is EAGLE-3's fused
input layer, the others plain decoder layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftgraph.kernels.ops import rope_ref
from draftgraph.models.chain_head import ChainHead
from draftgraph.train.loop import (  # noqa: F401  (re-exported: the trainer's public names)
    LoopConfig,
    OracleBatch,
    Sequence,
    TargetOracle,
    TrainState,
    batches,
    plot_history,
    regenerate,
    train_loop,
    walk_rounds,
)
from draftgraph.train.loop import rms as _rms


@dataclass
class TrainConfig(LoopConfig):
    ttt_steps: int = 4  # levels of the training-time test
    decay: float = 0.8  # loss weight of level j: decay ** j


# ---- the head under training ---------------------------------------------------------------

def _ttt_attend(attn, qkv: torch.Tensor, kv: list, j: int, pos: torch.Tensor,
                cos_sin: torch.Tensor) -> torch.Tensor:
    """One attention layer of level j over [B, S] entries: q/k/v from qkv [B, S, q + 2 kv];
    this level's keys and values are appended to `kv` (this layer's, one pair per level). Level
    j at position p attends to the level-0 entries up to p - j and to the chain's own entries at
    p - j + jj (levels jj = 1 .. j), exactly the entries chain step j sees. Returns
    [B, S, q_size]."""
    b, s, _ = qkv.shape
    hq, hk, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q, k = rope_ref(q.reshape(b * s, hq, d), k.reshape(b * s, hk, d), pos.repeat(b), cos_sin)
    q = q.view(b, s, hq, d).transpose(1, 2)  # [B, Hq, S, D]
    k = k.view(b, s, hk, d).transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    v = v.view(b, s, hk, d).transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    kv.append((k, v))
    scale = d ** -0.5
    keys0, values0 = kv[0]
    sc0 = (q @ keys0.transpose(-1, -2)).float() * scale  # [B, Hq, S, S]
    sc0 = sc0.masked_fill(pos[None, :] > (pos[:, None] - j), float("-inf"))
    diag, diag_v = [], []
    for jj in range(1, j + 1):  # the chain's own entries: level jj at p - j + jj
        shift = j - jj
        kk = torch.roll(kv[jj][0], shifts=shift, dims=2)
        vv = torch.roll(kv[jj][1], shifts=shift, dims=2)
        sc = (q * kk).sum(-1).float() * scale  # [B, Hq, S]
        diag.append(sc.masked_fill(pos < shift, float("-inf")))
        diag_v.append(vv)
    scores = torch.cat([sc0] + [t[..., None] for t in diag], dim=-1)
    w = torch.softmax(scores, dim=-1).to(v.dtype)
    o = w[..., :s] @ values0
    for i, vv in enumerate(diag_v):
        o = o + w[..., s + i : s + i + 1] * vv
    return o.transpose(1, 2).reshape(b, s, attn.q_size)


def _mlp_block(layer, h: torch.Tensor, eps: float) -> torch.Tensor:
    """The stream after a decoder layer's MLP: h + down(silu(gate) * up) of norm(h)."""
    g, u = F.linear(_rms(h, layer.post_attention_layernorm.weight, eps),
                    layer.mlp.gate_up_proj.weight).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, layer.mlp.down_proj.weight) + h


def ttt_streams(head: ChainHead, embed_w: torch.Tensor, streams: torch.Tensor,
                tokens: torch.Tensor, levels: int) -> list[torch.Tensor]:
    """The head's output streams (before `norm`) [B, S, H] of each training-time-test level:
    level j at position p is chain step j of a chain begun at p - j (level 0 reads the target's
    feature of p - 1 and token p; level j > 0 its level j - 1 stream at p - 1 and token p).
    streams [B, S, n * H] are the target's captured streams, tokens [B, S]. Every layer of the
    head runs at every level: the first reads [norm(embedding), norm(feature)], the others are
    plain decoder layers."""
    first, eps = head.layers[0], head.config.rms_norm_eps
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    cos_sin = head.cos_sin_cache
    emb = _rms(F.embedding(tokens, embed_w), first.input_layernorm.weight, eps)
    feats = head.fc(streams)  # [B, S, H]: the target's feature of each position
    feat_in = torch.cat([torch.zeros_like(feats[:, :1]), feats[:, :-1]], dim=1)  # of p - 1
    kv: list[list] = [[] for _ in head.layers]  # per layer: (keys, values) per level
    out = []
    for j in range(levels):
        x = torch.cat([emb, _rms(feat_in, first.hidden_norm.weight, eps)], dim=-1)
        attn = first.self_attn
        qkv = F.linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias)
        o = _ttt_attend(attn, qkv, kv[0], j, pos, cos_sin)
        stream = _mlp_block(first, F.linear(o, attn.o_proj.weight) + feat_in, eps)
        for li, layer in enumerate(head.layers[1:], 1):
            attn = layer.self_attn
            qkv = F.linear(_rms(stream, layer.input_layernorm.weight, eps),
                           attn.qkv_proj.weight, attn.qkv_proj.bias)
            o = _ttt_attend(attn, qkv, kv[li], j, pos, cos_sin)
            stream = _mlp_block(layer, F.linear(o, attn.o_proj.weight) + stream, eps)
        out.append(stream)
        feat_in = torch.cat([torch.zeros_like(stream[:, :1]), stream[:, :-1]], dim=1)
    return out


def ttt_loss(head: ChainHead, embed_w: torch.Tensor, lm_w: torch.Tensor,
             streams: torch.Tensor, target_logits: torch.Tensor, tokens: torch.Tensor,
             loss_mask: torch.Tensor, levels: int, decay: float):
    """streams [B, S, n * H], target_logits [B, S, V], tokens [B, S], loss_mask [B, S] (bool:
    position p's next token is a response token). The LM head and the loss run on the masked
    positions alone. Returns (loss, per-level top-1 agreement with the target's argmax over its
    whole vocabulary, the head's greedy drafts [levels, B, S]: target ids at the masked
    positions, -1 elsewhere, for `replay_acceptance`)."""
    b, s = tokens.shape
    eps = head.config.rms_norm_eps
    rows = loss_mask.flatten().nonzero().squeeze(1)  # [N] the masked (b, p), flattened
    row_pos = torch.arange(s, device=tokens.device).repeat(b)[rows]  # [N]
    with torch.no_grad():
        t_logits = target_logits.reshape(b * s, -1)[rows].float()  # [N, V]
        top_t = t_logits.argmax(-1)  # over the target's whole vocabulary
        if head.reduced_vocab:  # the target over the draft vocabulary
            t_logits = t_logits.index_select(-1, head.d2t)
        p_t = F.softmax(t_logits, dim=-1)
        logp_t = F.log_softmax(t_logits, dim=-1)
        del t_logits
    total = torch.zeros((), device=tokens.device)
    weight_sum, agree = 0.0, []
    preds = torch.full((levels, b * s), -1, dtype=torch.int64, device=tokens.device)
    for j, stream in enumerate(ttt_streams(head, embed_w, streams, tokens, levels)):
        h = stream.reshape(b * s, -1)[rows]  # [N, H]
        logits = F.linear(_rms(h, head.norm.weight, eps), lm_w)  # [N, V']
        live = row_pos >= j  # level j drafts from a chain begun at p - j
        logq = F.log_softmax(logits.float(), dim=-1)
        kl = (p_t * (logp_t - logq)).sum(-1)  # [N]
        n = live.sum().clamp_min(1)
        total = total + decay ** j * (kl * live).sum() / n
        weight_sum += decay ** j
        with torch.no_grad():
            top_q = logits.argmax(-1)
            if head.reduced_vocab:
                top_q = head.d2t[top_q]
            agree.append(((top_q == top_t) & live).sum().item() / n.item())
            preds[j, rows] = top_q
    return total / weight_sum, agree, preds.view(levels, b, s)


def expected_accept_length(agree: list[float]) -> float:
    """1 + sum_j prod_{i <= j} a_i: the accept length if level j's drafts were accepted at
    rate a_j independently (greedy)."""
    out, run = 1.0, 1.0
    for a in agree:
        run *= a
        out += run
    return out


def replay_acceptance(preds: torch.Tensor, ids: list[int], prompt_len: int,
                      k: int) -> dict:
    """Greedy chain speculation walked along a greedy sequence `ids` as the engine runs it
    (`walk_rounds`): a round starting at t drafts preds[j, t + j] for j < k, accepted while
    each equals the next token. preds [levels >= k, S]: the head's greedy drafts
    (`ttt_loss`). Returns the engine's statistics (num_drafts, num_draft_tokens,
    num_accepted_tokens, accepted_per_pos, steps): on the target's own greedy outputs, what
    the engine reports, up to rounding near ties."""
    p, last = preds.tolist(), len(ids) - 1
    leads = []
    for t in range(prompt_len, last):
        a = 0
        while a < k and t + a < last and p[a][t + a] == ids[t + a + 1]:
            a += 1
        leads.append(a)
    return walk_rounds(leads, prompt_len, len(ids), k)


# ---- the loop --------------------------------------------------------------------------------

def train_head(head: ChainHead, target_model, seqs: list[Sequence], cfg: TrainConfig,
               out_dir: str, device, dtype, backend: str, progress: bool = True,
               eval_seqs: list[Sequence] | None = None) -> TrainState:
    """Train `head` in place (fp32 master weights) for cfg.steps steps over `seqs`; writes
    checkpoint.pt, the head directory `head/`, history.json and loss.png to out_dir; resumes
    from out_dir/checkpoint.pt when it is there. With `eval_seqs` (held-out sequences), the
    same loss on them every cfg.eval_every steps, and the best head in `best/`."""
    if not isinstance(head, ChainHead):
        raise ValueError(f"train_head trains chain heads, got {type(head).__name__}")
    head.head_config.validate_for(target_model.config)
    embed_w = target_model.embed_tokens.weight.detach()
    lm_w = head.lm_head_weight(target_model.lm_head_weight.detach())

    def loss_fn(batch: OracleBatch, step: int):
        tok = batch.padded("tokens")
        mask = torch.zeros_like(tok, dtype=torch.bool)
        for i, x in enumerate(batch.seqs):
            mask[i, x.prompt_len - 1 : len(x.ids) - 1] = True
        loss, agree, preds = ttt_loss(head, embed_w, lm_w, batch.padded("streams"),
                                      batch.padded("logits"), tok, mask, cfg.ttt_steps,
                                      cfg.decay)
        # the engine's greedy acceptance along these sequences (the target's own outputs),
        # walked on the host: one copy of the drafts, not one read per sequence
        preds = preds.cpu()
        walks = [replay_acceptance(preds[:, i], x.ids, x.prompt_len, cfg.ttt_steps)
                 for i, x in enumerate(batch.seqs)]
        rounds = sum(w["num_drafts"] for w in walks)
        accepted = sum(w["num_accepted_tokens"] for w in walks)
        return loss, {"agree": agree, "accept_estimate": expected_accept_length(agree),
                      "accept_replayed": 1 + accepted / max(rounds, 1), "rounds": rounds,
                      "tokens": int(mask.sum())}

    return train_loop(head, target_model, seqs, cfg, out_dir, device, dtype, backend, loss_fn,
                      desc="train chain head", loss_label="forward KL (level-weighted)",
                      agree_label="top-1 agree, level {}", progress=progress,
                      eval_seqs=eval_seqs)
