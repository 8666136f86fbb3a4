"""A DSpark-style block head: drafts a whole block in one parallel forward.

The block of a request at seq_lens n is the anchor (its last token, position n - 1) followed by
block_size - 1 copies of `mask_token_id` (positions n .. n + block_size - 2); the head's output
at block position j >= 1 is its guess of the token at that position, so one forward gives
block_size - 1 drafts.

Context comes from the target: its residual streams after `hidden_layer_ids` (HiddenCapture),
concatenated per token, projected by `fc` and normalised (`hidden_norm`): the token's *context
feature*. Every draft layer turns the context feature of position p into its K/V at p (its own
k/v projections, RoPE at p) and keeps it in the head's KV pool at the target's slot of p: the
*KV injection* (`inject_kv`, after each verify forward and each eager target forward). The
block's own tokens go through plain decoder layers whose queries see the last `window` context
positions and every key of the block, non-causally (phase DRAFT_BLOCK). In the first layer
every mask row's query is the same vector rotated to its position, so what it looks for cannot
depend on the context (only the keys vary); a second layer's queries carry what the first
found (on the default model a 2-layer head's first draft agreed with the target 0.65 of the
time on held-out responses against 1 layer's 0.48, same data and schedule: NOTES.md).

The target's embedding and LM head are shared; with a reduced draft vocabulary
(`draft_vocab_size` > 0) the drafts are taken over the target tokens `d2t` alone, through the
target's LM-head rows d2t (and the Markov head's rows d2t): their logits are the whole
vocabulary's restricted to d2t, so a head trained over the whole vocabulary keeps its drafts
wherever they fall in d2t, each block's LM head reading V' rows instead of V. Optional, as in
DSpark:
- a low-rank **Markov head** (`markov_rank` r > 0): position j's logits gain
  `markov_out(markov_in[token j-1])`, so the drafts are taken left to right;
- a **confidence head** (`confidence`): sigmoid of a linear map of [h_j; markov_in[token j-1]]
  (h_j alone without a Markov head), the head's estimate that draft j is accepted; a request's
  block is cut at the first draft under `confidence_threshold`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from draftgraph.attention.backend import AttentionBackend, ForwardBatch
from draftgraph.distributed.parallel import TPInfo
from draftgraph.kernels import gemv
from draftgraph.models.chain_head import HeadShape, store_kv_only
from draftgraph.models.config import ModelConfig
from draftgraph.models.llama import LlamaDecoderLayer, RMSNorm, rope_cos_sin_cache, run_layers


@dataclass
class BlockHeadConfig(HeadShape):
    """The shape of a block head and the target it was built for."""

    kind: str = "block"
    block_size: int = 8  # the anchor + block_size - 1 mask tokens: block_size - 1 drafts
    window: int = 512  # context positions a block attends to (the last ones)
    mask_token_id: int = 0  # the target token id whose embedding marks a masked position
    markov_rank: int = 0  # 0: no Markov head
    confidence: bool = False  # a confidence head cuts blocks short
    confidence_threshold: float = 0.5
    draft_vocab_size: int = 0  # 0: the target's vocabulary; else the tokens `d2t`

    def validate_for(self, target: ModelConfig) -> None:
        super().validate_for(target)
        if not 0 <= self.draft_vocab_size <= target.vocab_size:
            raise ValueError(f"block head: draft vocabulary {self.draft_vocab_size} exceeds "
                             f"the target's {target.vocab_size} tokens")
        if not 2 <= self.block_size <= 17:
            raise ValueError(f"block head: block_size must be in 2..17 (1..16 drafts), got "
                             f"{self.block_size} (--block-size)")
        if self.window < 1:
            raise ValueError(f"block head: window must be >= 1, got {self.window} (--window)")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ValueError(f"block head: mask_token_id {self.mask_token_id} is not a token "
                             f"of the target's {target.vocab_size} (--mask-token-id)")
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise ValueError("block head: confidence_threshold must be in [0, 1], got "
                             f"{self.confidence_threshold} (--confidence-threshold)")


class BlockHead(nn.Module):
    def __init__(self, head_cfg: BlockHeadConfig, target: ModelConfig) -> None:
        super().__init__()
        head_cfg.validate_for(target)
        self.head_config = head_cfg
        self.config = cfg = head_cfg.model_config(target)
        tp = TPInfo()  # replicated on every rank
        h, r = cfg.hidden_size, head_cfg.markov_rank
        self.fc = nn.Linear(len(head_cfg.hidden_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.markov_in = nn.Embedding(target.vocab_size, r) if r else None
        # over the draft vocabulary: a reduced head keeps the rows d2t alone
        self.markov_out = nn.Linear(r, head_cfg.draft_vocab_size or target.vocab_size,
                                    bias=False) if r else None
        self.confidence = nn.Linear(h + r, 1) if head_cfg.confidence else None
        if head_cfg.draft_vocab_size:  # (absent otherwise: older heads load as they were)
            self.register_buffer("d2t", torch.arange(head_cfg.draft_vocab_size))  # [V'] int64
        self.register_buffer("cos_sin_cache",
                             rope_cos_sin_cache(cfg, cfg.max_position_embeddings),
                             persistent=False)

    @property
    def block_size(self) -> int:
        return self.head_config.block_size

    @property
    def num_local_heads(self) -> int:
        return self.layers[0].self_attn.num_heads

    @property
    def num_local_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    def context(self, streams: torch.Tensor) -> torch.Tensor:
        """The target's concatenated streams [T, n * hidden] -> context features [T, hidden]."""
        return self.hidden_norm(self.fc(streams))[0]

    def inject_kv(self, streams: torch.Tensor, fb: ForwardBatch,
                  backend: AttentionBackend) -> None:
        """Every layer's context K/V of these tokens (at fb.positions, into fb.out_cache_loc):
        the context feature through the layer's own k/v projections."""
        ctx = self.context(streams)
        for layer in self.layers:
            attn = layer.self_attn
            store_kv_only(attn, attn.qkv_proj(ctx), fb, backend, self.cos_sin_cache)

    def forward(self, embeds: torch.Tensor, fb: ForwardBatch,
                backend: AttentionBackend) -> torch.Tensor:
        """The block's hidden states [T, hidden] after the final norm (fb: DRAFT_BLOCK)."""
        x, residual = run_layers(self.layers, embeds, None, fb, backend, self.cos_sin_cache)
        return self.norm(x, residual)[0]

    @property
    def reduced_vocab(self) -> bool:
        """Whether it drafts over a reduced vocabulary (logits over `d2t`'s tokens)."""
        return self.head_config.draft_vocab_size > 0

    def lm_head_weight(self, target_lm_head: torch.Tensor) -> torch.Tensor:
        """Its LM head [V', hidden]: the target's, or its rows d2t (a gather: bind-time work)."""
        return target_lm_head.index_select(0, self.d2t) if self.reduced_vocab \
            else target_lm_head

    def logits(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] (normed) -> logits [rows, V'] fp32 through `lm_head`
        (`lm_head_weight`: the target's LM head or its rows d2t)."""
        return gemv.gemv(hidden, lm_head).float()

    def markov(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """The Markov head's logit correction [rows, V'] fp32 over the draft vocabulary for
        the (target) tokens before them."""
        return self.markov_out(self.markov_in(prev_tokens)).float()

    def accept_prob(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """The confidence head: [rows] fp32 in (0, 1)."""
        x = hidden if self.markov_in is None else torch.cat(
            [hidden, self.markov_in(prev_tokens)], dim=-1)
        return torch.sigmoid(self.confidence(x).float()).squeeze(-1)
