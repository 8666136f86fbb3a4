"""Which requests' tokens differ from the synchronous engine's: async alone, async + overlap
(the GPU overlap test's workload, chain head k = 3). Prints the first differing index.
On a GPU: `PYTHONPATH=$PWD/src TRITON_INTERPRET=0 python3 benchmarks/overlap_diag.py` (~20 s)."""
import sys

sys.path.insert(0, "tests")
from test_gpu_graphs import _engine, run_arrivals  # noqa: E402

from draftgraph.config import SpecConfig  # noqa: E402

spec = SpecConfig(method="chain", draft_head="random", num_draft_tokens=3, adaptive=False)
res = {}
for mode in ("sync", "async", "overlap"):
    e = _engine(use_graphs=True, spec=spec)
    e.async_scheduling = mode != "sync"
    e.config.overlap_prefill = mode == "overlap"
    res[mode] = {rid: tokens for rid, (tokens, _) in run_arrivals(e).items()}
    print(mode, "steps behind", e.stats["steps_behind"])
for mode in ("async", "overlap"):
    for rid, ta in res["sync"].items():
        tb = res[mode][rid]
        d = next((i for i, (a, b) in enumerate(zip(ta, tb, strict=False)) if a != b), None)
        print(mode, rid, "equal" if d is None and len(ta) == len(tb) else f"differs at {d}")
