"""An EAGLE-3-style chain head: a small decoder that drafts from the target's hidden states.

The target's residual streams after three of its layers (low, middle, high: `hidden_layer_ids`)
are concatenated per token and projected by `fc` to the model width: the token's *feature*.
The head's entry at position p reads (the feature of position p - 1, the token at p): its first
layer normalises the token's embedding (`input_layernorm`) and the feature (`hidden_norm`),
concatenates them into its q/k/v projection (2 x hidden -> heads), and keeps the feature as
the residual stream; more layers are plain decoder layers. The stream after the last layer
(before `norm`) is the feature the next chain step reads in place of the target's; after
`norm` an LM head gives the next token. Position 0 reads a zero feature.

The target's embedding is shared, and so is its LM head unless the head has a reduced draft
vocabulary: then `d2t` [draft_vocab] (the target id of each draft token) maps draft logits onto
the target's vocabulary, and the LM head is the head's own `lm_head` [draft_vocab, hidden], or,
with `share_lm_head`, the target's rows `d2t` (no weights of its own: the drafter gathers them
once when it binds). A reduced vocabulary makes each draft step's LM head that much smaller,
which is most of a draft step's bytes on a small target; drafts outside it are never proposed.

Head directories (save, load, random heads) are models/heads.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from draftgraph.attention.backend import AttentionBackend, ForwardBatch
from draftgraph.distributed.parallel import TPInfo
from draftgraph.kernels import gemv, ops
from draftgraph.models.config import ModelConfig
from draftgraph.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    RMSNorm,
    rope_cos_sin_cache,
    run_layers,
)


@dataclass
class HeadShape:
    """What every drafter head records (its config.json): the target it was built for, which
    of its layers it reads, and its own decoder's shape (0: the target's)."""

    hidden_layer_ids: list[int]  # target layers whose output streams the head reads
    target_hidden_size: int
    target_vocab_size: int
    kind: str = "chain"  # "chain" (this module) or "block" (models/block_head.py)
    num_layers: int = 1
    num_attention_heads: int = 0  # 0: the target's
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0

    def validate_for(self, target: ModelConfig) -> None:
        """ValueError naming the mismatch when this head cannot draft for `target`."""
        if (self.target_hidden_size, self.target_vocab_size) != (target.hidden_size,
                                                                 target.vocab_size):
            raise ValueError(
                f"--draft-head was built for a target of hidden size {self.target_hidden_size} "
                f"and {self.target_vocab_size} tokens; this target has "
                f"{target.hidden_size} and {target.vocab_size}")
        bad = [i for i in self.hidden_layer_ids
               if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ValueError(f"--draft-head reads target layers {bad}; the target has "
                             f"{target.num_hidden_layers} layers")

    def model_config(self, target: ModelConfig) -> ModelConfig:
        """The head's decoder shape: the target's, with the head's overrides."""
        return dataclasses.replace(
            target, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads or target.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads or target.num_key_value_heads,
            head_dim=self.head_dim or target.head_dim,
            intermediate_size=self.intermediate_size or target.intermediate_size,
            sliding_window=None, layer_types=[], name=f"{self.kind}-head")


@dataclass
class HeadConfig(HeadShape):
    """The shape of a chain head and the target it was built for."""

    draft_vocab_size: int = 0  # 0: the target's vocabulary and LM head
    # with a reduced vocabulary: its LM head is the target's rows d2t (no lm_head of its own)
    share_lm_head: bool = False

    def validate_for(self, target: ModelConfig) -> None:
        super().validate_for(target)
        if not 0 <= self.draft_vocab_size <= target.vocab_size:
            raise ValueError(f"--draft-head draft vocabulary {self.draft_vocab_size} exceeds "
                             f"the target's {target.vocab_size} tokens")
        if self.share_lm_head and not self.draft_vocab_size:
            raise ValueError("--draft-head share_lm_head needs a reduced draft vocabulary "
                             "(draft_vocab_size > 0): without one the head shares the "
                             "target's whole LM head already")


def default_layer_ids(num_layers: int) -> list[int]:
    """Low, middle and high target layers (EAGLE-3's choice): 2, L // 2, L - 3."""
    return sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)})


class HeadFirstLayer(nn.Module):
    """The first head layer: q/k/v read [norm(embedding), norm(feature)]; the feature is the
    residual stream."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, 0, tp)
        attn = self.self_attn
        attn.qkv_proj = nn.Linear(2 * h, attn.q_size + 2 * attn.kv_size,
                                  bias=cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp)

    def qkv(self, embeds: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        h = embeds.shape[-1]
        x = embeds.new_empty(*embeds.shape[:-1], 2 * h)  # the norms write its halves
        ln, hn = self.input_layernorm, self.hidden_norm
        ops.rms_norm(embeds, ln.weight, ln.eps, out=x[..., :h])
        ops.rms_norm(feat, hn.weight, hn.eps, out=x[..., h:])
        qkv = self.self_attn.qkv_proj
        return gemv.linear(x, qkv.weight, qkv.bias)

    def forward(self, embeds, feat, fb, backend, cos_sin_cache):
        attn = self.self_attn
        h = attn.o_proj(attn.attend(self.qkv(embeds, feat), fb, backend, cos_sin_cache))
        h, residual = self.post_attention_layernorm(h, feat)
        return self.mlp(h), residual


def store_kv_only(attn: LlamaAttention, qkv: torch.Tensor, fb: ForwardBatch,
                  backend: AttentionBackend, cos_sin_cache: torch.Tensor) -> None:
    """RoPE and the KV store of one attention layer, without attention (KV catch-up)."""
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.view(-1, attn.num_heads, attn.head_dim)
    k = k.view(-1, attn.num_kv_heads, attn.head_dim)
    v = v.view(-1, attn.num_kv_heads, attn.head_dim)
    if q.is_cuda and backend.fused_kv_store:
        from draftgraph.kernels.elementwise import rope_and_store_kv

        pool = backend.kv_pool
        rope_and_store_kv(q, k, v, fb.positions, cos_sin_cache, pool.k_buffers[attn.layer_id],
                          pool.v_buffers[attn.layer_id], fb.out_cache_loc)
        return
    _, k = ops.rope(q, k, fb.positions, cos_sin_cache)
    backend.store_kv(k, v, attn.layer_id, fb)


class ChainHead(nn.Module):
    def __init__(self, head_cfg: HeadConfig, target: ModelConfig) -> None:
        super().__init__()
        head_cfg.validate_for(target)
        self.head_config = head_cfg
        self.config = cfg = head_cfg.model_config(target)
        tp = TPInfo()  # replicated on every rank
        h = cfg.hidden_size
        self.fc = nn.Linear(len(head_cfg.hidden_layer_ids) * h, h, bias=False)
        self.layers = nn.ModuleList(
            [HeadFirstLayer(cfg, tp)]
            + [LlamaDecoderLayer(cfg, i, tp) for i in range(1, cfg.num_hidden_layers)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        dv = head_cfg.draft_vocab_size
        self.lm_head = (nn.Linear(h, dv, bias=False) if dv and not head_cfg.share_lm_head
                        else None)
        self.register_buffer("d2t", torch.arange(dv, dtype=torch.int64))  # [dv] target ids
        self.register_buffer("cos_sin_cache",
                             rope_cos_sin_cache(cfg, cfg.max_position_embeddings),
                             persistent=False)

    @property
    def num_local_heads(self) -> int:
        return self.layers[0].self_attn.num_heads

    @property
    def num_local_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    def features(self, streams: torch.Tensor) -> torch.Tensor:
        """The target's concatenated streams [T, n * hidden] -> features [T, hidden]."""
        return gemv.linear(streams, self.fc.weight)

    def forward(self, embeds: torch.Tensor, feat: torch.Tensor, fb: ForwardBatch,
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) after the last layer, before `norm`: the next feature is x + residual
        (`logits` takes the pair)."""
        x, residual = self.layers[0](embeds, feat, fb, backend, self.cos_sin_cache)
        return run_layers(self.layers[1:], x, residual, fb, backend, self.cos_sin_cache)

    def write_kv(self, embeds: torch.Tensor, feat: torch.Tensor, fb: ForwardBatch,
                 backend: AttentionBackend) -> None:
        """The head's KV of these entries, nothing else: the last layer stops at its store."""
        first, cache = self.layers[0], self.cos_sin_cache
        if len(self.layers) == 1:
            store_kv_only(first.self_attn, first.qkv(embeds, feat), fb, backend, cache)
            return
        x, residual = run_layers(self.layers[1:-1], *first(embeds, feat, fb, backend, cache), fb,
                                 backend, cache)
        last = self.layers[-1]
        h, _ = last.input_layernorm(x, residual)
        qkv = last.self_attn.qkv_proj
        store_kv_only(last.self_attn, gemv.linear(h, qkv.weight, qkv.bias), fb, backend, cache)

    @property
    def reduced_vocab(self) -> bool:
        """Whether it drafts over a reduced vocabulary (logits over `d2t`'s tokens)."""
        return self.head_config.draft_vocab_size > 0

    def lm_head_weight(self, target_lm_head: torch.Tensor) -> torch.Tensor:
        """Its LM head [V', hidden]: its own, or the target's (its rows d2t when shared over a
        reduced vocabulary: a gather, so bind-time work, not per step)."""
        if self.lm_head is not None:
            return self.lm_head.weight
        return target_lm_head.index_select(0, self.d2t) if self.reduced_vocab \
            else target_lm_head

    def logits(self, x: torch.Tensor, residual: torch.Tensor,
               lm_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [T, V'], next feature x + residual [T, hidden]) through `lm_head`
        (`lm_head_weight`): V' is the draft vocabulary (map with `d2t`) or the target's.
        The logits stay in the model's dtype: every reader (argmax, top-W, draft sampling,
        their twins) reads them in fp32 itself, so a bf16 head saves a conversion launch a
        step and gets the same drafts."""
        return gemv.rmsnorm_gemv(x, self.norm.weight, self.norm.eps, lm_head, None, residual)
