"""LLMEngine: requests in, tokens out, one scheduler step at a time.

`add_request` and `abort` may be called from any thread: they go through an inbox that the
engine thread drains at the start of each `step`. Everything else runs on the engine thread.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import deque

import torch

from draftgraph.attention.backend import Phase
from draftgraph.config import EngineConfig
from draftgraph.engine.errors import EngineError, QueueFullError
from draftgraph.engine.first_tokens import FirstTokens
from draftgraph.engine.request import Request, RequestOutput, Status
from draftgraph.engine.sampling import SamplingParams
from draftgraph.engine.scheduler import ScheduledRequest, Scheduler
from draftgraph.engine.speculation import SpecPolicy
from draftgraph.engine.stats import STEP_KINDS
from draftgraph.models import row_pack
from draftgraph.runtime import host_memory
from draftgraph.runtime.controls import StepControls
from draftgraph.runtime.executor import build_target
from draftgraph.runtime.kv_cache import OutOfKVSlots
from draftgraph.runtime.prefix_cache import PrefixCache
from draftgraph.runtime.schema import StepBatch
from draftgraph.spec import Drafter, emit, make_drafter
from draftgraph.spec.extras import TOP_N_MAX, ExtrasFactory, ensure_controls
from draftgraph.spec.step import BodyFactory

logger = logging.getLogger(__name__)
_RUNNING = Status.RUNNING  # identity tests in the per-request loops (see request._FINISHED)

__all__ = ["EngineError", "LLMEngine", "QueueFullError"]


def _lanes_to(dev: torch.device, ints: list[list[int]], floats: list[list[float]]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request lanes ([bs] each) on `dev` in one transfer from pinned memory (no
    synchronising pageable copies): int64 rows [len(ints), bs], fp32 rows [len(floats), bs]."""
    bs = len(ints[0])
    n = len(ints) * bs
    host = torch.empty(2 * n + len(floats) * bs, dtype=torch.int32,
                       pin_memory=dev.type == "cuda")
    host[:2 * n].view(torch.int64).copy_(torch.tensor(ints, dtype=torch.int64).view(-1))
    host[2 * n:].view(torch.float32).copy_(torch.tensor(floats, dtype=torch.float32).view(-1))
    d = host.to(dev, non_blocking=True)
    return d[:2 * n].view(torch.int64).view(-1, bs), d[2 * n:].view(torch.float32).view(-1, bs)


# A decode row rides in a prefill only if its keys outnumber the prefill's longest list by at
# most this many: 8 more 64-key tiles in the extend kernel's longest loop (~2 us each a layer
# on an H200: benchmarks/results/prefill_graphs_smollm2-135m_h200.json, 478 us over 30 layers
# for a 512-token prompt's 8 tiles), ~0.5 ms for SmolLM2's 30 layers at most, against the ~1.1
# ms decode step at 64 streams that the row saves (H100, benchmarks/NOTES.md stop 54).
RIDE_EXTRA_KEYS = 512


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded=None, drafter: Drafter | None = None) -> None:
        """`drafter`: a Drafter object instead of the one `config.spec` names (tests, custom
        drafters); `loaded`: an already loaded model (tests)."""
        self.config = config
        self.device = torch.device(config.device)
        torch.manual_seed(config.seed)
        if self.device.type == "cpu":  # activations reuse freed heap memory (no page faults)
            host_memory.keep_freed_memory()
        if config.tensor_parallel_size > 1:  # TP: start ranks 1.. (runtime/tp_worker.py)
            from draftgraph.runtime.tp_worker import start_workers

            if loaded is not None:
                raise EngineError("--tensor-parallel-size > 1: every rank loads its shard "
                                  "itself; pass the model by name, not loaded")
            start_workers(config)
        if loaded is None:
            from draftgraph.models.loader import load_model

            loaded = load_model(config.model, device=config.device, dtype=config.torch_dtype)
        self.loaded = loaded
        if config.quantization == "int4":  # in place: an engine sharing `loaded` reads int4 too
            from draftgraph.models.quant import quantize_int4_

            q = quantize_int4_(loaded.model)
            logger.info("int4: %d weights packed; a step reads %.0f MB of them, not %.0f MB",
                        q["packed"], q["bytes_after"] / 1e6, q["bytes_before"] / 1e6)
        if (config.device.startswith("cpu") and config.quantization == "none"
                and config.tensor_parallel_size == 1
                and (config.row_pack == "on" or (config.row_pack == "auto"
                                                 and row_pack.wants(loaded.model)))):
            logger.info("row pack: blocked weight copies for 2 .. %d-row products, %.0f MB",
                        row_pack.ROWS_MAX, row_pack.pack_rows_(loaded.model) / 1e6)
        self.model = self.loaded.model
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.source = self.loaded.source  # the resolved model path or random: preset
        sched_cfg = config.scheduler
        model_ctx = self.model_config.max_position_embeddings
        self.max_model_len = min(sched_cfg.max_model_len or min(model_ctx, 8192), model_ctx)
        if sched_cfg.max_model_len and sched_cfg.max_model_len > model_ctx:
            raise EngineError(f"--max-model-len {sched_cfg.max_model_len} exceeds the model's "
                              f"context of {model_ctx} tokens")
        self.drafter = drafter if drafter is not None else make_drafter(
            config.spec, self.device, config.torch_dtype, self.model_config, config.model,
            quantization=config.quantization)
        if self.drafter is not None and config.quantization == "int4":
            logger.warning(
                "--quantization int4 with a %s drafter: the int4 kernel is compute-bound on a "
                "CPU, so a speculative step's verify rows cost nearly a decode step each and "
                "speculation runs at about 0.4-0.6x plain int4 decoding (benchmarks/NOTES.md); "
                "leave --speculative off with int4 for speed", self.drafter.name)
        if self.drafter is not None and not self.drafter.runs_under_tp and \
                config.tensor_parallel_size > 1:
            raise EngineError(f"--speculative {self.drafter.name} does not run under "
                              "--tensor-parallel-size > 1 yet")
        k = self.drafter.k if self.drafter is not None else 0
        backend = config.attention_backend or ("triton" if self.device.type == "cuda"
                                               else "torch")
        # one slot space for every model; the target's executor over it
        self.slots, self.target = build_target(
            self.model, cache_cfg=config.cache, sched_cfg=sched_cfg,
            max_model_len=self.max_model_len, device=self.device, dtype=config.torch_dtype,
            backend=backend, extra_tokens_per_req=k,
            extra_kv_bytes_per_token=(self.drafter.kv_bytes_per_token(config.torch_dtype)
                                      if self.drafter is not None else 0),
            exact_rows=config.exact_rows, tensor_core_rows=config.tensor_core_rows,
            deterministic=config.deterministic)
        self.spec_k = k
        self.requests: dict[str, Request] = {}
        self._inbox: deque = deque()
        self._lock = threading.Lock()
        self._rng = random.Random(config.seed)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            self.eos_token_ids |= set(self.tokenizer.eos_token_ids)
        self.stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                      "accepted_per_pos": [0] * max(k, 1), "prompt_tokens": 0,
                      "generation_tokens": 0, "rows_riding": 0, "prefills_held": 0,
                      **{f"steps_{kind}": 0 for kind in STEP_KINDS},
                      **{f"step_seconds_{kind}": 0.0 for kind in STEP_KINDS},
                      **{f"wait_seconds_{kind}": 0.0 for kind in STEP_KINDS}}
        self.prefix_cache = (PrefixCache(self.slots.allocator, self.stats)
                             if config.cache.enable_prefix_caching else None)
        self.scheduler = Scheduler(sched_cfg, self.slots.allocator, self.slots.req_pool,
                                   self.prefix_cache, self._write_cached_prefix)
        self.policy = (SpecPolicy(config.spec, k, keeps_kv=self.drafter.keeps_kv)
                       if self.drafter is not None else None)
        if self.policy is not None:
            self.policy.stats = self.stats
            self.policy.max_model_len = self.max_model_len
        # decode and speculative steps are graph sets of step bodies: captured on a GPU, run
        # eagerly elsewhere (the same body, the same buffers)
        use_graphs = self.device.type == "cuda" and config.use_graphs
        # each with an extras twin (spec/extras.py): top-N logprobs and sampling controls,
        # replayed only for steps where a request asks for them
        self.controls = ensure_controls(self.target, 1 + k)
        bodies = {"decode": BodyFactory(None, use_graphs=use_graphs)}
        if self.drafter is not None:
            bodies["spec"] = BodyFactory(self.drafter, use_graphs=use_graphs)
        bodies.update({f"{name}+extras": ExtrasFactory(f, 1 + k) for name, f in bodies.items()})
        self.target.init_graphs(bodies, use_graphs=use_graphs, shared_pools={
            name: name.removesuffix("+extras") for name in bodies if name.endswith("+extras")})
        if use_graphs and config.prefill_graph_tokens and config.tensor_parallel_size == 1:
            self.target.init_extend_graphs(config.prefill_graph_tokens)
        self.decode_graphs = self.target.graph_sets["decode"]
        self.spec_graphs = self.target.graph_sets.get("spec")
        self.extras_graphs = {gs: self.target.graph_sets[f"{name}+extras"]
                              for name, gs in self.target.graph_sets.items()
                              if not name.endswith("+extras")}
        # async scheduling: requests of a launched replay whose tokens are not read yet.
        # NOTE: with graphs only (eagerly nothing overlaps). Under TP, ranks > 0 replay the same
        # staged references and resolve them from their own output buffers, which hold the
        # same tokens: the logits are all-gathered, sampling is a pure function of (seed,
        # position), drafts of the token table (tested on CPU over gloo)
        self.async_scheduling = config.async_scheduling and use_graphs
        self._inflight: list[Request] | None = None
        self._inflight_graphs = None  # the graph set of that replay
        self._inflight_draft: list[int] | None = None  # its max_draft per request
        # --overlap-prefill: first tokens of a prefill run behind the step in flight, left on
        # the device for the next launch (engine/first_tokens.py); one per graph set
        self._first: dict = {}
        self._into: FirstTokens | None = None  # where _sample puts them, during that prefill
        self.step_kind = ""  # what the last step() ran: one of STEP_KINDS, "" nothing
        self._waited = 0.0  # seconds this step() waited for the device's results

    # ---- requests ---------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int] | list[dict],
                      use_chat_template: bool = True, add_special_tokens: bool | None = None,
                      **chat) -> list[int]:
        """Token ids of a prompt given as text, token ids, or chat messages
        (`admission.encode_prompt`, whose keyword options `chat` passes on: truncation and
        how chat messages render)."""
        from draftgraph.engine import admission

        return admission.encode_prompt(self, prompt, use_chat_template, add_special_tokens,
                                       **chat)

    def add_request(self, prompt: str | list[int] | list[dict],
                    params: SamplingParams | None = None, request_id: str | None = None,
                    use_chat_template: bool = True, arrival_time: float | None = None) -> str:
        """Queue a request (thread-safe). Raises EngineError on bad input, or when it could
        never run (see engine/admission.py). arrival_time: when it came in (a
        time.perf_counter() of the caller's, e.g. the API server's receipt; default now),
        what its TTFT and latency are timed from."""
        from draftgraph.engine import admission

        ids, params = admission.admit(self, prompt, params or SamplingParams(),
                                      use_chat_template)
        sched = self.config.scheduler
        with self._lock:
            adds = sum(1 for kind, _ in self._inbox if kind == "add")
        # the requests that start at the next step (free decode rows) are not waiting
        free = max(0, sched.max_num_seqs - len(self.scheduler.running))
        if len(self.scheduler.waiting) + adds + 1 - free > sched.max_waiting:
            raise QueueFullError(f"{sched.max_waiting} requests are waiting (--max-waiting); "
                                 "retry later")
        request_id = request_id or uuid.uuid4().hex
        seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        detok = None
        if self.tokenizer is not None and params.detokenize:
            from draftgraph.engine.detokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        req = Request(request_id, ids, params, seed, self.eos_token_ids, detok, arrival_time)
        with self._lock:
            self._inbox.append(("add", req))
        return request_id

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe); its KV slots are freed at the next step."""
        with self._lock:
            self._inbox.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self._inbox) or self.scheduler.num_unfinished > 0

    def _drain_inbox(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            items = list(self._inbox)
            self._inbox.clear()
        for kind, item in items:
            if kind == "add":
                if item.request_id in self.requests:
                    item.error = f"duplicate request id {item.request_id}"
                    item.finish("error")
                    outputs.append(self._output(item, []))
                    continue
                self.requests[item.request_id] = item
                self.scheduler.add(item)
                self.stats["prompt_tokens"] += len(item.prompt_token_ids)
            else:
                req = self.requests.get(item)
                if req is not None and not req.finished:
                    self._finish(req, "abort")
                    outputs.append(self._output(req, []))

    def _write_cached_prefix(self, req: Request) -> None:
        """A request admitted past cached blocks (scheduler): their slots and tokens into its
        rows of `req_to_token` and the token table, which a forward writes for the positions
        it computes (drafters read the token table), in one transfer."""
        n = req.num_computed_tokens
        ps = self.slots.allocator.page_size
        slots = req.pages[:n] if ps == 1 else [req.pages[p // ps] * ps + p % ps
                                                for p in range(n)]
        rows = torch.tensor([slots, req.token_slice(0, n)], dtype=torch.int64)
        if self.device.type == "cuda":
            rows = rows.pin_memory().to(self.device, non_blocking=True)
        self.slots.req_pool.req_to_token[req.req_pool_idx, :n] = rows[0]
        self.slots.token_table[req.req_pool_idx, :n] = rows[1]

    def _finish(self, req: Request, reason: str) -> None:
        if req.detokenizer is not None and reason in ("length", "stop") and \
                not req.stop_string_hit:
            req.text += req.detokenizer.flush()  # an unfinished character at the very end
        req.finish(reason)
        self.scheduler.release(req)
        if self.policy is not None:
            self.policy.forget(req.request_id)
        self.requests.pop(req.request_id, None)

    # ---- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs: list[RequestOutput] = []
        self._drain_inbox(outputs)
        self.step_kind = ""  # what this step ran (set below; "": nothing was schedulable)
        self._waited = 0.0
        if self._inflight is not None:
            self.step_kind = "ahead"
            outputs += self._step_ahead()
        else:
            self._step_now(outputs)
        if self._inflight is not None and all(r.finished for r in self._inflight):
            # every row of the step in flight ended before it was read (a speculative step
            # may emit a request's last tokens early): nothing left to read from it
            self._inflight = None
        if self.step_kind:
            self.stats[f"steps_{self.step_kind}"] += 1
            self.stats[f"step_seconds_{self.step_kind}"] += time.perf_counter() - t0
            self.stats[f"wait_seconds_{self.step_kind}"] += self._waited
        return outputs

    def _step_now(self, outputs: list[RequestOutput]) -> None:
        # drafts are made on the device, inside the step: each decoding request gets 1 + k
        # KV slots (the drafts' slots are given back after acceptance)
        t0 = time.perf_counter()  # the whole step, as a stream waits it (scheduler.observe)
        scheduled = self.scheduler.schedule(self.spec_k)
        if not scheduled:
            return
        self._admit_controls([sr.req for sr in scheduled])
        timed = self.config.scheduler.max_step_seconds > 0  # else nothing reads the timings
        decode_rows = sum(1 for sr in scheduled
                          if sr.num_new_tokens == 1 and not sr.req.is_prefilling) if timed else 0
        self._run_scheduled(scheduled, outputs)
        if timed:
            self.scheduler.observe(sum(sr.num_new_tokens for sr in scheduled) - decode_rows,
                                   decode_rows, time.perf_counter() - t0)

    def _run_scheduled(self, scheduled: list[ScheduledRequest], outputs: list[RequestOutput],
                       riders: list[tuple[Request, int, int]] = ()) -> None:
        """Run the scheduled work and record each request's result (or the error of the
        rows that made the step raise, for them alone). `riders`: decode rows riding in a
        prefill behind (`_riders`)."""
        for sr, result in zip(scheduled, self._run_isolated(scheduled, riders), strict=True):
            if isinstance(result, Exception):
                outputs.append(self._fail(sr.req, result))
            elif result is None:  # its first token waits on the device: appended later
                sr.req.num_computed_tokens += sr.num_new_tokens
            else:
                outputs.append(self._append(sr.req, *result, num_fed=sr.num_new_tokens))

    def _admit_controls(self, reqs: list[Request]) -> None:
        """A request with sampling controls that starts its prefill (first scheduled, or
        again after a preemption, maybe on a row another request used meanwhile) gets its
        row of the control tables written, once."""
        for req in reqs:
            if req.has_controls and (req.controls_row != req.req_pool_idx
                                            or req.num_computed_tokens == 0):
                stops = sorted(req.eos_token_ids | req.stop_token_ids) \
                    if req.params.min_tokens else []
                self.controls.admit(req.req_pool_idx, req.prompt_token_ids,
                                    req.output_token_ids, req.params.logit_bias, stops,
                                    req.params.allowed_token_ids or (),
                                    req.params.bad_words_token_ids or ())
                req.controls_row = req.req_pool_idx

    def _run_isolated(self, scheduled: list[ScheduledRequest],
                      riders: list[tuple[Request, int, int]] = ()) -> list:
        """`_run`, and when the step raises, the same work again in halves until the
        request(s) responsible are alone: they get the exception, the others their tokens.
        Riders go only in the first try (dropped, they take the next launch as usual).
        NOTE: re-running is safe: a step's KV and token-table writes depend only on the
        request's own inputs and slots, so a repeated row rewrites the same values (and a
        step split in parts never launches ahead: not every running request is in it)."""
        try:
            return self._run(scheduled, riders)
        except Exception as e:  # one request must not fail another, nor kill the engine
            if riders:
                logger.warning("prefill with %d decode rows riding failed (%s); again "
                               "without them", len(riders), e)
                return self._run_isolated(scheduled)
            if len(scheduled) == 1:
                logger.exception("step failed for request %s", scheduled[0].req.request_id)
                return [e]
            logger.warning("step of %d requests failed (%s); re-running them in halves to "
                           "find the request responsible", len(scheduled), e)
            mid = len(scheduled) // 2
            return self._run_isolated(scheduled[:mid]) + self._run_isolated(scheduled[mid:])

    def _run(self, scheduled: list[ScheduledRequest],
             riders: list[tuple[Request, int, int]] = ()) -> list[tuple[list[int],
                                                                       list[float], list]]:
        """One step over the scheduled work; returns the tokens each request gains, their
        logprobs and their top-N alternatives ([] when not asked). `riders` (request, input
        reference, KV slot): decode rows after them whose tokens stay on the device."""
        decoding = [sr.num_new_tokens == 1 and not sr.req.is_prefilling for sr in scheduled]
        if all(decoding) and self.decode_graphs.bucket_for(len(scheduled)) is not None:
            return self._replay(scheduled)
        if self.config.deterministic and any(decoding) and not all(decoding):
            # batch invariance: a decode row never rides in a prefill step (its attention
            # would take the extend kernel there, the decode kernel elsewhere): two forwards
            done = {d: iter(self._run([sr for sr, di in zip(scheduled, decoding, strict=True)
                                       if di == d])) for d in (True, False)}
            return [next(done[d]) for d in decoding]
        # a step with prefill chunks: one eager forward, decode rows draft nothing (in
        # deterministic mode a decode-only eager step takes the decode phase, as replays do)
        phase = Phase.DECODE if self.config.deterministic and all(decoding) else Phase.EXTEND
        self.step_kind = "extend"
        sb = StepBatch(phase, [], [], [], [], [], [])
        rows: list[tuple[ScheduledRequest, int]] = []  # (request, number of logit rows)
        prompt_rows: list[tuple[Request, int, int]] = []  # (request, first row, rows)
        for sr in scheduled:
            req = sr.req
            start = req.num_computed_tokens
            toks = req.token_slice(start, start + sr.num_new_tokens)
            # prompt logprobs: position p's row scores prompt token p + 1, once per token
            if req.params.prompt_logprobs is not None:
                first = len(req.prompt_logprobs) - 1  # the next position not scored yet
                end = min(start + len(toks), len(req.prompt_token_ids) - 1)
                if start <= first < end:
                    prompt_rows.append((req, len(sb.input_ids) + first - start, end - first))
            sb.input_ids += toks
            sb.req_pool_indices.append(req.req_pool_idx)
            sb.seq_lens.append(start + len(toks))
            sb.extend_lens.append(len(toks))
            sb.out_cache_loc += sr.slots[: len(toks)]
            samples = start + sr.num_new_tokens == req.num_tokens
            if samples:
                sb.logit_indices.append(len(sb.input_ids) - 1)
            rows.append((sr, int(samples)))
        for req, ref, slot in riders:  # one token each, read on the device (`_riders`)
            sb.input_ids.append(ref)
            sb.req_pool_indices.append(req.req_pool_idx)
            sb.seq_lens.append(req.num_tokens + 1)
            sb.extend_lens.append(1)
            sb.out_cache_loc.append(slot)
            sb.logit_indices.append(len(sb.input_ids) - 1)
        if riders:
            sb.ref_tokens = self._into.step_tokens
        if prompt_rows:
            logits = self._forward_scoring_prompts(sb, prompt_rows)
        else:
            # always runs: prefill chunks write KV (a drafter that keeps KV writes its own)
            logits = self.target.forward(sb)
        return self._sample(rows, logits, [r for r, _, _ in riders])

    def _forward_scoring_prompts(self, sb: StepBatch,
                                 prompt_rows: list[tuple[Request, int, int]]) -> torch.Tensor:
        """The eager forward, which also scores prompt tokens on the device for the requests
        that asked (runtime/executor.py `forward_scoring`); the others' rows cost nothing."""
        indices, next_ids, top_n = [], [], 0
        for req, first, n in prompt_rows:
            p0 = len(req.prompt_logprobs)  # the first prompt token scored by these rows
            indices += range(first, first + n)
            next_ids += req.prompt_token_ids[p0 : p0 + n]
            top_n = max(top_n, req.params.prompt_logprobs)
        logits, scored = self.target.forward_scoring(sb, indices, next_ids, top_n)
        i = 0
        for req, _, n in prompt_rows:
            k = req.params.prompt_logprobs
            for lp, rank, ids, tops in zip(*(x[i : i + n] for x in scored), strict=True):
                req.prompt_logprobs.append(lp)
                req.prompt_top_logprobs.append((rank, ids[:k], tops[:k]))
            i += n
        return logits

    def _replay(self, scheduled: list[ScheduledRequest]):
        """A step of decoding requests as one graph-set replay, staged straight from the
        scheduled requests: a speculative step (drafts made inside it) when any request may
        draft now, else a decode step."""
        reqs = [sr.req for sr in scheduled]
        max_draft = [0] * len(reqs)
        graphs = self.decode_graphs
        if self.spec_graphs is not None:
            max_draft = [self.policy.max_draft(r) for r in reqs]
            # a drafter with its own KV sees every token: every decode step is speculative
            if any(max_draft) or self.drafter.keeps_kv:
                graphs = self.spec_graphs
        if any(r.needs_extras for r in reqs):
            graphs = self.extras_graphs[graphs]
        self.step_kind = "spec" if graphs.body.k else "decode"
        self._stage(graphs, reqs, [r.token_slice(r.num_tokens - 1, r.num_tokens)[0]
                                   for r in reqs], [r.num_tokens for r in reqs],
                    [sr.slots for sr in scheduled], max_draft)
        if self.policy is not None:
            self.policy.launched(reqs)
        ahead = self._launch_ahead(reqs, graphs)
        results = self._read(reqs, graphs, max_draft, back=1 if ahead else 0)
        return [(tokens, logprobs, top) for tokens, logprobs, _, top in results]

    def _read(self, reqs: list[Request], graphs, max_draft: list[int], back: int) -> list:
        """Wait for a replay's results (back=1: the one before the latest); a speculative
        step's acceptance goes to the policy (requests finished meanwhile are skipped)."""
        t0 = time.perf_counter()
        results = graphs.result(back=back)
        self._waited += time.perf_counter() - t0
        if graphs.body.k:
            for req, d, (tokens, _, num_drafts, _) in zip(reqs, max_draft, results,
                                                          strict=True):
                if req.finished:
                    continue
                if num_drafts:
                    self.policy.record(req, num_drafts, len(tokens) - 1)
                elif d:
                    self.policy.no_proposal(req)
        return results

    def _stage(self, graphs, reqs: list[Request], input_ids: list[int], seq_lens: list[int],
               reserved_slots: list[list[int]], max_draft: list[int] | None = None) -> int:
        """Replay a step of `graphs` for `reqs` (the raw-input lanes of spec/step.py; an
        extras graph set's control lanes too)."""
        p = [r.params for r in reqs]
        fields = dict(
            input_ids=input_ids, req_pool_indices=[r.req_pool_idx for r in reqs],
            seq_lens=seq_lens, max_draft=max_draft, top_k=[x.top_k for x in p],
            seeds=[r.seed for r in reqs], reserved_slots=reserved_slots,
            temperature=[x.temperature for x in p], top_p=[x.top_p for x in p])
        if graphs.body.k:  # the device's draft cap after an async shift (decode has none)
            fields["seq_limit"] = [min(len(r.prompt_token_ids) + x.max_tokens,
                                       self.max_model_len) for r, x in zip(reqs, p, strict=True)]
        if graphs in self.extras_graphs.values():
            fields.update(self._control_lanes(reqs))
        return graphs.replay(len(reqs), all(x.temperature == 0 for x in p), fields)

    @staticmethod
    def _control_lanes(reqs: list[Request]) -> dict[str, list]:
        """Per request: the sampling controls' lanes (spec/step.py `step_inputs`); a request
        without controls gets them off (its row of the tables is never read)."""
        p = [r.params if r.has_controls else None for r in reqs]
        return dict(
            min_tokens=[x.min_tokens if x else 0 for x in p],
            prompt_lens=[len(r.prompt_token_ids) for r in reqs],
            num_logit_bias=[len(x.logit_bias) if x else 0 for x in p],
            num_allowed=[len(x.allowed_token_ids or ()) if x else 0 for x in p],
            num_bad_words=[len(x.bad_words_token_ids or ()) if x else 0 for x in p],
            presence_penalty=[x.presence_penalty if x else 0.0 for x in p],
            frequency_penalty=[x.frequency_penalty if x else 0.0 for x in p],
            repetition_penalty=[x.repetition_penalty if x else 1.0 for x in p],
            min_p=[x.min_p if x else 0.0 for x in p])

    # ---- async scheduling: launch step N + 1 before reading step N --------------------------
    # What step N emits stays on the device: the next step's last tokens are staged as
    # references to step N's output rows, and a speculative step's seq_lens, KV slots and
    # max_draft as if step N emitted one token, shifted on the device by the accept lengths
    # it did emit (kernels/tokens.py). Rows are independent, so a request that finishes at
    # step N only wastes its row of step N + 1 (its tokens are dropped, its KV slots freed
    # with the rest of its pages). A request prefilled behind step N joins step N + 1 the same
    # way, its first token a reference to the spare row its prefill wrote
    # (engine/first_tokens.py).

    def _launch_ahead(self, reqs: list[Request], graphs,
                      first: FirstTokens | None = None) -> bool:
        """Launch the step after the one just launched for `reqs` (its tokens unread) when
        every running request is in it or was prefilled behind it, and nothing else waits
        for the normal path; True when launched. `graphs`: the graph set of that step (decode
        or speculative, plain or extras), the next one's too: a step that should switch
        between decode and speculative takes the normal path. `first`: the first tokens that
        prefill left on the device."""
        for r in reqs:
            r.ahead = 0
        overlap = self.config.overlap_prefill
        if not self.async_scheduling or (self.scheduler.waiting and not overlap):
            return False
        alive = [(j, r) for j, r in enumerate(reqs) if not r.finished]
        running = self.scheduler.running
        # (reference, request, its tokens not appended yet): rows that refer to a replay's
        # row for their last token: step N's row j, or the spare row where the prefill behind
        # step N left a fresh request's first token or the token of a row that rode in it
        # (after step N's token: two to come)
        refs = []
        for j, r in alive:
            ref = first.ref(r) if first is not None else None
            refs.append((-(j + 1), r, 1) if ref is None else (ref, r, 2))
        known = []  # fresh requests whose last token is on the host
        if len(running) != len(alive):
            if not overlap:
                return False  # another request (prefilling, preempted) needs the normal path
            # fresh: requests that started decoding after step N was launched (their prefill
            # ran behind it, just now)
            in_step = {id(r) for _, r in alive}
            fresh = [r for r in running if id(r) not in in_step]
            if len(alive) + len(fresh) != len(running) or any(r.is_prefilling for r in fresh):
                return False
            if graphs in self.extras_graphs and any(r.needs_extras for r in fresh):
                return False  # the step after needs the extras twin: the normal path
            for r in fresh:  # (`first` holds its rows in `graphs`: the step in flight's)
                ref = first.ref(r) if first is not None else None
                if ref is None:
                    known.append(r)
                else:
                    refs.append((ref, r, 1))
        # rows that surely end with the tokens they refer to need no next step
        rows = [(ref, r, length) for ref, r, n in refs
                if (length := self._length_after(r, n)) is not None]
        ahead = [r for _, r, _ in rows] + known
        if not ahead:
            return False
        k = graphs.body.k
        max_draft = None
        if self.spec_graphs is not None:
            max_draft = [self.policy.max_draft(r) for r in ahead]
            if bool(k) != (any(max_draft) or self.drafter.keeps_kv):
                return False
        try:  # step N + 1 writes from step N's last token on: positions num_tokens .. + 2k
            # (a rider's one later); a known fresh request's from its last token on, as the
            # normal path's
            slots = [self.slots.allocator.extend(r.pages, length - 1, 1 + 2 * k)
                     for _, r, length in rows] + \
                [self.slots.allocator.extend(r.pages, r.num_computed_tokens, 1 + k)
                 for r in known]
        except OutOfKVSlots:
            # the normal path preempts; slots already taken go back when step N's tokens are
            # appended (truncation to the computed tokens, `ahead` being 0)
            return False
        # NOTE: the row references read the previous replay of the same graph set
        self._stage(graphs, ahead,
                    [ref for ref, _, _ in rows]
                    + [r.token_slice(r.num_tokens - 1, r.num_tokens)[0] for r in known],
                    [length for _, _, length in rows] + [r.num_tokens for r in known],
                    slots, max_draft)
        if self.policy is not None:
            self.policy.launched(ahead)
        for r in ahead:
            r.ahead = 1 + k  # the positions step N + 1 may write past step N's last token
        self._inflight = ahead
        self._inflight_graphs = graphs
        self._inflight_draft = max_draft or [0] * len(ahead)
        return True

    def _step_ahead(self) -> list[RequestOutput]:
        """Prefill the waiting prompts behind the step in flight (`--overlap-prefill`), launch
        the next step with them if it can go, then read the one in flight and their first
        tokens."""
        reqs, self._inflight = self._inflight, None
        graphs, max_draft = self._inflight_graphs, self._inflight_draft
        outputs: list[RequestOutput] = []
        first = None
        try:
            if self.scheduler.waiting and self.config.overlap_prefill and self._prefill_due():
                first = self._prefill_behind(outputs, reqs)
            ahead = self._launch_ahead(reqs, graphs, first)
            results = self._read(reqs, graphs, max_draft, back=1 if ahead else 0)
        except Exception as e:  # a failing step must not kill the engine
            logger.exception("step failed for requests %s", [r.request_id for r in reqs])
            self._inflight = None
            if first is not None:  # its requests fail below with the running ones
                first.clear()
            outputs += [self._fail(r, e) for r in
                        reqs + [r for r in list(self.scheduler.running) if r not in reqs]
                        if not r.finished]
            return outputs
        rode = self._take_first_tokens(first) if first is not None else {}
        for r, (tokens, logprobs, _, top) in zip(reqs, results, strict=True):
            more = rode.pop(id(r), None)  # its token of the prefill it rode in, after these
            if r.finished:  # finished or aborted while its step ran: tokens dropped
                continue
            if more is not None:
                tokens, logprobs = tokens + [more[1]], logprobs + [more[2]]
            outputs.append(self._append(r, tokens, logprobs, top, num_fed=1))
        # the first tokens of the requests prefilled behind
        outputs += [self._append(req, [tok], [lp], [], num_fed=1)
                    for req, tok, lp in rode.values()]
        return outputs

    def _prefill_due(self) -> bool:
        """Whether the waiting prompts are prefilled behind this step: at once, or under
        `--prefill-coalesce-ms` once the oldest has waited that long since its arrival or
        their tokens fill half the step's budget (a prefill step's cost hardly follows its
        prompts: config.py says what was measured)."""
        hold = self.config.prefill_coalesce_ms / 1000
        waiting = self.scheduler.waiting
        if hold <= 0 or time.perf_counter() - waiting[0].arrival_time >= hold:
            return True
        need, tokens = self.config.scheduler.max_num_batched_tokens // 2, 0
        for r in waiting:
            tokens += r.num_tokens - r.num_computed_tokens
            if tokens >= need:
                return True
        self.stats["prefills_held"] += 1
        return False

    def _prefill_behind(self, outputs: list[RequestOutput],
                        step: list[Request]) -> FirstTokens | None:
        """The waiting prompts' chunks as one prefill forward, queued on the device behind
        the step in flight (which holds every running request; nobody is preempted for
        them), with the next decode rows of that step's requests (`step`) riding in it where
        they can (`_riders`). The tokens it samples stay on the device, in the spare rows of
        that step's graph set (engine/first_tokens.py), for the next launch to refer to
        (returned: None when none were left there); they are read after it. (Under tensor
        parallelism, or where a request needs top-N or sampling controls, the first tokens
        are read here and staged as literal tokens, and nobody rides.)"""
        riding = self._riding(step)
        scheduled = self.scheduler.schedule(self.spec_k, decode=False, riding=len(riding))
        if not scheduled:
            return None
        self._admit_controls([sr.req for sr in scheduled])
        riders = []
        if self.config.tensor_parallel_size == 1:  # ranks > 0 would lack the rows
            g = self._inflight_graphs
            if g not in self._first:
                self._first[g] = FirstTokens(g)
            self._into = self._first[g]
            if not any(sr.req.needs_extras for sr in scheduled):
                riders = self._riders(riding, scheduled)
        try:
            self._run_scheduled(scheduled, outputs, riders)
        finally:
            into, self._into = self._into, None
        self.step_kind = "behind"  # (the prefill's forward said "extend")
        self.stats["rows_riding"] += sum(into is not None and into.ref(r) is not None
                                         for r, _, _ in riders)
        return into if into is not None and into.reqs else None

    def _riding(self, step: list[Request]) -> list[tuple[int, Request]]:
        """(row in the step in flight, request): the requests whose next decode row may ride
        in the prefill behind it (`--decode-rides-prefill`): plain decode steps (no drafter:
        a speculative step's accept lengths are unknown here; no extras; one rank), and rows
        the token of the step in flight surely does not end."""
        if not (self.config.decode_rides_prefill and self.spec_graphs is None
                and self.config.tensor_parallel_size == 1 and not self.config.deterministic
                and self._inflight_graphs not in self.extras_graphs.values()):
            return []
        return [(j, r) for j, r in enumerate(step)
                if not r.finished and self._length_after(r, 1) is not None]

    def _length_after(self, r: Request, n: int) -> int | None:
        """`r`'s tokens once n more arrive, or None when those surely end it (max_tokens, the
        context): a step after them is needed only otherwise (counted once: this runs for
        every request of every step)."""
        length = r.num_tokens + n
        if len(r.output_token_ids) + n < r.params.max_tokens and length < self.max_model_len:
            return length
        return None

    def _riders(self, riding: list[tuple[int, Request]],
                scheduled: list[ScheduledRequest]) -> list[tuple[Request, int, int]]:
        """(request, input, KV slot) for each riding row: its input the token that row j of
        the step in flight samples, -(j + 1) (the row's seq_lens and slot as if it were
        there), at the position after its last. Only rows whose keys are at most
        RIDE_EXTRA_KEYS more than the prefill's longest list: the extend kernel's time is
        its longest key loop (a row of its own for each riding request), so a long context
        riding beside a short prompt would cost more than the decode step it saves. Fewer
        when KV slots run out."""
        longest = max(sr.req.num_computed_tokens + sr.num_new_tokens for sr in scheduled)
        riders = []
        for j, r in riding:
            if r.num_tokens + 1 > longest + RIDE_EXTRA_KEYS:
                continue
            try:
                slot = self.slots.allocator.extend(r.pages, r.num_tokens, 1)[0]
            except OutOfKVSlots:
                break
            riders.append((r, -(j + 1), slot))
        return riders

    def _take_first_tokens(self, first: FirstTokens) -> dict[int, tuple[Request, int, float]]:
        """The tokens a prefill behind left on the device, by id(request): (request, token,
        logprob)."""
        t0 = time.perf_counter()
        taken = first.take()
        self._waited += time.perf_counter() - t0
        return {id(req): (req, tok, lp) for req, tok, lp in taken}

    def _sample(self, rows, logits: torch.Tensor,
                riders: list[Request] = ()) -> list[tuple[list[int], list[float], list]]:
        """Tokens of the requests whose last prompt token was fed (one logit row each), then
        of the riders' rows, by the same tail as the step bodies (spec.verify.emit with no
        drafts; top-N and controls only when one of them asks). In a prefill behind the step
        in flight a sampled row's result is None: its token stays on the device
        (`_prefill_behind`), as the riders' do."""
        fed = [sr.req for sr, n in rows if n]
        reqs = fed + list(riders)
        if not reqs:
            return [([], [], []) for _ in rows]
        dev = logits.device
        p = [r.params for r in reqs]
        bs = len(reqs)
        ints = [[0] * bs, [x.top_k for x in p], [r.seed for r in reqs],
                [r.num_tokens for r in fed] + [r.num_tokens + 1 for r in riders]]
        floats = [[x.temperature for x in p], [x.top_p for x in p]]
        with_extras = any(r.needs_extras for r in reqs)
        if with_extras:
            lanes = self._control_lanes(reqs)
            ints += [[r.req_pool_idx for r in reqs], lanes["min_tokens"], lanes["prompt_lens"],
                     lanes["num_logit_bias"], lanes["num_allowed"], lanes["num_bad_words"]]
            floats += [lanes[f"{n}_penalty"] for n in ("presence", "frequency", "repetition")]
            floats.append(lanes["min_p"])
        i64, f32 = _lanes_to(dev, ints, floats)
        extras = {}
        if with_extras:
            extras = dict(
                out_top_ids=torch.empty(bs, TOP_N_MAX, dtype=torch.int64, device=dev),
                out_top_logprobs=torch.empty(bs, TOP_N_MAX, dtype=torch.float32, device=dev),
                controls=StepControls(self.controls, i64[4], f32[2], f32[3], f32[4],
                                      i64[5], i64[6], i64[7], num_allowed=i64[8],
                                      num_bad_words=i64[9], min_p=f32[5],
                                      temperature=f32[0]))
        tokens, _, lps = emit(
            logits, torch.zeros(bs, 0, dtype=torch.int64, device=dev), i64[0], None,
            f32[0], f32[1], i64[1], i64[2], i64[3], all(x.temperature == 0 for x in p),
            **extras)
        into = self._into  # a prefill behind: the tokens stay on the device (None results)
        if into is not None and not with_extras:
            into.put(reqs, tokens[:, 0], lps[:, 0])
            return [None if n else ([], [], []) for _, n in rows]
        t0 = time.perf_counter()
        tokens = tokens[:, 0].tolist()  # waits for the forward
        self._waited += time.perf_counter() - t0
        lps = lps[:, 0].tolist()
        tops = ([(a, b) for a, b in zip(extras["out_top_ids"].tolist(),
                                        extras["out_top_logprobs"].tolist(), strict=True)]
                if extras else None)
        out: list[tuple[list[int], list[float], list]] = []
        i = 0
        for _sr, n in rows:
            if n:
                out.append(([tokens[i]], [lps[i]], [tops[i]] if tops else []))
                i += 1
            else:
                out.append(([], [], []))
        return out

    def _append(self, req: Request, tokens: list[int], logprobs: list[float], top: list,
                num_fed: int) -> RequestOutput:
        """Record a step's result for one request: KV progress, new tokens, stops. If that
        raises, the request alone fails ("error"); its batch-mates' results are recorded.

        top: per token (top ids, their logprobs), or [] when the step computed none;
        num_fed: tokens of the sequence fed this step (drafts not counted)."""
        try:
            num_tokens = req.num_tokens  # kept up to date below: runs per request per step
            if tokens:
                # tokens fed this step now have KV: all but the newest sampled one
                req.num_computed_tokens = num_tokens - 1 + len(tokens)
            else:
                req.num_computed_tokens += num_fed
            new: list[int] = []
            n_top = req.params.top_logprobs if req.params.logprobs else 0
            for i, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
                req.output_token_ids.append(tok)
                req.output_logprobs.append(lp)
                if n_top:
                    ids, tlp = top[i]
                    req.output_top_logprobs.append(list(zip(ids[:n_top], tlp[:n_top],
                                                            strict=True)))
                new.append(tok)
                num_tokens += 1
                if req.first_token_time is None:
                    req.first_token_time = time.perf_counter()
                reason = self._check_stop(req, tok)
                if reason:
                    self._finish(req, reason)
                    break
            if req.status is _RUNNING and num_tokens >= self.max_model_len:
                self._finish(req, "length")
            # drop KV slots of tokens past the sequence (rejected drafts); keep the slot a
            # launched next step writes (async scheduling)
            if not req.finished:
                req.num_computed_tokens = min(req.num_computed_tokens, num_tokens - 1)
                self.slots.allocator.truncate(req.pages, req.num_computed_tokens + req.ahead)
            self.stats["generation_tokens"] += len(new)
            return self._output(req, new)
        except Exception as e:  # one request's bookkeeping must not end the others' step
            logger.exception("recording the tokens of request %s failed", req.request_id)
            return self._fail(req, e)

    def _fail(self, req: Request, error: Exception) -> RequestOutput:
        """End `req` with "error" for an internal failure of its step (once); its output."""
        req.error = f"internal error: {error}"
        if not req.finished:
            self._finish(req, "error")
        return self._output(req, [])

    def _check_stop(self, req: Request, tok: int) -> str | None:
        p = req.params
        if tok in req.eos_token_ids or tok in req.stop_token_ids:
            return "stop"
        if req.detokenizer is not None:
            delta = req.detokenizer.add([tok])
            req.text += delta
            # NOTE: like vLLM, no stop string ends a request before min_tokens, and a stop
            # string must end in the new text: one that ended in the text before (streamed
            # already) came before min_tokens
            if p.stop and delta and len(req.output_token_ids) >= p.min_tokens:
                start = len(req.text) - len(delta) + 1
                hits = [(i, len(s)) for s in p.stop
                        if (i := req.text.find(s, max(0, start - len(s)))) >= 0]
                if hits:
                    i, n = min(hits)  # the earliest; at one place, the shorter string
                    req.text = req.text[: i + n if p.include_stop_str_in_output else i]
                    req.stop_string_hit = True
                    return "stop"
        if len(req.output_token_ids) >= p.max_tokens:
            return "length"
        return None

    def _output(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        """The step's output of `req`; `new_tokens` (a list of the caller's own) goes in as
        it is."""
        final = req.finished
        if not final and req.detokenizer is None and not req.params.logprobs and \
                req.params.prompt_logprobs is None and req.error is None:
            # a running stream's common output (tokens only): what the general path gives,
            # with its tests skipped (this runs for every request of every step)
            return RequestOutput(
                request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                token_ids=[], new_token_ids=new_tokens, text="", delta_text="",
                finished=False, finish_reason=None,
                metrics=req.metrics() if len(req.output_token_ids) == len(new_tokens) else {})
        text = req.text
        if not final and req.params.stop:
            hold = max(len(s) for s in req.params.stop) - 1
            text = text[: max(req.num_sent_chars, len(text) - hold)]
        delta = text[req.num_sent_chars :]
        req.num_sent_chars = len(text)
        n_new = len(new_tokens)
        lps = req.output_logprobs if req.params.logprobs else None
        tops = req.output_top_logprobs if req.params.logprobs else None
        # the first output with tokens (prefill done) and the last carry the prompt logprobs
        prompt_lps = req.params.prompt_logprobs is not None and (
            final or (n_new > 0 and len(req.output_token_ids) == n_new))
        # NOTE: the whole lists only in the final output: copying them every step cost
        # O(length) per request and step (streams read the new_* fields)
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids) if final else [],
            new_token_ids=new_tokens,
            text=text,
            delta_text=delta,
            finished=final,
            finish_reason=req.finish_reason,
            logprobs=(list(lps) if final else []) if lps is not None else None,
            new_logprobs=list(lps[len(lps) - n_new :]) if lps is not None and n_new else
            ([] if lps is not None else None),
            top_logprobs=(list(tops) if final else []) if tops is not None else None,
            new_top_logprobs=(list(tops[len(tops) - n_new :]) if n_new else [])
            if tops is not None else None,
            prompt_logprobs=list(req.prompt_logprobs) if prompt_lps else None,
            prompt_top_logprobs=list(req.prompt_top_logprobs) if prompt_lps else None,
            # timing metrics where they are read: the first tokens (TTFT) and the end
            metrics=req.metrics() if final or len(req.output_token_ids) == n_new
            else {},
            error=req.error,
        )

    # ---- offline API ------------------------------------------------------------------
    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None,
                 use_chat_template: bool = True, on_output=None) -> list[RequestOutput]:
        """Run prompts to completion; returns one final output per prompt, in order."""
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp, use_chat_template=use_chat_template)
               for p, sp in zip(prompts, params, strict=True)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if on_output is not None:
                    on_output(out)
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (also done at exit)."""
        from draftgraph.distributed import current_tp
        from draftgraph.runtime.tp_worker import shutdown_workers

        if current_tp().size > 1 and self.device.type == "cuda":
            # NOTE: captured graphs hold work on the NCCL communicator: finish and drop them
            # before the process group is destroyed
            torch.cuda.synchronize(self.device)
            self.target.graph_sets.clear()
            self.decode_graphs = self.spec_graphs = None
        shutdown_workers()

    def num_free_kv_slots(self) -> int:
        return self.slots.allocator.num_free_slots

    @property
    def kv_capacity(self) -> int:
        """KV slots one request may use at most: the whole pool but the reserved dummy page."""
        return self.slots.allocator.usable_slots

    @property
    def kv_page_size(self) -> int:
        return self.slots.allocator.page_size

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def kv_usage(self) -> float:
        a = self.slots.allocator
        return 1.0 - a.num_free_slots / a.usable_slots
