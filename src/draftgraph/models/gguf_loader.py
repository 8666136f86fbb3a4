"""GGUF files (llama.cpp): config from the metadata, dequantised weights under HF names, tokenizer.

Weights: every tensor is dequantised with `gguf.quants.dequantize` to fp32 and cast to the run
dtype one tensor at a time, so peak host memory is one fp32 tensor, not a second model.

llama.cpp's converter permutes the rows of Q and K for the `llama` architecture (interleaved
RoPE pairs instead of HF's rotate-half halves); `unpermute_qk` undoes it, exactly as
transformers' GGUF integration does (`LlamaTensorProcessor._reverse_permute_weights`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Iterator

import numpy as np
import torch

from draftgraph.models.config import ModelConfig
from draftgraph.models.llama import rope_inv_freq
from draftgraph.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")
PERMUTED_QK_ARCHS = ("llama", "mistral")  # convert_hf_to_gguf's LlamaModel.permute

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4


def open_gguf(path: str):
    """A `gguf.GGUFReader` over `path`; a ValueError naming the file if it is not a valid GGUF."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError, ...
        raise ValueError(
            f"{path} is not a valid GGUF file (it may be truncated or corrupt: "
            f"{type(e).__name__}: {e})"
        ) from e


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _require(reader, key: str, path: str):
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"{path}: GGUF metadata has no {key!r}")
    return value


def gguf_architecture(reader, path: str = "") -> str:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{path}: architecture {arch!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    return arch


def _llama3_scaling_from_rope_freqs(cfg: ModelConfig, rope_freqs: np.ndarray,
                                    original_ctx: int | None, path: str) -> dict:
    """Recover Llama-3 rope scaling from llama.cpp's `rope_freqs` tensor (the per-frequency
    divisors the converter precomputes), checking the fit exactly."""
    factor = float(rope_freqs.max())
    candidates = [original_ctx] if original_ctx else [8192]
    for old_ctx in candidates:
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": old_ctx}
        base = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None)).double()
        expect = base / torch.from_numpy(rope_freqs).double()
        got = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=scaling)).double()
        if torch.allclose(got, expect, rtol=1e-5, atol=0):
            return scaling
    raise ValueError(f"{path}: rope_freqs does not match Llama-3 rope scaling "
                     "(factor, low 1, high 4); this rope scaling is not supported")


def gguf_config(reader, path: str = "") -> ModelConfig:
    """ModelConfig from the `<arch>.*` metadata of a GGUF file."""
    arch = gguf_architecture(reader, path)

    def get(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    def need(key):
        return _require(reader, f"{arch}.{key}", path)

    tensors = {t.name: t for t in reader.tensors}
    hidden = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    n_kv = int(get("attention.head_count_kv", n_heads))
    head_dim = int(get("attention.key_length", 0) or hidden // n_heads)
    rot_dim = get("rope.dimension_count")
    if rot_dim is not None and int(rot_dim) != head_dim:
        raise ValueError(f"{path}: partial rotary embedding (rope.dimension_count={rot_dim}, "
                         f"head_dim={head_dim}) is not supported")
    vocab = get("vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else tensors["token_embd.weight"].shape[1]
    n_layers = int(need("block_count"))
    sliding = get("attention.sliding_window")
    if arch == "qwen2":
        sliding = None  # Qwen2 files carry no use_sliding_window; HF's default is off
    eos = _field(reader, "tokenizer.ggml.eos_token_id")

    cfg = ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(eos)] if eos is not None else [],
        name=arch,
    )
    scaling_type = get("rope.scaling.type")
    if scaling_type == "linear":
        cfg.rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"{path}: rope scaling {scaling_type!r} is not supported (llama3, linear)")
    if "rope_freqs.weight" in tensors:
        freqs = np.array(tensors["rope_freqs.weight"].data, dtype=np.float32).reshape(-1)
        if not np.all(freqs == 1.0):
            ctx = get("rope.scaling.original_context_length")
            cfg.rope_scaling = _llama3_scaling_from_rope_freqs(cfg, freqs, ctx, path)
    return cfg


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf's `permute(w, n_head, n_head_kv)` for one of Q (n_head =
    attention heads) or K (n_head = KV heads): rows [h, 2, d/2] <- [h, d/2, 2]."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_to_hf_name(name: str) -> str | None:
    """HF parameter name of a GGUF tensor, or None for tensors the model does not use."""
    if name == "rope_freqs.weight":
        return None  # folded into ModelConfig.rope_scaling
    m = _BLOCK_RE.match(name)
    if m:
        layer, part, kind = m.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    else:
        base, _, kind = name.rpartition(".")
        if base in _TOP_NAMES and kind in ("weight", "bias"):
            return f"{_TOP_NAMES[base]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} has no place in a Llama-family model")


def iter_gguf_weights(reader, cfg: ModelConfig,
                      dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in `dtype`) for each tensor, dequantised, Q/K un-permuted."""
    from gguf.quants import dequantize

    permuted = cfg.name in PERMUTED_QK_ARCHS
    for t in reader.tensors:
        hf_name = gguf_to_hf_name(t.name)
        if hf_name is None:
            continue
        arr = dequantize(t.data, t.tensor_type)  # fp32 numpy; F32 tensors come back memmapped
        w = torch.from_numpy(np.array(arr, dtype=np.float32, copy=not arr.flags.writeable))
        if permuted and ".q_proj." in hf_name:
            w = unpermute_qk(w, cfg.num_attention_heads)
        elif permuted and ".k_proj." in hf_name:
            w = unpermute_qk(w, cfg.num_key_value_heads)
        yield hf_name, w.to(dtype)


# ---- tokenizer ----------------------------------------------------------------------------

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer_splits() -> dict[str, str]:
    """Split regex per `tokenizer.ggml.pre`: ours for Llama 3 and Qwen2, plus transformers'
    table where this transformers version has one."""
    splits = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
              "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_PRE_TOKENIZER_SPLITS,
        )
    except ImportError:
        return splits
    return {**GGUF_PRE_TOKENIZER_SPLITS, **splits}


def _pre_tokenizer(pre: str | None):
    """The pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre` (llama-vocab.cpp)."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"):
        # "\p{N}" then the GPT-2 regex: digits one by one
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    split = _pre_tokenizer_splits().get(pre)
    if split is not None:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return byte_level  # "gpt2" and unknown: the GPT-2 regex


def _byte_level_bpe(reader):
    """A `tokenizers.Tokenizer` for a `gpt2`-type GGUF vocabulary (tokens + merges)."""
    from tokenizers import AddedToken, decoders, processors
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import BPE

    tokens = _field(reader, "tokenizer.ggml.tokens")
    token_types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    raw = RawTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False))
    raw.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre"))
    raw.decoder = decoders.ByteLevel()
    raw.post_processor = processors.ByteLevel(trim_offsets=False)
    raw.add_special_tokens([AddedToken(tok, special=True, normalized=False)
                            for tok, kind in zip(tokens, token_types, strict=True)
                            if kind == _TOKEN_CONTROL])
    raw.add_tokens([AddedToken(tok, special=False, normalized=False)
                    for tok, kind in zip(tokens, token_types, strict=True)
                    if kind == _TOKEN_USER_DEFINED])
    return raw


def gguf_tokenizer(reader, path: str) -> Tokenizer | None:
    """Tokenizer with the file's chat template. `gpt2` (byte-level BPE) vocabularies are built
    here directly; others (sentencepiece `llama`, ...) go through transformers' GGUF support."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokens = _field(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        logger.warning("%s has no tokenizer (tokenizer.ggml.tokens); loading without one", path)
        return None
    model_type = _field(reader, "tokenizer.ggml.model")
    template = _field(reader, "tokenizer.chat_template")

    def special(key: str) -> str | None:
        tid = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[tid] if tid is not None and 0 <= tid < len(tokens) else None

    if model_type == "gpt2":
        raw = _byte_level_bpe(reader)
        add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
        bos = special("bos")
        if add_bos and bos is not None:
            from tokenizers import processors
            bos_id = tokens.index(bos)
            raw.post_processor = processors.Sequence([
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(single=f"{bos}:0 $A:0",
                                              pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                              special_tokens=[(bos, bos_id)]),
            ])
        hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos,
                                     eos_token=special("eos"), unk_token=special("unknown"),
                                     pad_token=special("padding"))
    else:
        d, name = os.path.split(os.path.abspath(path))
        hf = AutoTokenizer.from_pretrained(d, gguf_file=name, local_files_only=True)
    return Tokenizer(hf, chat_template=template)


def gguf_reader_summary(reader) -> str:
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))

