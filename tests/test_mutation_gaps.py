"""Behaviours of the last sessions' features that their own tests let go (a mutation pass:
each test here failed with the feature broken and passes without): decode rows riding in a
prefill behind the step in flight (their key bound, the scheduler's budget beside them, the
context, an abort, a failed forward), the first tokens that prefill leaves on the device, the
launch ahead's rule for rows that need no next step and for requests that need the extras
twin, a stream's prompt logprobs, the detokenizer's prompt context on each of its paths, and
the extend attention plan's split-KV limits. On CPU the graph sets run eagerly with the
captured graphs' contract (see test_overlap_prefill.py)."""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_hf_model, tiny_loaded
from test_overlap_prefill import arrivals_of, drive, engine_for

import draftgraph.engine.engine as engine_module
from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.request import Request
from draftgraph.engine.sampling import SamplingParams
from draftgraph.engine.scheduler import ScheduledRequest, Scheduler
from draftgraph.runtime.kv_cache import PagedAllocator, ReqToTokenPool

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model(seed=0)


def overlapping(engine: LLMEngine) -> LLMEngine:
    """`engine` with async scheduling (off on CPU by default), prefills behind the step in
    flight and decode rows riding in them."""
    engine.async_scheduling = True
    engine.config.overlap_prefill = True
    engine.config.decode_rides_prefill = True
    return engine


def test_a_prefill_behind_leaves_its_riding_rows_room_in_the_token_budget():
    """schedule(decode=False, riding=n): the prompt chunks and the n riding decode rows
    together stay within max_num_batched_tokens."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                      PagedAllocator(257), ReqToTokenPool(4, 256, "cpu"))
    sched.add(Request("a", list(range(100)), SamplingParams(max_tokens=8), 0, set()))
    [sr] = sched.schedule(decode=False, riding=5)
    assert sr.num_new_tokens == 64 - 5 and len(sr.slots) == 59


def test_a_row_rides_only_while_its_keys_exceed_the_prefills_by_at_most_the_bound(
        hf, monkeypatch):
    """With RIDE_EXTRA_KEYS = 3 beside a 7-token prompt, a row whose next step sees 10 keys
    rides, one that sees 11 does not; the rider's input refers to its row of the step in
    flight and its KV slot is the position after its last token."""
    monkeypatch.setattr(engine_module, "RIDE_EXTRA_KEYS", 3)
    engine = engine_for(hf, "overlap")
    alloc = engine.slots.allocator
    prompt = Request("p", list(range(7)), GREEDY, 0, set())
    near, far = (Request(rid, list(range(n)), GREEDY, 0, set())
                 for rid, n in (("near", 9), ("far", 10)))
    for r in (near, far):  # their KV so far
        alloc.extend(r.pages, 0, r.num_tokens)
    riders = engine._riders([(0, near), (1, far)], [ScheduledRequest(prompt, 7)])
    assert riders == [(near, -1, near.pages[9])] and len(far.pages) == 10


def test_a_prefill_whose_riding_rows_fail_runs_again_without_them(hf):
    """A prefill behind that fails with decode rows riding in it runs again without them
    (they take the next launch as usual): nobody errs, the outputs are the synchronous
    engine's, and no row counts as having ridden."""
    arrivals = arrivals_of([GREEDY] * 7)
    ref = drive(engine_for(hf, "sync"), arrivals)
    engine = engine_for(hf, "overlap")
    forward, failed = engine.target.forward, []

    def failing_with_riders(sb):
        if sb.ref_tokens is not None:  # rows riding: inputs read from the step in flight
            failed.append(len(sb.seq_lens))
            raise RuntimeError("a riding row broke the forward")
        return forward(sb)

    engine.target.forward = failing_with_riders
    assert drive(engine, arrivals) == ref
    assert len(failed) >= 3 and engine.stats["steps_behind"] >= 3
    assert engine.stats["rows_riding"] == 0


def test_a_request_failing_in_a_prefill_behind_leaves_the_others_first_tokens(hf):
    """Three prompts prefilled together behind the step in flight, the middle one making
    every forward it is in fail: re-run in parts, it alone errs, and the two others' first
    tokens (left on the device by two separate parts) reach their own requests."""
    prompts = {rid: list(range(s, s + n)) for rid, s, n in
               (("a", 3, 5), ("b", 20, 9), ("x", 40, 6), ("bad", 60, 7), ("y", 80, 8))}
    arrivals = {0: [("a", prompts["a"], GREEDY), ("b", prompts["b"], GREEDY)],
                3: [(rid, prompts[rid], GREEDY) for rid in ("x", "bad", "y")]}
    ref = drive(engine_for(hf, "sync"), {s: [a for a in arr if a[0] != "bad"]
                                         for s, arr in arrivals.items()})
    engine = engine_for(hf, "overlap")
    forward, parts = engine.target.forward, []

    def failing_with_bad(sb):
        bad = engine.requests.get("bad")
        parts.append(len(sb.seq_lens))
        if bad is not None and bad.req_pool_idx in sb.req_pool_indices:
            raise RuntimeError("request 'bad' breaks every forward it is in")
        return forward(sb)

    engine.target.forward = failing_with_bad
    got = drive(engine, arrivals)
    assert got.pop("bad") == ([], None, "error")
    assert got == ref and engine.stats["steps_behind"] >= 1
    assert parts.count(1) >= 2  # x and y each took a forward of its own


def context_engine(hf, max_model_len: int) -> LLMEngine:
    """The tiny engine with a context of `max_model_len` tokens (synchronous)."""
    config = EngineConfig(
        model="tiny", device="cpu", cache=CacheConfig(page_size=1, kv_cache_tokens=2048),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                  max_model_len=max_model_len))
    return LLMEngine(config, loaded=tiny_loaded(hf))


def test_riding_rows_never_take_a_request_past_the_context(hf):
    """A request that reaches --max-model-len while a prompt arrives at every step: a row
    rides only where the step in flight leaves room for its token, so the request ends with
    exactly the context's tokens, as in the synchronous engine."""
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    arrivals = {0: [("long", list(range(1, 21)), long)]}
    arrivals.update({s: [(f"p{s}", [s, s + 1, s + 2], one)] for s in range(3, 16)})
    ref = drive(context_engine(hf, 32), arrivals)
    engine = overlapping(context_engine(hf, 32))
    got = drive(engine, arrivals)
    assert len(ref["long"][0]) == len(got["long"][0]) == 32 - 20
    assert got == ref and got["long"][2] == "length"
    assert engine.stats["rows_riding"] >= 3


def finals(engine: LLMEngine, arrivals: dict[int, list]) -> dict:
    """`drive`, keeping each request's final output whole (its top logprobs too)."""
    out = {}

    def keep(engine_step=engine.step):
        outputs = engine_step()
        out.update({o.request_id: o for o in outputs if o.finished})
        return outputs

    engine.step = keep
    drive(engine, arrivals)
    return out


def test_top_logprobs_of_requests_that_arrive_mid_run_equal_the_synchronous_engines(hf):
    """A request asking for top-N logprobs, prefilled behind the step in flight, takes the
    extras twin from its first launch on (a plain graph set computes no top-N), and a prompt
    arriving while that twin is in flight runs beside it: every request's tokens, logprobs
    and top logprobs are the synchronous engine's."""
    params = [GREEDY] * 7
    params[5] = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True,
                               top_logprobs=2)
    arrivals = arrivals_of(params)
    arrivals[15] = [("r7", list(range(30, 41)), GREEDY)]
    ref = finals(engine_for(hf, "sync"), arrivals)
    engine = engine_for(hf, "overlap")
    got = finals(engine, arrivals)
    assert got.keys() == ref.keys() and len(ref["r5"].top_logprobs) == 12
    assert {rid: o.token_ids for rid, o in got.items()} == \
        {rid: o.token_ids for rid, o in ref.items()}
    got5, want5 = got["r5"], ref["r5"]
    assert got5.logprobs == pytest.approx(want5.logprobs, abs=1e-5)
    assert [[t for t, _ in alts] for alts in got5.top_logprobs] == \
        [[t for t, _ in alts] for alts in want5.top_logprobs]
    assert [lp for alts in got5.top_logprobs for _, lp in alts] == \
        pytest.approx([lp for alts in want5.top_logprobs for _, lp in alts], abs=1e-5)
    assert engine.stats["steps_behind"] >= 4


def test_the_step_that_brings_a_requests_last_token_launches_none_after_it(hf):
    """Launched ahead, a row whose referred token surely ends it (max_tokens) needs no next
    step: a lone request of 5 tokens takes its prefill and 4 decode replays, not 5."""
    engine = engine_for(hf, "async")
    replays, replay = [], engine.decode_graphs.replay

    def counting(bs, greedy, fields):
        replays.append(bs)
        return replay(bs, greedy, fields)

    engine.decode_graphs.replay = counting
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    [out] = engine.generate([list(range(1, 9))], sp)
    assert len(out.token_ids) == 5 and replays == [1] * 4
    assert engine.stats["steps_ahead"] >= 3


def test_a_streams_first_output_with_tokens_carries_its_prompt_logprobs(hf):
    """prompt_logprobs asked: the first output with tokens and the final one carry the
    prompt's logprobs (None for its first token), the outputs between them none."""
    engine = engine_for(hf, "sync")
    prompt = list(range(5, 14))
    rid = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0,
                                                    ignore_eos=True, prompt_logprobs=1))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid and o.new_token_ids]
    first, *middle, final = outs
    assert len(first.prompt_logprobs) == len(prompt) and first.prompt_logprobs[0] is None
    assert all(isinstance(lp, float) and lp <= 0 for lp in first.prompt_logprobs[1:])
    assert middle and all(o.prompt_logprobs is None for o in middle)
    assert final.finished and final.prompt_logprobs == first.prompt_logprobs


def metaspace_tokenizer():
    """A sentencepiece-style tokenizer (Llama 2, Mistral): "▁" marks a word's leading space,
    and a decode drops the space of its first word."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from draftgraph.models.tokenizer import Tokenizer

    words = ["The", "capital", "of", "France", "is", "Paris."]
    backend = Backend(models.WordLevel({"<unk>": 0} | {f"▁{w}": i + 1
                                                       for i, w in enumerate(words)},
                                       unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>"))


class DecodeStreamWithoutPrefill:
    """tokenizers' DecodeStream before it took `ids` (a prefill)."""

    def __init__(self, skip_special_tokens: bool = True) -> None:
        self.skip_special_tokens = skip_special_tokens


@pytest.mark.parametrize("path", ["stream", "windows", "stream without prefill"])
def test_a_metaspace_tokenizers_first_generated_word_keeps_its_space(path, monkeypatch):
    """The prompt's last tokens are the context of the first generated ones (DecodeStream's
    prefill, or the first window; the windows too where a DecodeStream takes no prefill):
    alone, "▁Paris." decodes to "Paris."."""
    from draftgraph.engine import detokenizer

    if path == "windows":
        monkeypatch.setattr(detokenizer, "DecodeStream", None)
    elif path == "stream without prefill":
        monkeypatch.setattr(detokenizer, "DecodeStream", DecodeStreamWithoutPrefill)
    elif detokenizer.DecodeStream is None:
        pytest.skip("this tokenizers has no DecodeStream")
    tok = metaspace_tokenizer()
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    [paris] = tok.encode("Paris.", add_special_tokens=False)
    assert tok.decode([paris]) == "Paris."
    detok = detokenizer.IncrementalDetokenizer(tok, prompt)
    assert (detok._stream is not None) == (path == "stream")
    assert detok.add([paris]) == " Paris." and detok.text == " Paris."
    assert detok.flush() == "" and detok.text == " Paris."


def test_the_batch_invariant_triton_backend_never_splits_an_extend_step(monkeypatch):
    """Split-KV extend makes a row's arithmetic follow the step's token count, so the
    batch-invariant backend (--deterministic) runs every prefill unsplit, whatever
    EXTEND_MAX_SPLITS allows the other (3 here: a 12-token prefill takes 3 splits there)."""
    from test_kernels_backend import Runner, steps, tiny_model

    from draftgraph.attention.triton_backend import TritonBackend
    from draftgraph.kernels import attention as attn_kernels

    monkeypatch.setattr(attn_kernels, "EXTEND_MAX_SPLITS", 3)
    launches = []
    extend = attn_kernels.extend_attention
    monkeypatch.setattr(attn_kernels, "extend_attention", lambda *a, **k: launches.append(
        (k["num_splits"], k["unmasked_first"])) or extend(*a, **k))
    cfg, model = tiny_model(None)
    logits = {}
    for invariant in (False, True):
        run = Runner(TritonBackend, cfg, max_bs=4, num_q_heads=4, max_kv_splits=4,
                     invariant=invariant)
        phase, *batch = next(steps())  # the prefill of two prompts, 5 + 7 tokens
        logits[invariant] = run.step(model, phase, *batch)
    # one launch a layer: split and unmasked first, then neither under the invariant plan
    assert launches == [(3, True)] * 2 + [(1, False)] * 2
    torch.testing.assert_close(logits[True], logits[False], atol=1e-4, rtol=1e-4)


def test_a_request_aborted_as_prompts_arrive_does_not_ride_in_their_prefill(hf):
    """An abort drained in the same step as two arrivals prefilled behind the step in flight:
    the aborted row (its KV pages already given back) rides in nothing, every KV slot comes
    back (`drive` checks), and the others' outputs are the synchronous engine's."""
    arrivals = arrivals_of([GREEDY] * 7)
    ref = drive(engine_for(hf, "sync"), arrivals)
    engine = engine_for(hf, "overlap")
    riding = engine._riders
    rode = []  # per prefill behind: the requests offered a ride, finished ones marked

    def spying(riders, scheduled):
        rode.append([(r.request_id, r.finished) for _, r in riders])
        return riding(riders, scheduled)

    engine._riders = spying
    got = drive(engine, arrivals, abort={6: "r0"})  # r3 and r4 arrive after step 6 too
    assert got.pop("r0")[2] == "abort" and got == {k: v for k, v in ref.items() if k != "r0"}
    assert any(("r0", False) in offered for offered in rode)  # it rode before its abort
    assert not any(done for offered in rode for _, done in offered)
    assert engine.stats["rows_riding"] >= 5


def test_a_noncausal_extend_runs_unsplit_whatever_splits_it_is_given():
    """Split-KV extend is causal only: a draft block's non-causal attention asked for 2
    splits runs whole, every row over its request's whole list, as the twin computes it."""
    from test_kernels_attention import DEVICE, SCALE, D, setup

    from draftgraph.kernels import attention as attn

    seq_lens, extend_lens = [30, 4, 1, 70], [30, 0, 1, 4]
    q, k_cache, v_cache, bufs, lists = setup(seq_lens, extend_lens, None, torch.float32)
    bs, num_tokens = len(seq_lens), q.shape[0]
    args = (bufs.qo_indptr, lists.kv_indptr, lists.kv_indices, lists.kv_start, bufs.positions)
    out = torch.full_like(q, float("nan"))
    attn.extend_attention(q, k_cache, v_cache, *args, None, SCALE, out, bs, block_n=32,
                          noncausal=True, num_splits=2, **attn.extend_scratch(D, DEVICE))
    twin = attn.attention_ref(q, k_cache, v_cache, bufs.qo_indptr[: bs + 1],
                              lists.kv_indptr[: bs + 1], lists.kv_indices, lists.kv_start[:bs],
                              bufs.positions[:num_tokens], None, SCALE, noncausal=True)
    torch.testing.assert_close(out, twin, atol=2e-5, rtol=2e-5)
