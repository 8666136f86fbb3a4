"""Sampling controls on the device (runtime/controls.py): logit bias, min_tokens, repetition /
frequency / presence penalties and min_p, applied inside the one sampling tail (spec.verify.emit) to
every row, verify rows included; and top-N logprobs from the same tail."""

from __future__ import annotations

import pytest
import torch
from _tiny import OracleDrafter, tiny_engine, tiny_hf_model

from draftgraph.config import SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams, SamplingParamsError
from draftgraph.runtime import controls as controls_mod
from draftgraph.runtime.controls import ControlTables, StepControls, apply_controls
from draftgraph.runtime.sampling import processed_probs
from draftgraph.spec.verify import emit

# ------------------------------------------------------------------ a plain-torch reference


def controlled_ref(logits: torch.Tensor, prompt: list[int], outputs: list[int],
                   p: SamplingParams, stop_ids: list[int] = ()) -> torch.Tensor:
    """vLLM's order on one row of logits [V]: allowed ids, logit bias, min_tokens mask,
    repetition penalty (prompt + output tokens), frequency and presence penalties (output
    tokens), then min_p on the probabilities at the request's temperature."""
    x = logits.clone().double()
    for w in p.bad_words_token_ids or ():  # outputs only, never the prompt
        if len(w) == 1 or (len(outputs) >= len(w) - 1 and outputs[len(outputs) - len(w) + 1:]
                           == w[:-1]):
            x[w[-1]] = float("-inf")
    if p.allowed_token_ids:
        banned = torch.ones_like(x, dtype=torch.bool)
        banned[p.allowed_token_ids] = False
        x[banned] = float("-inf")
    for t, b in p.logit_bias.items():
        x[t] += b
    if len(outputs) < p.min_tokens:
        for t in stop_ids:
            x[t] = float("-inf")
    for t in set(prompt) | set(outputs):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(outputs):
        c = outputs.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    if p.min_p and p.temperature:
        probs = torch.softmax(x / p.temperature, -1)
        x[probs < p.min_p * probs.max()] = float("-inf")
    return x.float()


def _tables(vocab: int, rows: int, width: int) -> ControlTables:
    table = torch.zeros(rows, 64, dtype=torch.int64)
    return ControlTables(rows, vocab, table, width, torch.device("cpu"))


def _step_controls(tables, rows, params, prompt_lens):
    f = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
    return StepControls(tables, torch.tensor(rows), f([p.presence_penalty for p in params]),
                        f([p.frequency_penalty for p in params]),
                        f([p.repetition_penalty for p in params]),
                        torch.tensor([p.min_tokens for p in params]), torch.tensor(prompt_lens),
                        torch.tensor([len(p.logit_bias) for p in params]),
                        num_allowed=torch.tensor([len(p.allowed_token_ids or ()) for p in params]),
                        num_bad_words=torch.tensor([len(p.bad_words_token_ids or ())
                                                    for p in params]),
                        min_p=f([p.min_p for p in params]),
                        temperature=f([p.temperature for p in params]))


def _admit(tables, row, seq, prompt_len, params, stop_ids):
    """Write a request's row the way the engine does, its tokens into the token table."""
    tables.token_table[row, : len(seq)] = torch.tensor(seq)
    tables.admit(row, seq[:prompt_len], [], params.logit_bias, stop_ids,
                 params.allowed_token_ids or (), params.bad_words_token_ids or ())


PARAMS = [
    SamplingParams(repetition_penalty=1.7, frequency_penalty=0.8, presence_penalty=-0.5,
                   logit_bias={3: 4.0, 9: -30.0}, min_tokens=6,
                   # one token always; 9 3 -> 11 after the draft 3 (row 1); 7 3 9 -> 10 at row 0
                   bad_words_token_ids=[[4], [9, 3, 11], [7, 3, 9, 10], [5, 3, 6]]),
    SamplingParams(frequency_penalty=1.5, presence_penalty=1.0, min_p=0.3, temperature=0.5),
    SamplingParams(repetition_penalty=0.6, logit_bias={0: 2.5}, min_p=0.1,
                   allowed_token_ids=[0, 3, 5, 7, 9, 10]),
    SamplingParams(),  # no controls: unchanged
]


@pytest.mark.parametrize("k", [0, 3])
def test_controlled_logits_equal_the_reference_on_every_row(k) -> None:
    """Every target row of a verify step: row j counts the drafts before it as outputs."""
    gen = torch.Generator().manual_seed(0)
    vocab, bs = 12, len(PARAMS)
    T = k + 1
    tables = _tables(vocab, bs + 1, T)
    prompts = [[1, 2, 2, 5], [5, 6], [3, 3, 4], [0, 1]]
    outs = [[3, 7, 3, 9], [6, 6, 1], [], [2]]  # outputs so far (the last one not yet counted)
    stop_ids = [[8, 11], [], [], []]
    rows = [1, 2, 3, 4]
    for r, prompt, out, params, stops in zip(rows, prompts, outs, PARAMS, stop_ids,
                                             strict=True):
        tables.admit(r, prompt, out[:-1], params.logit_bias, stops,
                     params.allowed_token_ids or (), params.bad_words_token_ids or ())
    seqs = [p + o for p, o in zip(prompts, outs, strict=True)]
    for r, seq in zip(rows, seqs, strict=True):
        tables.token_table[r, : len(seq)] = torch.tensor(seq)
    seq_lens = torch.tensor([len(s) for s in seqs])
    # all but a request's last output were counted before (admit); the fold takes the last
    ctl = _step_controls(tables, rows, PARAMS, [len(p) for p in prompts])
    tables.fold(ctl.req_pool_indices, seq_lens)
    tables.fold(ctl.req_pool_indices, seq_lens)  # folding again adds nothing
    drafts = torch.randint(0, vocab, (bs, k), generator=gen)
    if k:
        drafts[0] = torch.tensor([3, 3, 7])  # repeats inside the draft
    logits = torch.randn(bs * T, vocab, generator=gen) * 3
    got = apply_controls(logits, ctl, drafts, seq_lens).view(bs, T, vocab)
    for b in range(bs):
        for j in range(T):
            ref = controlled_ref(logits.view(bs, T, vocab)[b, j], prompts[b],
                                 outs[b] + drafts[b, :j].tolist(), PARAMS[b], stop_ids[b])
            torch.testing.assert_close(got[b, j], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[3], logits.view(bs, T, vocab)[3])  # no controls: unchanged
    # min_p masked tokens of its rows (the test sees it), on every verify row
    assert got[1].isinf().any(dim=-1).all() and got[2].isinf().any(dim=-1).all()
    # and allowed_token_ids every other token, on every verify row
    assert got[2][:, [1, 2, 4, 6, 8, 11]].isneginf().all()
    # bad words: the one-token word everywhere; 7 3 9 -> 10 at row 0; 9 3 -> 11 at row 1
    assert got[0][:, 4].isneginf().all() and got[0][0, 10].isneginf()
    assert k == 0 or got[0][1, 11].isneginf()


def test_bad_words_match_the_outputs_not_the_prompt() -> None:
    """A bad word's prefix is matched against outputs only (vLLM's rule): the prompt's last
    token followed by nothing bans nothing; once the output has it, the word's end is banned."""
    params = SamplingParams(bad_words_token_ids=[[6, 7], [5, 6, 3]])
    tables = _tables(8, 2, 1)
    logits = torch.zeros(1, 8)
    no_drafts = torch.zeros(1, 0, dtype=torch.int64)
    for seq, banned in (([5, 6], []), ([5, 6, 6], [7])):
        _admit(tables, 1, seq, 2, params, [])
        ctl = _step_controls(tables, [1], [params], [2])
        x = apply_controls(logits, ctl, no_drafts, torch.tensor([len(seq)]))
        assert x[0].isneginf().nonzero().flatten().tolist() == banned


def test_fold_counts_only_new_positions_and_is_bounded() -> None:
    tables = _tables(8, 3, 2)
    tables.token_table[1, :6] = torch.tensor([1, 2, 3, 4, 4, 5])
    tables.admit(1, [1, 2], [], {}, [])  # counted up to position 2
    rows = torch.tensor([1])
    tables.fold(rows, torch.tensor([4]))
    tables.fold(rows, torch.tensor([6]))
    counts = tables.token_counts[1] & controls_mod.COUNT_MASK
    assert counts.tolist() == [0, 0, 0, 1, 2, 1, 0, 0]
    assert (tables.token_counts[1, [1, 2]] >= controls_mod.PROMPT_FLAG).all()
    assert tables.counted_lens[1].item() == 6


# ------------------------------------------------------------------ the engine


def _reference_greedy(hf, prompt: list[int], params: SamplingParams, n: int,
                      stop_ids=()) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0, -1].float()
        tok = int(controlled_ref(logits, prompt, out, params, stop_ids).argmax())
        out.append(tok)
        seq.append(tok)
    return out


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model(seed=3, vocab=64)


PENALIZED = SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.3,
                           frequency_penalty=0.4, presence_penalty=0.2,
                           logit_bias={5: 0.5, 17: -1.0}, ignore_eos=True)
PROMPT = [3, 9, 4, 3, 9, 4, 3, 9, 4, 3]


def test_greedy_with_penalties_equals_a_plain_torch_loop(hf) -> None:
    engine = tiny_engine(hf)
    got = engine.generate([PROMPT], PENALIZED)[0].token_ids
    assert got == _reference_greedy(hf, PROMPT, PENALIZED, 24)
    plain = engine.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0,
                                                     ignore_eos=True))[0].token_ids
    assert got != plain  # the controls changed something


def test_greedy_speculative_with_penalties_equals_plain(hf) -> None:
    """n-gram drafts and an oracle that drafts the right answer: verify rows see the same
    processed distribution as plain decoding, so the output is the same; the oracle's drafts
    are accepted (its row j counts drafts 0..j-1 as outputs)."""
    plain = tiny_engine(hf).generate([PROMPT], PENALIZED)[0].token_ids
    ngram = tiny_engine(hf, spec=SpecConfig(method="ngram", num_draft_tokens=3))
    assert ngram.generate([PROMPT], PENALIZED)[0].token_ids == plain
    oracle = tiny_engine(hf, spec=SpecConfig(method="ngram", num_draft_tokens=4),
                         drafter=OracleDrafter(PROMPT + plain, k=4))
    assert oracle.generate([PROMPT], PENALIZED)[0].token_ids == plain
    assert oracle.stats["num_accepted_tokens"] >= len(plain) // 2


def test_min_tokens_masks_stop_tokens_until_reached(hf) -> None:
    engine = tiny_engine(hf)
    stop = 11
    # a bias that makes the stop token the argmax at every step
    greedy = dict(max_tokens=20, temperature=0, stop_token_ids=[stop], logit_bias={stop: 50.0})
    assert engine.generate([PROMPT], SamplingParams(**greedy))[0].token_ids == [stop]
    out = engine.generate([PROMPT], SamplingParams(min_tokens=6, **greedy))[0]
    assert len(out.token_ids) == 7 and out.token_ids[-1] == stop
    assert stop not in out.token_ids[:6] and out.finish_reason == "stop"
    spec = tiny_engine(hf, spec=SpecConfig(method="ngram", num_draft_tokens=3))
    assert spec.generate([PROMPT], SamplingParams(min_tokens=6, **greedy))[0].token_ids == \
        out.token_ids


def test_min_p_of_one_samples_only_the_likeliest_token(hf) -> None:
    """min_p = 1 keeps only the tokens as likely as the likeliest: a sampled request at a high
    temperature then emits greedy decoding's tokens, plain and speculative (drafts verified
    against the min_p distribution); without min_p the same seed strays."""
    greedy = tiny_engine(hf).generate([PROMPT], SamplingParams(
        max_tokens=16, temperature=0, ignore_eos=True))[0].token_ids
    hot = dict(max_tokens=16, temperature=5.0, seed=7, ignore_eos=True)
    for spec in (None, SpecConfig(method="ngram", num_draft_tokens=3)):
        engine = tiny_engine(hf, spec=spec)
        assert engine.generate([PROMPT], SamplingParams(min_p=1.0, **hot))[0].token_ids == greedy
        assert engine.generate([PROMPT], SamplingParams(**hot))[0].token_ids != greedy


def test_allowed_token_ids_are_all_a_request_emits(hf) -> None:
    """vLLM's allowed_token_ids: greedy picks the likeliest allowed token at every step (a torch
    loop's tokens), plain and speculative; a sampled request draws only allowed tokens."""
    allowed = [4, 9, 17, 30, 41]
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                            allowed_token_ids=allowed)
    ref = _reference_greedy(hf, PROMPT, greedy, 16)
    assert set(ref) <= set(allowed) and len(set(ref)) > 1
    for spec in (None, SpecConfig(method="ngram", num_draft_tokens=3)):
        engine = tiny_engine(hf, spec=spec)
        assert engine.generate([PROMPT], greedy)[0].token_ids == ref
        sampled = engine.generate([PROMPT] * 4, SamplingParams(
            max_tokens=16, temperature=1.0, seed=5, ignore_eos=True, allowed_token_ids=allowed))
        assert all(set(o.token_ids) <= set(allowed) for o in sampled)


def test_bad_words_are_never_completed(hf) -> None:
    """vLLM's bad_words as token sequences: a two-token word taken from greedy's own output
    never appears in it again, and the output is a torch loop's with the word's last token
    banned after its first; plain and speculative."""
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    out = tiny_engine(hf).generate([PROMPT], plain)[0].token_ids
    word = out[2:4]
    banned = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                            bad_words_token_ids=[word])
    ref = _reference_greedy(hf, PROMPT, banned, 16)
    pairs = list(zip(ref, ref[1:], strict=False))
    assert tuple(word) not in pairs and ref != out
    for spec in (None, SpecConfig(method="ngram", num_draft_tokens=3)):
        assert tiny_engine(hf, spec=spec).generate([PROMPT], banned)[0].token_ids == ref


def test_controls_do_not_leak_into_batch_mates(hf) -> None:
    engine = tiny_engine(hf)
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = engine.generate([PROMPT[:5]], plain)[0].token_ids
    both = engine.generate([PROMPT, PROMPT[:5]], [PENALIZED, plain])
    assert both[1].token_ids == alone
    assert both[0].token_ids == _reference_greedy(hf, PROMPT, PENALIZED, 24)


def test_top_logprobs_are_the_models_top_alternatives(hf) -> None:
    engine = tiny_engine(hf)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, logprobs=True,
                                                   top_logprobs=5))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT + out.token_ids])).logits[0].float(), -1)
    for i, alts in enumerate(out.top_logprobs):
        row = ref[len(PROMPT) - 1 + i]
        values, ids = row.topk(5)
        assert [t for t, _ in alts] == ids.tolist()
        assert [lp for _, lp in alts] == pytest.approx(values.tolist(), abs=1e-4)
        assert alts[0] == (out.token_ids[i], pytest.approx(out.logprobs[i], abs=1e-6))


def test_sampling_controls_are_validated_naming_the_field() -> None:
    cases = [dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")),
             dict(repetition_penalty=0.0), dict(logit_bias={1: 101.0}),
             dict(logit_bias={-1: 1.0}), dict(logit_bias={i: 1.0 for i in range(301)}),
             dict(min_tokens=65, max_tokens=64), dict(top_logprobs=21), dict(min_p=1.5),
             dict(min_p=-0.1), dict(allowed_token_ids=[]), dict(allowed_token_ids=[-1]),
             dict(allowed_token_ids=list(range(1025))), dict(truncate_prompt_tokens=0),
             dict(bad_words=[" "]), dict(bad_words_token_ids=[list(range(17))])]
    for kw in cases:
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(**kw)
        assert e.value.param == next(iter(kw)) if "max_tokens" not in kw else "min_tokens"
    assert SamplingParams(logit_bias={"7": 1}).logit_bias == {7: 1.0}  # JSON keys


@pytest.mark.parametrize("param, kwargs", [("logit_bias", dict(logit_bias={64: 1.0})),
                                           ("stop_token_ids", dict(stop_token_ids=[3, 64])),
                                           ("allowed_token_ids",
                                            dict(allowed_token_ids=[3, 64]))])
def test_token_ids_past_the_vocabulary_are_refused(hf, param, kwargs) -> None:
    engine = tiny_engine(hf)
    with pytest.raises(SamplingParamsError, match="vocabulary size 64") as e:
        engine.add_request(PROMPT, SamplingParams(**kwargs))
    assert e.value.param == param
    assert not engine.has_unfinished()


# ------------------------------------------------------------------ the distribution, T = 1

N = 100_000
VOCAB = 6
TV_THRESHOLD = 0.012  # a correct sampler sits near 0.004 at 100k samples


def _tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    return 0.5 * (counts / counts.sum() - p.double()).abs().sum().item()


def _sampled_round(k: int):
    """N requests sharing logits, prompt and controls; k point-mass drafts (token 2 first)."""
    params = SamplingParams(frequency_penalty=1.2, presence_penalty=0.3, repetition_penalty=1.5,
                            logit_bias={4: 1.0}, min_p=0.5)
    prompt = [1, 2]
    tables = _tables(VOCAB, N + 1, k + 1)
    tables.token_table[1:, :2] = torch.tensor(prompt)
    tables.admit(1, prompt, [], params.logit_bias, [])
    for name in ("token_counts", "counted_lens", "bias_ids", "bias_values", "stop_ids"):
        t = getattr(tables, name)
        t[2:] = t[1]
    rows = list(range(1, N + 1))
    ctl = _step_controls(tables, rows, [params] * N, [2] * N)
    base = torch.tensor([0.5, 1.0, 1.5, 0.2, -0.3, 0.8])
    logits = base.repeat(N * (k + 1), 1)
    drafts = torch.tensor([2, 2][:k]).repeat(N, 1)
    seq_lens = torch.full((N,), 2)
    ones = torch.ones(N)
    tokens, accept, _ = emit(logits, drafts, torch.full((N,), k), None, ones, ones,
                             torch.full((N,), -1), torch.arange(N) * 7 + 3, seq_lens, False,
                             controls=ctl)
    targets = [torch.softmax(controlled_ref(base, prompt, [2] * j, params), -1)
               for j in range(k + 1)]
    return tokens, accept, targets


def test_sampled_first_token_follows_the_processed_distribution() -> None:
    tokens, _, (target,) = _sampled_round(0)
    assert _tv(tokens[:, 0], target) < TV_THRESHOLD
    raw = torch.softmax(torch.tensor([0.5, 1.0, 1.5, 0.2, -0.3, 0.8]), -1)
    assert _tv(tokens[:, 0], raw) > 3 * TV_THRESHOLD  # the test sees the controls
    # min_p 0.5 masks token 3 (0.45 of the likeliest's probability): never drawn
    assert target[3] == 0 and not (tokens[:, 0] == 3).any()


def test_rejection_sampling_verifies_against_the_processed_distribution(monkeypatch) -> None:
    """With drafts [2, 2]: the second emitted token, given the first draft accepted, follows
    the processed distribution that counts that draft (and fails to when the per-row
    correction is removed)."""
    tokens, accept, targets = _sampled_round(2)
    assert _tv(tokens[:, 0], targets[0]) < TV_THRESHOLD
    second = tokens[accept >= 2, 1]
    assert second.numel() > N // 10
    assert _tv(second, targets[1]) < TV_THRESHOLD * (N / second.numel()) ** 0.5
    # without the verify-row correction (every row sees only the outputs so far)
    real = apply_controls

    def no_draft_counts(logits, ctl, draft_tokens, seq_lens):
        bs, k = draft_tokens.shape
        x = real(logits.view(bs, k + 1, -1)[:, 0].contiguous(), ctl,
                 draft_tokens[:, :0], seq_lens)
        return x[:, None].expand(bs, k + 1, -1).reshape(bs * (k + 1), -1)

    monkeypatch.setattr("draftgraph.spec.verify.apply_controls", no_draft_counts)
    tokens, accept, targets = _sampled_round(2)
    second = tokens[accept >= 2, 1]
    assert _tv(second, targets[1]) > 3 * TV_THRESHOLD * (N / second.numel()) ** 0.5


def test_processed_distribution_of_a_controlled_row_is_what_emit_samples() -> None:
    """The controlled logits feed the same processed_probs as plain sampling (top-k here)."""
    tables = _tables(VOCAB, 2, 1)
    params = SamplingParams(logit_bias={0: 3.0})
    tables.admit(1, [5], [], params.logit_bias, [])
    ctl = _step_controls(tables, [1], [params], [1])
    logits = torch.zeros(1, VOCAB)
    x = apply_controls(logits, ctl, torch.zeros(1, 0, dtype=torch.int64), torch.tensor([1]))
    probs = processed_probs(x, torch.ones(1), torch.ones(1), torch.tensor([1]))
    assert probs[0].tolist() == [1.0, 0, 0, 0, 0, 0]


def test_requests_without_extras_replay_the_plain_graph_set(hf) -> None:
    """Top-N and controls cost nothing to a request that asks for neither: its steps replay
    the plain decode body (no top-N lanes, no control lanes); one that asks replays its
    extras twin."""
    engine = tiny_engine(hf)
    plain, extras = engine.decode_graphs, engine.extras_graphs[engine.decode_graphs]
    assert "top_ids" not in plain.body.outputs._offsets
    assert "repetition_penalty" not in plain.body.inputs._offsets
    engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                             logprobs=True))
    assert plain._launched == 5 and extras._launched == 0
    engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                             logprobs=True, top_logprobs=2))
    assert plain._launched == 5 and extras._launched == 5


def test_speculative_top_logprobs_equal_plain_ones(hf) -> None:
    """Verify rows write their alternatives too: a speculative run (an oracle drafting the
    right answer, so several rows are accepted per step) reports the same top-N as plain
    decoding, token for token."""
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=True,
                        top_logprobs=3)
    plain = tiny_engine(hf).generate([PROMPT], sp)[0]
    spec = tiny_engine(hf, spec=SpecConfig(method="ngram", num_draft_tokens=3),
                       drafter=OracleDrafter(PROMPT + plain.token_ids, k=3))
    out = spec.generate([PROMPT], sp)[0]
    assert spec.stats["num_accepted_tokens"] > 0
    assert out.token_ids == plain.token_ids
    for a, b in zip(out.top_logprobs, plain.top_logprobs, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", [None, SpecConfig(method="ngram", num_draft_tokens=3)])
def test_gpu_extras_graphs_equal_the_eager_tail(spec) -> None:
    """The extras graph sets (top-N and controls captured) give the eager run's tokens and
    alternatives, with a plain request batched alongside; buffers keep their addresses."""
    from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig

    def engine(use_graphs: bool):
        return LLMEngine(EngineConfig(
            model="random:smollm2-135m", device="cuda", dtype="float32", use_graphs=use_graphs,
            seed=0, cache=CacheConfig(kv_cache_tokens=8192),
            scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=1024),
            spec=spec or SpecConfig()))

    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5], [11, 12, 13]]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=True,
                             top_logprobs=5, repetition_penalty=1.3, frequency_penalty=0.5,
                             logit_bias={9: 3.0}, min_tokens=4,
                             bad_words_token_ids=[[7], [5, 6]]),
              SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True,
                             min_p=0.05, allowed_token_ids=list(range(0, 4000, 7)))]
    graph = engine(True)
    counts = graph.controls.token_counts.data_ptr()
    a = engine(False).generate(prompts, params)
    b = graph.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a[0].top_logprobs, b[0].top_logprobs, strict=True):
        assert [t for t, _ in x] == [t for t, _ in y]
    assert graph.controls.token_counts.data_ptr() == counts
    assert graph.extras_graphs[graph.decode_graphs]._launched > 0


def test_controlled_requests_survive_preemption_with_the_same_output(hf) -> None:
    """A preempted request gets its row of the control tables rewritten (counts of the
    outputs it already has) when it starts again, maybe on a row another request used; its
    tokens equal an unhurried run's. Mixed with plain requests."""
    prompts = [[(7 * i + j) % 60 + 1 for j in range(12 + 3 * i)] for i in range(6)]
    params = [PENALIZED if i % 2 == 0 else
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for i in range(6)]
    ref = tiny_engine(hf).generate(prompts, params)
    small = tiny_engine(hf, kv_tokens=100, budget=32)
    outs = small.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert ref[0].token_ids == _reference_greedy(hf, prompts[0], PENALIZED, 24)


def test_the_extras_twin_shares_the_drafters_binding(hf) -> None:
    """The speculative extras twin must not bind the drafter again (a second bind would give
    it a new KV pool and buffers while the plain body's graphs keep the old ones)."""
    class Counting(OracleDrafter):
        binds = 0

        def bind(self, target) -> None:
            Counting.binds += 1

    drafter = Counting([0] * 64, k=3)
    engine = tiny_engine(hf, spec=SpecConfig(method="ngram", num_draft_tokens=3),
                         drafter=drafter)
    twin = engine.extras_graphs[engine.spec_graphs].body
    assert Counting.binds == 1 and twin.drafter is engine.spec_graphs.body.drafter
