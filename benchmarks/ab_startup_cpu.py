"""Start-up of the default model on the CPU, two trees A/B (issue 19): `bench_cpu.startup` (a
fresh process on an empty weight cache, then a second one reading the cache) for the tree
before a change and after it, alternating, three times each.

    git worktree add /tmp/wt_before <commit before>
    python benchmarks/ab_startup_cpu.py /tmp/wt_before/src   # -> results/startup_ab_cpu.json
"""

import json
import os
import sys

import bench_cpu
from _meta import run_header


def main() -> None:
    model = "default"
    res = {"benchmark": "startup_ab_cpu", **run_header(), "model": model,
           "load_average_before": os.getloadavg()[0], "arms": []}
    for rep in range(3):
        for arm, src in (("before", sys.argv[1]), ("after", os.path.abspath("src"))):
            os.environ["PYTHONPATH"] = src  # the fresh processes import this tree's package
            r = bench_cpu.startup(model, 2)
            res["arms"].append({"arm": arm, "rep": rep, **r})
            print(arm, rep, {k: {kk: round(vv, 2) for kk, vv in v.items()}
                             for k, v in r.items()}, flush=True)
    with open("benchmarks/results/startup_ab_cpu.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
