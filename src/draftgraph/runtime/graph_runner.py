"""CUDA-graph runner for decode and speculative steps.

One graph per batch-size bucket (1, 2, 4, 8, then multiples of 8), captured largest first
into one memory pool, and per sampling mode (greedy, sampled). A graph holds the whole step:

  decode (k = 0):  metadata from the raw inputs -> forward -> LM head -> sample
  speculative (k): record the last token in the device token table -> n-gram proposal of up
                   to k drafts per request (capped per request by `max_draft`) -> pack the
                   1 + d tokens of each request -> metadata for the ACTIVE counts -> forward ->
                   logits of every request's 1 + k rows -> acceptance (greedy or rejection
                   sampling) -> accepted tokens and counts

Both read the logits once for (argmax, logsumexp) per row (`kernels.argmax`, two small
launches): the argmax is the greedy token, and an emitted token's logprob is its logit - lse.
Greedy decode writes the argmax and its logprob (row max - lse) straight into the output
buffer, and its final norm runs inside the LM head kernel (one row: `compute_logits`).

A replay copies only the raw inputs — last tokens, req_pool_indices, seq_lens, out_cache_loc
(1 + k reserved slots per request), max_draft and the sampling parameters — from one pinned
staging buffer with ONE non-blocking H2D copy, replays, and starts ONE async D2H copy of the
results into pinned memory; the host waits on its event only when it reads them.

Padded rows point at the dummy request (row 0) and the dummy KV slot 0, so they never write a
live request's KV. Packed token slots past the live tokens also write slot 0.

Fallback: a backend without `in_graph_metadata` gets its metadata rebuilt eagerly before each
replay (logged once); the graph then holds only the rest. That path is the A arm of the
in-graph-metadata A/B. (It needs the packed layout on the host, so it serves k = 0 only.)
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from draftgraph.attention.backend import ForwardBatch, Phase
from draftgraph.runtime.sampling import processed_probs, sample
from draftgraph.kernels.argmax import argmax_lse
from draftgraph.kernels.tokens import record_last_tokens
from draftgraph.spec.ngram import NgramProposer
from draftgraph.spec.verify import greedy_accept_from_argmax, rejection_sample

logger = logging.getLogger(__name__)

# staging layout: per-request int64 fields, then out_cache_loc [max_bs, 1 + k], then float32
# sampling parameters packed two per int64 lane
_ROW_FIELDS = ("input_ids", "req_pool_indices", "seq_lens", "max_draft", "top_k", "seeds")
_FLOAT_FIELDS = ("temperature", "top_p")


def batch_buckets(max_bs: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8) if b <= max_bs]
    buckets += list(range(16, max_bs + 1, 8))
    if buckets[-1] != max_bs:
        buckets.append(max_bs)
    return buckets


def stage_slot_rows(dst: np.ndarray, rows: list[list[int]]) -> None:
    """dst[i] = the first dst.shape[1] slots of rows[i], zero-padded (slot 0 is the dummy).
    One numpy assignment when every row is long enough: row by row cost ~0.7 us a row, 45 us
    of host time per step at batch 64."""
    width = dst.shape[1]
    cut = [r[:width] for r in rows]
    if all(len(r) == width for r in cut):
        dst[: len(cut)] = cut
        return
    for i, r in enumerate(cut):
        dst[i, : len(r)] = r
        dst[i, len(r) :] = 0


class StepGraphRunner:
    def __init__(self, runner, max_bs: int, num_draft_tokens: int = 0,
                 proposer: NgramProposer | None = None,
                 metadata_in_graph: bool | None = None) -> None:
        self.runner = runner
        self.model = runner.model
        self.backend = runner.backend
        self.device = runner.device
        self.max_bs = max_bs
        self.k = num_draft_tokens
        self.tokens_per_req = 1 + self.k
        self.proposer = proposer
        if self.k and proposer is None:
            raise ValueError("a speculative step graph needs a proposer")
        can = self.backend.in_graph_metadata
        self.metadata_in_graph = can if metadata_in_graph is None else (metadata_in_graph and can)
        if not self.metadata_in_graph:
            if self.k:
                raise ValueError("speculative step graphs need in-graph metadata")
            logger.warning(
                "attention backend %r: metadata is rebuilt eagerly before each graph replay "
                "(%s)", self.backend.name,
                "requested" if can else "backend lacks in_graph_metadata")
        self.buckets = batch_buckets(max_bs)
        T = self.tokens_per_req
        n_rows, n_float = len(_ROW_FIELDS), len(_FLOAT_FIELDS)
        lanes = max_bs * (n_rows + T) + max_bs * ((n_float + 1) // 2)
        # [lanes] int64: one pinned staging buffer on the host, one persistent twin on the GPU
        self.staging = torch.zeros(lanes, dtype=torch.int64, pin_memory=True)
        self.raw = torch.zeros(lanes, dtype=torch.int64, device=self.device)
        # numpy views of the pinned buffer: staging a step is a few slice assignments
        self._host = {k: t.numpy() for k, t in self._split(self.staging).items()}
        self._dev = self._split(self.raw)
        # persistent, graph-written forward inputs
        self.packed_ids = torch.zeros(max_bs * T, dtype=torch.int64, device=self.device)
        self.packed_loc = torch.zeros(max_bs * T, dtype=torch.int64, device=self.device)
        self.extend_lens = torch.ones(max_bs, dtype=torch.int64, device=self.device)
        self.seq_lens_after = torch.ones(max_bs, dtype=torch.int64, device=self.device)
        # results: tokens [bs, T] | accept_lens [bs] | num_drafts [bs] | logprobs [bs, T] fp32
        out_lanes = max_bs * (T + 2) + (max_bs * T + 1) // 2
        self.out = torch.zeros(out_lanes, dtype=torch.int64, device=self.device)
        if self.k == 0:  # decode emits one token per request and drafts none, every step
            self._out_views(self.out, max_bs)[1].fill_(1)
        self.no_drafts = torch.zeros(max_bs, 0, dtype=torch.int64, device=self.device)
        # two pinned result buffers: a step may be launched before the previous one is read
        self.host_out = [torch.zeros(out_lanes, dtype=torch.int64, pin_memory=True)
                         for _ in range(2)]
        self._host_out = [[t.numpy() for t in self._out_views(h, max_bs)]
                          for h in self.host_out]
        self.done = [torch.cuda.Event() for _ in range(2)]  # per result buffer: D2H finished
        self.staged = torch.cuda.Event()  # the H2D copy has read the staging buffer
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self._launched = 0  # replays so far; replay n writes result buffer n % 2
        self._bs = [0, 0]

    # ---- buffer views ---------------------------------------------------------------------
    def _split(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        m, T = self.max_bs, self.tokens_per_req
        views = {name: buf[i * m : (i + 1) * m] for i, name in enumerate(_ROW_FIELDS)}
        base = len(_ROW_FIELDS) * m
        views["out_cache_loc"] = buf[base : base + m * T].view(m, T)
        floats = buf[base + m * T :].view(torch.float32)
        for i, name in enumerate(_FLOAT_FIELDS):
            views[name] = floats[i * m : (i + 1) * m]
        return views

    def _out_views(self, buf: torch.Tensor, bs: int):
        m, T = self.max_bs, self.tokens_per_req
        tokens = buf[: m * T].view(m, T)[:bs]
        accept_lens = buf[m * T : m * T + m][:bs]
        num_drafts = buf[m * T + m : m * T + 2 * m][:bs]
        logprobs = buf[m * (T + 2) :].view(torch.float32)[: m * T].view(m, T)[:bs]
        return tokens, accept_lens, num_drafts, logprobs

    # ---- the captured body ----------------------------------------------------------------
    def _fb(self, bs: int, num_tokens: int) -> ForwardBatch:
        v = self._dev
        if self.k == 0:  # decode reads the raw inputs themselves: one token per request
            return ForwardBatch(Phase.DECODE, v["input_ids"][:bs], v["req_pool_indices"][:bs],
                                v["seq_lens"][:bs], self.extend_lens[:bs],
                                v["out_cache_loc"][:bs, 0], self.runner.meta)
        return ForwardBatch(Phase.VERIFY, self.packed_ids[:num_tokens],
                            v["req_pool_indices"][:bs], self.seq_lens_after[:bs],
                            self.extend_lens[:bs], self.packed_loc[:num_tokens],
                            self.runner.meta)

    def _prepare(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts and the packed 1 + d tokens of each request, on the device."""
        v, T, k = self._dev, self.tokens_per_req, self.k
        rows, seq, last = v["req_pool_indices"][:bs], v["seq_lens"][:bs], v["input_ids"][:bs]
        table = self.runner.token_table
        # last tokens staged as -(j + 1) are row j of the previous replay's output (async
        # scheduling); resolved in place, then recorded in the token table
        record_last_tokens(last, self._out_views(self.out, self.max_bs)[0][:, 0], table, rows,
                           seq)
        if k == 0:
            return self.no_drafts[:bs], None
        drafts, num_drafts = self.proposer.propose(table[rows], seq)  # [bs, k], [bs]
        num_drafts = torch.minimum(num_drafts, v["max_draft"][:bs])
        ext = 1 + num_drafts
        self.extend_lens[:bs].copy_(ext)
        self.seq_lens_after[:bs].copy_(seq + num_drafts)
        qo_end = ext.cumsum(0)
        start = qo_end - ext
        t = torch.arange(bs * T, device=self.device)
        r = torch.searchsorted(qo_end, t, right=True).clamp_max(bs - 1)  # [bs*T] request
        j = t - start[r]  # [bs*T] index inside the request's 1 + d tokens
        live = j < ext[r]
        jc = j.clamp(0, T - 1)
        cand = torch.where(j == 0, last[r], drafts[r, (jc - 1).clamp_min(0)])
        self.packed_ids[: bs * T].copy_(torch.where(live, cand, 0))
        self.packed_loc[: bs * T].copy_(torch.where(live, v["out_cache_loc"][:bs][r, jc], 0))
        # the drafts' token ids at their positions (rows past a request's length are rewritten
        # before they are ever read); dead slots go to the dummy row 0
        table[torch.where(live, rows[r], 0), torch.where(live, seq[r] - 1 + jc, 0)] = \
            self.packed_ids[: bs * T]
        return drafts, num_drafts

    def _step(self, bs: int, greedy: bool) -> None:
        v, T = self._dev, self.tokens_per_req
        drafts, num_drafts = self._prepare(bs)
        num_tokens = bs * T
        fb = self._fb(bs, num_tokens)
        if self.metadata_in_graph:
            self.backend.build_metadata(fb)
        if T == 1:  # every row is a logit row: the final norm goes into the LM head kernel
            logits = self.model.compute_logits(*self.model(fb.input_ids, fb, self.backend,
                                                           final_norm=False))
        else:
            hidden = self.model(fb.input_ids, fb, self.backend)
            qo_start = self.extend_lens[:bs].cumsum(0) - self.extend_lens[:bs]
            idx = (qo_start[:, None] + torch.arange(T, device=self.device)).clamp_max(
                num_tokens - 1)
            logits = self.model.compute_logits(hidden[idx.flatten()])  # [bs * T, V] fp32
        vocab = logits.shape[-1]
        o_tok, o_acc, o_nd, o_lp = self._out_views(self.out, bs)
        if T == 1 and greedy:  # the argmax and its logprob go straight into the outputs
            argmax_lse(logits, out=o_tok[:, 0], top_logprob=o_lp[:, 0])
            return
        # one pass over the vocabulary: the greedy tokens and the logsumexp of every row
        target_argmax, lse = argmax_lse(logits)  # [bs * T] int64, [bs * T] fp32
        temperature, top_p, top_k = v["temperature"][:bs], v["top_p"][:bs], v["top_k"][:bs]
        seeds, seq = v["seeds"][:bs], v["seq_lens"][:bs]
        if T == 1:
            tokens = sample(logits, temperature, top_p, top_k, seeds, seq, target_argmax)
            tokens, accept_lens = tokens[:, None], None
        elif greedy:
            tokens, accept_lens = greedy_accept_from_argmax(drafts, num_drafts,
                                                            target_argmax.view(bs, T))
        else:
            probs = processed_probs(logits, temperature.repeat_interleave(T),
                                    top_p.repeat_interleave(T), top_k.repeat_interleave(T))
            tokens, accept_lens = rejection_sample(drafts, num_drafts, None,
                                                   probs.view(bs, T, vocab), seeds, seq,
                                                   temperature <= 0, target_argmax.view(bs, T))
        o_tok.copy_(tokens)
        if T == 1:  # accept_lens (1) and num_drafts (0) were written once, at construction
            torch.sub(logits.gather(1, tokens), lse[:, None], out=o_lp)  # log_softmax
            return
        # log_softmax of each emitted token (-1 past accept_lens reads token 0, never emitted)
        logprobs = logits.gather(1, tokens.reshape(-1, 1).clamp_min(0)).squeeze(1) - lse
        o_acc.copy_(accept_lens)
        o_nd.copy_(num_drafts)
        o_lp.copy_(logprobs.view(bs, T))

    # ---- capture and replay -------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        self._fill_padding(0, self.max_bs)
        self.raw.copy_(self.staging)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.buckets):  # largest first: later graphs reuse its pool
                for greedy in (True, False):
                    for _ in range(2):  # warm up: Triton compiles, cuBLAS picks kernels
                        self.run_eager(bs, greedy)
                    if not self.metadata_in_graph:
                        self._eager_metadata(bs)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        self._step(bs, greedy)
                    if self.pool is None:
                        self.pool = graph.pool()
                    self.graphs[(bs, greedy)] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured %s graphs (k=%d) for batch sizes %s, greedy and sampled",
                    "verify" if self.k else "decode", self.k, self.buckets)

    def _eager_metadata(self, bs: int) -> None:
        self._prepare(bs)
        self.backend.build_metadata(self._fb(bs, bs * self.tokens_per_req))

    def _fill_padding(self, start: int, end: int) -> None:
        h = self._host
        for name in _ROW_FIELDS:
            h[name][start:end] = 0
        h["out_cache_loc"][start:end] = 0
        h["seq_lens"][start:end] = 1
        h["temperature"][start:end] = 0.0
        h["top_p"][start:end] = 1.0

    def bucket_for(self, bs: int) -> int | None:
        for b in self.buckets:
            if b >= bs:
                return b
        return None

    def replay(self, input_ids: list[int], req_pool_indices: list[int], seq_lens: list[int],
               out_cache_loc: list[list[int]], temperature: list[float], top_p: list[float],
               top_k: list[int], seeds: list[int], max_draft: list[int] | None = None) -> int:
        """Stage, copy once, replay, start the one D2H copy. Returns the padded batch size;
        `result()` waits for the tokens. A replay may be launched before the previous one's
        result is read (two result buffers; read each before launching the one after next).

        input_ids: each request's last token, or -(j + 1) for the token row j of the previous
        replay of this runner sampled (still on the device, not yet read back);
        seq_lens: tokens of each sequence including the last (un-cached) one;
        out_cache_loc: per request 1 + k reserved KV slots (only the first is used at k = 0).
        """
        bs = len(input_ids)
        bucket = self.bucket_for(bs)
        self.staged.synchronize()  # the previous replay's H2D copy has read the staging buffer
        h = self._host
        h["input_ids"][:bs] = input_ids
        h["req_pool_indices"][:bs] = req_pool_indices
        h["seq_lens"][:bs] = seq_lens
        h["max_draft"][:bs] = max_draft or 0
        h["top_k"][:bs] = top_k
        h["seeds"][:bs] = seeds
        stage_slot_rows(h["out_cache_loc"], out_cache_loc)
        h["temperature"][:bs] = temperature
        h["top_p"][:bs] = top_p
        self._fill_padding(bs, bucket)
        greedy = all(t == 0 for t in temperature)
        if self.runner.tp_driver is not None:  # TP: ranks > 0 replay the same graph
            self.runner.tp_driver.send_replay(self.k, bucket, greedy, self.staging)
        self.replay_staged(bucket, greedy, self.staged)
        i = self._launched % 2
        self.host_out[i].copy_(self.out, non_blocking=True)  # the one D2H copy
        self.done[i].record()
        self._bs[i] = bs
        self._launched += 1
        return bucket

    def replay_staged(self, bucket: int, greedy: bool,
                      staged: torch.cuda.Event | None = None) -> None:
        """The one H2D copy of the staged raw inputs, then the replay (on every TP rank)."""
        self.raw.copy_(self.staging, non_blocking=True)  # the one H2D copy
        if staged is not None:
            staged.record()
        if not self.metadata_in_graph:
            self._eager_metadata(bucket)
        self.graphs[(bucket, greedy)].replay()

    def result(self, back: int = 0) -> list[tuple[list[int], list[float], int]]:
        """Wait for the latest replay (back=1: the one before it); per request (emitted
        tokens, their logprobs, drafts)."""
        i = (self._launched - 1 - back) % 2
        self.done[i].synchronize()
        bs = self._bs[i]
        tokens, accept_lens, num_drafts, logprobs = (v[:bs].tolist() for v in self._host_out[i])
        return [(tokens[j][: accept_lens[j]], logprobs[j][: accept_lens[j]], num_drafts[j])
                for j in range(bs)]

    @torch.inference_mode()
    def run_eager(self, bs: int, greedy: bool) -> None:
        """The same step without a graph (replays must equal it)."""
        if not self.metadata_in_graph:
            self._eager_metadata(bs)
        self._step(bs, greedy)
