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
from draftgraph.engine.request import Request, RequestOutput, Status
from draftgraph.engine.sampling import SamplingParams
from draftgraph.runtime.sampling import sample
from draftgraph.engine.scheduler import ScheduledRequest, Scheduler
from draftgraph.kernels.argmax import argmax_lse
from draftgraph.runtime.kv_cache import OutOfKVSlots
from draftgraph.runtime.model_runner import ModelRunner, StepBatch

logger = logging.getLogger(__name__)


class EngineError(ValueError):
    """A request the engine refuses; the message says what to change."""


class QueueFullError(EngineError):
    """The waiting queue is full; retry later."""


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded=None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        torch.manual_seed(config.seed)
        if config.tensor_parallel_size > 1:  # TP: start ranks 1.. (distributed/worker.py)
            from draftgraph.distributed import start_workers

            if loaded is not None:
                raise EngineError("--tensor-parallel-size > 1: every rank loads its shard "
                                  "itself; pass the model by name, not loaded")
            start_workers(config)
        if loaded is None:
            from draftgraph.models.loader import load_model

            loaded = load_model(config.model, device=config.device, dtype=config.torch_dtype)
        self.loaded = loaded
        self.model = self.loaded.model
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        sched_cfg = config.scheduler
        model_ctx = self.model_config.max_position_embeddings
        self.max_model_len = min(sched_cfg.max_model_len or min(model_ctx, 8192), model_ctx)
        if sched_cfg.max_model_len and sched_cfg.max_model_len > model_ctx:
            raise EngineError(f"--max-model-len {sched_cfg.max_model_len} exceeds the model's "
                              f"context of {model_ctx} tokens")
        spec = config.spec
        k = spec.num_draft_tokens if spec.method else 0
        backend = config.attention_backend or ("triton" if self.device.type == "cuda"
                                               else "torch")
        self.runner = ModelRunner(self.model, config.cache, sched_cfg, self.max_model_len,
                                  self.device, config.torch_dtype, backend,
                                  extra_tokens_per_req=k)
        self.spec_k = k
        self.scheduler = Scheduler(sched_cfg, self.runner.allocator, self.runner.req_pool)
        self.requests: dict[str, Request] = {}
        self._inbox: deque = deque()
        self._lock = threading.Lock()
        self._rng = random.Random(config.seed)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            self.eos_token_ids |= set(self.tokenizer.eos_token_ids)
        self.stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                      "accepted_per_pos": [0] * max(k, 1), "prompt_tokens": 0,
                      "generation_tokens": 0}
        self.proposer = None
        if spec.method == "ngram":
            from draftgraph.spec.speculator import NgramSpeculator

            self.proposer = NgramSpeculator(spec)
            self.proposer.stats = self.stats
            self.proposer.max_model_len = self.max_model_len
        if self.device.type == "cuda" and config.use_graphs:
            self.runner.init_graphs(num_draft_tokens=k,
                                    proposer=self.proposer.proposer if self.proposer else None)
        # async scheduling: requests of a launched decode replay whose tokens are not read yet.
        # NOTE: off with speculation, and under TP until it has run on GPUs (the ranks > 0
        # would resolve the token references from their own, identical, output buffers)
        self.async_scheduling = (config.async_scheduling and self.proposer is None
                                 and config.tensor_parallel_size == 1)
        self._inflight: list[Request] | None = None

    # ---- requests ---------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int] | list[dict],
                      use_chat_template: bool = True) -> list[int]:
        """Token ids of a prompt given as text, token ids, or chat messages."""
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise EngineError(f"prompt token ids must be integers in [0, {vocab}); "
                                  f"got {bad[:3]}")
        else:
            if self.tokenizer is None:
                raise EngineError(f"model {self.config.model} has no tokenizer (random "
                                  "weights): pass prompts as token ids")
            if isinstance(prompt, list):
                if not prompt:
                    raise EngineError("messages must not be empty")
                ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
            elif use_chat_template and self.tokenizer.has_chat_template:
                ids = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True)
            else:
                ids = self.tokenizer.encode(prompt)
        if not ids:
            raise EngineError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise EngineError(f"prompt has {len(ids)} tokens; the model's context is "
                              f"{self.max_model_len} (--max-model-len), leaving no room to "
                              "generate")
        return ids

    def add_request(self, prompt: str | list[int] | list[dict],
                    params: SamplingParams | None = None, request_id: str | None = None,
                    use_chat_template: bool = True) -> str:
        """Queue a request (thread-safe). Raises EngineError on bad input."""
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt, use_chat_template)
        if len(self.scheduler.waiting) + len(self._inbox) >= self.config.scheduler.max_waiting:
            raise QueueFullError(f"{self.config.scheduler.max_waiting} requests are waiting "
                                 "(--max-waiting); retry later")
        request_id = request_id or uuid.uuid4().hex
        seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        detok = None
        if self.tokenizer is not None:
            from draftgraph.engine.detokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer, ids)
        req = Request(request_id, ids, params, seed, self.eos_token_ids, detok)
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

    def _finish(self, req: Request, reason: str) -> None:
        if req.detokenizer is not None and reason in ("length", "stop") and \
                not req.stop_string_hit:
            req.text += req.detokenizer.flush()  # an unfinished character at the very end
        req.finish(reason)
        self.scheduler.release(req)
        if self.proposer is not None:
            self.proposer.forget(req.request_id)
        self.requests.pop(req.request_id, None)

    # ---- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        self._drain_inbox(outputs)
        if self._inflight is not None:
            return outputs + self._step_ahead()
        # with speculative step graphs the drafts are made on the device, inside the graph;
        # otherwise on the host before scheduling
        device_drafts = self.runner.spec_graphs is not None
        drafts = None
        if self.proposer is not None and not device_drafts:
            drafts = self.proposer.propose(self.scheduler.running)
        scheduled = self.scheduler.schedule(drafts, self.spec_k if device_drafts else 0)
        if not scheduled:
            return outputs
        try:
            new_tokens = self._run(scheduled)
        except Exception as e:  # a failing batch must not kill the engine
            logger.exception("step failed for requests %s",
                             [s.req.request_id for s in scheduled])
            for sr in scheduled:
                sr.req.error = f"internal error: {e}"
                self._finish(sr.req, "error")
                outputs.append(self._output(sr.req, []))
            return outputs
        for sr, (toks, logprobs) in zip(scheduled, new_tokens, strict=True):
            outputs.append(self._append(sr.req, toks, logprobs, sr.num_new_tokens))
        return outputs

    def _run(self, scheduled: list[ScheduledRequest]) -> list[tuple[list[int], list[float]]]:
        """One forward over the scheduled work; returns the tokens each request gains."""
        sb = StepBatch(Phase.EXTEND, [], [], [], [], [], [])
        rows: list[tuple[ScheduledRequest, int]] = []  # (request, number of logit rows)
        all_decode = True
        for sr in scheduled:
            req = sr.req
            start = req.num_computed_tokens
            toks = req.token_slice(start, start + sr.num_new_tokens) + sr.draft_tokens
            sb.input_ids += toks
            sb.req_pool_indices.append(req.req_pool_idx)
            sb.seq_lens.append(start + len(toks))
            sb.extend_lens.append(len(toks))
            sb.out_cache_loc += sr.out_cache_loc[: len(toks)]
            end = len(sb.input_ids)
            samples = start + sr.num_new_tokens == req.num_tokens
            n_rows = (1 + len(sr.draft_tokens)) if samples else 0
            sb.logit_indices += list(range(end - n_rows, end))
            rows.append((sr, n_rows))
            all_decode &= len(toks) == 1 and samples
        if all_decode:
            sb.phase = Phase.DECODE
            if self.runner.graphs is not None:
                return self._replay_decode(scheduled, sb)
        elif any(sr.draft_tokens for sr in scheduled):
            sb.phase = Phase.VERIFY
        logits = self.runner.forward(sb)  # always runs: prefill chunks write KV
        return self._sample(rows, logits if sb.logit_indices else None)

    def _replay_decode(self, scheduled: list[ScheduledRequest], sb: StepBatch):
        """A decode step as one graph replay; a speculative step (drafts made inside the
        graph) when any request may draft now."""
        reqs = [sr.req for sr in scheduled]
        max_draft = [0] * len(reqs)
        graphs = self.runner.graphs
        if self.runner.spec_graphs is not None:
            max_draft = [self.proposer.max_draft(r) for r in reqs]
            if any(max_draft):
                graphs = self.runner.spec_graphs
        graphs.replay(sb.input_ids, sb.req_pool_indices, sb.seq_lens,
                      [sr.out_cache_loc for sr in scheduled],
                      [r.params.temperature for r in reqs], [r.params.top_p for r in reqs],
                      [r.params.top_k for r in reqs], [r.seed for r in reqs], max_draft)
        ahead = graphs is self.runner.graphs and self._launch_ahead(reqs)
        results = graphs.result(back=1 if ahead else 0)
        if graphs is self.runner.spec_graphs:
            for req, d, (tokens, _, num_drafts) in zip(reqs, max_draft, results, strict=True):
                if num_drafts:
                    self.proposer.record(req, num_drafts, len(tokens) - 1)
                elif d:
                    self.proposer.no_proposal(req)
        return [(tokens, logprobs) for tokens, logprobs, _ in results]

    # ---- async scheduling: launch decode step N + 1 before reading step N ----------------
    # The next step's last tokens are the ones step N samples, still on the device: they are
    # staged as references to step N's output rows (graph_runner.replay). Rows are
    # independent, so a request that finishes at step N only wastes its row of step N + 1
    # (its token is dropped, its KV slot freed with the rest of its pages).

    def _launch_ahead(self, reqs: list[Request]) -> bool:
        """Launch the decode step after the one just launched for `reqs` (its tokens unread)
        when every running request is in it and nothing waits; True when launched."""
        for r in reqs:
            r.ahead = 0
        if not self.async_scheduling or self.scheduler.waiting:
            return False
        alive = [(j, r) for j, r in enumerate(reqs) if not r.finished]
        if len(alive) != len(self.scheduler.running):
            return False  # another request (prefilling, preempted) needs the normal path
        # rows that surely end with step N's token need no next step
        rows = [(j, r) for j, r in alive
                if len(r.output_token_ids) + 1 < r.params.max_tokens
                and r.num_tokens + 1 < self.max_model_len]
        if not rows:
            return False
        try:  # step N + 1 writes the KV of step N's token, at num_tokens
            slots = [self.runner.allocator.extend(r.pages, r.num_tokens, 1) for _, r in rows]
        except OutOfKVSlots:
            # the normal path preempts; slots already taken go back when step N's tokens are
            # appended (truncation to the computed tokens, `ahead` being 0)
            return False
        ahead = [r for _, r in rows]
        self.runner.graphs.replay(
            [-(j + 1) for j, _ in rows], [r.req_pool_idx for r in ahead],
            [r.num_tokens + 1 for r in ahead], slots, [r.params.temperature for r in ahead],
            [r.params.top_p for r in ahead], [r.params.top_k for r in ahead],
            [r.seed for r in ahead])
        for r in ahead:
            r.ahead = 1
        self._inflight = ahead
        return True

    def _step_ahead(self) -> list[RequestOutput]:
        """Launch the next decode step if it can go, then read the one in flight."""
        reqs, self._inflight = self._inflight, None
        try:
            ahead = self._launch_ahead(reqs)
            results = self.runner.graphs.result(back=1 if ahead else 0)
        except Exception as e:  # a failing step must not kill the engine
            logger.exception("step failed for requests %s", [r.request_id for r in reqs])
            self._inflight = None
            outputs = []
            for r in reqs + [r for r in list(self.scheduler.running) if r not in reqs]:
                if not r.finished:
                    r.error = f"internal error: {e}"
                    self._finish(r, "error")
                    outputs.append(self._output(r, []))
            return outputs
        return [self._append(r, tokens, logprobs, 1)
                for r, (tokens, logprobs, _) in zip(reqs, results, strict=True)
                if not r.finished]  # finished or aborted while its step ran: token dropped

    def _sample(self, rows, logits) -> list[tuple[list[int], list[float]]]:
        out: list[tuple[list[int], list[float]]] = []
        if logits is None:
            return [([], []) for _ in rows]
        if any(sr.draft_tokens for sr, _ in rows):
            return self.proposer.verify(rows, logits)
        reqs = [sr.req for sr, n in rows if n]
        dev = logits.device
        temperature = torch.tensor([r.params.temperature for r in reqs], device=dev)
        # the same tail as the step graphs: one pass for the greedy tokens and the logsumexp
        greedy_tokens, lse = argmax_lse(logits)
        if bool((temperature == 0).all()):
            tokens = greedy_tokens
        else:
            tokens = sample(
                logits, temperature,
                torch.tensor([r.params.top_p for r in reqs], device=dev),
                torch.tensor([r.params.top_k for r in reqs], device=dev),
                torch.tensor([r.seed for r in reqs], device=dev),
                torch.tensor([r.num_tokens for r in reqs], device=dev),
                greedy_tokens,
            )
        want_lp = any(r.params.logprobs for r in reqs)
        lps = ((logits.gather(1, tokens[:, None])[:, 0] - lse).tolist()
               if want_lp else [0.0] * len(reqs))
        tokens = tokens.tolist()
        i = 0
        for _sr, n in rows:
            if n:
                out.append(([tokens[i]], [lps[i]]))
                i += 1
            else:
                out.append(([], []))
        return out

    def _append(self, req: Request, tokens: list[int], logprobs: list[float],
                num_fed: int) -> RequestOutput:
        """Record a step's result for one request: KV progress, new tokens, stops.

        num_fed: tokens of the sequence fed this step (drafts not counted)."""
        if tokens:
            # tokens fed this step now have KV: all but the newest sampled one
            req.num_computed_tokens = req.num_tokens - 1 + len(tokens)
        else:
            req.num_computed_tokens += num_fed
        new: list[int] = []
        for tok, lp in zip(tokens, logprobs, strict=True):
            req.output_token_ids.append(tok)
            req.output_logprobs.append(lp)
            new.append(tok)
            if req.first_token_time is None:
                req.first_token_time = time.perf_counter()
            reason = self._check_stop(req, tok)
            if reason:
                self._finish(req, reason)
                break
        if req.status == Status.RUNNING and req.num_tokens >= self.max_model_len:
            self._finish(req, "length")
        # drop KV slots of tokens past the sequence (rejected drafts); keep the slot a
        # launched next step writes (async scheduling)
        if not req.finished:
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            self.runner.allocator.truncate(req.pages, req.num_computed_tokens + req.ahead)
        self.stats["generation_tokens"] += len(new)
        return self._output(req, new)

    def _check_stop(self, req: Request, tok: int) -> str | None:
        p = req.params
        if tok in req.eos_token_ids or tok in req.stop_token_ids:
            return "stop"
        if req.detokenizer is not None:
            delta = req.detokenizer.add([tok])
            req.text += delta
            if p.stop and delta:
                window = len(delta) + max(len(s) for s in p.stop)
                tail_start = max(0, len(req.text) - window)
                hits = [i for s in p.stop if (i := req.text.find(s, tail_start)) >= 0]
                if hits:
                    req.text = req.text[: min(hits)]
                    req.stop_string_hit = True
                    return "stop"
        if len(req.output_token_ids) >= p.max_tokens:
            return "length"
        return None

    def _output(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        text = req.text
        if not req.finished and req.params.stop:
            hold = max(len(s) for s in req.params.stop) - 1
            text = text[: max(req.num_sent_chars, len(text) - hold)]
        delta = text[req.num_sent_chars :]
        req.num_sent_chars = len(text)
        n_new = len(new_tokens)
        lps = req.output_logprobs if req.params.logprobs else None
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            new_token_ids=list(new_tokens),
            text=text,
            delta_text=delta,
            finished=req.finished,
            finish_reason=req.finish_reason,
            logprobs=list(lps) if lps is not None else None,
            new_logprobs=list(lps[len(lps) - n_new :]) if lps is not None and n_new else
            ([] if lps is not None else None),
            # timing metrics where they are read: the first tokens (TTFT) and the end
            metrics=req.metrics() if req.finished or len(req.output_token_ids) == n_new
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
        from draftgraph.distributed import current_tp, shutdown_workers

        if current_tp().size > 1 and self.device.type == "cuda":
            # NOTE: captured graphs hold work on the NCCL communicator: finish and drop them
            # before the process group is destroyed
            torch.cuda.synchronize(self.device)
            self.runner.graphs = self.runner.spec_graphs = None
        shutdown_workers()

    def num_free_kv_slots(self) -> int:
        return self.runner.allocator.num_free_slots

    def kv_usage(self) -> float:
        a = self.runner.allocator
        return 1.0 - a.num_free_slots / a.usable_slots
