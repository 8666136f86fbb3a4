"""Tensor-parallel processes: rank 0 drives, ranks > 0 follow its raw inputs.

Rank 0 is the LLMEngine's process (scheduler, sampling, detokenisation). `start_workers`
starts ranks 1..N-1 with torch.multiprocessing (spawn); they meet rank 0 through a TCPStore on
127.0.0.1 (its port picked by the OS), load their weight shards and build the same ModelRunner
from the arguments rank 0's runner broadcasts. Then each step rank 0 broadcasts ONE fixed-size
int64 control message on the gloo control group, and every rank runs the identical forward or
replays the identical decode-graph bucket, so the collectives inside line up:

  message = [kind, a, b, c, d, 0, 0, payload lanes n | payload]
  The first INLINE payload lanes travel with the header in one broadcast of fixed size; a
  longer payload (a prefill chunk) follows in a second broadcast of exactly n lanes.
    FORWARD      a = phase, b = num_tokens, c = bs, d = len(logit_indices); payload =
                 input_ids, out_cache_loc, logit_indices [b | b | d], then req_pool_indices,
                 seq_lens, extend_lens [c each]
    REPLAY       a = bucket, b = greedy, c = lanes, d = k (0: decode graphs, else the
                 speculative-step graphs); payload = that graph runner's staging lanes
    INIT_GRAPHS  no payload; ModelRunner.init_graphs' arguments follow as one object broadcast
    SHUTDOWN

NOTE: KV slots and request rows are chosen by rank 0's scheduler only; a rank's KV pool has the
same number of slots (the minimum over ranks) holding its KV heads, and its request-to-token
table is written by the metadata builders from the broadcast out_cache_loc, so nothing but the
raw inputs has to travel.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from draftgraph.distributed.parallel import (
    TPInfo,
    current_tp,
    destroy_tp,
    init_tp,
    set_tp_env,
)

logger = logging.getLogger(__name__)

FORWARD, REPLAY, INIT_GRAPHS, SHUTDOWN = 1, 2, 3, 4
HEADER = 8
INLINE = 1024  # payload lanes sent with the header: a decode replay of up to ~100 requests
STARTUP_TIMEOUT_S = 600.0


def message_capacity(runner_kwargs: dict) -> int:
    """Lanes of the control message, from the runner's arguments (same on every rank)."""
    sched = runner_kwargs["sched_cfg"]
    extra = runner_kwargs.get("extra_tokens_per_req", 0)
    max_tokens = max(sched.max_num_batched_tokens, sched.max_num_seqs * (1 + extra))
    # a forward: 2 * tokens + logit rows (<= tokens) + 3 * bs lanes; a replay: the staging
    # lanes (about 8 + k per row)
    return HEADER + max(INLINE, 3 * max_tokens + (16 + extra) * sched.max_num_seqs)


class TPDriver:
    """Rank 0's side of the control plane: one broadcast per step (two for a long payload)."""

    def __init__(self, tp: TPInfo, capacity: int) -> None:
        self.tp = tp
        self.msg = torch.zeros(capacity, dtype=torch.int64)  # [capacity] int64

    def _send(self, kind: int, header: list[int], payload: list[torch.Tensor] = ()) -> None:
        m = self.msg
        off = HEADER
        for t in payload:
            n = t.numel()
            if off + n > m.numel():
                raise RuntimeError(f"tensor-parallel control message overflow ({off + n} > "
                                   f"{m.numel()} lanes)")
            m[off : off + n] = t
            off += n
        m[:HEADER] = torch.tensor([kind, *header] + [0] * (HEADER - 2 - len(header))
                                  + [off - HEADER])
        dist.broadcast(m[: HEADER + INLINE], src=0, group=self.tp.control)
        if off > HEADER + INLINE:
            dist.broadcast(m[HEADER:off], src=0, group=self.tp.control)

    def send_forward(self, sb) -> None:
        from draftgraph.attention.backend import Phase

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64)

        self._send(FORWARD, [list(Phase).index(sb.phase), len(sb.input_ids),
                             len(sb.req_pool_indices), len(sb.logit_indices)],
                   [t(sb.input_ids), t(sb.out_cache_loc), t(sb.logit_indices),
                    t(sb.req_pool_indices), t(sb.seq_lens), t(sb.extend_lens)])

    def send_replay(self, k: int, bucket: int, greedy: bool, staging: torch.Tensor) -> None:
        self._send(REPLAY, [bucket, int(greedy), staging.numel(), k], [staging])

    def send_init_graphs(self, init_graphs_kwargs: dict) -> None:
        self._send(INIT_GRAPHS, [])
        dist.broadcast_object_list([init_graphs_kwargs], src=0, group=self.tp.control)

    def send_shutdown(self, timeout_s: float = 10.0) -> None:
        m = self.msg
        m.zero_()
        m[0] = SHUTDOWN
        work = dist.broadcast(m[: HEADER + INLINE], src=0, group=self.tp.control,
                              async_op=True)
        work.wait(_timedelta(timeout_s))  # raises instead of blocking on a stuck or dead peer


def tp_driver(tp: TPInfo, runner_kwargs: dict) -> TPDriver | None:
    """Called by ModelRunner on every rank. On rank 0 of a TP group: send the runner's
    arguments to ranks > 0 (which build the same runner from them) and return the driver of
    its steps. None without tensor parallelism and on ranks > 0."""
    if tp.size == 1 or tp.rank != 0:
        return None
    dist.broadcast_object_list([runner_kwargs], src=0, group=tp.control)
    _STATE["driver"] = TPDriver(tp, message_capacity(runner_kwargs))
    return _STATE["driver"]


# ---- rank 0: start and stop the workers -------------------------------------------------

_STATE: dict = {"procs": [], "driver": None, "threads": None}


def _rank_device(device: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.startswith("cuda") else torch.device("cpu")


def _cpu_threads(size: int) -> int:
    return max(1, (os.cpu_count() or 1) // size)


def start_workers(config) -> TPInfo:
    """Rank 0 (the caller): start ranks 1..N-1 of `config.tensor_parallel_size`, form the group
    with them and return rank 0's TPInfo. `shutdown_workers` (also run at exit) ends them."""
    size = config.tensor_parallel_size
    if _STATE["procs"] or current_tp().size > 1:
        logger.warning("tensor parallel: one TP engine per process; shutting down the previous "
                       "one's workers")
        shutdown_workers()
    set_tp_env()  # inherited by the spawned workers
    device = _rank_device(config.device, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        _STATE["threads"] = torch.get_num_threads()
        torch.set_num_threads(_cpu_threads(size))
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                          timeout=_timedelta(STARTUP_TIMEOUT_S))
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(r, size, store.port, config),
                         name=f"draftgraph-tp{r}", daemon=True) for r in range(1, size)]
    for p in procs:
        p.start()
    _STATE["procs"] = procs
    if not _STATE.get("atexit"):
        atexit.register(shutdown_workers)
        _STATE["atexit"] = True
    try:
        _wait_for_workers(store, procs)
        tp = init_tp(0, size, store, device)
    except BaseException:
        shutdown_workers()
        raise
    logger.info("tensor parallel: %d ranks (%d worker processes started)", size, len(procs))
    return tp


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def _wait_for_workers(store, procs) -> None:
    """Until every worker has reached the store; fails fast when one dies first."""
    keys = [f"joined/{p.name}" for p in procs]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not store.check(keys):
        for p in procs:
            if not p.is_alive():
                raise RuntimeError(f"tensor-parallel worker {p.name} exited with code "
                                   f"{p.exitcode} during startup (its error is above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel workers did not start in {STARTUP_TIMEOUT_S}s")
        time.sleep(0.05)


def shutdown_workers(timeout_s: float = 30.0) -> None:
    """Stop the workers (a SHUTDOWN message, then terminate stragglers) and leave the group.
    Safe to call twice; a no-op without tensor parallelism."""
    procs, driver = _STATE["procs"], _STATE["driver"]
    if not procs and current_tp().size == 1:
        return
    if driver is not None and any(p.is_alive() for p in procs):
        try:
            driver.send_shutdown()
        except Exception as e:  # a worker died: terminate the rest below
            logger.warning("tensor parallel: shutdown message failed (%s)", e)
    # without a driver the workers never got past startup: they exit on their own or hang
    deadline = time.monotonic() + (timeout_s if driver is not None else 5.0)
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            logger.warning("tensor parallel: terminating %s", p.name)
            p.terminate()
            p.join(5)
    _STATE.update(procs=[], driver=None)
    destroy_tp()
    if _STATE["threads"] is not None:
        torch.set_num_threads(_STATE["threads"])
        _STATE["threads"] = None


# ---- ranks > 0 ------------------------------------------------------------------------


def _exit_with_parent() -> None:
    """A worker must not outlive rank 0 (e.g. killed by a signal): poll and exit."""
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def worker_main(rank: int, size: int, port: int, config) -> None:
    """Entry point of rank `rank` > 0 (a spawned process)."""
    try:
        _worker(rank, size, port, config)
    except (ValueError, FileNotFoundError, ImportError) as e:
        # a bad model or flag: rank 0 hits the same error and reports it; one line here
        logger.error("tensor parallel rank %d: %s", rank, e)
        sys.exit(1)


def _worker(rank: int, size: int, port: int, config) -> None:
    from draftgraph.models.loader import load_model
    from draftgraph.runtime.model_runner import ModelRunner

    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s")
    set_tp_env()
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    device = _rank_device(config.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(_cpu_threads(size))
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False,
                          timeout=_timedelta(STARTUP_TIMEOUT_S))
    store.set(f"joined/draftgraph-tp{rank}", "1")
    tp = init_tp(rank, size, store, device)
    torch.manual_seed(config.seed)
    loaded = load_model(config.model, device=device, dtype=config.torch_dtype)
    box = [None]
    dist.broadcast_object_list(box, src=0, group=tp.control)
    runner_kwargs = box[0]
    runner = ModelRunner(loaded.model, device=device, **runner_kwargs)
    follow(runner, tp, message_capacity(runner_kwargs))
    if device.type == "cuda":
        # NOTE: tearing down an NCCL group that CUDA graphs captured can block (seen on the
        # 2-GPU run: rank 1 had to be terminated); finish the GPU work and end the process
        runner.graphs = runner.spec_graphs = None
        torch.cuda.synchronize(device)
        logging.shutdown()
        os._exit(0)
    destroy_tp()


@torch.inference_mode()
def follow(runner, tp: TPInfo, capacity: int) -> None:
    """The worker loop: run what rank 0 broadcasts until SHUTDOWN."""
    from draftgraph.attention.backend import Phase
    from draftgraph.runtime.model_runner import StepBatch

    phases = list(Phase)
    msg = torch.zeros(capacity, dtype=torch.int64)
    while True:
        dist.broadcast(msg[: HEADER + INLINE], src=0, group=tp.control)
        kind, a, b, c, d, _, _, n = msg[:HEADER].tolist()
        if n > INLINE:
            dist.broadcast(msg[HEADER : HEADER + n], src=0, group=tp.control)
        if kind == SHUTDOWN:
            return
        if kind == FORWARD:
            body = msg[HEADER : HEADER + 2 * b + d + 3 * c].tolist()
            ids, loc, logit = body[:b], body[b : 2 * b], body[2 * b : 2 * b + d]
            rows = body[2 * b + d :]
            runner.forward(StepBatch(phases[a], ids, rows[:c], rows[c : 2 * c],
                                     rows[2 * c :], loc, logit))
        elif kind == REPLAY:
            graphs = runner.spec_graphs if d else runner.graphs
            graphs.staged.synchronize()  # the last H2D copy has read the staging buffer
            graphs.staging.copy_(msg[HEADER : HEADER + c])
            graphs.replay_staged(a, bool(b), graphs.staged)
        elif kind == INIT_GRAPHS:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=tp.control)
            runner.init_graphs(**box[0])
        else:
            raise RuntimeError(f"tensor parallel rank {tp.rank}: unknown message kind {kind}")
