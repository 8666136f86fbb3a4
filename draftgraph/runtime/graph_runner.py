"""CUDA-graph runner for the decode step.

One graph per batch-size bucket (1, 2, 4, 8, then multiples of 8), captured largest first
into one memory pool. Each graph holds the whole step: metadata from the raw inputs (when the
backend can build it in the graph), the model forward, the LM head and sampling. A replay
copies only the raw inputs — tokens, req_pool_indices, seq_lens, out_cache_loc and the
per-request sampling parameters — from one pinned staging buffer with ONE non-blocking H2D
copy, replays, and starts an async D2H copy of the sampled tokens into pinned memory; the host
waits on its event only when it reads them.

Padded rows point at the dummy request (row 0) and the dummy KV slot 0, so they never write a
live request's KV.

Fallback: a backend without `in_graph_metadata` gets its metadata rebuilt eagerly before each
replay (logged once); the graph then holds only the forward and sampling. That path is the A
arm of the in-graph-metadata A/B.
"""

from __future__ import annotations

import logging

import torch

from draftgraph.attention.backend import ForwardBatch, Phase
from draftgraph.engine.sampling import sample

logger = logging.getLogger(__name__)

# staging layout, per row (int64 lanes): the raw inputs, then sampling parameters
_INT_FIELDS = ("input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "top_k", "seeds")
_FLOAT_FIELDS = ("temperature", "top_p")  # float32, packed two per int64 lane


def batch_buckets(max_bs: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8) if b <= max_bs]
    buckets += list(range(16, max_bs + 1, 8))
    if buckets[-1] != max_bs:
        buckets.append(max_bs)
    return buckets


class DecodeGraphRunner:
    def __init__(self, runner, max_bs: int, metadata_in_graph: bool | None = None) -> None:
        self.runner = runner
        self.model = runner.model
        self.backend = runner.backend
        self.device = runner.device
        self.max_bs = max_bs
        can = self.backend.in_graph_metadata
        self.metadata_in_graph = can if metadata_in_graph is None else (metadata_in_graph and can)
        if not self.metadata_in_graph:
            logger.warning(
                "attention backend %r: metadata is rebuilt eagerly before each graph replay "
                "(%s)", self.backend.name,
                "requested" if can else "backend lacks in_graph_metadata")
        self.buckets = batch_buckets(max_bs)
        n_int, n_float = len(_INT_FIELDS), len(_FLOAT_FIELDS)
        lanes = max_bs * (n_int + (n_float + 1) // 2)
        # [lanes] int64: one pinned staging buffer on the host, one persistent twin on the GPU
        self.staging = torch.zeros(lanes, dtype=torch.int64, pin_memory=True)
        self.raw = torch.zeros(lanes, dtype=torch.int64, device=self.device)
        self._views_host = self._split(self.staging)
        self._views_dev = self._split(self.raw)
        self.extend_lens = torch.ones(max_bs, dtype=torch.int64, device=self.device)
        # outputs: sampled tokens and their logprobs, persistent on the GPU, pinned on the host
        self.out_tokens = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        self.out_logprobs = torch.zeros(max_bs, dtype=torch.float32, device=self.device)
        self.host_tokens = torch.zeros(max_bs, dtype=torch.int64, pin_memory=True)
        self.host_logprobs = torch.zeros(max_bs, dtype=torch.float32, pin_memory=True)
        self.done = torch.cuda.Event()
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _split(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        m = self.max_bs
        views = {name: buf[i * m : (i + 1) * m] for i, name in enumerate(_INT_FIELDS)}
        base = len(_INT_FIELDS) * m
        floats = buf[base:].view(torch.float32)
        for i, name in enumerate(_FLOAT_FIELDS):
            views[name] = floats[i * m : (i + 1) * m]
        return views

    def _fb(self, bs: int) -> ForwardBatch:
        v = self._views_dev
        return ForwardBatch(Phase.DECODE, v["input_ids"][:bs], v["req_pool_indices"][:bs],
                            v["seq_lens"][:bs], self.extend_lens[:bs], v["out_cache_loc"][:bs],
                            self.runner.meta, extend_lens_cpu=[1] * bs)

    def _step(self, bs: int, greedy: bool) -> None:
        """The captured body (also its eager twin)."""
        fb = self._fb(bs)
        if self.metadata_in_graph:
            self.backend.build_metadata(fb)
        hidden = self.model(fb.input_ids, fb, self.backend)
        logits = self.model.compute_logits(hidden)
        v = self._views_dev
        if greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = sample(logits, v["temperature"][:bs], v["top_p"][:bs], v["top_k"][:bs],
                            v["seeds"][:bs], v["seq_lens"][:bs])
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
        self.out_tokens[:bs].copy_(tokens)
        self.out_logprobs[:bs].copy_(logprobs)

    @torch.inference_mode()
    def capture(self) -> None:
        self._fill_padding(0, self.max_bs)
        self.raw.copy_(self.staging)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.buckets):  # largest first: later graphs reuse its pool
                for greedy in (True, False):
                    if not self.metadata_in_graph:
                        self.backend.build_metadata(self._fb(bs))
                    for _ in range(2):  # warm up: Triton compiles, cuBLAS picks kernels
                        self._step(bs, greedy)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        self._step(bs, greedy)
                    if self.pool is None:
                        self.pool = graph.pool()
                    self.graphs[(bs, greedy)] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured decode graphs for batch sizes %s (greedy and sampled)",
                    self.buckets)

    def _fill_padding(self, start: int, end: int) -> None:
        h = self._views_host
        for name in _INT_FIELDS:
            h[name][start:end] = 0
        h["seq_lens"][start:end] = 1
        h["temperature"][start:end] = 0.0
        h["top_p"][start:end] = 1.0

    def bucket_for(self, bs: int) -> int | None:
        for b in self.buckets:
            if b >= bs:
                return b
        return None

    def replay(self, input_ids: list[int], req_pool_indices: list[int], seq_lens: list[int],
               out_cache_loc: list[int], temperature: list[float], top_p: list[float],
               top_k: list[int], seeds: list[int]) -> int:
        """Stage, copy once, replay, start the D2H copy. Returns the padded batch size."""
        bs = len(input_ids)
        bucket = self.bucket_for(bs)
        self.done.synchronize()  # the previous replay's H2D copy has read the staging buffer
        h = self._views_host
        h["input_ids"][:bs] = torch.tensor(input_ids)
        h["req_pool_indices"][:bs] = torch.tensor(req_pool_indices)
        h["seq_lens"][:bs] = torch.tensor(seq_lens)
        h["out_cache_loc"][:bs] = torch.tensor(out_cache_loc)
        h["top_k"][:bs] = torch.tensor(top_k)
        h["seeds"][:bs] = torch.tensor(seeds)
        h["temperature"][:bs] = torch.tensor(temperature)
        h["top_p"][:bs] = torch.tensor(top_p)
        self._fill_padding(bs, bucket)
        self.raw.copy_(self.staging, non_blocking=True)  # the one H2D copy
        if not self.metadata_in_graph:
            self.backend.build_metadata(self._fb(bucket))
        greedy = all(t == 0 for t in temperature)
        self.graphs[(bucket, greedy)].replay()
        self.host_tokens[:bucket].copy_(self.out_tokens[:bucket], non_blocking=True)
        self.host_logprobs[:bucket].copy_(self.out_logprobs[:bucket], non_blocking=True)
        self.done.record()
        return bucket

    def result(self, bs: int) -> tuple[list[int], list[float]]:
        """Wait for the last replay's D2H copy; tokens and logprobs of the first bs rows."""
        self.done.synchronize()
        return self.host_tokens[:bs].tolist(), self.host_logprobs[:bs].tolist()

    @torch.inference_mode()
    def run_eager(self, bs: int, greedy: bool) -> None:
        """The same step without a graph (for tests: replay must equal it)."""
        if not self.metadata_in_graph:
            self.backend.build_metadata(self._fb(bs))
        self._step(bs, greedy)
