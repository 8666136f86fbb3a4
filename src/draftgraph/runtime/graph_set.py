"""GraphSet: one step body, captured per batch bucket as CUDA graphs, replayed from one copy.

A step body (the decode step, a speculative step: spec/step.py) declares its raw inputs and
results as `Lanes` (runtime/schema.py) and splits its work into parts:

    body.parts(bs, greedy) -> [(fn, capturable), ...]

Capturable parts become graphs (per bucket and sampling mode, captured largest bucket first
into ONE memory pool, which a twin set replayed on the same stream may share: `pool` set
before `capture`, executor.init_graphs' shared_pools); a part that is not capturable (an eager
metadata rebuild for a backend without in-graph metadata, logged once by the body) runs
between them. So a step may be one
graph, or a draft graph and a verify graph, after one staging copy.

A replay writes the pinned staging buffer (numpy views of the body's input lanes), makes ONE
non-blocking H2D copy into the persistent raw buffer, runs the parts, and starts ONE async
D2H copy of the results into one of two pinned buffers: a step may be launched before the
previous one's results are read (async scheduling). The host waits on its event only when it
reads them. Padded rows take the body's padding values (the dummy request row 0 and KV slot 0).

Without graphs (CPU, `--no-graphs`) the same parts run eagerly per step: the same body, the
same buffers, the same results.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time

import numpy as np
import torch
from tqdm import tqdm

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def gc_paused():
    """Python's cycle collector off for a capture, after one collection first. torch's graph
    capture no longer collects (torch.compiler.config.force_cudagraph_gc), so a collection the
    capture's own allocations trigger could free a dead object's CUDA resources (another
    engine's graphs, events or pinned buffers) mid-capture, and any such call invalidates it
    (cudaErrorStreamCaptureInvalidated; seen on the H200 when engines were built one after
    another in one process)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def batch_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 128, every 32 up to 256, every 64
    beyond, and max_bs: a batch pads by at most a quarter of its rows (7 below 64), and
    --max-num-seqs 256 captures 19 sizes (not 35)."""
    buckets = [b for b in (1, 2, 4, 8) if b <= max_bs]
    for start, stop, step in ((16, 64, 8), (80, 128, 16), (160, 256, 32)):
        buckets += list(range(start, min(stop, max_bs) + 1, step))
    buckets += list(range(320, max_bs + 1, 64))
    if buckets[-1] != max_bs:
        buckets.append(max_bs)
    return buckets


def stage_slot_rows(dst: np.ndarray, rows: list[list[int]]) -> None:
    """dst[i] = the first dst.shape[1] slots of rows[i], zero-padded (slot 0 is the dummy).
    One numpy assignment when the rows are equally long: row by row cost ~0.7 us a row, 45 us
    of host time per step at batch 64."""
    width = dst.shape[1]
    cut = [r[:width] for r in rows]
    n = len(cut[0]) if cut else 0
    if all(len(r) == n for r in cut):
        dst[: len(cut), :n] = cut
        dst[: len(cut), n:] = 0
        return
    for i, r in enumerate(cut):
        dst[i, : len(r)] = r
        dst[i, len(r) :] = 0


class _NoEvent:
    """CPU stand-in of a CUDA event: work is already done when it is recorded."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class GraphSet:
    def __init__(self, executor, body, index: int, use_graphs: bool = True) -> None:
        self.executor = executor
        self.body = body
        self.index = index  # position among the executor's graph sets (TP ranks follow it)
        self.device = executor.device
        self.max_bs = body.inputs.max_bs
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.buckets = batch_buckets(self.max_bs) if self.use_graphs else None
        cuda = self.device.type == "cuda"
        # [lanes] int64: one (pinned) staging buffer on the host, one persistent twin on the
        # device; the results the same way, with two host buffers
        self.staging = torch.zeros(body.inputs.size, dtype=torch.int64, pin_memory=cuda)
        self.raw = torch.zeros(body.inputs.size, dtype=torch.int64, device=self.device)
        self.out = torch.zeros(body.outputs.size, dtype=torch.int64, device=self.device)
        self.host_out = [torch.zeros(body.outputs.size, dtype=torch.int64, pin_memory=cuda)
                         for _ in range(2)]
        self._host = body.inputs.host_views(self.staging)
        self._host_out = [body.outputs.host_views(h) for h in self.host_out]
        body.bind(body.inputs.views(self.raw), body.outputs.views(self.out))
        event = torch.cuda.Event if cuda else _NoEvent
        self.done = [event() for _ in range(2)]  # per result buffer: its D2H copy finished
        self.staged = event()  # the H2D copy has read the staging buffer
        self.graphs: dict[tuple[int, bool], list] = {}  # (bucket, greedy) -> graphs of parts
        self.pool = None
        self._launched = 0  # replays so far; replay n writes result buffer n % 2
        self._bs = [0, 0]

    # ---- capture --------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (bucket, greedy) combination; a no-op without graphs."""
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        mem0 = torch.cuda.memory_allocated(self.device)
        self._fill_padding(0, self.max_bs)
        self.raw.copy_(self.staging)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        todo = [(bs, greedy) for bs in reversed(self.buckets) for greedy in (True, False)]
        with torch.cuda.stream(stream), gc_paused():
            # largest first: later graphs reuse its pool
            for bs, greedy in tqdm(todo, desc=f"capturing {self.body.name} graphs",
                                   disable=None, leave=False):
                for _ in range(2):  # warm up: Triton compiles, cuBLAS picks kernels
                    self.run_eager(bs, greedy)
                captured = []
                for fn, capturable in self.body.parts(bs, greedy):
                    if not capturable:
                        fn()  # its outputs are inputs of the next captured part
                        captured.append(fn)
                        continue
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        fn()
                    if self.pool is None:
                        self.pool = graph.pool()
                    captured.append(graph)
                self.graphs[(bs, greedy)] = captured
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured %s graphs for batch sizes %s, greedy and sampled, in %.1f s "
                    "(%.0f MiB)", self.body.name, self.buckets, time.perf_counter() - t0,
                    (torch.cuda.memory_allocated(self.device) - mem0) / 2**20)

    def _fill_padding(self, start: int, end: int) -> None:
        for name, view in self._host.items():
            view[start:end] = self.body.padding.get(name, 0)

    def bucket_for(self, bs: int) -> int | None:
        if not self.use_graphs:
            return bs if bs <= self.max_bs else None
        for b in self.buckets:
            if b >= bs:
                return b
        return None

    # ---- replay ---------------------------------------------------------------------------
    def replay(self, bs: int, greedy: bool, fields: dict[str, list]) -> int:
        """Stage `fields` (input lane name -> one value or one row per request; absent lanes
        are 0), copy once, run the step, start the one D2H copy. Returns the padded batch
        size; `result()` waits for the results. A replay may be launched before the previous
        one's result is read (two result buffers; read each before launching the one after
        next)."""
        bucket = self.bucket_for(bs)
        self.staged.synchronize()  # the previous replay's H2D copy has read the staging buffer
        h = self._host
        for name, view in h.items():
            values = fields.get(name)
            if values is None:
                view[:bs] = self.body.padding.get(name, 0)
            elif view.ndim == 2:
                stage_slot_rows(view, values)
            else:
                view[:bs] = values
        self._fill_padding(bs, bucket)
        driver = self.executor.tp_driver
        if driver is not None:  # TP: ranks > 0 replay the same graphs
            driver.send_replay(self.index, bucket, greedy, self.staging)
        self.replay_staged(bucket, greedy)
        i = self._launched % 2
        self.host_out[i].copy_(self.out, non_blocking=True)  # the one D2H copy
        self.done[i].record()
        self._bs[i] = bs
        self._launched += 1
        return bucket

    def wait_staged(self) -> None:
        self.staged.synchronize()

    def replay_staged(self, bucket: int, greedy: bool) -> None:
        """The one H2D copy of the staged raw inputs, then the step (on every TP rank)."""
        self.raw.copy_(self.staging, non_blocking=True)  # the one H2D copy
        self.staged.record()
        if not self.use_graphs:
            self.run_eager(bucket, greedy)
            return
        for part in self.graphs[(bucket, greedy)]:
            part.replay() if isinstance(part, torch.cuda.CUDAGraph) else part()

    def result(self, back: int = 0) -> list:
        """Wait for the latest replay (back=1: the one before it); the body's per-request
        results."""
        i = (self._launched - 1 - back) % 2
        self.done[i].synchronize()
        return self.body.read(self._host_out[i], self._bs[i])

    @torch.inference_mode()
    def run_eager(self, bs: int, greedy: bool) -> None:
        """The same step without graphs (replays must equal it)."""
        for fn, _ in self.body.parts(bs, greedy):
            fn()
