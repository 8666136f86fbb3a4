"""Which requests' tokens differ from the synchronous engine's: async alone, async + overlap
(the GPU overlap test's workload, chain head k = 3). Prints the first differing index.
On a GPU: `PYTHONPATH=$PWD/src TRITON_INTERPRET=0 python3 benchmarks/overlap_diag.py` (~20 s)."""
import sys

import torch

sys.path.insert(0, "tests")
from test_gpu_graphs import _engine  # noqa: E402

from draftgraph.config import SpecConfig  # noqa: E402
from draftgraph.engine.sampling import SamplingParams  # noqa: E402

spec = SpecConfig(method="chain", draft_head="random", num_draft_tokens=3, adaptive=False)
res = {}
for mode in ("sync", "async", "overlap"):
    e = _engine(use_graphs=True, spec=spec)
    e.async_scheduling = mode != "sync"
    e.config.overlap_prefill = mode == "overlap"
    vocab = e.model_config.vocab_size
    g = torch.Generator().manual_seed(3)
    arr = {s: (torch.randint(0, vocab, (n,), generator=g).tolist(),
               SamplingParams(max_tokens=m, temperature=t, seed=m, ignore_eos=True))
           for s, n, m, t in ((0, 40, 50, 0), (1, 300, 30, 0.8), (5, 17, 40, 0),
                              (9, 120, 25, 1.0), (10, 64, 35, 0), (20, 8, 12, 0))}
    got, step = {}, 0
    while e.has_unfinished() or step <= max(arr):
        if step in arr:
            e.add_request(*arr[step], request_id=f"r{step}")
        for o in e.step():
            if o.finished:
                got[o.request_id] = o.token_ids
        step += 1
    res[mode] = got
    print(mode, "steps behind", e.stats["steps_behind"])
for mode in ("async", "overlap"):
    for rid, ta in res["sync"].items():
        tb = res[mode][rid]
        d = next((i for i, (a, b) in enumerate(zip(ta, tb, strict=False)) if a != b), None)
        print(mode, rid, "equal" if d is None and len(ta) == len(tb) else f"differs at {d}")
