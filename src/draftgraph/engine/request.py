"""A request's life: tokens, KV ownership, stop conditions and what it has streamed so far."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from draftgraph.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_FINISHED = Status.FINISHED  # NOTE: an identity test; `Status.X` is an attribute lookup of
# ~0.2 us on Python 3.11, and a step asks every request several times whether it finished


@dataclass(slots=True)  # built for every request of every step
class RequestOutput:
    """What one engine step reports about one request."""

    request_id: str
    prompt_token_ids: list[int]
    # every output token, in the final output (finished); [] before it: a stream reads
    # new_token_ids (so no step copies a request's whole history)
    token_ids: list[int]
    new_token_ids: list[int]  # tokens added by this step
    text: str  # all output text so far (without held-back stop-string prefixes)
    delta_text: str  # text added by this step
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    # per output token, from the target model: the whole list in the final output, like
    # token_ids ([] before it); None when the request did not ask
    logprobs: list[float] | None = None
    new_logprobs: list[float] | None = None
    # per output token its top alternatives [(token id, logprob)], most likely first, when
    # the request asked for top_logprobs ([] as a whole when it asked for logprobs alone);
    # final output only, as above
    top_logprobs: list[list[tuple[int, float]]] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    # per prompt token its logprob (None for the first), and (rank, top ids, top logprobs)
    # (None for the first); in the first output and the final one, when asked
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list | None = None
    metrics: dict = field(default_factory=dict)
    error: str | None = None

    @classmethod
    def failed(cls, request_id: str, message: str) -> RequestOutput:
        """The final output of a request that ended with an error and no tokens."""
        return cls(request_id=request_id, prompt_token_ids=[], token_ids=[], new_token_ids=[],
                   text="", delta_text="", finished=True, finish_reason="error", error=message)


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 seed: int, eos_token_ids: set[int], detokenizer=None,
                 arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.stop_token_ids = set(params.stop_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        # prompt token p's logprob (p = 0: None), filled as prefill chunks are scored
        self.prompt_logprobs: list[float | None] = [None]
        self.prompt_top_logprobs: list = [None]
        self.controls_row = 0  # the request row whose control tables were written for it
        # read every step: computed once (the properties cost ~0.3 us a request)
        self.has_controls = params.has_controls
        self.needs_extras = params.needs_extras
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        # KV state
        self.req_pool_idx = 0  # row in req_to_token; 0 = none
        self.pages: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        # prefix caching: the cached blocks its first positions read or it computed and
        # shared (engine/scheduler.py), and the prompt tokens found cached at its first
        # admission (None: caching is off)
        self.cached_blocks: list = []
        self.num_cached_tokens: int | None = None
        self.cache_sealed = False  # its next block was cached by another request first
        self.ahead = 0  # KV slots past them that a launched, unread step writes (async)
        # streaming state
        self.detokenizer = detokenizer
        self.text = ""  # full detokenized output, stop string cut off when finished
        self.stop_string_hit = False
        self.num_sent_chars = 0
        self.num_sent_tokens = 0
        # speculative statistics
        self.verify_steps = 0
        self.accepted_draft_tokens = 0
        self.proposed_draft_tokens = 0
        self.accepted_per_pos: list[int] = []
        # timing
        # arrival: where the request came in (the API server's receipt: its tokenizing and
        # the trip to this engine's queue count), else here; queued: here, the queue's start
        self.queued_time = time.perf_counter()
        # (never later than the queueing: a caller's clock might not be this one's)
        self.arrival_time = min(self.queued_time, arrival_time or self.queued_time)
        self.scheduled_time: float | None = None  # first admitted to a step (queue time's end)
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole sequence (a decode step reads
        one token; concatenating prompt + output every step cost O(length) per request)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        # tokens still to compute before sampling resumes; afterwards each step feeds the
        # last sampled token (a preempted request recomputes its output tokens too)
        target = self.num_tokens - (1 if self.output_token_ids else 0)
        return self.num_computed_tokens < target

    @property
    def finished(self) -> bool:
        return self.status is _FINISHED

    def finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter()

    def metrics(self) -> dict:
        end = self.finish_time or time.perf_counter()
        out = {
            "prompt_tokens": len(self.prompt_token_ids),
            "completion_tokens": len(self.output_token_ids),
            "seconds": end - self.arrival_time,
            "ttft": (self.first_token_time - self.arrival_time) if self.first_token_time else None,
            # waiting in this engine's queue for a step, then until the first token: ttft's
            # parts past the API server (vLLM's request_queue_time / request_prefill_time)
            "queue": (self.scheduled_time - self.queued_time) if self.scheduled_time else None,
            "prefill": (self.first_token_time - self.scheduled_time)
            if self.first_token_time and self.scheduled_time else None,
        }
        if self.num_cached_tokens is not None:
            out["cached_tokens"] = self.num_cached_tokens
        if self.verify_steps:
            out.update(
                verify_steps=self.verify_steps,
                accepted_tokens=self.accepted_draft_tokens,
                draft_tokens=self.proposed_draft_tokens,
                accept_len_mean=(self.accepted_draft_tokens + self.verify_steps)
                / self.verify_steps,
                acceptance_rate_per_pos=[a / self.verify_steps for a in self.accepted_per_pos],
            )
        return out
