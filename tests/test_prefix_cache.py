"""Automatic prefix caching (`--enable-prefix-caching`, runtime/prefix_cache.py): the cache's
blocks, references and eviction over the paged allocator; in the engine, prompts that start
with cached blocks compute only the rest and give plain decoding's tokens (every drafter),
also when the KV pool is short (eviction, preemption); no slot is lost."""

from __future__ import annotations

import gc
import re

import httpx
import pytest
import torch
from _tiny import tiny_engine, tiny_loaded

from draftgraph.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams
from draftgraph.models.heads import random_head
from draftgraph.runtime.kv_cache import OutOfKVSlots, PagedAllocator
from draftgraph.runtime.prefix_cache import PrefixCache
from draftgraph.spec.block import BlockHeadDrafter
from draftgraph.spec.chain_head import ChainHeadDrafter
from draftgraph.spec.draft_model import DraftModelDrafter

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
BASE = [(7 * i) % 90 + 3 for i in range(75)]
# one after another: later prompts find 64, 32, 0 and 64 tokens of blocks cached before them
PROMPTS = [BASE + [5, 6, 7], BASE + [9, 10], BASE[:40] + [1, 2, 3, 4], [11, 12] * 20,
           BASE + [5, 6, 7]]


def _cache(num_slots: int = 64 + 1, page_size: int = 1) -> tuple[PagedAllocator, PrefixCache]:
    allocator = PagedAllocator(num_slots + page_size - 1, page_size)
    return allocator, PrefixCache(allocator, block_tokens=4)


def _sequence(allocator: PagedAllocator, n: int) -> list[int]:
    pages: list[int] = []
    allocator.extend(pages, 0, n)
    return pages


def test_blocks_are_found_by_their_whole_prefix_and_referenced():
    allocator, cache = _cache()
    toks = list(range(100, 111))  # 11 tokens: two full blocks of 4 computed
    pages = _sequence(allocator, 11)
    first_two = pages[:8]
    cache.release(toks, pages, 10, [])
    assert cache.num_blocks == 2 and allocator.num_free_slots == 64
    hit = cache.match(toks + [1, 2], 12)
    assert cache.pages(hit) == first_two
    assert cache.match(toks, 7) == hit[:1]  # the limit: one block below 7 tokens
    other = toks[:5] + [0] + toks[6:]  # the second block differs: only the first found
    assert cache.match(other, 12) == hit[:1]
    assert cache.match([0] + toks[1:], 12) == []  # blocks are found from the start only
    assert cache.stats["prefix_cache_hits"] == 8 + 4 + 4
    # referenced blocks are never evicted: only the pages free on the allocator remain
    assert allocator.num_free_slots == 64 - 8
    assert cache.evict(100) == 0


def test_a_release_caches_new_blocks_frees_copies_and_drops_references():
    allocator, cache = _cache()
    toks = list(range(12))
    a = _sequence(allocator, 12)
    cache.release(toks, a, 12, [])  # three blocks cached
    hit = cache.match(toks, 11)  # two borrowed by a second request
    b = cache.pages(hit)
    allocator.extend(b, 8, 8)  # computes positions 8 .. 15
    c = _sequence(allocator, 8)  # a third request computes the same first 8 tokens itself
    c_pages = list(c)
    cache.release(toks[:8], c, 8, [])  # its copies are spare: freed
    assert cache.num_blocks == 3
    assert all(p in allocator._free_pages for p in c_pages)
    cache.release(toks + [50, 51, 52, 53], b, 16, hit)  # a fourth block (new), refs dropped
    assert cache.num_blocks == 4 and b == [] and hit == []
    assert allocator.num_free_slots == 64  # everything cached is evictable again


def test_eviction_takes_a_chains_deepest_blocks_first_and_the_allocator_asks_for_it():
    allocator, cache = _cache(num_slots=16 + 1)
    toks = list(range(16))
    cache.release(toks, _sequence(allocator, 16), 16, [])
    assert allocator.num_free_slots == 16 and len(allocator._free_pages) == 0
    pages: list[int] = []
    allocator.extend(pages, 0, 4)  # short: one block evicted, the deepest
    assert len(cache.match(toks, 16)) == 3
    with pytest.raises(OutOfKVSlots):  # the three left are referenced now
        allocator.extend(pages, 4, 4)


def test_evicted_pages_are_handed_out_in_ascending_order_along_a_chain():
    """Blocks evicted together give their pages back in one call, in the order a call per
    block gave: a released chain (evicted deepest first) comes back in ascending slots."""
    allocator, cache = _cache(num_slots=16 + 1)
    cache.release(list(range(16)), _sequence(allocator, 16), 16, [])  # slots 1 .. 16
    pages: list[int] = []
    allocator.extend(pages, 0, 8)  # the two deepest blocks evicted: slots 9 .. 16
    assert pages == list(range(9, 17))
    assert cache.num_blocks == 2


def test_cached_blocks_add_no_objects_for_the_cycle_collector():
    """A cached block is an id and tuples of ints in the cache's dicts, which Python's cycle
    collector does not track: a thousand blocks leave the tracked objects (what a full
    collection walks, and what triggers one) as they were (a Block object and a page list
    per block were 2,000 more)."""
    allocator, cache = _cache(num_slots=4000 + 1)
    toks = list(range(4000))
    gc.collect()
    before = len(gc.get_objects())
    cache.release(toks, _sequence(allocator, 4000), 4000, [])
    gc.collect()
    assert cache.num_blocks == 1000
    assert len(gc.get_objects()) - before < 100


def test_blocks_of_whole_pages():
    allocator = PagedAllocator(64 + 4, page_size=4)
    cache = PrefixCache(allocator, block_tokens=6)  # rounded up to two pages
    assert cache.block_tokens == 8 and cache.pages_per_block == 2
    toks = list(range(20))
    pages = _sequence(allocator, 20)
    cache.release(toks, pages, 19, [])
    hit = cache.match(toks, 19)
    assert len(hit) == 2 and all(len(cache.pages([b])) == 2 for b in hit)


def _run_one_by_one(engine, prompts, params):
    return [engine.generate([p], params)[0] for p in prompts]


@pytest.fixture(scope="module")
def plain(hf):
    return [o.token_ids for o in tiny_engine(hf).generate(PROMPTS, GREEDY)]


def _drafter(hf, kind: str):
    cfg = tiny_loaded(hf).config
    if kind == "chain":
        return ChainHeadDrafter(random_head(cfg, "", seed=3), 3)
    if kind == "block":
        return BlockHeadDrafter(random_head(cfg, "block_size=5,window=8", seed=3, kind="block"))
    return None


@pytest.mark.parametrize("method", ["plain", "ngram", "chain", "block"])
def test_cached_prompts_give_plain_decodings_tokens(hf, plain, method):
    spec = SpecConfig(method="ngram", num_draft_tokens=3) if method != "plain" else None
    engine = tiny_engine(hf, spec=spec, drafter=_drafter(hf, method), prefix_caching=True)
    outs = _run_one_by_one(engine, PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert [o.metrics["cached_tokens"] for o in outs] == [0, 64, 32, 0, 64]
    assert engine.stats["prefix_cache_hits"] == 64 + 32 + 64
    if method == "ngram":  # drafts from the token table: the cached rows' tokens written
        ref = tiny_engine(hf, spec=spec)
        _run_one_by_one(ref, PROMPTS, GREEDY)
        assert engine.stats["num_accepted_tokens"] > 0
        for key in ("num_draft_tokens", "num_accepted_tokens"):
            assert engine.stats[key] == ref.stats[key]
    elif method != "plain":  # random heads: drafted, rarely accepted
        assert engine.stats["num_draft_tokens"] > 0


def test_a_cached_requests_rows_hold_the_cached_slots_and_tokens(hf):
    """What no forward writes for a request admitted past cached blocks: its rows of
    req_to_token (the blocks' slots) and of the token table (their tokens; drafters read
    it), on a row another request used in between."""
    engine = tiny_engine(hf, prefix_caching=True)
    engine.generate([PROMPTS[0]], GREEDY)
    engine.generate([[1, 2, 3] * 30], GREEDY)  # the same row, other tokens and slots
    engine.add_request(PROMPTS[1], GREEDY, request_id="c")
    engine.step()
    req = engine.requests["c"]
    assert req.num_cached_tokens == 64
    blocks = engine.prefix_cache.pages(req.cached_blocks)
    row = req.req_pool_idx
    assert engine.slots.req_pool.req_to_token[row, :64].tolist() == blocks
    assert engine.slots.token_table[row, :64].tolist() == PROMPTS[1][:64]


def test_penalties_count_the_cached_prompt_tokens(hf):
    penalized = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                               repetition_penalty=1.5, frequency_penalty=0.5)
    ref = [o.token_ids for o in tiny_engine(hf).generate(PROMPTS, penalized)]
    engine = tiny_engine(hf, prefix_caching=True)
    outs = _run_one_by_one(engine, PROMPTS, penalized)
    assert [o.token_ids for o in outs] == ref
    assert engine.stats["prefix_cache_hits"] > 0


def test_a_drafters_kv_is_cached_with_the_targets(hf, plain):
    """The target as its own draft model accepts every draft only while the draft model's
    KV is right everywhere: at the cached positions too, which no step of the later
    requests computes (the slot space's one slot per position serves both pools)."""
    spec = SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False)
    engine = tiny_engine(hf, spec=spec, drafter=DraftModelDrafter(tiny_loaded(hf).model, 4),
                         prefix_caching=True)
    outs = _run_one_by_one(engine, PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert engine.stats["prefix_cache_hits"] == 64 + 32 + 64
    s = engine.stats
    assert s["num_draft_tokens"] > 60 and s["num_accepted_tokens"] == s["num_draft_tokens"]


def test_a_conversations_next_turn_finds_the_last_reply_cached(hf):
    """A request's generated tokens are cached with its prompt: the next turn (prompt,
    reply, a new message) computes only what follows the last full block of the reply."""
    engine = tiny_engine(hf, prefix_caching=True)
    first = engine.generate([PROMPTS[0]], GREEDY)[0]
    turn = PROMPTS[0] + first.token_ids + [4, 5, 6]
    second = engine.generate([turn], GREEDY)[0]
    assert second.metrics["cached_tokens"] == (len(PROMPTS[0]) + len(first.token_ids) - 1) \
        // 16 * 16
    assert second.token_ids == tiny_engine(hf).generate([turn], GREEDY)[0].token_ids


def test_a_running_requests_blocks_are_found_by_arrivals(hf, plain):
    """Blocks are cached as soon as they are computed: a prompt arriving while another with
    the same beginning still decodes finds its blocks; of two that arrive together the second
    waits for the first's blocks (`test_a_burst_after_one_prefix_computes_it_once`)."""
    engine = tiny_engine(hf, prefix_caching=True)
    engine.add_request(PROMPTS[0], GREEDY, request_id="a")
    for _ in range(3):
        engine.step()
    assert not engine.requests["a"].finished
    engine.add_request(PROMPTS[1], GREEDY, request_id="b")
    engine.add_request(PROMPTS[1], GREEDY, request_id="c")
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [outs[r].token_ids for r in "abc"] == [plain[0], plain[1], plain[1]]
    assert outs["b"].metrics["cached_tokens"] == outs["c"].metrics["cached_tokens"] == 64
    allocator = engine.slots.allocator
    assert allocator.num_free_slots == allocator.usable_slots
    # together: e borrows the blocks d computes; each block is cached once
    engine = tiny_engine(hf, prefix_caching=True)
    d, e = engine.generate([PROMPTS[3], PROMPTS[3]], GREEDY)
    assert d.token_ids == e.token_ids == plain[3]
    assert (d.metrics["cached_tokens"], e.metrics["cached_tokens"]) == (0, 32)
    assert engine.prefix_cache.num_blocks == (len(PROMPTS[3]) + 24 - 1) // 16
    assert engine.slots.allocator.num_free_slots == engine.slots.allocator.usable_slots


def test_a_burst_after_one_prefix_computes_it_once(hf):
    """Prompts that arrive together after the same 128 tokens: the first computes them, the
    others wait for its blocks (SGLang's in-batch prefix caching) while a prompt with other
    tokens behind them is admitted at once; every output is plain decoding's."""
    shared = [(11 * i) % 90 + 3 for i in range(128)]
    prompts = [shared + [4, 5], shared + [6], [7, 8, 9] * 10, shared + [5, 4, 3]]
    ref = [o.token_ids for o in tiny_engine(hf, budget=256).generate(prompts, GREEDY)]
    engine = tiny_engine(hf, budget=256, prefix_caching=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, GREEDY, request_id=str(i))
    engine.step()
    running = {r.request_id for r in engine.scheduler.running}
    assert running == {"0", "2"}
    assert [r.request_id for r in engine.scheduler.waiting] == ["1", "3"]
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [outs[str(i)].token_ids for i in range(4)] == ref
    assert [outs[str(i)].metrics["cached_tokens"] for i in range(4)] == [0, 128, 0, 128]
    assert engine.stats["prefix_cache_hits"] == 256


def test_a_request_waits_only_for_blocks_it_can_borrow(hf):
    """No wait where the running prefill shares no full block past the cache, where it
    has computed it already, or for a request that scores its prompt (it computes every
    position)."""
    engine = tiny_engine(hf, budget=256, prefix_caching=True)
    shared = [(11 * i) % 90 + 3 for i in range(40)]
    engine.add_request(shared + [1], GREEDY, request_id="a")
    engine.add_request(shared[:15] + [2] * 30, GREEDY, request_id="b")  # < one block shared
    engine.add_request(shared + [3], SamplingParams(max_tokens=2, prompt_logprobs=1),
                       request_id="c")
    engine.add_request(shared[:20], GREEDY, request_id="d")  # block 0 shared, then its end
    engine.step()
    assert {r.request_id for r in engine.scheduler.running} == {"a", "b", "c"}
    assert [r.request_id for r in engine.scheduler.waiting] == ["d"]
    engine.step()  # a's blocks computed and cached: d admitted past them
    assert engine.requests["d"].num_cached_tokens == 16


def test_without_the_cache_nothing_is_cached(hf):
    outs = _run_one_by_one(tiny_engine(hf), PROMPTS[:2], GREEDY)
    assert all("cached_tokens" not in o.metrics for o in outs)


def test_seeded_sampling_from_a_cached_prefix_draws_the_same_tokens(hf):
    sampled = SamplingParams(max_tokens=24, temperature=0.9, seed=4, ignore_eos=True)
    ref = [o.token_ids for o in tiny_engine(hf).generate(PROMPTS, sampled)]
    outs = _run_one_by_one(tiny_engine(hf, prefix_caching=True), PROMPTS, sampled)
    assert [o.token_ids for o in outs] == ref


def test_a_request_scoring_its_prompt_computes_it_all(hf):
    scored = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2)
    ref = tiny_engine(hf).generate([PROMPTS[1]], scored)[0]
    engine = tiny_engine(hf, prefix_caching=True)
    engine.generate([PROMPTS[0]], GREEDY)
    out = engine.generate([PROMPTS[1]], scored)[0]
    assert out.metrics["cached_tokens"] == 0
    assert out.prompt_logprobs == pytest.approx(ref.prompt_logprobs, abs=1e-5)


def test_a_short_pool_evicts_and_preempts_and_loses_no_slot(hf, plain):
    """Batched, in a pool too small for them all: cached blocks are evicted for new work,
    requests preempted find their blocks again; every slot is free or evictable at the end."""
    others = [[(13 * j + 7 * i) % 90 + 3 for i in range(70)] for j in range(1, 7)]
    prompts = PROMPTS + others + PROMPTS
    ref = [o.token_ids for o in tiny_engine(hf).generate(others, GREEDY)]
    engine = tiny_engine(hf, kv_tokens=300, budget=32, prefix_caching=True)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain + ref + plain
    assert engine.stats["prefix_cache_hits"] > 0
    assert engine.prefix_cache._next_id - 1 > engine.prefix_cache.num_blocks  # evicted
    allocator = engine.slots.allocator
    assert allocator.num_free_slots == allocator.usable_slots
    assert engine.prefix_cache.num_evictable_pages == engine.prefix_cache.num_blocks * 16
    engine.prefix_cache.clear()
    assert engine.prefix_cache.num_blocks == 0
    assert len(allocator._free_pages) * allocator.page_size == allocator.usable_slots


def test_prefix_caching_is_refused_under_tensor_parallelism():
    with pytest.raises(ValueError, match="--enable-prefix-caching"):
        EngineConfig(model="random:tiny", device="cpu", tensor_parallel_size=2,
                     cache=CacheConfig(enable_prefix_caching=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", [None, SpecConfig(method="ngram", num_draft_tokens=3)])
def test_gpu_cached_prefixes_behind_steps_in_flight_give_the_same_tokens(spec):
    """On a GPU, graphs and async steps: two rows at a time, so each arrival is admitted
    (its cached rows written) while a launched step is in flight; fp32 outputs equal an
    engine's without the cache. Then all at once: the burst after the first waits for its
    blocks and borrows them."""
    def engine(cache: bool, rows: int):
        return LLMEngine(EngineConfig(
            model="random:smollm2-135m", device="cuda", dtype="float32", seed=0,
            cache=CacheConfig(kv_cache_tokens=8192, enable_prefix_caching=cache),
            scheduler=SchedulerConfig(max_num_seqs=rows, max_model_len=1024),
            spec=spec or SpecConfig()))

    prompts = [BASE * 3 + [j, j + 1] for j in range(6)] + [BASE[:50] + [7] * j for j in (9, 30)]
    ref = [o.token_ids for o in engine(False, 2).generate(prompts, GREEDY)]
    cached = engine(True, 2)
    outs = cached.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert cached.stats["prefix_cache_hits"] >= 5 * 224 + 2 * 48  # the first: a miss
    burst = engine(True, 8).generate(prompts[:6], GREEDY)  # against the same batch, uncached
    assert [o.token_ids for o in burst] == \
        [o.token_ids for o in engine(False, 8).generate(prompts[:6], GREEDY)]
    assert [o.metrics["cached_tokens"] for o in burst] == [0] + [224] * 5


def test_the_server_reports_cached_prompt_tokens(default_model):
    """A chat with a shared system prompt, asked twice: the second answer is the first's,
    its usage counts the cached prompt tokens (OpenAI's prompt_tokens_details), /metrics
    counts queries and hits (vLLM's names)."""
    pytest.importorskip("fastapi")
    from draftgraph.server.app import build_app
    from draftgraph.server.async_engine import AsyncEngine
    from draftgraph.server.config import ServerConfig
    from draftgraph.server.launcher import ServerThread

    engine = LLMEngine(EngineConfig(
        model="default", device="cpu", cache=CacheConfig(enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=1024)), loaded=default_model)
    st = ServerThread(build_app(AsyncEngine(engine), ServerConfig())).start()
    try:
        system = "You are a terse assistant. " * 12
        body = {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": "Name a color."}],
                "max_tokens": 6, "temperature": 0}
        first, second = (httpx.post(st.base_url + "/v1/chat/completions", json=body,
                                    timeout=120).json() for _ in range(2))
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and cached % 16 == 0 and cached < second["usage"]["prompt_tokens"]
        assert second["choices"][0]["message"] == first["choices"][0]["message"]
        metrics = httpx.get(st.base_url + "/metrics", timeout=30).text
        hits = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", metrics, re.M)
        assert hits and float(hits.group(1)) == cached
    finally:
        st.stop()
