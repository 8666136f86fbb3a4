"""Tensor-parallel process groups and the collectives the model uses.

One process per rank. The default group carries the model's collectives (NCCL on GPUs, gloo
on CPU); a second, gloo group carries the control plane (rank 0 broadcasting each step's raw
inputs to ranks > 0). Without `init_tp` every process is rank 0 of a group of one and the
collectives below are no-ops, so a single-process model is exactly the plain one.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# NVLink multicast (NVLS / symmetric memory multicast) stays off in every rank's process.
TP_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
          "NVSHMEM_DISABLE_NVLS": "1"}
# Model collectives run inside steps; the control group waits for rank 0's next step, which
# may come after the engine has idled for a long time.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
CONTROL_TIMEOUT = datetime.timedelta(days=7)


@dataclass(frozen=True)
class TPInfo:
    """This process's place in its tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: object = None  # ProcessGroup of the model collectives (None: the default group)
    control: object = None  # gloo ProcessGroup of the control plane


_TP = TPInfo()


def current_tp() -> TPInfo:
    return _TP


def set_tp_env() -> None:
    os.environ.update(TP_ENV)


def init_tp(rank: int, size: int, store: dist.Store, device: torch.device) -> TPInfo:
    """Join the TP group through `store` (every rank calls this); returns this rank's TPInfo."""
    global _TP
    set_tp_env()
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT, **kw)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _TP = TPInfo(rank, size, None, control)
    # NOTE: the first collective creates the NCCL communicator; it must not happen inside a
    # CUDA graph capture, so warm it up here.
    warm = torch.ones(1, device=device)
    dist.all_reduce(warm)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    assert warm.item() == size, warm
    logger.info("tensor parallel rank %d/%d joined (%s)", rank, size, backend)
    return _TP


def destroy_tp() -> None:
    global _TP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP = TPInfo()


def all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Sum `x` over the ranks in place (graph-capturable on NCCL); returns x."""
    if tp.size > 1:
        dist.all_reduce(x, group=tp.group)
    return x


def all_gather_rows(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """[n, d] on each rank -> [size * n, d], rank r's rows at r * n."""
    if tp.size == 1:
        return x
    out = x.new_empty(tp.size * x.shape[0], x.shape[1])
    _all_gather_single(out, x.contiguous(), group=tp.group)
    return out


def all_gather_last_dim(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """[n, d] on each rank -> [n, size * d], rank r's columns at r * d."""
    if tp.size == 1:
        return x
    out = all_gather_rows(x, tp)
    return out.view(tp.size, x.shape[0], x.shape[1]).permute(1, 0, 2).reshape(x.shape[0], -1)


# torch >= 2.13 renames all_gather_into_tensor (and deprecates the old name)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def min_over_ranks(value: int, tp: TPInfo) -> int:
    """The smallest `value` any rank has (for sizes every rank must agree on)."""
    if tp.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.control)
    return int(t.item())
