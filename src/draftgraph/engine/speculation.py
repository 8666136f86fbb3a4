"""The engine's policy around a drafter: how many drafts each request may verify now
(adaptive draft length, capped by max_tokens and the context) and acceptance statistics.

Drafting, verification and acceptance themselves run on the device, in the speculative step
body (spec/step.py); this class only chooses each request's `max_draft` and records what the
step reports.
"""

from __future__ import annotations

from draftgraph.config import SpecConfig
from draftgraph.engine.request import Request


class SpecPolicy:
    def __init__(self, cfg: SpecConfig, k: int, keeps_kv: bool = False) -> None:
        """keeps_kv: the drafter keeps its own KV (a chain or block head, a draft model), so
        every step runs all its draft forwards whatever the draft length: a shorter draft only
        gives up accepted tokens, and the draft length stays k (measured on the CPU with the
        shipped chain head, adaptive against k = 4: 0.66x against 0.97x plain decoding on
        MT-Bench, 0.94x against 1.36x on HumanEval)."""
        self.cfg = cfg
        self.adaptive = cfg.adaptive and not keeps_kv
        self.k = k
        self.draft_len: dict[str, int] = {}  # adaptive per-request draft length
        self.idle_steps: dict[str, int] = {}  # steps spent at draft length 0
        self.stats = None  # the engine's counters, attached by the engine
        self.max_model_len = 1 << 30  # set by the engine

    # NOTE: a request whose drafts keep failing drops to draft length 0 (plain decoding) and
    # probes again with one draft every PROBE_INTERVAL steps.
    PROBE_INTERVAL = 16

    def max_draft(self, req: Request) -> int:
        """Drafts this request may verify in its next step: adaptive length, capped by
        max_tokens and the context. Asking counts nothing: `launched` does, once the step
        runs (a launch ahead may ask and then not launch)."""
        rid = req.request_id
        d = self.draft_len.setdefault(rid, self.k)
        if d == 0 and self.idle_steps.get(rid, 0) + 1 >= self.PROBE_INTERVAL:
            d = 1
        room = min(req.params.max_tokens - len(req.output_token_ids) - 1,
                   self.max_model_len - req.num_tokens - 1)
        return max(0, min(d, room))

    def launched(self, reqs: list[Request]) -> None:
        """A step of `reqs` was launched with their `max_draft`: the ones at draft length 0
        count an idle step (the PROBE_INTERVAL-th is the probe, and starts the count again)."""
        for req in reqs:
            rid = req.request_id
            if self.draft_len.get(rid) == 0:
                idle = self.idle_steps.get(rid, 0) + 1
                self.idle_steps[rid] = 0 if idle >= self.PROBE_INTERVAL else idle

    def record(self, req: Request, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        req.verify_steps += 1
        req.proposed_draft_tokens += proposed
        req.accepted_draft_tokens += accepted
        if len(req.accepted_per_pos) < self.k:
            req.accepted_per_pos += [0] * (self.k - len(req.accepted_per_pos))
        for j in range(accepted):
            req.accepted_per_pos[j] += 1
        if self.stats is not None:
            self.stats["num_drafts"] += 1
            self.stats["num_draft_tokens"] += proposed
            self.stats["num_accepted_tokens"] += accepted
            for j in range(accepted):
                self.stats["accepted_per_pos"][j] += 1
        if self.adaptive:
            d = self.draft_len.get(req.request_id, self.k)
            if accepted == proposed:
                d = min(self.k, d + 1)
            elif accepted == 0:
                d //= 2
            self.draft_len[req.request_id] = d

    def no_proposal(self, req: Request) -> None:
        """The device proposer found nothing to draft although drafting was allowed: the
        verify step still cost more than a decode, so back off like a rejection."""
        if self.adaptive:
            self.draft_len[req.request_id] = self.draft_len.get(req.request_id, self.k) // 2

    def forget(self, request_id: str) -> None:
        self.draft_len.pop(request_id, None)
        self.idle_steps.pop(request_id, None)
