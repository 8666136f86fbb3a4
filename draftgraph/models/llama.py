"""Llama-family decoder over flat token batches.

The forward takes `input_ids [num_tokens]` and a `ForwardBatch` whose metadata (positions,
KV index lists) the attention backend has built; no padded [B, S] tensors anywhere.
Projections are fused at load time: q/k/v into `qkv_proj`, gate/up into `gate_up_proj`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from draftgraph.attention.backend import AttentionBackend, ForwardBatch
from draftgraph.kernels import ops
from draftgraph.models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] fp32, with Llama-3 or linear scaling applied."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    rtype = scaling.get("rope_type", scaling.get("type"))
    if rtype == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif rtype == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rtype not in (None, "default"):
        raise ValueError(f"rope scaling {rtype!r} is not supported (llama3, linear)")
    return inv_freq.float()


def rope_cos_sin_cache(cfg: ModelConfig, max_pos: int) -> torch.Tensor:
    """[max_pos, head_dim] fp32: cos in the first half, sin in the second."""
    inv_freq = rope_inv_freq(cfg).double()
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual=None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.sliding = cfg.is_sliding(layer_id)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(self, x, fb: ForwardBatch, backend: AttentionBackend, cos_sin_cache):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = ops.rope(q, k, fb.positions, cos_sin_cache)
        o = backend.forward(q, k, v, self.layer_id, self.sliding, fb)
        return self.o_proj(o.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, residual, fb, backend, cos_sin_cache):
        h, residual = self.input_layernorm(x, residual)
        if residual is None:
            residual = x
        h = self.self_attn(h, fb, backend, cos_sin_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer(
            "cos_sin_cache", rope_cos_sin_cache(cfg, cfg.max_position_embeddings),
            persistent=False,
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, fb: ForwardBatch,
                backend: AttentionBackend) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm."""
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, fb, backend, self.cos_sin_cache)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] fp32."""
        return (hidden @ self.lm_head_weight.t()).float()

    # ---- weights -------------------------------------------------------------------------
    _STACKED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...)."""
        cfg = self.config
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shard_sizes = {"qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
                       "gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size]}
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            for part, (fused, shard) in self._STACKED.items():
                if f".{part}." in name:
                    target = name.replace(part, fused)
                    sizes = shard_sizes[fused]
                    start = sum(sizes[:shard])
                    param = params[target]
                    if tensor.shape[0] != sizes[shard]:
                        raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match "
                                         f"the config ({sizes[shard]} rows expected)")
                    with torch.no_grad():
                        param[start : start + sizes[shard]].copy_(tensor)
                    loaded.add(f"{target}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected weight {name!r} for {cfg.name}")
                param = params[name]
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != "
                                     f"expected {tuple(param.shape)}")
                with torch.no_grad():
                    param.copy_(tensor)
                loaded.add(name)
        missing = []
        for pname in params:
            fused = pname.split(".")[-2]
            if fused in shard_sizes and not pname.endswith("bias"):
                n = len(shard_sizes[fused])
                if any(f"{pname}#{i}" not in loaded for i in range(n)):
                    missing.append(pname)
            elif fused in shard_sizes:
                if any(f"{pname}#{i}" not in loaded for i in range(3)):
                    missing.append(pname)
            elif pname not in loaded:
                missing.append(pname)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")
