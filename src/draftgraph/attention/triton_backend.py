"""Triton attention backend: metadata built on the device, attention over CSR KV lists.

Capabilities: in_graph_metadata (every builder is capturable: no host read, no allocation,
grids from static sizes); draft_step_update (a draft chain's next-step metadata is rebuilt
inside the graph from the advanced raw inputs); fused_kv_store.

`forward` stores the new K/V, then runs the phase's kernel (`kernels`): split-KV decode
attention for DECODE, DRAFT_CHAIN and VERIFY (one row per query token; under `exact_rows`
each computed as the decode row at its position, else in the splits its row count's plan
gives), the variable-length extend kernel for EXTEND,
and the same kernel non-causally over the block's lists for DRAFT_BLOCK (its metadata: the
positions and one count/scan/compact of the block's lists, in the graph). Nothing is read
back to the host, so a whole forward can be captured in a CUDA graph.

NOTE: the split-KV scratch (partials `mid_o` / `mid_lse`, per-(row, KV head) arrival counters
`kv_counters`) is allocated once, sized for the largest rows x splits of any batch up to
`max_bs` (`decode_plan` gives each batch size its splits); its addresses never change. Without
`num_q_heads` it is allocated by the first decode forward, which must then run eagerly (graph
runners warm up before capture); a decode batch that does not fit is an error, never a
reallocation. Decode attention is one launch: the last split program of a (row, KV head) to
bump its counter combines the partials and resets the counter to 0, so the counters are zero
between launches and a graph replay needs no memset (and no second reduce launch).
"""

from __future__ import annotations

import torch

from draftgraph.attention.backend import AttentionBackend, ForwardBatch, Phase
from draftgraph.attention.kv_pool import KVPool
from draftgraph.config import TREE_MAX_NODES
from draftgraph.kernels import attention as attn_kernels
from draftgraph.kernels import metadata as meta_kernels
from draftgraph.kernels.kv_store import store_kv


class TritonBackend(AttentionBackend):
    name = "triton"
    in_graph_metadata = True
    draft_step_update = True
    fused_kv_store = True
    kernels = {Phase.DECODE: "decode", Phase.DRAFT_CHAIN: "decode", Phase.EXTEND: "extend",
               Phase.VERIFY: "decode", Phase.DRAFT_BLOCK: "extend"}
    # query rows a verify request brings at most (the last token and a tree's nodes; a chain
    # brings up to 16 drafts): the scratch's bound unless the engine gives its own
    MAX_VERIFY_ROWS = 1 + TREE_MAX_NODES
    # verify attention planned by its row count when rows need not be exact (False: by its
    # requests, as exact rows do; the A arm of benchmarks/bench_block.py's `batchplan` mode)
    verify_plan_by_rows = True

    def __init__(
        self,
        kv_pool: KVPool,
        req_to_token: torch.Tensor,
        sliding_window: int | None,
        scale: float,
        *,
        max_bs: int = 256,
        num_q_heads: int | None = None,
        max_kv_splits: int = 32,
        max_num_tokens: int | None = None,
        device: torch.device | str | None = None,
        invariant: bool = False,
        rows_per_request: int | None = None,
    ) -> None:
        super().__init__(kv_pool, req_to_token, sliding_window, scale)
        k0 = kv_pool.k_buffers[0]
        self.num_kv_heads, self.head_dim = k0.shape[1], k0.shape[2]
        self.max_bs = max_bs
        self.max_kv_splits = max_kv_splits
        self.max_num_tokens = max_num_tokens
        # query rows one request brings to a decode-kernel forward at most (1 + k: its
        # verify rows); the split-KV scratch is sized by it
        self.rows_per_request = rows_per_request or self.MAX_VERIFY_ROWS
        self.device = torch.device(device) if device is not None else k0.device
        self.num_q_heads = num_q_heads
        # batch-invariant decode plan (`--deterministic`): a fixed split length over the
        # longest list a request can have, a slot per split for every row
        self.invariant = invariant
        self.max_len = req_to_token.shape[1]
        self.mid_o: torch.Tensor | None = None
        self.mid_lse: torch.Tensor | None = None
        self.kv_counters: torch.Tensor | None = None
        if num_q_heads is not None:
            self._alloc_scratch(num_q_heads)
        # split-KV extend (kernels/attention.py EXTEND_MAX_SPLITS; never batch-invariant):
        # its scratch, allocated once for every plan
        self.extend_splits = 1 if invariant else attn_kernels.EXTEND_MAX_SPLITS
        self.extend_scratch = (attn_kernels.extend_scratch(self.head_dim, self.device)
                               if self.extend_splits > 1 else {})
        # key tiles without masks below a tile's first query (EXTEND_UNMASKED_FIRST); not
        # batch-invariant on the GPU (which loop takes a key tile follows the tiling)
        self.extend_unmasked = attn_kernels.EXTEND_UNMASKED_FIRST and not invariant

    def _alloc_scratch(self, num_q_heads: int) -> None:
        # split-KV partials of decode attention (normalised acc and log2-sum-exp per split),
        # flat: each batch size views [bs, Hq, its splits, D] from the front
        self.num_q_heads = num_q_heads
        rpr, cap = self.rows_per_request, self.max_num_tokens
        max_rows = min(self.max_bs * rpr, cap or self.max_bs * rpr)
        if self.invariant:
            rows = max_rows * attn_kernels.INVARIANT_MAX_SPLITS
        else:
            rows = attn_kernels.decode_scratch_rows(self.max_bs, num_q_heads, self.num_kv_heads,
                                                    self.head_dim, self.max_kv_splits, rpr, cap)
        self.mid_o = torch.empty(rows * num_q_heads * self.head_dim, dtype=torch.float32,
                                 device=self.device)  # [bs * S * Hq * D]
        self.mid_lse = torch.empty(rows * num_q_heads, dtype=torch.float32,
                                   device=self.device)  # [bs * S * Hq]
        # split programs that have finished, per (row, KV head); zero between launches
        self.kv_counters = torch.zeros(max_rows * self.num_kv_heads, dtype=torch.int32,
                                       device=self.device)  # [max rows * Hkv] int32

    def build_metadata(self, fb: ForwardBatch) -> None:
        meta_kernels.build_metadata(fb.req_pool_indices, fb.seq_lens, fb.extend_lens,
                                    fb.out_cache_loc, self.req_to_token, fb.meta,
                                    fb.phase is Phase.DRAFT_BLOCK, fb.paths)

    def advance_metadata(self, fb: ForwardBatch) -> None:
        """The next draft step's metadata, inside the graph: the builders are capturable, so
        the advance is a rebuild from the advanced raw inputs (one launch, two for tree rows),
        never a host trip.
        """
        self.build_metadata(fb)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                sliding: bool, fb: ForwardBatch) -> torch.Tensor:
        self.store_kv(k, v, layer_id, fb)
        return self.attend(q, layer_id, sliding, fb)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                 fb: ForwardBatch) -> None:
        store_kv(k, v, self.kv_pool.k_buffers[layer_id], self.kv_pool.v_buffers[layer_id],
                 fb.out_cache_loc)

    def attend(self, q: torch.Tensor, layer_id: int, sliding: bool,
               fb: ForwardBatch) -> torch.Tensor:
        """Attention only: the new tokens' K/V are already in the pool (e.g. written by
        `kernels.elementwise.rope_and_store_kv`, which saves the store launch)."""
        k_cache = self.kv_pool.k_buffers[layer_id]
        v_cache = self.kv_pool.v_buffers[layer_id]
        lists = fb.lists(sliding)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
        if self.kernel_for(fb.phase) == "decode":
            # with exact rows the plan is the request batch's: a verify row takes the splits
            # and tiles a decode row of the same batch size takes, so it is computed as that
            # row. Without (its projections differ from the decode row's anyway), a verify
            # whose batch plan splits rows takes the plan of its row count: fewer, longer
            # splits (on the 8B, 5 verify rows in the batch-1 plan of 32 splits cost 2.6x a
            # decode row; benchmarks/results/verify_plan/).
            bs, rows = fb.bs, q.shape[0]
            if self.mid_o is None:
                if q.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError("TritonBackend: pass num_q_heads= (or run one eager "
                                       "decode forward) before capturing a decode graph")
                self._alloc_scratch(q.shape[1])
            hq = q.shape[1]
            if self.invariant:
                num_splits, cfg = attn_kernels.invariant_decode_plan(bs, self.num_kv_heads,
                                                                     self.max_len)
                slots = attn_kernels.INVARIANT_MAX_SPLITS
            else:
                plan = attn_kernels.decode_plan
                num_splits, cfg = plan(bs, hq, self.num_kv_heads, self.head_dim,
                                       self.max_kv_splits)
                if (num_splits > 1 and fb.phase is Phase.VERIFY and self.verify_plan_by_rows
                        and not self.exact_rows):
                    num_splits, cfg = plan(rows, hq, self.num_kv_heads, self.head_dim,
                                           self.max_kv_splits)
                slots = num_splits
            if (rows * slots * hq > self.mid_lse.numel()
                    or rows * self.num_kv_heads > self.kv_counters.numel()):
                raise ValueError(
                    f"decode batch of {rows} rows ({bs} requests) x {hq} query heads does not "
                    f"fit the backend's scratch ({self.max_bs} requests of up to "
                    f"{self.rows_per_request} rows x {self.num_q_heads}); build TritonBackend "
                    f"with max_bs=, rows_per_request=, num_q_heads= and max_num_tokens= large "
                    f"enough"
                )
            n = rows * hq * slots
            token_rows = ((fb.meta.token_req, fb.meta.qo_indptr, bs)
                          if fb.phase is Phase.VERIFY else None)
            attn_kernels.decode_attention(
                q, k_cache, v_cache, lists.kv_indptr, lists.kv_indices, lists.kv_start,
                fb.positions, lists.window, self.scale, out,
                mid_o=self.mid_o[: n * self.head_dim].view(rows, hq, slots, self.head_dim),
                mid_lse=self.mid_lse[:n].view(rows, hq, slots),
                kv_counters=self.kv_counters, num_splits=num_splits, config=cfg,
                token_rows=token_rows,
            )
        else:
            splits = 1
            if self.extend_splits > 1 and not lists.noncausal:
                splits = attn_kernels.extend_num_splits(q.shape[0], fb.bs, q.shape[1],
                                                        self.num_kv_heads,
                                                        max_splits=self.extend_splits)
            attn_kernels.extend_attention(
                q, k_cache, v_cache, fb.meta.qo_indptr, lists.kv_indptr, lists.kv_indices,
                lists.kv_start, fb.positions, None if lists.noncausal else lists.window,
                self.scale, out, fb.bs, noncausal=lists.noncausal, num_splits=splits,
                unmasked_first=self.extend_unmasked,
                **(self.extend_scratch if splits > 1 else {}),
            )
        return out
