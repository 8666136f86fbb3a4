"""Tensor parallelism (`--tensor-parallel-size N`): one process per rank.

  parallel.py  process groups (model collectives + a gloo control group), TPInfo, collectives
  sharding.py  which heads / rows / vocabulary shard each rank holds (uneven head splits)
  layers.py    row-parallel linear, vocab-parallel embedding and LM head

The processes themselves (start, follow rank 0's steps, stop) are `runtime/tp_worker.py` and
`runtime/tp_control.py`: they run executors, which sit above the models.
"""

from draftgraph.distributed.parallel import TPInfo, current_tp

__all__ = ["TPInfo", "current_tp"]
