"""ModelExecutor: one model with its own KV pool, metadata buffers and attention backend,
over the engine's shared slot space; runs one eager forward of a `StepBatch`, and holds the
graph sets that replay step bodies on it.

`build_target` makes the engine's slot space and the target's executor (on every TP rank:
rank 0 sends its arguments to ranks > 0, which call it with the same ones).
"""

from __future__ import annotations

import logging

import torch

from draftgraph.attention.backend import ForwardBatch, TorchBackend
from draftgraph.attention.kv_pool import KVPool
from draftgraph.attention.metadata import MetadataBuffers
from draftgraph.config import CacheConfig, SchedulerConfig
from draftgraph.distributed.parallel import min_over_ranks
from draftgraph.kernels import gemv
from draftgraph.models.llama import HiddenCapture, LlamaForCausalLM
from draftgraph.runtime.controls import ControlTables
from draftgraph.runtime.schema import StepBatch, resolve_refs
from draftgraph.runtime.slot_space import SlotSpace, kv_slots
from draftgraph.runtime.tp_control import tp_driver

logger = logging.getLogger(__name__)

SCORE_ROWS = 256  # prompt rows scored per LM-head pass (forward_scoring)


def make_backend(name: str, kv_pool: KVPool, req_to_token: torch.Tensor, model_cfg,
                 max_bs: int, device: torch.device, num_q_heads: int | None = None,
                 max_num_tokens: int | None = None, invariant: bool = False,
                 rows_per_request: int | None = None):
    """`num_q_heads`: the query heads this rank attends over (default: all of the model's);
    `max_num_tokens`: the most tokens of one forward (bounds the verify rows' scratch);
    `invariant`: the batch-invariant decode plan (Triton; `--deterministic`);
    `rows_per_request`: the most query rows one request brings (1 + k; default: the largest
    tree's)."""
    scale = model_cfg.head_dim ** -0.5
    if name == "torch":
        return TorchBackend(kv_pool, req_to_token, model_cfg.sliding_window, scale)
    if name == "triton":
        from draftgraph.attention.triton_backend import TritonBackend

        return TritonBackend(kv_pool, req_to_token, model_cfg.sliding_window, scale,
                             max_bs=max_bs,
                             num_q_heads=num_q_heads or model_cfg.num_attention_heads,
                             max_num_tokens=max_num_tokens, device=device,
                             invariant=invariant, rows_per_request=rows_per_request)
    raise ValueError(f"unknown attention backend {name!r} (torch, triton)")


def kv_bytes_per_token(model: LlamaForCausalLM, dtype: torch.dtype) -> int:
    cfg = model.config
    return (2 * cfg.num_hidden_layers * model.num_local_kv_heads * cfg.head_dim
            * torch.tensor([], dtype=dtype).element_size())


class ModelExecutor:
    def __init__(self, model: LlamaForCausalLM, slots: SlotSpace, max_bs: int,
                 max_num_tokens: int, device: torch.device, dtype: torch.dtype,
                 backend: str, exact_rows: str | None = None,
                 deterministic: bool = False, tensor_core_rows: str | None = None,
                 rows_per_request: int | None = None) -> None:
        """exact_rows: whether multi-row steps (verify rows, small batches) compute every row
        exactly as a decode row (kernels/gemv.py): "on", "off", "auto" (on for models of at
        most gemv.EXACT_ROWS_MAX_BYTES of weights), or None: leave the model's weights as they
        are marked (a drafter's executor, whose model may share the target's weights: a draft
        model `self`, the target's LM head). deterministic: batch invariance, every row's
        result independent of its batch-mates and of M (GPU: the batch-invariant matmul and
        decode plan; CPU: exact rows, which it implies). tensor_core_rows: products of
        gemv.DOT_ROWS rows on the tensor-core matmul (CUDA): "on", "off", "auto" (on for
        models of at most gemv.DOT_ROWS_MAX_BYTES of weights), or None: leave the weights as
        marked; `self.tensor_core_rows` is what was resolved ("on" / "off"), for a drafter's
        executor to take. rows_per_request: the most rows one request brings to a forward
        (1 + the drafter's k: a verify; None: the largest tree's); a drafter's executor takes
        the target's."""
        cfg = model.config
        self.model = model
        self.config = cfg
        self.slots = slots
        self.device = device
        self.dtype = dtype
        self.max_bs = max_bs
        self.max_num_tokens = max_num_tokens
        self.rows_per_request = rows_per_request
        self.kv_pool = KVPool(cfg.num_hidden_layers, slots.num_slots, model.num_local_kv_heads,
                              cfg.head_dim, dtype, device)
        kv_capacity = slots.num_slots + max_num_tokens * 2
        # max_bs + 1 requests: a captured prefill's padding request rides after the live ones
        self.meta = MetadataBuffers(max_bs + 1, max_num_tokens, kv_capacity,
                                    cfg.sliding_window, device)
        if exact_rows not in (None, "auto", "on", "off"):
            raise ValueError(f"--exact-rows must be auto, on or off, got {exact_rows!r}")
        exact = deterministic or exact_rows == "on" or (exact_rows == "auto"
                                                        and gemv.wants_exact_rows(model))
        if exact_rows is not None or deterministic:
            gemv.mark_exact_rows(model, gemv.EXACT_ROWS_MAX_M if exact else 0)
            gemv.mark_invariant(model, deterministic)
            if exact and device.type == "cpu":
                bounds = gemv.mark_rows_invariant(model)
                logger.info("exact rows on the CPU: products of up to N rows measured bitwise "
                            "their lone rows' here go batched, the rest one row at a time "
                            "(N by weight: %s)", bounds)
        if tensor_core_rows not in (None, "auto", "on", "off"):
            raise ValueError("--tensor-core-rows must be auto, on or off, got "
                             f"{tensor_core_rows!r}")
        self.tensor_core_rows = tensor_core_rows
        if tensor_core_rows is not None:
            on = tensor_core_rows == "on" or (tensor_core_rows == "auto"
                                              and gemv.wants_dot_rows(model))
            self.tensor_core_rows = "on" if on else "off"
            gemv.mark_dot_rows(model, gemv.DOT_ROWS if on else None)
        self.backend = make_backend(backend, self.kv_pool, slots.req_pool.req_to_token, cfg,
                                    max_bs, device, num_q_heads=model.num_local_heads,
                                    max_num_tokens=max_num_tokens, invariant=deterministic,
                                    rows_per_request=rows_per_request)
        self.backend.exact_rows = exact  # TorchBackend: verify attention row by row
        self.tp_driver = None  # rank 0 of a TP group: sends each step to ranks > 0
        self.capture: HiddenCapture | None = None  # hidden states a drafter reads
        self.observers: list = []  # drafters that keep KV: `observe` each eager forward
        self.controls: ControlTables | None = None  # sampling controls' per-request tables
        # graph sets by name, in creation order (TP ranks follow them by index)
        self.graph_sets: dict = {}
        self.extend_graphs = None  # captured prefill (runtime/extend_graphs.py), when made

    def capture_hidden(self, layer_ids: tuple[int, ...]) -> HiddenCapture:
        """From now on every forward of this executor (eager, verify) keeps the residual
        streams after `layer_ids` in one persistent buffer, for the drafter that asked."""
        if self.capture is not None and self.capture.layer_ids != tuple(layer_ids):
            raise ValueError(f"hidden states of layers {self.capture.layer_ids} are already "
                             f"captured; a second drafter asks for {tuple(layer_ids)}")
        bad = [i for i in layer_ids if not 0 <= i < self.config.num_hidden_layers]
        if bad:
            raise ValueError(f"hidden layer ids {bad} are outside the target's "
                             f"{self.config.num_hidden_layers} layers")
        if self.capture is None:
            out = torch.zeros(self.max_num_tokens, len(layer_ids) * self.config.hidden_size,
                              dtype=self.dtype, device=self.device)
            self.capture = HiddenCapture(tuple(layer_ids), out)
        return self.capture

    def forward_batch(self, sb: StepBatch) -> ForwardBatch:
        dev = self.device

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=dev)

        return ForwardBatch(
            phase=sb.phase,
            input_ids=resolve_refs(t(sb.input_ids), sb.ref_tokens),
            req_pool_indices=t(sb.req_pool_indices),
            seq_lens=t(sb.seq_lens),
            extend_lens=t(sb.extend_lens),
            out_cache_loc=t(sb.out_cache_loc),
            meta=self.meta,
        )

    @torch.inference_mode()
    def forward(self, sb: StepBatch) -> torch.Tensor:
        """Run one forward, a captured prefill's replay when one fits, else eagerly; returns
        logits [len(logit_indices), vocab] fp32."""
        graphs = self.extend_graphs
        if graphs is not None and graphs.fits(sb):
            hidden = graphs.run(sb)  # [len(logit_indices), hidden]
            if not sb.logit_indices:
                logits = hidden.new_empty(0, self.config.vocab_size, dtype=torch.float32)
            else:
                logits = self.model.compute_logits(hidden)
        else:
            logits = self._logits(sb, self._hidden(sb))
        self._observe(sb)
        return logits

    def _observe(self, sb: StepBatch) -> None:
        """The drafters that keep KV write theirs for the tokens just forwarded (on every TP
        rank: ranks > 0 follow `forward`, so their collectives line up)."""
        for drafter in self.observers:
            drafter.observe(sb)

    def _hidden(self, sb: StepBatch) -> torch.Tensor:
        if self.tp_driver is not None:  # TP: ranks > 0 run the same forward
            self.tp_driver.send_forward(sb)
        return self.forward_fb(self.forward_batch(sb))

    def forward_fb(self, fb: ForwardBatch) -> torch.Tensor:
        """The forward of raw inputs already on the device, graph-safe: metadata, the
        token-table write, the model (its hidden states captured for a drafter). Returns the
        final hidden states [num_tokens, hidden]."""
        self.backend.build_metadata(fb)
        self.slots.token_table[fb.req_pool_indices[fb.meta.token_req[: fb.num_tokens]],
                               fb.positions] = fb.input_ids
        return self.model(fb.input_ids, fb, self.backend, capture=self.capture)

    def _logits(self, sb: StepBatch, hidden: torch.Tensor) -> torch.Tensor:
        if not sb.logit_indices:
            return hidden.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        idx = torch.tensor(sb.logit_indices, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden[idx])

    @torch.inference_mode()
    def forward_scoring(self, sb: StepBatch, indices: list[int], next_ids: list[int],
                        top_n: int) -> tuple[torch.Tensor, tuple[list, list, list, list]]:
        """`forward`, and the tokens at `indices` (into the batch's tokens) scored on the
        device: the log_softmax of `next_ids` (the token that follows each), its rank (1 = the
        most likely) and the top_n alternatives. Logits are made SCORE_ROWS rows at a time
        and reduced at once, so a long prompt never holds [num_tokens, vocab] logits.
        NOTE: rank 0 only (the LM head's collectives would need every rank under TP; the
        engine refuses prompt logprobs there). Returns (logits, (logprobs, ranks, top ids,
        top logprobs)), lists of len(indices) (top lists of top_n each)."""
        hidden = self._hidden(sb)
        logits = self._logits(sb, hidden)
        self._observe(sb)
        idx = torch.tensor(indices, dtype=torch.int64, device=self.device)  # [n]
        nxt = torch.tensor(next_ids, dtype=torch.int64, device=self.device)  # [n]
        parts = []
        for i in range(0, len(indices), SCORE_ROWS):
            rows = self.model.compute_logits(hidden[idx[i : i + SCORE_ROWS]])  # [m, V] fp32
            lse = torch.logsumexp(rows, dim=-1)
            picked = rows.gather(1, nxt[i : i + SCORE_ROWS, None])  # [m, 1]
            rank = (rows > picked).sum(dim=-1) + 1
            values, ids = torch.topk(rows, top_n, dim=-1)
            parts.append((picked[:, 0] - lse, rank, ids, values - lse[:, None]))
        scored = tuple(torch.cat(x).tolist() for x in zip(*parts, strict=True))
        return logits, scored

    def init_graphs(self, bodies: dict, use_graphs: bool = True,
                    shared_pools: dict[str, str] | None = None) -> None:
        """One graph set per step body, by name: `bodies` maps a name to a factory
        `(executor) -> body` (picklable: TP ranks > 0 build the same bodies from it).
        Captured on CUDA with use_graphs; otherwise the bodies run eagerly per step.
        shared_pools: name -> an earlier graph set's name whose graph memory pool it captures
        into (sets replayed one after the other on one stream, e.g. a body and its twin)."""
        from draftgraph.runtime.graph_set import GraphSet

        shared_pools = shared_pools or {}
        if self.tp_driver is not None:
            self.tp_driver.send_init_graphs(dict(bodies=bodies, use_graphs=use_graphs,
                                                 shared_pools=shared_pools))
        for name, factory in bodies.items():
            gs = GraphSet(self, factory(self), len(self.graph_sets), use_graphs)
            if name in shared_pools:
                gs.pool = self.graph_sets[shared_pools[name]].pool
            gs.capture()
            self.graph_sets[name] = gs

    def init_extend_graphs(self, max_tokens: int, use_graphs: bool = True) -> None:
        """Captured prefill: extend forwards of up to `max_tokens` tokens (cut to what one
        forward and the padding request's table row hold) replay graphs of bucketed sizes;
        without graphs the same padded forward runs eagerly (tests). Not under TP: ranks > 0
        follow eager forwards only."""
        from draftgraph.runtime.extend_graphs import ExtendGraphs

        if self.tp_driver is not None:
            raise ValueError("captured prefill does not run under --tensor-parallel-size > 1")
        width = self.slots.req_pool.req_to_token.shape[1]
        cap = min(max_tokens, self.max_num_tokens, width, self.config.max_position_embeddings)
        self.extend_graphs = ExtendGraphs(self, cap, use_graphs)
        self.extend_graphs.capture()

    def graph_set_by_index(self, index: int):
        return list(self.graph_sets.values())[index]


def build_target(model: LlamaForCausalLM, *, cache_cfg: CacheConfig,
                 sched_cfg: SchedulerConfig, max_model_len: int, device: torch.device,
                 dtype: torch.dtype, backend: str, extra_tokens_per_req: int = 0,
                 extra_kv_bytes_per_token: int = 0, exact_rows: str = "off",
                 deterministic: bool = False,
                 tensor_core_rows: str = "off") -> tuple[SlotSpace, ModelExecutor]:
    """The engine's slot space and the target's executor.

    extra_tokens_per_req: draft tokens a step may feed per request (a verify step feeds
    1 + k); extra_kv_bytes_per_token: the drafters' KV per slot, so the pool fits them too."""
    kwargs = dict(cache_cfg=cache_cfg, sched_cfg=sched_cfg, max_model_len=max_model_len,
                  dtype=dtype, backend=backend, extra_tokens_per_req=extra_tokens_per_req,
                  extra_kv_bytes_per_token=extra_kv_bytes_per_token, exact_rows=exact_rows,
                  deterministic=deterministic, tensor_core_rows=tensor_core_rows)
    driver = tp_driver(model.tp, kwargs)  # TP rank 0: ranks > 0 call this with the same
    max_num_tokens = max(sched_cfg.max_num_batched_tokens,
                         sched_cfg.max_num_seqs * (1 + extra_tokens_per_req))
    per_token = kv_bytes_per_token(model, dtype) + extra_kv_bytes_per_token
    # TP: every rank's pools have the same slots (rank 0's allocator picks them)
    num_slots = min_over_ranks(kv_slots(cache_cfg, sched_cfg, max_model_len, per_token,
                                        device), model.tp)
    slots = SlotSpace(num_slots, cache_cfg.page_size, sched_cfg.max_num_seqs,
                      max_model_len + cache_cfg.page_size + extra_tokens_per_req, device)
    target = ModelExecutor(model, slots, sched_cfg.max_num_seqs, max_num_tokens, device, dtype,
                           backend, exact_rows, deterministic, tensor_core_rows,
                           rows_per_request=1 + extra_tokens_per_req)
    target.tp_driver = driver
    logger.info("KV cache: %d slots (%.1f MiB), page size %d, backend %s",
                slots.allocator.usable_slots, target.kv_pool.bytes() / 2**20,
                cache_cfg.page_size, target.backend.name)
    return slots, target
