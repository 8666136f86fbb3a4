"""Tensor parallelism on CPU (gloo, two processes): TP = 2 gives the logits of TP = 1 within
1e-4 and the same greedy tokens, on a tiny random checkpoint and on the default model (whose
9 query / 3 KV heads split unevenly, 6 + 3); shards reassemble the full weights; workers exit
cleanly; `draftgraph generate --tensor-parallel-size 2 --device cpu` works."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import save_tiny_hf_checkpoint, tiny_llama_config
from test_async_scheduling import count_refs

from draftgraph.attention.backend import Phase
from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig, TreeShape
from draftgraph.distributed import current_tp
from draftgraph.distributed.parallel import TPInfo
from draftgraph.distributed.sharding import AttentionShard as S
from draftgraph.distributed.sharding import attention_shard, split_evenly, vocab_shard
from draftgraph.engine.engine import EngineError, LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.models.config import ModelConfig
from draftgraph.models.llama import LlamaForCausalLM
from draftgraph.models.presets import init_random_weights
from draftgraph.runtime import tp_control, tp_worker
from draftgraph.runtime.schema import StepBatch

# fp32 rounding of a different summation order (row-parallel partials all-reduced; SDPA's
# fused CPU kernel blocks each rank's heads its own way) over up to 30 layers; a wrong shard
# is off by O(1)
LOGITS_ATOL = 2e-4


# ---- sharding arithmetic (no processes) ---------------------------------------------------

def test_heads_split_by_kv_group_unevenly_when_kv_heads_do_not_divide():
    # SmolLM2: 9 q heads, 3 kv heads (3 q per kv) over 2 ranks -> kv 2 + 1, q 6 + 3
    assert [attention_shard(9, 3, 2, r) for r in range(2)] == [
        S(0, 6, 0, 2), S(6, 3, 2, 1)]
    # Llama-3.1-8B: 32 q / 8 kv over 2 ranks -> even halves
    assert [attention_shard(32, 8, 2, r) for r in range(2)] == [
        S(0, 16, 0, 4), S(16, 16, 4, 4)]


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    # 8 q / 2 kv over 4 ranks: ranks 0, 1 share kv head 0 (q 0-1, 2-3), ranks 2, 3 kv head 1
    assert [attention_shard(8, 2, 4, r) for r in range(4)] == [
        S(0, 2, 0, 1), S(2, 2, 0, 1), S(4, 2, 1, 1), S(6, 2, 1, 1)]
    with pytest.raises(ValueError, match="--tensor-parallel-size 4"):
        attention_shard(9, 3, 4, 0)  # 4 ranks cannot share 3 kv heads


def test_vocab_and_intermediate_shards_cover_everything_once():
    assert [vocab_shard(11, 2, r) for r in range(2)] == [(0, 6, 6), (6, 5, 6)]
    assert [split_evenly(97, 2, r) for r in range(2)] == [(0, 49), (49, 48)]


def _odd_config() -> ModelConfig:
    # uneven everything: 6 q / 3 kv heads (4 + 2), intermediate 97, vocab 101, q/k/v bias
    return ModelConfig(vocab_size=101, hidden_size=48, intermediate_size=97,
                       num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                       attention_bias=True, tie_word_embeddings=False, name="odd")


def test_rank_shards_reassemble_the_single_rank_weights():
    cfg = _odd_config()
    full = LlamaForCausalLM(cfg)
    init_random_weights(full, seed=3)
    ranks = []
    for r in range(2):  # random TP weights = shards of the TP = 1 random weights
        m = LlamaForCausalLM(cfg, TPInfo(r, 2))
        init_random_weights(m, seed=3)
        ranks.append(dict(m.named_parameters()))
    fp = dict(full.named_parameters())
    hd = cfg.head_dim
    attn = "layers.1.self_attn."
    q, kv = cfg.q_size, cfg.kv_size
    q_heads, kv_heads = [4, 2], [2, 1]  # rank 0 holds kv heads 0-1, rank 1 kv head 2
    for part, (lo, hi) in {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}.items():
        for name in ("qkv_proj.weight", "qkv_proj.bias"):
            rebuilt = []
            for r in range(2):
                n_q, n_kv = q_heads[r] * hd, kv_heads[r] * hd
                assert ranks[r][attn + name].shape[0] == n_q + 2 * n_kv
                off, n = {"q": (0, n_q), "k": (n_q, n_kv), "v": (n_q + n_kv, n_kv)}[part]
                rebuilt.append(ranks[r][attn + name][off : off + n])
            assert torch.equal(torch.cat(rebuilt), fp[attn + name][lo:hi]), (part, name)
    o = fp[attn + "o_proj.weight"]
    assert torch.equal(torch.cat([ranks[r][attn + "o_proj.weight"] for r in range(2)], 1), o)
    down = fp["layers.0.mlp.down_proj.weight"]
    assert torch.equal(torch.cat([ranks[r]["layers.0.mlp.down_proj.weight"]
                                  for r in range(2)], 1), down)
    gate_up = [ranks[r]["layers.0.mlp.gate_up_proj.weight"] for r in range(2)]
    full_gu = fp["layers.0.mlp.gate_up_proj.weight"]
    assert [g.shape[0] for g in gate_up] == [2 * 49, 2 * 48]
    assert torch.equal(torch.cat([gate_up[0][:49], gate_up[1][:48]]), full_gu[:97])  # gate
    assert torch.equal(torch.cat([gate_up[0][49:], gate_up[1][48:]]), full_gu[97:])  # up
    for name in ("embed_tokens.weight", "lm_head.weight"):
        shards = [ranks[r][name] for r in range(2)]
        assert [s.shape[0] for s in shards] == [51, 51]  # padded to ceil(101 / 2)
        assert torch.equal(torch.cat(shards)[:101], fp[name])
        assert not shards[1][50:].any()  # the padding row is zero
    assert torch.equal(ranks[1]["norm.weight"], fp["norm.weight"])


def test_row_parallel_partials_are_summed_in_fp32_and_rounded_once(monkeypatch):
    from draftgraph.distributed import layers
    from draftgraph.kernels import gemv

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    shards = [layers.RowParallelLinear(32, 32, TPInfo(r, 2)) for r in range(2)]
    for r, lin in enumerate(shards):
        lin.weight.data = w[:, 32 * r : 32 * (r + 1)].clone()
    partial = [gemv.gemv(x[:, 32 * r : 32 * (r + 1)], shards[r].weight,
                         out_dtype=torch.float32) for r in range(2)]
    reduced = []

    def fake_all_reduce(t, tp):  # the other rank's partial arrives in the sum
        reduced.append(t.dtype)
        return t.add_(partial[1 - tp.rank])

    monkeypatch.setattr(layers, "all_reduce", fake_all_reduce)
    y = shards[0](x[:, :32])
    assert reduced == [torch.float32]
    assert y.dtype == torch.bfloat16
    exact = x.float() @ w.float().t()
    assert torch.equal(y, exact.to(torch.bfloat16))  # one rounding of the fp32 sum
    # rounding each partial first (a bf16 all-reduce) lands elsewhere for some outputs
    twice = (partial[0].to(torch.bfloat16) + partial[1].to(torch.bfloat16))
    assert not torch.equal(twice, exact.to(torch.bfloat16))


# ---- two processes over gloo ----------------------------------------------------------------

def _engine(model: str, tp: int, spec: SpecConfig | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=model, device="cpu", tensor_parallel_size=tp,
        cache=CacheConfig(kv_cache_tokens=2048),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1024),
        spec=spec or SpecConfig()))


def _prefill_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits at every position of a prefill (row 1, slots 1..n of a fresh engine)."""
    n = len(ids)
    sb = StepBatch(Phase.EXTEND, ids, [1], [n], [n], list(range(1, n + 1)), list(range(n)))
    return engine.target.forward(sb)


def _run(model: str, tp: int, prompts: list, max_tokens: int, spec: SpecConfig | None = None,
         params: SamplingParams | None = None, async_on: bool = False,
         stats: dict | None = None):
    """(prefill logits of prompts[0], token ids per prompt (greedy unless `params`), worker
    exit codes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like each TP rank; spinning OpenMP threads stall a busy CI box
    try:
        return _run_engine(model, tp, prompts, max_tokens, spec, params, async_on, stats)
    finally:
        torch.set_num_threads(threads)


def _run_engine(model, tp, prompts, max_tokens, spec, params=None, async_on=False,
                stats=None):
    engine = _engine(model, tp, spec)
    # on CPU off by default (eagerly nothing overlaps); the bodies run as they would replay
    engine.async_scheduling = async_on
    for graphs in engine.target.graph_sets.values():
        count_refs(graphs)
    procs = list(tp_worker._STATE["procs"])
    try:
        assert len(procs) == tp - 1 and current_tp().size == tp
        ids = prompts[0] if isinstance(prompts[0], list) else engine.encode_prompt(prompts[0])
        logits = _prefill_logits(engine, ids)
        outs = engine.generate(prompts, params or SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True))
        if stats is not None:
            stats.update(engine.stats)
        refs = sum(g.refs for g in engine.target.graph_sets.values())
        assert (refs > 0) == async_on  # steps really were launched ahead
    finally:
        engine.shutdown()
    assert current_tp().size == 1
    return logits, [o.token_ids for o in outs], [p.exitcode for p in procs]


@pytest.fixture(scope="module")
def odd_hf_dir(tmp_path_factory) -> str:
    """A tiny checkpoint that splits unevenly everywhere at TP = 2."""
    path = str(tmp_path_factory.mktemp("tiny_tp"))
    save_tiny_hf_checkpoint(path, tiny_llama_config(
        vocab_size=261, hidden_size=72, num_attention_heads=6, num_key_value_heads=3,
        intermediate_size=97, max_position_embeddings=1024))
    return path


def test_tp2_equals_tp1_on_a_tiny_checkpoint_with_speculative_decoding(tiny_hf_dir,
                                                                       odd_hf_dir):
    pytest.importorskip("transformers")
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42], list(range(60, 90))]
    spec = SpecConfig(method="ngram", num_draft_tokens=3)
    for path in (tiny_hf_dir, odd_hf_dir):
        if path == odd_hf_dir:  # a 600-token prefill: its raw inputs outgrow the inline lanes
            prompts.append([(7 * i) % 250 for i in range(600)])
            assert 2 * 600 > tp_control.INLINE
        ref_logits, ref_tokens, _ = _run(path, 1, prompts, 24)
        logits, tokens, exitcodes = _run(path, 2, prompts, 24)
        diff = (logits - ref_logits).abs().max().item()
        assert logits.shape == ref_logits.shape and diff < LOGITS_ATOL, diff
        assert tokens == ref_tokens
        assert exitcodes == [0]  # the worker left on the shutdown message
        # verify steps (1 + drafts per request) run on both ranks too
        _, spec_tokens, exitcodes = _run(path, 2, prompts, 24, spec)
        assert spec_tokens == ref_tokens and exitcodes == [0]


def test_tp2_with_async_scheduling_equals_tp1(default_gguf_path):
    """Async scheduling under TP: rank 0 launches step N + 1 before reading step N, its last
    tokens staged as references that ranks > 0 resolve from their own output buffers; plain
    steps (greedy) and n-gram steps (seeded sampling) give TP = 1's synchronous tokens."""
    pytest.importorskip("gguf")
    prompts = ["Explain speculative decoding in two sentences.", "1, 2, 3, 4, 5, 6, 7, 8,"]
    for spec, temperature in ((None, 0.0), (SpecConfig(method="ngram", num_draft_tokens=3),
                                            1.0)):
        params = SamplingParams(max_tokens=20, temperature=temperature, seed=7,
                                ignore_eos=True)
        _, ref, _ = _run(default_gguf_path, 1, prompts, 20, spec, params)
        _, got, exitcodes = _run(default_gguf_path, 2, prompts, 20, spec, params,
                                 async_on=True)
        assert got == ref and exitcodes == [0]


def test_chain_and_block_heads_under_tp2_equal_tp1(default_gguf_path):
    """The shipped chain and block heads, replicated on both ranks (their LM head gathered
    from the target's vocabulary shards once, their KV written on every rank after every
    eager forward), with async scheduling: TP = 2 gives TP = 1's greedy tokens, with drafts
    accepted on both; the chain head's draft trees too (every rank copies its KV shard)."""
    pytest.importorskip("gguf")
    prompts = ["Explain speculative decoding in two sentences.", "def fib(n):"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for method, tree in (("chain", None), ("block", None), ("chain", TreeShape(4, 5, 16))):
        spec = SpecConfig(method=method, num_draft_tokens=4, tree=tree)
        ref_stats, stats = {}, {}
        _, ref, _ = _run("default", 1, prompts, 24, spec, params, stats=ref_stats)
        _, got, exitcodes = _run("default", 2, prompts, 24, spec, params, async_on=True,
                                 stats=stats)
        assert got == ref and exitcodes == [0], method
        assert stats["num_accepted_tokens"] == ref_stats["num_accepted_tokens"] > 5, method


def test_tp2_equals_tp1_on_the_default_model_with_uneven_heads(default_gguf_path):
    pytest.importorskip("gguf")
    prompts = ["Explain speculative decoding in two sentences.", "Write a haiku about graphs."]
    ref_logits, ref_tokens, _ = _run(default_gguf_path, 1, prompts, 24)
    logits, tokens, exitcodes = _run(default_gguf_path, 2, prompts, 24)
    diff = (logits - ref_logits).abs().max().item()
    assert logits.shape == ref_logits.shape == (logits.shape[0], 49152)
    assert diff < LOGITS_ATOL, diff
    assert tokens == ref_tokens
    assert exitcodes == [0]


def test_cli_generate_with_tensor_parallel_size_2_matches_tp1(default_gguf_path):
    pytest.importorskip("gguf")
    from draftgraph.models.loader import load_model

    prompt = "What is the capital of France?"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = LLMEngine(EngineConfig(model="default", device="cpu"),
                        loaded=load_model(default_gguf_path))
        want = ref.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    finally:
        torch.set_num_threads(threads)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "draftgraph.cli", "generate", "--model", default_gguf_path,
         "--device", "cpu", "--tensor-parallel-size", "2", "--max-tokens", "12", "--json",
         prompt], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["token_ids"] == want.token_ids and got["text"] == want.text


def test_tp_flag_errors_name_the_flag():
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        EngineConfig(device="cpu", tensor_parallel_size=0)
    with pytest.raises(EngineError, match="--tensor-parallel-size"):
        LLMEngine(EngineConfig(device="cpu", tensor_parallel_size=2), loaded=object())
    assert not tp_worker._STATE["procs"]  # refused before any worker started
