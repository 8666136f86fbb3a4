"""The drafter seam: any Drafter plugs into the one speculative step body; n-gram's device
proposal equals its eager twin; the one sampling tail with no drafts is plain sampling; the
speculative flags are validated and name the flag."""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_engine, tiny_hf_model

from draftgraph.config import SpecConfig
from draftgraph.engine.sampling import SamplingParams
from draftgraph.runtime.sampling import sample
from draftgraph.spec import DraftContext, Drafter, NgramDrafter, Proposal, emit, make_drafter

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _ctx(table, rows, seq_lens, max_draft):
    bs = len(rows)
    return DraftContext(torch.tensor(rows), torch.tensor(seq_lens),
                        table[torch.tensor(rows), torch.tensor(seq_lens) - 1],
                        torch.tensor(max_draft), table, torch.zeros(bs),
                        torch.zeros(bs, dtype=torch.int64))


def test_ngram_drafter_on_the_device_equals_its_eager_twin():
    g = torch.Generator().manual_seed(3)
    table = torch.zeros(9, 300, dtype=torch.int64)
    rows, lens = [1, 4, 2, 7, 8], [2, 40, 120, 299, 17]
    for r, n in zip(rows, lens, strict=True):
        motif = torch.randint(0, 20, (int(torch.randint(2, 9, (1,), generator=g)),),
                              generator=g)
        table[r, :n] = motif.repeat(n // motif.numel() + 1)[:n]
    table[7, 100:140] = torch.randint(0, 1000, (40,), generator=g)  # a run that never recurs
    drafter = NgramDrafter(1, 4, 5)
    ctx = _ctx(table, rows, lens, [5, 3, 0, 5, 2])
    dev, ref = drafter.propose(ctx), drafter.propose_ref(ctx)
    assert torch.equal(dev.num_drafts, ref.num_drafts)
    assert torch.equal(dev.draft_tokens * (torch.arange(5) < dev.num_drafts[:, None]),
                       ref.draft_tokens)
    assert dev.num_drafts.tolist()[2] == 0 and dev.num_drafts.max() > 0  # capped, and found
    assert (dev.num_drafts <= ctx.max_draft).all() and dev.draft_probs is None


def test_emit_with_no_drafts_is_plain_sampling():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    temp = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.3, 0.5])
    top_p = torch.tensor([1.0, 0.9, 1.0, 1.0, 0.8, 1.0])
    top_k = torch.tensor([-1, 5, -1, 3, -1, 10])
    seeds, pos = torch.arange(6) + 11, torch.arange(6) * 7 + 3
    no = torch.zeros(6, 0, dtype=torch.int64)
    tokens, acc, lps = emit(logits, no, torch.zeros(6, dtype=torch.int64), None, temp, top_p,
                            top_k, seeds, pos, greedy=False)
    assert torch.equal(tokens[:, 0], sample(logits, temp, top_p, top_k, seeds, pos))
    assert acc.tolist() == [1] * 6
    ref_lp = torch.log_softmax(logits, -1).gather(1, tokens)
    torch.testing.assert_close(lps, ref_lp)
    g_tokens, _, g_lps = emit(logits, no, torch.zeros(6, dtype=torch.int64), None,
                              torch.zeros(6), top_p, top_k, seeds, pos, greedy=True)
    assert torch.equal(g_tokens[:, 0], logits.argmax(-1))
    torch.testing.assert_close(g_lps[:, 0], torch.log_softmax(logits, -1).amax(-1))


class WrongDrafter(Drafter):
    """Always proposes k copies of one token the model does not pick: every draft rejected."""

    name = "wrong"

    def __init__(self, token: int, k: int = 3) -> None:
        super().__init__(k)
        self.token = token
        self.calls = 0

    def propose(self, ctx):
        self.calls += 1
        bs = ctx.seq_lens.shape[0]
        drafts = torch.full((bs, self.k), self.token, dtype=torch.int64)
        return Proposal(drafts, ctx.max_draft.clone())


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model(seed=2)


def test_any_drafter_plugs_into_the_step_body_and_stays_lossless(hf):
    prompts = [[3, 4, 5, 6, 7, 8], list(range(20, 50)), [9] * 11]
    plain = tiny_engine(hf).generate(prompts, GREEDY)
    used = {t for o in plain for t in o.token_ids}
    token = next(t for t in range(128) if t not in used)
    drafter = WrongDrafter(token)
    engine = tiny_engine(hf, spec=SpecConfig(method="ngram", num_draft_tokens=3),
                         drafter=drafter)
    assert engine.spec_graphs is not None and engine.spec_graphs.body.drafter is drafter
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert drafter.calls > 0 and engine.stats["num_draft_tokens"] > 0
    assert engine.stats["num_accepted_tokens"] == 0  # every draft was rejected
    assert engine.num_free_kv_slots() == engine.slots.allocator.usable_slots


def test_speculative_flags_are_validated_and_name_the_flag():
    with pytest.raises(ValueError, match="--speculative must be one of: ngram, chain"):
        SpecConfig(method="medusa")
    with pytest.raises(ValueError, match="no chain head ships for model 'random:tiny'"):
        make_drafter(SpecConfig(method="chain"), model="random:tiny")
    with pytest.raises(ValueError, match="--speculative block needs --draft-head"):
        make_drafter(SpecConfig(method="block"), model="random:tiny")
    with pytest.raises(ValueError, match="--draft-model"):
        SpecConfig(method="draft")
    with pytest.raises(ValueError, match="--draft-head is for"):
        SpecConfig(method="ngram", draft_head="x")
    assert isinstance(make_drafter(SpecConfig(method="ngram")), NgramDrafter)
    assert make_drafter(SpecConfig()) is None
    with pytest.raises(ValueError, match="--draft-head 'some/dir': no config.json"):
        make_drafter(SpecConfig(method="block", draft_head="some/dir"))
    from draftgraph.models.presets import preset_config
    from draftgraph.spec.chain_head import ChainHeadDrafter

    chain = make_drafter(SpecConfig(method="chain", draft_head="random:layers=2"),
                         target_config=preset_config("tiny"))
    assert isinstance(chain, ChainHeadDrafter) and chain.head.config.num_hidden_layers == 2


def test_kv_sizing_always_fits_one_request_of_max_model_len():
    from draftgraph.config import CacheConfig
    from draftgraph.runtime.slot_space import kv_slots

    cpu = torch.device("cpu")

    def SchedulerConfig(**kw):  # noqa: N802  (the CPU's defaults, as EngineConfig resolves them)
        from draftgraph.config import SchedulerConfig as S

        s = S(**kw)
        s.resolve(gpu=False)
        return s

    small = kv_slots(CacheConfig(), SchedulerConfig(max_num_seqs=1), 100, 1000, cpu)
    assert small == 100 + 2  # one request (and the dummy page), not the CPU default
    default = kv_slots(CacheConfig(), SchedulerConfig(), 8192, 1000, cpu)
    assert default == 8192 + 2  # the CPU default covers one full-length request
    long = kv_slots(CacheConfig(page_size=16), SchedulerConfig(), 20000, 1000, cpu)
    assert long >= 20000 + 16
    assert kv_slots(CacheConfig(kv_cache_tokens=64), SchedulerConfig(), 20000, 1000,
                    cpu) == 65  # the flag wins
