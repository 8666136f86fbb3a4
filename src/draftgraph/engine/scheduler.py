"""Continuous batching with chunked prefill under a token budget.

Every step builds one flat batch: each running request in decode contributes its last token
(with KV slots reserved for the drafts a speculative step may make on the device), then
prefilling requests contribute prompt chunks while the
token budget lasts, then waiting requests are admitted. When the KV pool runs dry, the most
recently admitted request is preempted (its KV freed, recomputed later).

With a prefix cache (`runtime/prefix_cache.py`), an admitted request starts past the cached
blocks its tokens begin with (at least one token is always computed: its logits are the
next token's), `on_prefix_hit(req)` records their slots and tokens in the request's rows;
each step first caches the full blocks running requests computed since the last one, and a
request that ends or is preempted leaves the rest of its computed full blocks there (a
preempted one finds them again). A waiting request whose next uncached block a running
request is still prefilling waits for it (SGLang's in-batch prefix caching): a burst of
prompts after one system prompt computes it once, not once per request; requests behind it
with other prompts are admitted meanwhile.

With `max_step_seconds`, a step that carries decoding requests also caps its prefill tokens by
time: the engine reports each step's wall time (`observe`), and the chunk is sized from the
last decode-only step (the base) and the last prefill step's seconds per prompt token, which
grow with the context a chunk attends to; the last observation, not an average, follows that
growth. Steps without decoding requests keep the whole token budget (throughput).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from draftgraph.config import SchedulerConfig
from draftgraph.engine.request import Request, Status
from draftgraph.runtime.kv_cache import OutOfKVSlots, PagedAllocator, ReqToTokenPool
from draftgraph.runtime.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

MIN_CHUNK = 16  # prompt tokens a step always takes (a time cap never stops a prefill)


@dataclass
class ScheduledRequest:
    req: Request
    num_new_tokens: int  # tokens of the sequence fed this step (prefill chunk or 1)
    reserve: int = 0  # extra KV slots for the drafts a speculative step may make
    # KV slots of this step: the fed tokens', then the reserved ones (a speculative step's
    # reserved_slots [1 + k]; an eager forward's out_cache_loc is the first num_new_tokens)
    slots: list[int] = field(default_factory=list)

    @property
    def num_slots(self) -> int:
        return self.num_new_tokens + self.reserve


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, allocator: PagedAllocator,
                 req_pool: ReqToTokenPool, prefix_cache: PrefixCache | None = None,
                 on_prefix_hit: Callable[[Request], None] | None = None) -> None:
        self.cfg = cfg
        self.allocator = allocator
        self.req_pool = req_pool
        self.prefix_cache = prefix_cache
        self.on_prefix_hit = on_prefix_hit  # (request): its cached positions' rows to write
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # measured by `observe`: a decode-only step's seconds, a prompt token's seconds
        self.decode_step_seconds = 0.0
        self.prefill_token_seconds: float | None = None

    def observe(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        """The wall time of a step that fed `prefill_tokens` prompt tokens and `decode_rows`
        decoding requests (the engine reports every eager step)."""
        if prefill_tokens == 0:
            self.decode_step_seconds = seconds
        else:
            base = self.decode_step_seconds if decode_rows else 0.0
            self.prefill_token_seconds = max(seconds - base, 1e-6) / prefill_tokens

    def _time_budget(self, budget: int) -> int:
        """The token budget left for prefill chunks in a step that carries decoding requests:
        what fits in max_step_seconds by the last measured costs."""
        if not self.cfg.max_step_seconds or self.prefill_token_seconds is None:
            return budget
        spare = self.cfg.max_step_seconds - self.decode_step_seconds
        return min(budget, max(MIN_CHUNK, int(spare / self.prefill_token_seconds)))

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _give_back(self, req: Request) -> None:
        """The request's KV pages: into the prefix cache (the full blocks of its computed
        tokens; none of a failed request's) or back to the allocator."""
        if self.prefix_cache is None:
            self.allocator.free(req.pages)
            return
        valid = 0 if req.finish_reason == "error" else \
            max(0, min(req.num_computed_tokens, req.num_tokens - 1))
        self.prefix_cache.release(req.token_slice(0, valid), req.pages, valid,
                                  req.cached_blocks)
        req.cache_sealed = False

    def release(self, req: Request) -> None:
        """Give back the request's KV slots and table row (finished, aborted or failed)."""
        self._give_back(req)
        if req.req_pool_idx:
            self.req_pool.free(req.req_pool_idx)
            req.req_pool_idx = 0
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def _preempt(self, victim: Request) -> None:
        logger.info("KV pool full: preempting request %s (recomputed later)", victim.request_id)
        self._give_back(victim)
        self.req_pool.free(victim.req_pool_idx)
        victim.req_pool_idx = 0
        victim.num_computed_tokens = 0
        victim.status = Status.WAITING
        self.running.remove(victim)
        self.waiting.appendleft(victim)

    def _alloc(self, sr: ScheduledRequest, scheduled: list[ScheduledRequest],
               preempt: bool = True) -> bool:
        """KV slots for sr; preempts the newest other running request when out of slots
        (unless not `preempt`: then False)."""
        req = sr.req
        while True:
            try:
                sr.slots = self.allocator.extend(req.pages, req.num_computed_tokens,
                                                 sr.num_slots)
                return True
            except OutOfKVSlots:
                victims = [r for r in reversed(self.running)
                           if r is not req and all(s.req is not r for s in scheduled)
                           ] if preempt else []
                if not victims:
                    return False
                self._preempt(victims[0])

    def schedule(self, reserve: int = 0, decode: bool = True,
                 riding: int = 0) -> list[ScheduledRequest]:
        """Pick this step's work; `reserve` extra KV slots go to each decoding request (the
        drafts of a speculative step, made on the device). Not `decode`: the waiting
        requests' prompt chunks alone, preempting nobody (a prefill run behind a step in
        flight, whose requests hold their slots), in a budget `riding` tokens smaller (the
        decode rows that ride in it)."""
        budget = self.cfg.max_num_batched_tokens - riding
        scheduled: list[ScheduledRequest] = []
        if self.prefix_cache is not None:
            self._share_computed()
        # 1. decoding requests: one token each (plus slots for drafts)
        for req in list(self.running) if decode else []:
            if req.status is not Status.RUNNING or req.is_prefilling:  # preempted this step
                continue
            sr = ScheduledRequest(req, 1, reserve)
            if sr.num_slots > budget and scheduled:
                break
            if not self._alloc(sr, scheduled):
                self._preempt(req)
                continue
            budget -= sr.num_slots
            scheduled.append(sr)
        if scheduled:  # streams wait on this step: prefill no longer than the time allows
            budget = self._time_budget(budget)
        # 2. running requests still prefilling, then newly admitted ones
        prefilling = [r for r in self.running if r.is_prefilling]
        for req in prefilling:
            if budget <= 0:
                break
            if req.status is not Status.RUNNING:  # preempted by an earlier chunk of this step
                continue
            sr = self._prefill_chunk(req, budget, scheduled, decode)
            if sr:
                budget -= sr.num_new_tokens
                scheduled.append(sr)
        at = 0  # the next waiting request to consider (those before it wait for a prefix)
        by_block = self._by_first_block(prefilling) if self.waiting and self.prefix_cache \
            else {}
        while at < len(self.waiting) and budget > 0 \
                and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[at]
            if by_block and self._waits_for_prefix(req, by_block):
                at += 1
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            headroom = (1 + reserve) * sum(1 for r in self.running if not r.is_prefilling)
            if self.allocator.num_free_slots < min(remaining, budget) + headroom:
                break
            del self.waiting[at]
            req.req_pool_idx = self.req_pool.alloc()
            req.status = Status.RUNNING
            if req.scheduled_time is None:  # a preempted request keeps its first admission
                req.scheduled_time = time.perf_counter()
            self.running.append(req)
            if self.prefix_cache is not None:
                self._match_prefix(req)
                self._add_prefilling(by_block, req)
            sr = self._prefill_chunk(req, budget, scheduled, decode)
            if sr is None:
                break
            budget -= sr.num_new_tokens
            scheduled.append(sr)
        return scheduled

    def _share_computed(self) -> None:
        """Running requests' full blocks computed since the last step into the prefix cache,
        for the requests this step admits (a cheap check per request while no new block is
        full; none past a block another request cached first)."""
        b = self.prefix_cache.block_tokens
        for req in self.running:
            end = (len(req.cached_blocks) + 1) * b  # its next block's end
            # NOTE: num_computed_tokens first: most rows fail it (num_tokens is a property)
            if req.num_computed_tokens >= end and req.num_tokens > end \
                    and not req.cache_sealed:
                valid = min(req.num_computed_tokens, req.num_tokens - 1)
                req.cache_sealed = not self.prefix_cache.share(
                    req.token_slice(end - b, valid // b * b), req.pages, req.cached_blocks)

    def _by_first_block(self, prefilling: list[Request]) -> dict[tuple, list[Request]]:
        """The requests still prefilling that cache what they compute, by the tokens of their
        first block (a sealed one caches nothing more until it ends)."""
        out: dict[tuple, list[Request]] = {}
        for r in prefilling:
            if not r.cache_sealed:
                self._add_prefilling(out, r)
        return out

    def _add_prefilling(self, by_block: dict[tuple, list[Request]], req: Request) -> None:
        b = self.prefix_cache.block_tokens
        if req.num_tokens > b:
            by_block.setdefault(tuple(req.token_slice(0, b)), []).append(req)

    def _waits_for_prefix(self, req: Request, by_block: dict[tuple, list[Request]]) -> bool:
        """Whether a running request still prefilling (`by_block`) will compute the full
        block that follows what the cache holds of req's prompt (the same tokens up to its
        end): req then waits, and borrows it once computed instead of computing a copy
        alongside. A prompt whose first block no prefilling request shares costs one lookup."""
        b = self.prefix_cache.block_tokens
        limit = req.num_tokens - (1 if req.output_token_ids else 0) - 1  # as _match_prefix
        if limit < b or req.params.prompt_logprobs is not None:
            return False
        others = by_block.get(tuple(req.token_slice(0, b)))
        if not others:
            return False
        end = (self.prefix_cache.peek(req.token_slice(0, limit), limit) + 1) * b
        if end > limit:
            return False
        head = req.token_slice(0, end)
        return any(r.status is Status.RUNNING and r.num_computed_tokens < end < r.num_tokens
                   and r.token_slice(0, end) == head for r in others)

    def _match_prefix(self, req: Request) -> None:
        """Start an admitted request past the cached blocks its tokens begin with (not one
        that scores its prompt: every prompt position is computed for it)."""
        target = req.num_tokens - (1 if req.output_token_ids else 0)
        hit = self.prefix_cache.match(req.token_slice(0, target - 1), target - 1) \
            if req.params.prompt_logprobs is None else []
        if req.num_cached_tokens is None:  # its first admission: what its usage reports
            req.num_cached_tokens = len(hit) * self.prefix_cache.block_tokens
        if hit:
            req.cached_blocks = hit
            req.pages = self.prefix_cache.pages(hit)
            req.num_computed_tokens = len(hit) * self.prefix_cache.block_tokens
            self.on_prefix_hit(req)

    def _prefill_chunk(self, req: Request, budget: int, scheduled: list[ScheduledRequest],
                       preempt: bool = True) -> ScheduledRequest | None:
        target = req.num_tokens - (1 if req.output_token_ids else 0)
        n = min(target - req.num_computed_tokens, budget)
        sr = ScheduledRequest(req, n)
        if n <= 0 or not self._alloc(sr, scheduled, preempt):
            return None
        return sr
