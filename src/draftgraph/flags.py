"""The engine's command-line flags, defined once for `draftgraph generate` and `serve`.

`add_model_args` + `add_engine_args` build the flags, `engine_config_from_args` maps them to an
`EngineConfig` (`spec_config_from_args` is the one flag -> `SpecConfig` mapping), and
`apply_process_flags` applies the ones that act on the process (`--threads`,
`--no-weight-cache`) before the model loads. Both front ends import this module; neither
imports the other.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch

from draftgraph.config import (
    SPEC_METHODS,
    TREE_MAX_BS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpecConfig,
    TreeShape,
)

logger = logging.getLogger(__name__)

MODEL_HELP = ("'default' (SmolLM2-135M-Instruct GGUF), a .gguf file, a Hugging Face directory "
              "(config.json, *.safetensors, tokenizer.json), or random:<preset> (random weights: "
              "tiny, smollm2-135m, llama-3.2-1b, llama-3.1-8b)")
WEIGHT_CACHE_ENV = "DRAFTGRAPH_WEIGHT_CACHE"  # "0": never read or write the weight cache


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows every flag's default; the default of a flag whose help already says
    what its default means ("default: ...") or that has none is not repeated."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default:" in text or action.default is None or action.default is False or \
                action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return super()._get_help_string(action)


def physical_cores() -> int:
    """Physical CPU cores this process may run on (hyper-threads counted once)."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    cores: set[tuple[str, str]] = set()
    try:
        with open("/proc/cpuinfo") as f:
            phys = core = None
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "physical id":
                    phys = value
                elif key == "core id":
                    core = value
                elif not key and phys is not None and core is not None:
                    cores.add((phys, core))
                    phys = core = None
            if phys is not None and core is not None:
                cores.add((phys, core))
    except OSError:
        pass
    return max(1, min(len(cores), allowed) if cores else allowed)


# ---- the model argument: positional or --model, on every subcommand -----------------------

def add_model_args(p: argparse.ArgumentParser, positional: bool = True) -> None:
    """`--model X` everywhere; also the positional MODEL when `positional` (on `generate`
    the first positional is the model only when it names one: see `split_model_positional`)."""
    if positional:
        p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                       help=f"the model, as for --model ({MODEL_HELP})")
    p.add_argument("--model", dest="model_opt", default=None, metavar="MODEL",
                   help=f"{MODEL_HELP} (default: default)")


def looks_like_model(word: str) -> bool:
    """True when a positional word names a model rather than being a prompt: 'default',
    random:<preset>, a *.gguf path, or an existing directory."""
    return (word == "default" or word.startswith("random:") or word.endswith(".gguf")
            or os.path.isdir(os.path.expanduser(word)))


def resolve_model(args: argparse.Namespace) -> str:
    """The one model named by the positional and/or --model ('default' when neither)."""
    pos, opt = getattr(args, "model_pos", None), getattr(args, "model_opt", None)
    if pos is not None and opt is not None and pos != opt:
        raise ValueError(f"two models given: {pos!r} (positional) and --model {opt!r}; "
                         "pass the model once")
    return opt or pos or "default"


# ---- engine flags ---------------------------------------------------------------------------

def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every flag that configures the engine (model loading, cache, scheduler, speculation)."""
    e = p.add_argument_group("engine")
    e.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where the model runs (default: cuda if a GPU is visible, else cpu)")
    e.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weight and activation dtype (default: float32 on CPU, bfloat16 on GPU)")
    e.add_argument("--threads", type=int, default=physical_cores(),
                   help="CPU threads for torch (default: this machine's physical cores, "
                        f"{physical_cores()}); fewer when other processes share the CPU")
    e.add_argument("--no-weight-cache", action="store_true",
                   help="dequantise the GGUF again instead of reading (or writing) the cache "
                        f"of its dequantised weights (also: {WEIGHT_CACHE_ENV}=0)")
    e.add_argument("--no-graphs", action="store_true",
                   help="run every step eagerly instead of replaying CUDA graphs (GPU only)")
    e.add_argument("--no-async-scheduling", action="store_true",
                   help="read each decode step's tokens before launching the next")
    e.add_argument("--overlap-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="async scheduling: run arriving prompts' prefill behind the decode step "
                        "in flight instead of in a step that mixes them with the decode rows "
                        "(default on; --no-overlap-prefill: the mixed step)")
    e.add_argument("--decode-rides-prefill", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="with --overlap-prefill, plain decode: the running requests' next "
                        "decode rows ride in that prefill's forward instead of a decode step "
                        "of their own (default on)")
    e.add_argument("--prefill-coalesce-ms", type=float, default=0.0,
                   help="with --overlap-prefill: prompts that arrive while requests decode "
                        "wait up to this long for others to share their prefill, unless they "
                        "fill half the step's token budget (default 0: prefilled at once)")
    e.add_argument("--prefill-graph-tokens", type=int, default=8192,
                   help="extend steps (prefill chunks, mixed steps) of at most this many "
                        "tokens replay CUDA graphs of bucketed token counts (GPU; 0: eager)")
    e.add_argument("--exact-rows", choices=["auto", "on", "off"], default=None,
                   help="compute every verify row exactly as the decode row at its position "
                        "(GPU: steps of up to 16 rows through the fused single-row kernels; "
                        "CPU: verify attention, projections and logsumexp row by row), so "
                        "bf16 speculation equals plain decoding at batch 1; costs time per "
                        "step (auto: on for models of at most 1 GiB of weights; default: on "
                        "with --quantization int4, else off)")
    e.add_argument("--tensor-core-rows", choices=["auto", "on", "off"], default="auto",
                   help="GPU: projections of 2 to 128 rows (verify rows, batched decode) on "
                        "draftgraph's tensor-core matmul instead of cuBLAS (its launch overlaps "
                        "the kernel before it, SwiGLU and the next norm ride in its epilogues; "
                        "auto: on for models of at most 1 GiB of weights)")
    e.add_argument("--deterministic", action="store_true",
                   help="batch invariance on a GPU: a request's tokens do not depend on "
                        "what it is batched with (batch-invariant matmul and decode "
                        "attention plan), so bf16 speculation equals plain decoding at any "
                        "batch size; costs time per step. On a CPU it only implies "
                        "--exact-rows on (equal at batch 1, not batch-invariant)")
    e.add_argument("--quantization", choices=["none", "int4"], default="none",
                   help="int4: the projections and LM head read 4-bit weights in groups of 32 "
                        "(CPU only: 6.4x fewer bytes per projection; approximate, no "
                        "longer fp32-exact; a GGUF Q4_1 keeps its own codes)")
    e.add_argument("--row-pack", choices=["auto", "on", "off"], default="auto",
                   help="CPU, fp32: projections of 2 to 64 rows (speculative verify rows, "
                        "batched decode) through a blocked copy of each weight (oneDNN), "
                        "twice the weight memory (auto: on for models of at most 1 GiB)")
    e.add_argument("--attention-backend", choices=["torch", "triton"], default=None,
                   help="attention kernels (default: triton on GPU, torch on CPU)")
    gpu, cpu = SchedulerConfig.GPU_DEFAULTS, SchedulerConfig.CPU_DEFAULTS
    e.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"requests decoded together in one step (default: {gpu[0]} on a GPU, "
                        f"{cpu[0]} on the CPU)")
    e.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"token budget of one step: prefill chunks + decodes (default: "
                        f"{gpu[1]} on a GPU, {cpu[1]} on the CPU)")
    e.add_argument("--max-step-seconds", type=float, default=None,
                   help="while requests decode, cut prefill chunks so a step takes about this "
                        "long (measured), bounding the gap between a stream's tokens while a "
                        "long prompt is admitted; 0: the token budget alone (default: "
                        f"{SchedulerConfig.CPU_STEP_SECONDS} on the CPU, 0 on a GPU, whose "
                        "steps are short)")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="context length: prompt + generated tokens (default: the model's "
                        "context, capped at 8192)")
    e.add_argument("--max-waiting", type=int, default=SchedulerConfig.max_waiting,
                   help="requests waiting for a decode row before new ones are refused "
                        "(those that start at the next step do not count; generate queues "
                        "all its prompts)")
    e.add_argument("--page-size", type=int, default=CacheConfig.page_size,
                   help="KV cache page size in tokens")
    e.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV cache capacity in tokens (default: from free GPU memory, or a CPU "
                        "default)")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=CacheConfig.enable_prefix_caching,
                   help="keep requests' computed KV in blocks of 16 tokens for later "
                        "prompts that start with the same tokens (vLLM's automatic prefix "
                        "caching; on by default for serve)")
    e.add_argument("--gpu-memory-utilization", type=float,
                   default=CacheConfig.gpu_memory_utilization,
                   help="GPU without --kv-cache-tokens: the share of free GPU memory the KV "
                        "cache may take")
    e.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="split the model over N processes (one GPU each; gloo on --device cpu)")
    e.add_argument("--engine-seed", type=int, default=0,
                   help="seed of the engine (random presets' weights, per-request seeds)")
    e.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative", choices=list(SPEC_METHODS), default=None,
                   help="drafter (default: none, plain decoding): ngram (prompt lookup), "
                   "chain (an EAGLE-3-style head: --draft-head, or the head that ships with "
                   "the default model), draft (a separate draft model, --draft-model), "
                   "block (a DSpark-style block head drafting block-size - 1 tokens in one "
                   "forward: --draft-head, or the head that ships with the default model)")
    s.add_argument("--draft-model", default=None,
                   help="--speculative draft: a model with the target's vocabulary "
                   "(a .gguf file, a Hugging Face directory or random:<preset>)")
    s.add_argument("--draft-head", default=None,
                   help="--speculative chain / block: a head directory (draftgraph "
                   "train-drafter writes one), or random[:layers=N,draft_vocab=V]")
    s.add_argument("--num-draft-tokens", type=int, default=None,
                   help=f"draft tokens proposed per step (default {SpecConfig.num_draft_tokens}"
                   "); with a draft tree (--speculative-tree): the drafts its steps without "
                   f"one verify, a chain of the head's or of the block's first drafts (default "
                   f"{AUTO_TREE_CHAIN}; the block's size is --block-size)")
    s.add_argument("--speculative-tree", default="auto", metavar="WxD:N[+gG]|auto|off",
                   help="--speculative chain: in steps of up to 8 requests (greedy or "
                   "sampled), draft a tree (width W: beam and children per node, depth D, "
                   "N verified nodes, e.g. 8x5:32; +gG: with a prompt-lookup chain of G "
                   "drafts from the root beside it, deeper than D if G > D, --ngram-min/max; "
                   "N + G <= 63) and accept "
                   "its deepest path the target agrees with. auto (default): on one GPU, "
                   f"{AUTO_TREE} trees in steps "
                   f"of up to {AUTO_TREE_MAX_BS} requests unless --num-draft-tokens is given "
                   "(faster than the chain there; on a CPU slower, so the chain); off: the "
                   "chain. --speculative block: 1xK:K+gG (K: the block's drafts, block size "
                   "- 1) verifies a prompt-lookup chain of G drafts beside the block, WxD:N+gG "
                   "with W > 1, D <= K and N + G >= K a tree of the block's rows beside "
                   f"it; auto: {auto_block_tree(7)} for a block of 7 drafts on one GPU in "
                   f"steps of up to {AUTO_TREE_MAX_BS} requests, none on a CPU")
    s.add_argument("--block-size", type=int, default=None,
                   help="--speculative block: the anchor + this many - 1 mask tokens, "
                   "block-size - 1 drafts per step (default: the head's)")
    s.add_argument("--confidence-threshold", type=float, default=None,
                   help="--speculative block with a confidence head: cut a block at the first "
                   "draft the head rates below this (default: the head's)")
    s.add_argument("--ngram-min", type=int, default=None,
                   help="shortest n-gram matched against the context (default: "
                   f"{SpecConfig.ngram_min})")
    s.add_argument("--ngram-max", type=int, default=None,
                   help="longest n-gram matched against the context (default: "
                   f"{SpecConfig.ngram_max})")
    s.add_argument("--no-adaptive-draft", action="store_true",
                   help="keep the draft length fixed even when acceptance is low (n-gram; "
                        "chain, block and draft-model drafters keep it fixed anyway)")


# --speculative-tree auto: the shape and batch cap a chain head drafts with on one GPU. On an
# H100 (bf16, the real default model, 40 prompts a set, 256 tokens, greedy) 8x5:27+g16 -- the
# tree of 27 nodes with an n-gram branch of 16 beside it, reaching 11 past the tree's depth --
# runs 2.07x / 2.43x plain decoding at batch 1 (MT-Bench / HumanEval, best of two runs an
# arm; accept length 3.96 / 4.82) against 8x5:27+g5's 1.90x / 2.02x (3.54 / 3.95) and g10's
# 2.01x / 2.35x (g24: 1.92x, 8x5:32+g31: 1.65x on MT-Bench), 1.90x against 1.67x at batch 4
# (MT-Bench), and sampled (T = 0.7, batch 1) 1.47x against 1.50x (the branch rarely matches a
# draw); its round costs 1.10x g5's on random weights with a 512-token context (1.351 against
# 1.224 ms), where no branch is ever accepted. benchmarks/NOTES.md, stop 48. Before that
# (stop 47): 8x5:27+g5 -- the
# 8x5:32 tree's 33 verify rows with 5 of them spent on an n-gram branch -- ran 1.85x / 1.97x
# plain decoding at batch 1 (MT-Bench / HumanEval, best of two runs an arm) against 8x5:32's
# 1.74x / 1.84x in the same runs (accept length 3.53 / 3.91 against 3.39 / 3.64; 1.88x /
# 2.08x once RoPE went into the qkv product's epilogue, gemv.DOT_ROPE), 2.08x against 1.98x
# at batch 4 (MT-Bench), and sampled (T = 0.7, batch 1) 1.41x / 1.50x against
# 1.37x / 1.48x; its round costs 1.03x an 8x5:32 one (1.246 against 1.214 ms, random weights,
# batch 1). Earlier: 8x5:32 beat 4x5:16 (1.68x / 1.86x against 1.67x / 1.71x) and the chain
# (1.22x / 1.28x); 12x5:63 costs 1.18x an 8x5:32 round for +7-9 % accept (not taken).
# benchmarks/NOTES.md, stops 45-47. At batch 8 (MT-Bench) the chain of 4, 2x5:10+g5 and
# 8x5:27+g5 ran within 4 % of each other (1.48x / 1.49x / 1.44x), so trees stay at <= 4.
AUTO_TREE = TreeShape(8, 5, 27, 16)
AUTO_TREE_MAX_BS = 4
# --speculative block with --speculative-tree auto on one GPU: a tree of the block's K rows,
# width 4, its 27 best nodes verified with a 16-draft n-gram branch beside them (4xK:27+g16;
# `auto_block_tree`). On an H100 (bf16, batch 1, 40 prompts, 256 tokens, best of two runs an
# arm) the shipped block head (K = 7) drafts 2.00x / 2.66x plain on MT-Bench / HumanEval with
# it (accept length 3.59 / 4.98), against 1.98x / 2.63x with 4x7:16+g16 and 1.69x / 2.20x
# with the branch alone (1x7:7+g16: 2.92 / 3.94); at batch 4 (MT-Bench) 1.78x against 1.65x,
# sampled (T = 0.7) 1.36x against 1.11x. Its round costs 1.15x the branch's (1.274 against
# 1.104 ms, random weights). benchmarks/NOTES.md, stop 49. Wider trees break even (stop 50,
# same setting): 8x7:27+g16 and 8x7:40+g16 accept 3.72 / 5.02 and 3.80 / 5.15 but run
# 3122 / 4049 and 3116 / 4058 tokens/s against 3101 / 4124 (their rounds 3-5 % dearer).
AUTO_BLOCK_TREE = (4, 27, 16)  # width, verified nodes, n-gram drafts
# A tree drafter's steps without a tree (above AUTO_TREE_MAX_BS requests, top-N, penalties)
# verify a chain of its first AUTO_TREE_CHAIN drafts (--num-draft-tokens overrides): the
# block's first 3 or the chain head's chain of 3. On an H100 (random weights of the default
# model's shape, bf16) such a round of the shipped block head costs 1.589 against 2.034 ms
# for the whole block of 7 at batch 32 (128 verify rows against 256), 1.356 against 1.560 at
# 16, 1.189 against 1.296 at 8, while the real model's drafts past the third were accepted
# in 0.25 of 2.44 tokens a round (HumanEval, batch 32): ~1.32x plain at batch 32 instead of
# 1.15x, 1.47x instead of 1.42x at 16, 2 % below the whole block at 8 (stop 50). The chain
# head's chain of 3 against 4 (stop 51): 1.581 against 1.867 ms a round at batch 32, 1.326
# against 1.500 at 16, the real model's 4th draft accepted in 0.11-0.13 of 2.12-2.26 tokens
# a round (batch 32, MT-Bench / HumanEval): ~1.22x / 1.29x plain at batch 32 instead of
# 1.09x / 1.16x, 1.38x / 1.46x instead of 1.29x / 1.37x at 16 (the chain of 2: within 1 %
# of 3 at 32, 1-3 % below it at 16). Estimates from rounds and acceptance, not yet run end
# to end on the real model.
AUTO_TREE_CHAIN = 3


def auto_block_tree(k: int) -> TreeShape:
    """AUTO_BLOCK_TREE over a block of k drafts: depth k, its nodes within the tree's."""
    w, n, g = AUTO_BLOCK_TREE
    return TreeShape(w, k, max(k, min(n, w + (k - 1) * w * w)), g)


def _block_drafts(args: argparse.Namespace) -> int | None:
    """The drafts of the block the block head of these flags drafts: --block-size - 1, else
    its head directory's block size - 1; None for a random head or none found (make_drafter
    then says why)."""
    if args.block_size:
        return args.block_size - 1
    from draftgraph.models.heads import head_config
    from draftgraph.spec import shipped_head

    try:
        path = args.draft_head or shipped_head("block", resolve_model(args))
        if path.startswith("random"):
            return None
        return int(head_config(path)["block_size"]) - 1
    except (ValueError, OSError, KeyError):
        return None


def _tree(args: argparse.Namespace) -> tuple[TreeShape | None, int]:
    """(tree, tree_max_bs) of --speculative-tree: a shape, "off", or "auto" (module note)."""
    t = args.speculative_tree or "off"
    if t == "off":
        return None, TREE_MAX_BS
    if t != "auto":
        return TreeShape.parse(t), TREE_MAX_BS
    on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if not on_gpu or getattr(args, "tensor_parallel_size", 1) != 1:
        return None, TREE_MAX_BS
    if args.speculative == "chain" and args.num_draft_tokens is None:
        return AUTO_TREE, AUTO_TREE_MAX_BS
    k = _block_drafts(args) if args.speculative == "block" else None
    if k:
        return auto_block_tree(k), AUTO_TREE_MAX_BS
    return None, TREE_MAX_BS


def spec_config_from_args(args: argparse.Namespace) -> SpecConfig:
    """The one mapping of the speculative flags to a SpecConfig; ValueError for a drafter's
    flag given without --speculative."""
    if args.speculative is None:
        given = [flag for flag, value in (("--num-draft-tokens", args.num_draft_tokens),
                                          ("--ngram-min", args.ngram_min),
                                          ("--ngram-max", args.ngram_max),
                                          ("--no-adaptive-draft", args.no_adaptive_draft or None))
                 if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for "
                             f"--speculative ({', '.join(SPEC_METHODS)}); without it decoding "
                             "is plain")
    tree, tree_max_bs = _tree(args)
    k = args.num_draft_tokens
    if k is None:  # a tree drafter's chain steps, else the chain (n-gram's, a draft model's)
        k = AUTO_TREE_CHAIN if tree is not None else SpecConfig.num_draft_tokens
    return SpecConfig(method=args.speculative, num_draft_tokens=k,
                      ngram_min=SpecConfig.ngram_min if args.ngram_min is None
                      else args.ngram_min,
                      ngram_max=SpecConfig.ngram_max if args.ngram_max is None
                      else args.ngram_max,
                      adaptive=not args.no_adaptive_draft, draft_model=args.draft_model,
                      draft_head=args.draft_head, block_size=args.block_size,
                      confidence_threshold=args.confidence_threshold, tree=tree,
                      tree_max_bs=tree_max_bs)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the flags; ValueError naming the flag to change."""
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    step_seconds = args.max_step_seconds
    if step_seconds is None:
        on_cpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu"
        step_seconds = SchedulerConfig.CPU_STEP_SECONDS if on_cpu else 0.0
    # NOTE: None is serve's default: on, as vLLM's, where it is measured to pay and to cost
    # nothing without hits: on the CPU a chat's next turn after a 1,024-token history gets its
    # first token in 0.15 s instead of 1.4-1.7 (~0.1 ms of host work a prompt with no hits);
    # on an H100 16 streams after a shared 2,048-token prompt run 42 % faster, and 64 streams
    # of random prompts serve 32.1k tokens/s with it against 31.5k / 32.2k without
    # (2026-12-08). Refused under tensor parallelism; and not asked for under --deterministic,
    # whose requests' tokens must not depend on what ran before them (a cached prefix was
    # computed in another request's chunks)
    caching = args.enable_prefix_caching
    if caching is None:
        caching = args.tensor_parallel_size == 1 and not args.deterministic
    return EngineConfig(
        model=resolve_model(args),
        device=args.device,
        dtype=args.dtype,
        use_graphs=not args.no_graphs,
        async_scheduling=not args.no_async_scheduling,
        overlap_prefill=args.overlap_prefill,
        decode_rides_prefill=args.decode_rides_prefill,
        prefill_coalesce_ms=args.prefill_coalesce_ms,
        prefill_graph_tokens=args.prefill_graph_tokens,
        attention_backend=args.attention_backend,
        exact_rows=args.exact_rows,
        tensor_core_rows=args.tensor_core_rows,
        deterministic=args.deterministic,
        quantization=args.quantization,
        row_pack=args.row_pack,
        seed=args.engine_seed,
        tensor_parallel_size=args.tensor_parallel_size,
        cache=CacheConfig(page_size=args.page_size, kv_cache_tokens=args.kv_cache_tokens,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_waiting=args.max_waiting,
                                  max_model_len=args.max_model_len,
                                  max_step_seconds=step_seconds),
        spec=spec_config_from_args(args),
    )


def apply_process_flags(args: argparse.Namespace) -> None:
    """Act on the flags that configure the process, before the model loads: torch's thread
    count (and a warning when other processes already keep the cores busy) and the weight
    cache switch (an environment variable, so tensor-parallel workers see it too)."""
    import torch

    torch.set_num_threads(args.threads)
    if args.no_weight_cache:
        os.environ[WEIGHT_CACHE_ENV] = "0"
    warn_if_oversubscribed(args.threads)


def warn_if_oversubscribed(threads: int) -> bool:
    """Log one warning when the 1-minute load average leaves fewer free cores than `threads`
    (decode then slows down many times over); True when it warned."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return False
    cores = physical_cores()
    if load + threads <= cores + 0.5:
        return False
    free = max(1, cores - round(load))
    logger.warning("the CPU is oversubscribed: load average %.1f on %d cores with --threads "
                   "%d; decoding may slow down many times over (try --threads %d)",
                   load, cores, threads, free)
    return True


def usage_error(args: argparse.Namespace, message: str):
    """Exit with status 2, printing the subcommand's usage and `message` (argparse style)."""
    parser = getattr(args, "_parser", None)
    if parser is not None:
        parser.error(message)
    raise SystemExit(f"error: {message}")
