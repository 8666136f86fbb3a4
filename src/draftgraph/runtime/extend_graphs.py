"""ExtendGraphs: the eager extend forward (prefill chunks, mixed steps) replayed as CUDA graphs
of bucketed token counts, so a prefill costs one replay instead of a few hundred host launches.

A step's tokens are padded up to the next bucket (`token_buckets`) and its requests up to the
executor's max_bs + 1 rows. The padding tokens belong to one padding request placed after the
live ones: table row 0 and KV slot 0 (the dummy row and slot of every padded step), positions
0 .. pad - 1. The rows after it are requests of no tokens. So every graph has static shapes,
and its padding never touches a live request's KV, token-table row or attention.

The graph is the executor's eager forward (`ModelExecutor.forward_fb`): metadata built on the
device from the raw inputs (one H2D copy from pinned memory), the token-table write, the model
forward with its hidden-state capture, then the final hidden states of the rows that need
logits gathered into a persistent buffer. The LM head runs after the replay on those rows
alone, as the eager forward's does. A step of more tokens runs eagerly.

Captured largest bucket first into one memory pool of its own. Without graphs (CPU, tests) the
same padded body runs eagerly.
"""

from __future__ import annotations

import logging
import time

import torch
from tqdm import tqdm

from draftgraph.attention.backend import ForwardBatch, Phase
from draftgraph.runtime.graph_set import gc_paused
from draftgraph.runtime.schema import StepBatch, resolve_refs

logger = logging.getLogger(__name__)

PAD_ROW = 0  # the padding request's table row, and the KV slot its tokens write
# the raw inputs, in their order in the staging buffer: per token, then per request row
TOKEN_LANES = ("input_ids", "out_cache_loc")
ROW_LANES = ("req_pool_indices", "seq_lens", "extend_lens", "logit_indices")


def token_buckets(max_tokens: int) -> list[int]:
    """Every 16 tokens up to 256, then 8 sizes per doubling (a step above 256 tokens pads by
    at most an eighth), and max_tokens: 48 buckets up to 4096."""
    out, size, step = [], 16, 16
    while size < max_tokens:
        out.append(size)
        if size >= 16 * step:
            step *= 2
        size += step
    out.append(max_tokens)
    return out


class ExtendGraphs:
    def __init__(self, executor, max_tokens: int, use_graphs: bool = True) -> None:
        ex = executor
        self.executor = ex
        self.max_tokens = max_tokens
        self.rows = ex.max_bs + 1  # the live requests and the padding request
        if ex.meta.max_bs < self.rows:
            raise ValueError(f"metadata buffers of {ex.meta.max_bs} requests cannot describe "
                             f"{ex.max_bs} requests and the padding request")
        self.buckets = token_buckets(max_tokens)
        cuda = ex.device.type == "cuda"
        self.use_graphs = use_graphs and cuda
        sizes = [max_tokens] * len(TOKEN_LANES) + [self.rows] * len(ROW_LANES)
        # [2 * max_tokens + 4 * rows] int64: pinned staging on the host, its device twin
        self.staging = torch.zeros(sum(sizes), dtype=torch.int64, pin_memory=cuda)
        self.raw = torch.zeros(sum(sizes), dtype=torch.int64, device=ex.device)
        names = TOKEN_LANES + ROW_LANES
        self._host = {n: v.numpy() for n, v in zip(names, self.staging.split(sizes),
                                                   strict=True)}
        self._dev = dict(zip(names, self.raw.split(sizes), strict=True))
        # [rows, hidden] the final hidden states of the rows that need logits
        self.hidden_out = torch.zeros(self.rows, ex.config.hidden_size, dtype=ex.dtype,
                                      device=ex.device)
        self.staged = torch.cuda.Event() if cuda else None  # the H2D copy read the staging
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # bucket -> graph
        self.pool = None
        self.replays = 0  # steps run through the padded body (graph or eager)

    def fits(self, sb: StepBatch) -> bool:
        return (sb.phase is Phase.EXTEND and 0 < len(sb.input_ids) <= self.max_tokens
                and len(sb.req_pool_indices) < self.rows)

    def bucket_for(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    # ---- the body -------------------------------------------------------------------------
    def _body(self, bucket: int) -> None:
        ex, d = self.executor, self._dev
        fb = ForwardBatch(Phase.EXTEND, d["input_ids"][:bucket], d["req_pool_indices"],
                          d["seq_lens"], d["extend_lens"], d["out_cache_loc"][:bucket],
                          ex.meta)
        hidden = ex.forward_fb(fb)  # [bucket, hidden]
        torch.index_select(hidden, 0, d["logit_indices"], out=self.hidden_out)

    def _stage(self, sb: StepBatch | None, bucket: int) -> None:
        """Write the staging buffer for `sb` padded to `bucket` tokens (None: all padding)
        and copy it to the device."""
        if self.staged is not None:
            self.staged.synchronize()  # the last copy has read the staging buffer
        h = self._host
        n = len(sb.input_ids) if sb is not None else 0
        bs = len(sb.req_pool_indices) if sb is not None else 0
        m = len(sb.logit_indices) if sb is not None else 0
        if sb is not None:
            h["input_ids"][:n] = sb.input_ids
            h["out_cache_loc"][:n] = sb.out_cache_loc
            h["req_pool_indices"][:bs] = sb.req_pool_indices
            h["seq_lens"][:bs] = sb.seq_lens
            h["extend_lens"][:bs] = sb.extend_lens
            h["logit_indices"][:m] = sb.logit_indices
        h["input_ids"][n:bucket] = 0
        h["out_cache_loc"][n:bucket] = PAD_ROW
        h["req_pool_indices"][bs:] = PAD_ROW
        h["seq_lens"][bs:] = 0
        h["extend_lens"][bs:] = 0
        h["seq_lens"][bs] = h["extend_lens"][bs] = bucket - n  # the padding request
        h["logit_indices"][m:] = 0
        self.raw.copy_(self.staging, non_blocking=True)  # the one H2D copy
        if self.staged is not None:
            self.staged.record()

    def run(self, sb: StepBatch) -> torch.Tensor:
        """The forward of `sb` (it `fits`): the final hidden states of its logit rows,
        [len(sb.logit_indices), hidden] (a view, valid until the next run)."""
        bucket = self.bucket_for(len(sb.input_ids))
        self._stage(sb, bucket)
        if sb.ref_tokens is not None:  # before the replay, which reads the ids in place
            resolve_refs(self._dev["input_ids"][: len(sb.input_ids)], sb.ref_tokens)
        if self.use_graphs:
            self.graphs[bucket].replay()
        else:
            self._body(bucket)
        self.replays += 1
        return self.hidden_out[: len(sb.logit_indices)]

    # ---- capture --------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per bucket, largest first (the smaller ones reuse its pool); a no-op
        without graphs."""
        if not self.use_graphs:
            return
        dev = self.executor.device
        t0, mem0 = time.perf_counter(), torch.cuda.memory_allocated(dev)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), gc_paused():
            for bucket in tqdm(list(reversed(self.buckets)), desc="capturing prefill graphs",
                               disable=None, leave=False):
                self._stage(None, bucket)
                self._body(bucket)  # warm up: Triton compiles, cuBLAS picks kernels
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self._body(bucket)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bucket] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured prefill graphs for %d token counts up to %d in %.1f s (%.0f MiB)",
                    len(self.buckets), self.max_tokens, time.perf_counter() - t0,
                    (torch.cuda.memory_allocated(dev) - mem0) / 2**20)
