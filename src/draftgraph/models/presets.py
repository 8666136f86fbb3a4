"""Random-weight shape presets (`random:<name>`): real model shapes without a checkpoint, for
benchmarks and tests. Weights are drawn on the target device in the target dtype."""

from __future__ import annotations

import copy

import torch

from draftgraph.distributed.parallel import TPInfo
from draftgraph.models.config import ModelConfig
from draftgraph.models.llama import LlamaForCausalLM, unfuse_weight

# The rope cos/sin cache of a random model covers this many positions unless asked otherwise.
DEFAULT_PRESET_MAX_LEN = 8192

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
        eos_token_ids=[2], name="tiny",
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
        eos_token_ids=[2], name="smollm2-135m",
    ),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_ids=[128001, 128008, 128009], name="llama-3.2-1b",
    ),
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
        max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_ids=[128001, 128008, 128009], name="llama-3.1-8b",
    ),
}


def preset_config(name: str) -> ModelConfig:
    """A copy of the preset's config; ValueError listing the presets for an unknown name."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)} "
                         "(use random:<preset>)")
    return copy.deepcopy(PRESETS[name])


def fill_random(name: str, p: torch.Tensor, gen: torch.Generator) -> None:
    """Norms 1, biases 0, every other weight N(0, 0.02) (random presets and heads)."""
    if name.endswith("norm.weight"):
        p.fill_(1.0)
    elif name.endswith("bias"):
        p.zero_()
    else:
        p.normal_(0.0, 0.02, generator=gen)


@torch.no_grad()
def init_random_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """In place: norms 1, biases 0, every other weight N(0, 0.02), drawn on the model's device
    and in its dtype (no host copy), from a generator seeded with `seed`.

    A tensor-parallel rank draws the single-rank model's tensors, one at a time in the same
    order, and keeps its shard, so every TP size gets the same weights."""
    p0 = next(model.parameters())
    gen = torch.Generator(device=p0.device).manual_seed(seed)
    if model.tp.size == 1:
        for name, p in model.named_parameters():
            fill_random(name, p, gen)
        return
    with torch.device("meta"):
        full = LlamaForCausalLM(model.config, TPInfo())

    def draws():
        for name, meta in full.named_parameters():
            t = torch.empty(meta.shape, device=p0.device, dtype=p0.dtype)
            fill_random(name, t, gen)
            yield from unfuse_weight(model.config, name, t)

    model.load_weights(draws())
