"""A tiny random Llama (built with transformers, loaded into draftgraph) for fast engine tests."""

from __future__ import annotations

import types

import torch

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.models.config import ModelConfig
from draftgraph.models.llama import LlamaForCausalLM
from draftgraph.spec.drafter import Drafter, Proposal


def tiny_hf_model(seed: int = 0, vocab: int = 128, sliding_window: int | None = None):
    from transformers import LlamaConfig, MistralConfig, MistralForCausalLM
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if sliding_window:
        cfg = MistralConfig(sliding_window=sliding_window, **kw)
        return MistralForCausalLM(cfg).eval()
    return HFLlama(LlamaConfig(**kw)).eval()


def tiny_loaded(hf):
    cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    model = LlamaForCausalLM(cfg)
    model.load_weights(hf.state_dict().items())
    return types.SimpleNamespace(model=model.eval(), config=cfg, tokenizer=None, source="tiny")


def tiny_engine(hf, max_num_seqs: int = 8, budget: int = 64, kv_tokens: int = 2048,
                page_size: int = 1, spec: SpecConfig | None = None,
                drafter=None, prefix_caching: bool = False) -> LLMEngine:
    config = EngineConfig(
        model="tiny", device="cpu",
        cache=CacheConfig(page_size=page_size, kv_cache_tokens=kv_tokens,
                          enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        spec=spec or SpecConfig(),
    )
    return LLMEngine(config, loaded=tiny_loaded(hf), drafter=drafter)




def tree_accepts(engine) -> list[int]:
    """Drafts accepted by each request of every tree step the engine runs from now on (the
    list fills as it runs)."""
    body, seen = engine.spec_graphs.body, []
    accept = body._accept_tree

    def counted(bs, logits, greedy):
        accept(bs, logits, greedy)
        seen.extend((body.out["accept_lens"][:bs] - 1).tolist())

    body._accept_tree = counted
    return seen


class OracleDrafter(Drafter):
    """Drafts a known future sequence of one request, through the drafter seam: draft j of a
    request with seq_lens n is future[n + j]."""

    name = "oracle"

    def __init__(self, future: list[int], k: int = 4) -> None:
        super().__init__(k)
        self.future = torch.tensor(future + [0] * (k + 1))

    def propose(self, ctx):
        idx = ctx.seq_lens[:, None] + torch.arange(self.k)[None, :]  # [bs, k] positions
        drafts = self.future.to(idx.device)[idx.clamp_max(len(self.future) - 1)]
        return Proposal(drafts, ctx.max_draft.clone())
