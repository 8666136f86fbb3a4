"""Llama-family decoder over flat token batches.

The forward takes `input_ids [num_tokens]` and a `ForwardBatch` whose metadata (positions,
KV index lists) the attention backend has built; no padded [B, S] tensors anywhere.
Projections are fused at load time: q/k/v into `qkv_proj`, gate/up into `gate_up_proj`.

Tensor parallelism (`tp`, a `TPInfo`; default: this process's group, size 1 without one):
qkv and gate_up are column-parallel (each rank holds its heads' / its intermediate rows), o and
down row-parallel with one all-reduce each, the embedding and LM head vocab-parallel
(`compute_logits` all-gathers the full vocabulary on every rank). Heads split by KV group,
possibly unevenly (distributed/sharding.py); `num_local_heads` / `num_local_kv_heads` size the
KV pool and attention backend. `load_weights` takes full HF tensors and keeps this rank's shard.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftgraph.attention.backend import AttentionBackend, ForwardBatch
from draftgraph.distributed.layers import (
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_vocab_rows,
    parallel_lm_head,
)
from draftgraph.distributed.parallel import TPInfo, current_tp
from draftgraph.distributed.sharding import attention_shard, split_evenly, vocab_shard
from draftgraph.kernels import gemv, ops
from draftgraph.models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] fp32, with Llama-3 or linear scaling applied."""
    dim = cfg.head_dim
    # on the CPU whatever the default device: under `torch.device("meta")` (loader.empty_model)
    # torch's arange takes a path that imports torch._dynamo, 1.4-3 s of every start (the
    # callers move the result)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64,
                                                      device="cpu") / dim))
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
    """[max_pos, head_dim] fp32: cos in the first half, sin in the second; on the default
    device (computed on the CPU; left there when the default is meta, whose tensors hold no
    values anyway)."""
    inv_freq = rope_inv_freq(cfg).double()
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64, device="cpu"), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()
    device = torch.get_default_device()
    return cache if device.type == "meta" else cache.to(device)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual=None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPInfo) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.sliding = cfg.is_sliding(layer_id)
        shard = attention_shard(cfg.num_attention_heads, cfg.num_key_value_heads, tp.size,
                                tp.rank)
        self.num_heads = shard.num_q_heads  # this rank's heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, tp)

    def forward(self, x, fb: ForwardBatch, backend: AttentionBackend, cos_sin_cache):
        return self.o_proj(self.attend(self.qkv_proj(x), fb, backend, cos_sin_cache))

    def rotate_and_store(self, h, fb: ForwardBatch, backend: AttentionBackend,
                         cos_sin_cache) -> torch.Tensor | None:
        """Rotated q [T, num_heads, head_dim] from normed rows h, the K/V stored, all in the
        qkv product's epilogue where it can (rows on the tensor-core matmul, a backend with
        the fused KV store: kernels/gemv.py `linear_rope_store`); None elsewhere."""
        if not backend.fused_kv_store:
            return None
        pool = backend.kv_pool
        return gemv.linear_rope_store(
            h, self.qkv_proj.weight, self.qkv_proj.bias, fb.positions, cos_sin_cache,
            pool.k_buffers[self.layer_id], pool.v_buffers[self.layer_id], fb.out_cache_loc,
            self.num_heads, self.num_kv_heads)

    def attend(self, qkv, fb: ForwardBatch, backend: AttentionBackend, cos_sin_cache):
        """qkv [T, q + 2 kv] -> attention output [T, q_size] (RoPE, KV store, attention)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if q.is_cuda and backend.fused_kv_store:
            # one launch rotates q/k and stores k/v into the pool; then attention alone
            from draftgraph.kernels.elementwise import rope_and_store_kv

            pool = backend.kv_pool
            q = rope_and_store_kv(q, k, v, fb.positions, cos_sin_cache,
                                  pool.k_buffers[self.layer_id], pool.v_buffers[self.layer_id],
                                  fb.out_cache_loc)
            o = backend.attend(q, self.layer_id, self.sliding, fb)
        else:
            q, k = ops.rope(q, k, fb.positions, cos_sin_cache, fb.memo)
            o = backend.forward(q, k, v, self.layer_id, self.sliding, fb)
        return o.reshape(-1, self.q_size)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo) -> None:
        super().__init__()
        _, inter = split_evenly(cfg.intermediate_size, tp.size, tp.rank)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, tp)

    def forward(self, x):
        act, silu_mul = self.gate_up(x)
        return self.down_proj(act, silu_mul=silu_mul)

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(silu(gate) * up [M, I], False) where the tensor-core matmul's epilogue does
        SwiGLU; else ([gate | up] [M, 2I], True): SwiGLU is left to the down projection."""
        act = gemv.linear_silu_mul(x, self.gate_up_proj.weight)
        if act is not None:
            return act, False
        return gemv.linear(x, self.gate_up_proj.weight), True

    def split_pays(self, x: torch.Tensor) -> bool:
        """A CPU prefill chunk (more rows than exact rows take alone, dense weights) multiplies
        gate and up separately: MKL's two [M, I] products plus silu * up on contiguous halves
        beat one [M, 2I] product and silu * up on its strided halves (512-token prefill of
        SmolLM2 on 2 cores: 0.83 against 1.00 s, best of 8, interleaved)."""
        return not x.is_cuda and x.shape[0] > gemv.EXACT_ROWS_MAX_M and \
            gemv.dense_form(self.gate_up_proj.weight)

    def split_activation(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ W_gate^T) * (x @ W_up^T) [M, I], the halves of gate_up's weight as views."""
        w = self.gate_up_proj.weight
        inter = w.shape[0] // 2
        act = F.silu(F.linear(x, w[:inter]), inplace=True)  # in place: no second [M, I] buffer
        return act.mul_(F.linear(x, w[inter:]))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPInfo) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp)

    def forward(self, x, residual, fb, backend, cos_sin_cache, normed: bool = False,
                next_norm: RMSNorm | None = None):
        """(x, residual) -> (x, residual, normed): the layer's output and the stream before it.
        normed: x is already input_layernorm(stream) and residual the stream (the layer before
        normalized it in its down projection); the layer does the same with `next_norm` (the
        next layer's input norm) where its down projection's K-chunk combine can, and says so
        in the normed it returns."""
        attn, mlp = self.self_attn, self.mlp
        # single-row steps on a GPU fuse norm into the projections and SwiGLU into down where
        # it is measured to pay (kernels/gemv.py; the row-parallel o and down under TP too,
        # distributed/layers.py); multi-row steps on the tensor-core matmul fuse SwiGLU and the
        # next norm into its epilogues; everything else runs the plain chain
        fuse = not normed and gemv.pays(x.shape[0], attn.qkv_proj.weight)
        ln = self.input_layernorm
        q = None  # rotated q [T, heads, head_dim] where its K/V are already stored
        if fuse and backend.fused_kv_store and cos_sin_cache.shape[-1] == attn.head_dim:
            # norm, qkv, RoPE and the KV store in one launch; then attention alone
            pool = backend.kv_pool
            qkv, residual = gemv.rmsnorm_qkv_rope_triton(
                x, ln.weight, ln.eps, attn.qkv_proj.weight, attn.qkv_proj.bias, residual,
                fb.positions, cos_sin_cache, pool.k_buffers[attn.layer_id],
                pool.v_buffers[attn.layer_id], fb.out_cache_loc, attn.num_heads,
                attn.num_kv_heads)
            q = qkv[:, : attn.q_size].view(-1, attn.num_heads, attn.head_dim)
        elif fuse:
            qkv, residual = gemv.rmsnorm_gemv(x, ln.weight, ln.eps, attn.qkv_proj.weight,
                                              attn.qkv_proj.bias, residual)
        else:
            if normed:
                h = x
            else:
                h, residual = ln(x, residual)
                if residual is None:
                    residual = x
            q = attn.rotate_and_store(h, fb, backend, cos_sin_cache)  # or None
            if q is None:
                qkv = gemv.linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias)
        if q is not None:  # attention alone
            o = backend.attend(q, attn.layer_id, attn.sliding, fb).reshape(-1, attn.q_size)
        else:
            o = attn.attend(qkv, fb, backend, cos_sin_cache)
        h = attn.o_proj(o)
        if fuse:
            gate_up, residual = gemv.rmsnorm_gemv(h, self.post_attention_layernorm.weight,
                                                  self.post_attention_layernorm.eps,
                                                  mlp.gate_up_proj.weight, None, residual)
            return mlp.down_proj(gate_up, silu_mul=True), residual, False
        h, residual = self.post_attention_layernorm(h, residual)
        if mlp.split_pays(h):
            return mlp.down_proj(mlp.split_activation(h)), residual, False
        act, silu_mul = mlp.gate_up(h)
        down = mlp.down_proj
        if next_norm is not None and down.tp.size == 1:
            pair = gemv.linear_rmsnorm(act, down.weight, residual, next_norm.weight,
                                       next_norm.eps, silu_mul=silu_mul)
            if pair is not None:
                return pair[0], pair[1], True
        return down(act, silu_mul=silu_mul), residual, False


def run_layers(layers, x, residual, fb, backend, cos_sin_cache,
               capture: HiddenCapture | None = None):
    """Decoder layers in order: (x, residual) after the last one, before any norm. Each layer
    gets the next one's input norm, which its down projection applies where it can
    (`LlamaDecoderLayer.forward`); `capture` keeps the streams of its layers."""
    normed = False
    for i, layer in enumerate(layers):
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
        x, residual, normed = layer(x, residual, fb, backend, cos_sin_cache, normed=normed,
                                    next_norm=nxt)
        if capture is not None and normed:  # the stream after layer i is the residual now
            capture.write(i, residual, None)
        elif capture is not None:
            capture.write(i, x, residual)
    return x, residual


@dataclass
class HiddenCapture:
    """Where a forward keeps the residual stream (before any norm) after chosen decoder
    layers, for a drafter that reads the target's hidden states (an EAGLE-3 chain head):
    out[t, i * H : (i + 1) * H] is the stream of token t after layer layer_ids[i]."""

    layer_ids: tuple[int, ...]
    out: torch.Tensor  # [max_num_tokens, len(layer_ids) * hidden], persistent

    def write(self, layer_id: int, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        """The stream after layer `layer_id`: x + residual (x itself when residual is None)."""
        h = x.shape[-1]
        for i, lid in enumerate(self.layer_ids):
            if lid == layer_id:
                out = self.out[: x.shape[0], i * h : (i + 1) * h]
                if residual is None:
                    out.copy_(x)
                else:
                    torch.add(x, residual, out=out)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or current_tp()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:  # vocab-parallel like the embedding: [padded vocab shard, hidden]
            self.lm_head = nn.Linear(cfg.hidden_size, self.embed_tokens.num_embeddings,
                                     bias=False)
        self.register_buffer(
            "cos_sin_cache", rope_cos_sin_cache(cfg, cfg.max_position_embeddings),
            persistent=False,
        )

    @property
    def num_local_heads(self) -> int:
        """Query heads of this rank (all of them without tensor parallelism)."""
        return self.layers[0].self_attn.num_heads

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads of this rank: the heads its KV pool holds."""
        return self.layers[0].self_attn.num_kv_heads

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def full_lm_head_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the whole LM head on every rank (under TP the ranks' vocabulary
        shards gathered: a collective, for a drafter's replicated LM head at bind time)."""
        return gather_vocab_rows(self.lm_head_weight, self.config.vocab_size, self.tp)

    def forward(self, input_ids: torch.Tensor, fb: ForwardBatch, backend: AttentionBackend,
                final_norm: bool = True, capture: HiddenCapture | None = None):
        """Hidden states [num_tokens, hidden] after the final norm; with final_norm=False the
        pair (x, residual) before it, for `compute_logits(x, residual)`. `capture` keeps the
        streams of its layers on the way."""
        x = self.embed_tokens(input_ids)
        x, residual = run_layers(self.layers, x, None, fb, backend, self.cos_sin_cache, capture)
        if not final_norm:
            return x, residual
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] fp32, the full vocabulary on every rank. With `residual`,
        hidden is the last layer's output before the final norm: one row on one GPU then runs
        norm and LM head as one fused kernel (kernels/gemv.py)."""
        if residual is not None:
            w = self.lm_head_weight
            if self.tp.size == 1 and gemv.pays(hidden.shape[0], w):
                logits, _ = gemv.rmsnorm_gemv(hidden, self.norm.weight, self.norm.eps, w,
                                              None, residual)
                return logits.float()
            hidden, _ = self.norm(hidden, residual)
        return parallel_lm_head(hidden, self.lm_head_weight, self.config.vocab_size, self.tp)

    # ---- weights -------------------------------------------------------------------------
    _STACKED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...):
        full tensors, of which this rank keeps its shard."""
        cfg = self.config
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
        inter = mlp.down_proj.in_features
        full_rows = {"qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
                     "gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size]}
        shard_sizes = {"qkv_proj": [attn.q_size, attn.kv_size, attn.kv_size],
                       "gate_up_proj": [inter, inter]}
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
                    if tensor.shape[0] != full_rows[fused][shard]:
                        raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match "
                                         f"the config ({full_rows[fused][shard]} rows "
                                         "expected)")
                    with torch.no_grad():
                        param[start : start + sizes[shard]].copy_(self._tp_shard(name, tensor))
                    loaded.add(f"{target}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected weight {name!r} for {cfg.name}")
                param = params[name]
                tensor = self._tp_shard(name, tensor)
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

    def _tp_shard(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full HF tensor `name`: rows of column-parallel projections,
        input columns of row-parallel ones, a zero-padded vocabulary shard of the tables."""
        tp, cfg = self.tp, self.config
        if tp.size == 1:
            return w
        hd = cfg.head_dim
        shard = attention_shard(cfg.num_attention_heads, cfg.num_key_value_heads, tp.size,
                                tp.rank)
        q_cols = (shard.q_start * hd, shard.num_q_heads * hd)
        inter = split_evenly(cfg.intermediate_size, tp.size, tp.rank)
        if ".q_proj." in name:
            return w.narrow(0, *q_cols)
        if ".k_proj." in name or ".v_proj." in name:
            return w.narrow(0, shard.kv_start * hd, shard.num_kv_heads * hd)
        if ".gate_proj." in name or ".up_proj." in name:
            return w.narrow(0, *inter)
        if ".o_proj." in name:
            return w.narrow(1, *q_cols)
        if ".down_proj." in name:
            return w.narrow(1, *inter)
        if name in ("embed_tokens.weight", "lm_head.weight"):
            start, count, padded = vocab_shard(cfg.vocab_size, tp.size, tp.rank)
            out = w.new_zeros(padded, w.shape[1])
            out[:count] = w[start : start + count]
            return out
        return w


def unfuse_weight(cfg: ModelConfig, name: str,
                  tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A full (single-rank) parameter as the HF-named tensors it was fused from:
    `qkv_proj` -> q/k/v_proj, `gate_up_proj` -> gate/up_proj, anything else unchanged."""
    for fused, parts, sizes in (
            ("qkv_proj", ("q_proj", "k_proj", "v_proj"), [cfg.q_size, cfg.kv_size, cfg.kv_size]),
            ("gate_up_proj", ("gate_proj", "up_proj"), [cfg.intermediate_size] * 2)):
        if f".{fused}." in name:
            return [(name.replace(fused, p), t)
                    for p, t in zip(parts, tensor.split(sizes), strict=True)]
    return [(name, tensor)]
