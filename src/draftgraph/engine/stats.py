"""The engine's step accounts: what each step ran (`LLMEngine.step_kind`) and how long.

A step is a graph replay of decode or speculative rows ("decode", "spec"), the async path
("ahead": the next replay launched, the one in flight read; "behind": the same with the
arriving prompts' prefill queued between them, `--overlap-prefill`) or prefill chunks
with any decode rows ("extend"). `engine.stats` counts each as "steps_<kind>" and
"step_seconds_<kind>", and "wait_seconds_<kind>": the part spent waiting for the device (a
replay's results, sampled first tokens), the rest being the host's own work; the server
exports them (`/metrics`: engine_steps, engine_step_seconds, engine_step_wait_seconds by
kind), `bench serve` and benchmarks/serve_offline.py report their difference over a run.
No torch here: the benchmark client imports it.
"""

from __future__ import annotations

STEP_KINDS = ("decode", "spec", "ahead", "behind", "extend")


def step_accounts(stats: dict, before: dict | None = None) -> dict[str, dict]:
    """Steps, ms each and the ms of it spent waiting for the device by kind from engine
    stats (since `before`, an earlier snapshot of them), the kinds that ran only."""
    before = before or {}
    out = {}
    for kind in STEP_KINDS:
        n = stats.get(f"steps_{kind}", 0) - before.get(f"steps_{kind}", 0)
        if n:
            s, w = (stats.get(f"{x}_seconds_{kind}", 0.0) - before.get(f"{x}_seconds_{kind}", 0.0)
                    for x in ("step", "wait"))
            out[kind] = {"steps": n, "ms_each": 1e3 * s / n, "wait_ms_each": 1e3 * w / n}
    return out
