"""Tensor-parallel control plane: rank 0 drives, ranks > 0 follow its raw inputs.

Each step rank 0 broadcasts ONE int64 control message on the gloo control group, and every
rank runs the identical forward or replays the identical graph (graph set, bucket, mode), so
the collectives inside line up:

  message = [kind, a, b, c, d, 0, 0, payload lanes n | payload]
  The first INLINE payload lanes travel with the header in one broadcast of fixed size; a
  longer payload (a prefill chunk) follows in a second broadcast of exactly n lanes (the
  receiver sizes its buffer from n: there is no capacity formula to keep in step).
    FORWARD      a..d = StepBatch.to_lanes' header; payload = its lanes
    REPLAY       a = bucket, b = greedy, c = lanes, d = graph set index (creation order);
                 payload = that graph set's staging buffer (its body's raw-input `Lanes`)
    INIT_GRAPHS  no payload; ModelExecutor.init_graphs' arguments follow as one object
    SHUTDOWN

NOTE: KV slots and request rows are chosen by rank 0's scheduler only; a rank's KV pool has the
same number of slots (the minimum over ranks) holding its KV heads, and its request-to-token
table is written by the metadata builders from the broadcast out_cache_loc, so nothing but the
raw inputs has to travel.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from draftgraph.distributed.parallel import TPInfo
from draftgraph.runtime.schema import StepBatch

FORWARD, REPLAY, INIT_GRAPHS, SHUTDOWN = 1, 2, 3, 4
HEADER = 8
INLINE = 1024  # payload lanes sent with the header: a decode replay of up to ~100 requests

_DRIVER: list = [None]  # rank 0's driver of the live TP group


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class TPDriver:
    """Rank 0's side of the control plane: one broadcast per step (two for a long payload)."""

    def __init__(self, tp: TPInfo) -> None:
        self.tp = tp
        self.msg = torch.zeros(HEADER + INLINE, dtype=torch.int64)  # grows for long payloads

    def _send(self, kind: int, header: list[int], payload: list[torch.Tensor] = ()) -> None:
        n = sum(t.numel() for t in payload)
        if HEADER + n > self.msg.numel():
            with torch.inference_mode(False):  # a normal tensor: written in and out of it
                self.msg = torch.zeros(HEADER + n, dtype=torch.int64)
        m = self.msg
        off = HEADER
        for t in payload:
            m[off : off + t.numel()] = t.reshape(-1)
            off += t.numel()
        m[:HEADER] = torch.tensor([kind, *header] + [0] * (HEADER - 2 - len(header)) + [n])
        dist.broadcast(m[: HEADER + INLINE], src=0, group=self.tp.control)
        if n > INLINE:
            dist.broadcast(m[HEADER : HEADER + n], src=0, group=self.tp.control)

    def send_forward(self, sb: StepBatch) -> None:
        head, lanes = sb.to_lanes()
        self._send(FORWARD, head, [lanes])

    def send_replay(self, index: int, bucket: int, greedy: bool, staging: torch.Tensor) -> None:
        self._send(REPLAY, [bucket, int(greedy), staging.numel(), index], [staging])

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


def tp_driver(tp: TPInfo, executor_kwargs: dict) -> TPDriver | None:
    """Called on every rank while the target is built. On rank 0 of a TP group: send the
    arguments to ranks > 0 (which build the same slot space and executor from them) and
    return the driver of its steps. None without tensor parallelism and on ranks > 0."""
    if tp.size == 1 or tp.rank != 0:
        return None
    dist.broadcast_object_list([executor_kwargs], src=0, group=tp.control)
    _DRIVER[0] = TPDriver(tp)
    return _DRIVER[0]


def current_driver() -> TPDriver | None:
    return _DRIVER[0]


def forget_driver() -> None:
    _DRIVER[0] = None


def receive_executor_kwargs(tp: TPInfo) -> dict:
    """Ranks > 0: the arguments rank 0's `tp_driver` sent."""
    box = [None]
    dist.broadcast_object_list(box, src=0, group=tp.control)
    return box[0]


@torch.inference_mode()
def follow(executor, tp: TPInfo) -> None:
    """The worker loop of ranks > 0: run what rank 0 broadcasts until SHUTDOWN."""
    msg = torch.zeros(HEADER + INLINE, dtype=torch.int64)
    while True:
        dist.broadcast(msg[: HEADER + INLINE], src=0, group=tp.control)
        kind, a, b, c, d, _, _, n = msg[:HEADER].tolist()
        if HEADER + n > msg.numel():
            grown = torch.zeros(HEADER + n, dtype=torch.int64)
            grown[: HEADER + INLINE] = msg
            msg = grown
        if n > INLINE:
            dist.broadcast(msg[HEADER : HEADER + n], src=0, group=tp.control)
        if kind == SHUTDOWN:
            return
        if kind == FORWARD:
            # (the drafters that keep KV observe it inside, as on rank 0)
            executor.forward(StepBatch.from_lanes([a, b, c, d], msg[HEADER : HEADER + n]))
        elif kind == REPLAY:
            graphs = executor.graph_set_by_index(d)
            graphs.wait_staged()  # the last H2D copy has read the staging buffer
            graphs.staging.copy_(msg[HEADER : HEADER + c])
            graphs.replay_staged(a, bool(b))
        elif kind == INIT_GRAPHS:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=tp.control)
            executor.init_graphs(**box[0])
        else:
            raise RuntimeError(f"tensor parallel rank {tp.rank}: unknown message kind {kind}")
