"""Captured prefill (runtime/extend_graphs.py) on CPU: the padded extend body that a GPU
captures per token bucket, run eagerly here with the same buffers and padding.

A step's tokens are padded up to a bucket by a padding request (table row 0, KV slot 0) after
the live ones, and its requests by rows of no tokens. Outputs must equal the plain eager
forward's (tokens, logprobs), live requests' tables and KV must be what the eager forward
writes, and a drafter that reads the forward's captured hidden states sees the same ones."""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_engine, tiny_hf_model, tiny_loaded
from test_async_scheduling import run_steps

from draftgraph.engine.sampling import SamplingParams
from draftgraph.models.heads import random_head
from draftgraph.runtime.extend_graphs import token_buckets
from draftgraph.spec.chain_head import ChainHeadDrafter


def test_token_buckets_pad_by_at_most_an_eighth_above_256_tokens():
    buckets = token_buckets(4096)
    assert buckets[:3] == [16, 32, 48] and buckets[-1] == 4096 and len(buckets) == 48
    assert buckets == sorted(set(buckets))
    for n in range(1, 4097):
        b = next(x for x in buckets if x >= n)
        assert b - n < max(16, n / 8), n
    assert token_buckets(100)[-1] == 100 and token_buckets(16) == [16]


def _prompts(n: int, vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lens = [5, 37, 90, 17, 61, 3][:n]
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


def _engine(hf, padded: bool, drafter=None, max_tokens: int = 64):
    """Four requests at a time and 64-token steps: prompts are chunked and steps mix prefill
    chunks with decode rows. `padded`: extend steps take the padded body."""
    engine = tiny_engine(hf, max_num_seqs=4, budget=64, drafter=drafter)
    if padded:
        engine.target.init_extend_graphs(max_tokens, use_graphs=False)
    target, eager = engine.target, engine.target._hidden
    engine.eager_forwards = 0

    def counted(sb):
        engine.eager_forwards += 1
        return eager(sb)

    target._hidden = counted
    return engine


@pytest.mark.parametrize("sliding_window", [None, 8])
def test_padded_prefill_equals_the_eager_forward(sliding_window):
    hf = tiny_hf_model(seed=0, sliding_window=sliding_window)
    prompts = _prompts(6)
    params = [SamplingParams(max_tokens=n, temperature=0, logprobs=True, ignore_eos=True)
              for n in (9, 14, 6, 11, 8, 12)]
    outs = {}
    for padded in (False, True):
        engine = _engine(hf, padded)
        outs[padded] = run_steps(engine, prompts, params)
    # every extend step of this run fits 64 tokens: all of them took the padded body
    assert engine.target.extend_graphs.replays >= 5 and engine.eager_forwards == 0
    assert [v[0] for v in outs[True].values()] == [v[0] for v in outs[False].values()]
    for (tok_p, lp_p, _), (tok_e, lp_e, _) in zip(outs[True].values(), outs[False].values(),
                                                  strict=True):
        assert tok_p == tok_e
        torch.testing.assert_close(torch.tensor(lp_p), torch.tensor(lp_e), atol=1e-5, rtol=0)


def test_padded_prefill_writes_the_live_requests_kv_and_tables_as_eager_does():
    """One 37-token prefill (bucket 48: 11 padding tokens): the live request's table row, token
    row and KV at its slots equal the eager forward's; the padding went to row 0 and slot 0."""
    hf = tiny_hf_model(seed=0)
    prompt = _prompts(2)[1]
    state = {}
    for padded in (False, True):
        engine = _engine(hf, padded)
        engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0))
        engine.step()  # the prefill step
        req = next(iter(engine.requests.values()))
        row, n = req.req_pool_idx, len(prompt)
        slots = engine.slots.req_pool.req_to_token[row, :n].clone()
        state[padded] = dict(
            slots=slots, tokens=engine.slots.token_table[row, :n].clone(),
            k=torch.stack([b[slots] for b in engine.target.kv_pool.k_buffers]),
            pad_tokens=engine.slots.token_table[0, : 48 - n].clone(),
            pad_slots=engine.slots.req_pool.req_to_token[0, : 48 - n].clone())
    eager, padded = state[False], state[True]
    assert torch.equal(padded["slots"], eager["slots"]) and (padded["slots"] > 0).all()
    assert padded["tokens"].tolist() == prompt == eager["tokens"].tolist()
    torch.testing.assert_close(padded["k"], eager["k"], atol=1e-6, rtol=0)
    assert (padded["pad_slots"] == 0).all()


def test_a_chain_head_reads_the_padded_forwards_hidden_states():
    """A chain head writes its KV from the prefill's captured hidden states (`observe`): after
    a padded prefill its KV at the prompt's slots equals the one after an eager prefill, and
    speculative outputs still equal plain decoding."""
    hf = tiny_hf_model(seed=0)
    prompts = _prompts(4)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
              for n in (20, 12, 16, 9)]
    plain = run_steps(_engine(hf, False), prompts, params)
    head_kv = {}
    for padded in (False, True):
        head = random_head(tiny_loaded(hf).config, "", seed=3)
        engine = _engine(hf, padded, drafter=ChainHeadDrafter(head, 3))
        engine.add_request(prompts[1], SamplingParams(max_tokens=2, temperature=0))
        engine.step()  # the prefill step: the head observes it
        req = next(iter(engine.requests.values()))
        slots = engine.slots.req_pool.req_to_token[req.req_pool_idx, : len(prompts[1])]
        head_kv[padded] = engine.drafter.executor.kv_pool.k_buffers[0][slots].clone()
        while engine.has_unfinished():
            engine.step()
        out = run_steps(engine, prompts, params)
        assert [v[0] for v in out.values()] == [v[0] for v in plain.values()]
    assert engine.target.extend_graphs.replays >= 4 and engine.eager_forwards == 0
    assert head_kv[True].abs().sum() > 0
    torch.testing.assert_close(head_kv[True], head_kv[False], atol=1e-6, rtol=0)
