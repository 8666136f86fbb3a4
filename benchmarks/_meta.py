"""The header every benchmark JSON starts with: date, command, device, versions; and helpers
the benchmarks share."""

from __future__ import annotations

import cProfile
import datetime
import os
import platform
import pstats
import sys

import torch


def run_header(device: str | None = None) -> dict:
    """device: as measured on (default: the CUDA device's name, else the CPU's threads)."""
    if device is None or device.startswith("cuda"):  # --device cuda: the GPU's name
        device = (torch.cuda.get_device_name() if torch.cuda.is_available()
                  else f"CPU ({torch.get_num_threads()} threads)")
    elif device == "cpu":
        device = f"CPU ({torch.get_num_threads()} threads)"
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        # engine switches set for the run (A/B arms such as DRAFTGRAPH_PDL=0)
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("DRAFTGRAPH_")},
    }


def model_shape(cfg) -> dict:
    """The shape fields of a ModelConfig that a benchmark's timings depend on."""
    return {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
            "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size}


def timed_generate(engine, prompts: list, params) -> dict:
    """One timed `engine.generate` after a 4-token warm-up on the first prompt: tokens/s, the
    outputs' digest (to compare arms) and, when the engine speculated, its accept length
    (accepted drafts per verify step + 1, the warm-up included)."""
    import hashlib
    import time

    from draftgraph.engine.sampling import SamplingParams

    engine.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0))
    t0 = time.perf_counter()
    toks = [o.token_ids for o in engine.generate(prompts, params)]
    dt = time.perf_counter() - t0
    out = {"tokens_per_s": sum(map(len, toks)) / dt,
           "outputs_md5": hashlib.md5(str(toks).encode()).hexdigest()}
    st = engine.stats
    if st.get("num_drafts"):
        out["accept_length"] = 1 + st["num_accepted_tokens"] / st["num_drafts"]
    return out


def ab_prompts(every_code: int, every_chat: int) -> list[list[int]]:
    """Spread prompts of the default model's accept sets for the CPU A/B scripts: HumanEval's
    (160) every `every_code`-th, then MT-Bench's (80) every `every_chat`-th."""
    import json
    from pathlib import Path

    sets = json.loads((Path(__file__).parent / "data" / "accept_sets_smollm2_ids.json")
                      .read_text())
    return sets["humaneval"][:160:every_code] + sets["mtbench"][:80:every_chat]


def ab_arm(arm: str, loaded, dtype, model: str):
    """(SpecConfig, drafter) of a CPU A/B arm: "plain"; "chain", the shipped head's chain of
    4; "tree", its 4x5:16 trees."""
    from draftgraph.config import SpecConfig, TreeShape
    from draftgraph.spec import make_drafter

    if arm == "plain":
        return SpecConfig(), None
    spec = SpecConfig(method="chain", num_draft_tokens=4, adaptive=False,
                      tree=TreeShape(4, 5, 16) if arm == "tree" else None)
    return spec, make_drafter(spec, "cpu", dtype, loaded.config, model)


def profile_per_step(fn, steps: int, top: int) -> list[dict]:
    """`fn()` (which runs `steps` steps) under cProfile: each function's calls, own and
    cumulative us per step, the most own time first; the `top` printed."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    rows = [{"function": f"{file.split('/src/')[-1]}:{line} {name}",
             "calls_per_step": calls / steps, "own_us_per_step": own / steps * 1e6,
             "cum_us_per_step": cum / steps * 1e6}
            for (file, line, name), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items()]
    rows.sort(key=lambda r: -r["own_us_per_step"])
    for r in rows[:top]:
        print(f"  {r['own_us_per_step']:8.1f} us  x{r['calls_per_step']:6.1f}  "
              f"{r['function'][:100]}", flush=True)
    return rows
