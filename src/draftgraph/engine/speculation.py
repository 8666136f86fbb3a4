"""The engine's side of speculative decoding: propose drafts per request, verify them against
the target's logits, and keep acceptance statistics and the adaptive draft length.

Verification runs inside the engine's ordinary step: a request with drafts feeds
[last token, d drafts] as one extend of length 1 + d, and the logits of all 1 + d positions
come back. Acceptance itself is the device-side code of `spec.verify`.
"""

from __future__ import annotations

import torch

from draftgraph.config import SpecConfig
from draftgraph.engine.request import Request
from draftgraph.runtime.sampling import processed_probs
from draftgraph.kernels.argmax import argmax_lse
from draftgraph.spec.ngram import NgramProposer
from draftgraph.spec.verify import greedy_accept_from_argmax, rejection_sample


class NgramSpeculator:
    def __init__(self, cfg: SpecConfig) -> None:
        self.cfg = cfg
        self.k = cfg.num_draft_tokens
        self.proposer = NgramProposer(cfg.ngram_min, cfg.ngram_max, cfg.num_draft_tokens)
        self.draft_len: dict[str, int] = {}  # adaptive per-request draft length
        self.idle_steps: dict[str, int] = {}  # steps spent at draft length 0
        self.stats = None  # the engine's counters, attached by the engine
        self.max_model_len = 1 << 30  # set by the engine

    # NOTE: a request whose drafts keep failing drops to draft length 0 (plain decoding) and
    # probes again with one draft every PROBE_INTERVAL steps.
    PROBE_INTERVAL = 16

    def max_draft(self, req: Request) -> int:
        """Drafts this request may verify now: adaptive length, capped by max_tokens and the
        context."""
        rid = req.request_id
        d = self.draft_len.setdefault(rid, self.k)
        if d == 0:
            idle = self.idle_steps.get(rid, 0) + 1
            self.idle_steps[rid] = idle
            if idle >= self.PROBE_INTERVAL:
                self.idle_steps[rid] = 0
                d = 1
        room = min(req.params.max_tokens - len(req.output_token_ids) - 1,
                   self.max_model_len - req.num_tokens - 1)
        return max(0, min(d, room))

    def propose(self, running: list[Request]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        for req in running:
            if req.is_prefilling:
                continue
            d = self.max_draft(req)
            if d <= 0:
                continue
            proposal = self.proposer.propose_ref(req.all_token_ids)[:d]
            if proposal:
                drafts[req.request_id] = proposal
        return drafts

    @torch.inference_mode()
    def verify(self, rows, logits: torch.Tensor) -> list[tuple[list[int], list[float]]]:
        """rows: (ScheduledRequest, number of logit rows) per scheduled request, in batch
        order; logits: [sum of rows, vocab] fp32. Returns (tokens, logprobs) per request."""
        live = [(sr, n) for sr, n in rows if n]
        bs, k, vocab = len(live), max(len(sr.draft_tokens) for sr, _ in live), logits.shape[1]
        dev = logits.device
        target = logits.new_full((bs, k + 1, vocab), 0.0)
        draft_tokens = torch.zeros(bs, k, dtype=torch.int64, device=dev)
        num_draft = torch.zeros(bs, dtype=torch.int64, device=dev)
        offset = 0
        for i, (sr, n) in enumerate(live):
            target[i, :n] = logits[offset : offset + n]
            offset += n
            d = len(sr.draft_tokens)
            if d:
                draft_tokens[i, :d] = torch.tensor(sr.draft_tokens, device=dev)
            num_draft[i] = d
        reqs = [sr.req for sr, _ in live]
        temperature = torch.tensor([r.params.temperature for r in reqs], device=dev)
        rep = k + 1
        target_argmax, lse = argmax_lse(target.view(bs * rep, vocab))  # as the step graphs do
        target_argmax, lse = target_argmax.view(bs, rep), lse.view(bs, rep)
        if bool((temperature == 0).all()):
            out_tokens, accept_lens = greedy_accept_from_argmax(draft_tokens, num_draft,
                                                                target_argmax)
        else:
            probs = processed_probs(
                target.view(bs * rep, vocab),
                temperature.repeat_interleave(rep),
                torch.tensor([r.params.top_p for r in reqs], device=dev).repeat_interleave(rep),
                torch.tensor([r.params.top_k for r in reqs], device=dev).repeat_interleave(rep),
            ).view(bs, rep, vocab)
            first_pos = torch.tensor([r.num_tokens for r in reqs], device=dev)
            seeds = torch.tensor([r.seed for r in reqs], device=dev)
            out_tokens, accept_lens = rejection_sample(draft_tokens, num_draft, None, probs,
                                                       seeds, first_pos, temperature == 0,
                                                       target_argmax)
        want_lp = any(r.params.logprobs for r in reqs)
        if want_lp:
            safe = out_tokens.clamp_min(0)
            lp = (target.gather(2, safe[..., None])[..., 0] - lse).tolist()
        out_tokens, accept_lens = out_tokens.tolist(), accept_lens.tolist()
        results: list[tuple[list[int], list[float]]] = []
        i = 0
        for sr, n in rows:
            if not n:
                results.append(([], []))
                continue
            m = accept_lens[i]
            results.append((out_tokens[i][:m], lp[i][:m] if want_lp else [0.0] * m))
            self.record(sr.req, len(sr.draft_tokens), m - 1)
            i += 1
        return results

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
        if self.cfg.adaptive:
            d = self.draft_len.get(req.request_id, self.k)
            if accepted == proposed:
                d = min(self.k, d + 1)
            elif accepted == 0:
                d //= 2
            self.draft_len[req.request_id] = d

    def no_proposal(self, req: Request) -> None:
        """The device proposer found nothing to draft although drafting was allowed: the
        verify step still cost more than a decode, so back off like a rejection."""
        if self.cfg.adaptive:
            self.draft_len[req.request_id] = self.draft_len.get(req.request_id, self.k) // 2

    def forget(self, request_id: str) -> None:
        self.draft_len.pop(request_id, None)
        self.idle_steps.pop(request_id, None)
