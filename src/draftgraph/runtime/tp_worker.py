"""Tensor-parallel processes: rank 0 starts ranks > 0, which follow its steps.

Rank 0 is the LLMEngine's process (scheduler, sampling, detokenisation). `start_workers`
starts ranks 1..N-1 with torch.multiprocessing (spawn); they meet rank 0 through a TCPStore on
127.0.0.1 (its port picked by the OS), load their weight shards, build the same slot space and
target executor from the arguments rank 0 broadcasts (`build_target`), then follow rank 0's
control messages (`tp_control.follow`).
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
from draftgraph.runtime.executor import build_target
from draftgraph.runtime.tp_control import (
    _timedelta,
    current_driver,
    follow,
    forget_driver,
    receive_executor_kwargs,
)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0


# ---- rank 0: start and stop the workers -------------------------------------------------

_STATE: dict = {"procs": [], "threads": None}


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
    procs, driver = _STATE["procs"], current_driver()
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
    _STATE["procs"] = []
    forget_driver()
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
    _, executor = build_target(loaded.model, device=device, **receive_executor_kwargs(tp))
    follow(executor, tp)
    if device.type == "cuda":
        # NOTE: tearing down an NCCL group that CUDA graphs captured can block (seen on the
        # 2-GPU run: rank 1 had to be terminated); finish the GPU work and end the process
        executor.graph_sets.clear()
        torch.cuda.synchronize(device)
        logging.shutdown()
        os._exit(0)
    destroy_tp()
    # and on the CPU too, leave without the interpreter's teardown: destroying the gloo
    # group's native threads there aborted the worker now and then after a clean shutdown
    # ("terminate called without an active exception", exit code -6; once in a CPU suite run)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
