"""Tensor parallelism (`--tensor-parallel-size N`): one process per rank.

  parallel.py  process groups (model collectives + a gloo control group), TPInfo, collectives
  sharding.py  which heads / rows / vocabulary shard each rank holds (uneven head splits)
  layers.py    row-parallel linear, vocab-parallel embedding and LM head
  worker.py    rank 0 starts ranks > 0 and broadcasts each step's raw inputs; they follow
"""

from draftgraph.distributed.parallel import TPInfo, current_tp
from draftgraph.distributed.worker import shutdown_workers, start_workers

__all__ = ["TPInfo", "current_tp", "shutdown_workers", "start_workers"]
