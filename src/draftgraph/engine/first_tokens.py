"""First tokens left on the device: a prefill run behind the step in flight
(`--overlap-prefill`) samples its requests' first tokens into the spare result rows of that
step's graph set (spec/step.py `step_outputs`: rows max_bs ..), and the next launch, queued
right behind the prefill, stages those requests as references to the rows, -(max_bs + i + 1),
the way it stages every running request's last token (kernels/tokens.py
`record_last_tokens`: accept length read as 1, no shift). Their seq_lens and KV slots are
staged as if the token were there, as a running row's are.

So the new requests join the very next step, and the host never waits for their prefill
before launching it: the tokens cross to pinned memory behind the prefill (one copy, one
event) and are appended after that launch, beside the in-flight step's results, in the same
engine step. A first token that stops its request wastes its row of the next step, as a row
that finished at the step before does.

The running requests' next decode rows may ride in that prefill's forward
(`--decode-rides-prefill`, engine/engine.py `_riders`): their inputs refer to the step in
flight's rows, resolved on the device before the forward (runtime/schema.py `resolve_refs`),
and their tokens go to the spare rows after the first tokens, so the next launch refers to
them the same way; the host appends each rider's two tokens (the step in flight's, then the
prefill's) together.
"""

from __future__ import annotations

import torch

from draftgraph.engine.request import Request


class FirstTokens:
    """The requests whose first token waits on the device, in spare-row order (one per graph
    set, reused: its pinned buffers are allocated once)."""

    def __init__(self, graphs) -> None:
        """graphs: the graph set whose spare rows hold them (the step in flight's, which the
        next launch replays again)."""
        dev = graphs.device
        cuda = dev.type == "cuda"
        m = graphs.max_bs
        # [2 max_bs] device view: the step in flight's rows (which rows riding in the
        # prefill read: -(j + 1) is row j), then the spare rows
        self.step_tokens = graphs.body.out["tokens"][:, 0]
        self.rows = self.step_tokens[m:]  # [max_bs]
        self.base = m
        self.host_tokens = torch.zeros(m, dtype=torch.int64, pin_memory=cuda)
        self.host_logprobs = torch.zeros(m, dtype=torch.float32, pin_memory=cuda)
        self.done = torch.cuda.Event() if cuda else None
        self.reqs: list[Request] = []
        self.row: dict[int, int] = {}  # id(request) -> its spare row

    def clear(self) -> None:
        self.reqs, self.row = [], {}

    def put(self, reqs: list[Request], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """tokens, logprobs [n] on the device, sampled for `reqs` (each's first output token):
        into the next spare rows, and on their way to the host. There are max_bs of them, as
        many as the scheduler runs requests at most."""
        i, n = len(self.reqs), len(reqs)
        self.rows[i : i + n].copy_(tokens)
        self.host_tokens[i : i + n].copy_(tokens, non_blocking=True)
        self.host_logprobs[i : i + n].copy_(logprobs, non_blocking=True)
        if self.done is not None:
            self.done.record()
        for j, r in enumerate(reqs):
            self.row[id(r)] = i + j
        self.reqs += reqs

    def ref(self, req: Request) -> int | None:
        """The staged input of `req`'s last token in the next replay of the graph set, or None
        when its token is not here."""
        j = self.row.get(id(req))
        return None if j is None else -(self.base + j + 1)

    def take(self) -> list[tuple[Request, int, float]]:
        """Wait for the copy; (request, first token, its logprob) in row order; empties the
        rows (the next prefill behind writes them again)."""
        if self.done is not None:
            self.done.synchronize()
        n = len(self.reqs)
        toks, lps = self.host_tokens[:n].tolist(), self.host_logprobs[:n].tolist()
        out = list(zip(self.reqs, toks, lps, strict=True))
        self.clear()
        return out
