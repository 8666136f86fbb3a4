"""Engine configuration: one dataclass per concern, validated when built.

Errors name the command-line flag to change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

MAX_SEED = 2**63 - 1  # --engine-seed's and a request's seed (engine/sampling.py) bound
MAX_COALESCE_MS = 1000.0  # --prefill-coalesce-ms: a hold past a second is a stall, not a batch
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass
class CacheConfig:
    page_size: int = 1
    kv_cache_tokens: int | None = None  # None: sized from free memory (GPU) or a CPU default
    gpu_memory_utilization: float = 0.85
    # requests' computed full blocks of KV kept for later prompts with the same beginning
    # (runtime/prefix_cache.py); off by default here (`serve` turns it on:
    # flags.engine_config_from_args): a prompt's logits then depend on what ran before it
    # (its cached KV came from another step's shapes), as with vLLM's
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        _need(self.page_size >= 1, f"--page-size must be >= 1, got {self.page_size}")
        _need(self.kv_cache_tokens is None or self.kv_cache_tokens >= 16,
              f"--kv-cache-tokens must be >= 16, got {self.kv_cache_tokens}")
        # NOTE: the pool holds kv_cache_tokens + a page (page 0 is the dummy), whole pages
        _need(self.kv_cache_tokens is None or self.kv_cache_tokens >= self.page_size,
              f"--kv-cache-tokens {self.kv_cache_tokens} is less than one page of "
              f"--page-size {self.page_size}: set --kv-cache-tokens >= {self.page_size} or a "
              "smaller --page-size")
        _need(0 < self.gpu_memory_utilization <= 1,
              f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass
class SchedulerConfig:
    # requests decoded together, and the token budget of one step (prefill chunks + decodes);
    # None: sized for the device (EngineConfig: GPU_DEFAULTS or CPU_DEFAULTS)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_waiting: int = 1024  # queued requests before new ones are refused
    max_model_len: int | None = None  # None: the model's context, capped at 8192
    # while requests decode, prefill chunks are cut so that a step takes about this long (by
    # the measured cost of the last steps): a running stream waits at most about this between
    # two tokens while a long prompt is admitted. 0: off, the token budget alone. Off by
    # default here, since chunk sizes then follow the machine's speed (a batch's numerics with
    # them); the CLI and server turn it on on a CPU (CPU_STEP_SECONDS)
    max_step_seconds: float = 0.0

    def __post_init__(self) -> None:
        _need(self.max_num_seqs is None or self.max_num_seqs >= 1,
              f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        _need(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 16,
              f"--max-num-batched-tokens must be >= 16, got {self.max_num_batched_tokens}")
        _need(self.max_model_len is None or self.max_model_len >= 2,
              f"--max-model-len must be >= 2, got {self.max_model_len}")
        _need(self.max_waiting >= 0, f"--max-waiting must be >= 0, got {self.max_waiting}")
        _need(self.max_step_seconds >= 0,
              f"--max-step-seconds must be >= 0, got {self.max_step_seconds}")

    # (max_num_seqs, max_num_batched_tokens) when not given: a GPU serves many requests and
    # takes prefills of thousands of tokens per step (as vLLM and SGLang default to); a CPU
    # keeps small batches and short chunks, so running streams wait less behind a long
    # prompt (2 cores, a 4096-token prompt: worst gap 2.2 s at 256 vs 3.7 s at 512, and
    # its TTFT 23.8 vs 24.7 s; 128: 1.3 s but 26.5 s)
    GPU_DEFAULTS = (256, 8192)
    CPU_DEFAULTS = (32, 256)
    # a step's time while streams decode on a CPU: issue 19's goal is an inter-token gap of at
    # most 0.5 s while a 4096-token prompt is admitted (bench_cpu.py `stall`). 0.4 left one
    # step in ~40 over it in 1 of 3 runs (0.52 s; 2-core Xeon), 0.35 none (worst 0.38-0.50 s)
    # for that prompt's first token 10-25 % later
    CPU_STEP_SECONDS = 0.35

    def resolve(self, gpu: bool) -> None:
        """Fill the fields left None with the device's defaults."""
        seqs, tokens = self.GPU_DEFAULTS if gpu else self.CPU_DEFAULTS
        if self.max_num_seqs is None:
            self.max_num_seqs = seqs
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = tokens


SPEC_METHODS = ("ngram", "chain", "draft", "block")
# the largest batch that drafts trees (their 1 + nodes rows a request are decode rows with
# lists of their own: buffers sized for it); larger batches draft chains
TREE_MAX_BS = 8
# verified nodes a tree may have (63: 64 verify rows a request, the GPU's tensor-core rows
# tile at batch 1; 1 + 2 x 63 reserved KV slots a request)
TREE_MAX_NODES = 63


@dataclass(frozen=True)
class TreeShape:
    """Width W (beam and children per node), depth D (steps: the deepest node), nodes N
    (verified drafts of the head's tree), ngram G (a prompt-lookup chain of up to G drafts
    from the root verified beside the tree: "WxD:N+gG"; 0: none)."""

    width: int
    depth: int
    nodes: int
    ngram: int = 0

    @classmethod
    def parse(cls, spec: str) -> TreeShape:
        m = re.fullmatch(r"(\d+)x(\d+):(\d+)(?:\+g(\d+))?", spec.strip())
        if not m:
            raise ValueError(f"--speculative-tree must look like WxD:N or WxD:N+gG (width x "
                             f"depth : verified nodes, + an n-gram branch of G drafts; e.g. "
                             f"4x5:16 or 8x5:27+g5), got {spec!r}")
        return cls(*(int(g) for g in m.groups() if g is not None))

    def __post_init__(self) -> None:
        w, d, n, g = self.width, self.depth, self.nodes, self.ngram
        if not 1 <= w <= 16 or d < 1 or not d <= n or n + g > TREE_MAX_NODES:
            raise ValueError(f"--speculative-tree {self}: need 1 <= width <= 16, depth >= 1, "
                             f"depth <= nodes and nodes + n-gram drafts <= {TREE_MAX_NODES}")
        if g < 0:
            raise ValueError(f"--speculative-tree {self}: the n-gram branch needs G >= 0")
        if n > self.total:
            raise ValueError(f"--speculative-tree {self}: a tree of width {w} and depth "
                             f"{d} has {self.total} nodes, fewer than {n}")

    def __str__(self) -> str:
        tail = f"+g{self.ngram}" if self.ngram else ""
        return f"{self.width}x{self.depth}:{self.nodes}{tail}"

    @property
    def verified(self) -> int:
        """Drafts a step verifies: the tree's nodes and the n-gram branch's."""
        return self.nodes + self.ngram

    @property
    def reach(self) -> int:
        """The deepest verified draft: the tree's depth, or the n-gram branch's length where
        it reaches past it (a step accepts up to this many drafts)."""
        return max(self.depth, self.ngram)

    def check_beams(self) -> None:
        """A chain head's beam rows, (depth - 1) x width over the steps after the first,
        write their KV into the verify rows' slots, so they must fit the verified drafts (a
        block's tree runs no beam rows)."""
        rows = (self.depth - 1) * self.width
        if rows > self.verified:
            raise ValueError(f"--speculative-tree {self}: its {rows} beam rows need (depth - 1) "
                             f"x width <= verified drafts ({self.verified}) for a chain head")

    @property
    def total(self) -> int:
        """Nodes grown: W at depth 1, W^2 at each deeper level."""
        return self.width + (self.depth - 1) * self.width ** 2


@dataclass
class SpecConfig:
    method: str | None = None  # None | "ngram" | "chain" | "draft" | "block" (--speculative)
    num_draft_tokens: int = 4  # k drafts per step (chain, n-gram); the block size - 1 (block)
    ngram_min: int = 1
    ngram_max: int = 4
    # shrink the draft length when acceptance is low (n-gram; a drafter with its own KV runs
    # all its draft steps every step anyway, so it keeps k: engine/speculation.py)
    adaptive: bool = True
    # chain / block: a head directory (--draft-head); chain without one: the shipped head of
    # the model (spec.SHIPPED_HEADS)
    draft_head: str | None = None
    draft_model: str | None = None  # draft: a model with the target's vocabulary (--draft-model)
    # block: the anchor + block_size - 1 masks (None: the head's own); drafts per step are
    # block_size - 1 (--block-size)
    block_size: int | None = None
    confidence_threshold: float | None = None  # block: None: the head's (--confidence-threshold)
    # chain: draft a tree (spec/tree.py) in steps of at most tree_max_bs requests
    # (--speculative-tree; the CLI's "auto" picks one on a GPU: flags.AUTO_TREE); block:
    # 1xK:K+gG, the block and an n-gram branch of G drafts beside it, or WxD:N+gG with W > 1,
    # a tree of the block's rows (spec/block.py)
    tree: TreeShape | None = None
    tree_max_bs: int = TREE_MAX_BS

    def __post_init__(self) -> None:
        _need(self.method is None or self.method in SPEC_METHODS,
              f"--speculative must be one of: {', '.join(SPEC_METHODS)} (got {self.method!r})")
        _need(1 <= self.num_draft_tokens <= 16,
              f"--num-draft-tokens must be in 1..16, got {self.num_draft_tokens}")
        _need(1 <= self.ngram_min <= self.ngram_max,
              f"need 1 <= --ngram-min <= --ngram-max, got {self.ngram_min}, {self.ngram_max}")
        _need(self.block_size is None or 2 <= self.block_size <= 17,
              f"--block-size must be in 2..17 (1..16 drafts), got {self.block_size}")
        _need(self.block_size is None and self.confidence_threshold is None
              or self.method == "block",
              "--block-size and --confidence-threshold are for --speculative block")
        _need(self.confidence_threshold is None or 0.0 <= self.confidence_threshold <= 1.0,
              f"--confidence-threshold must be in [0, 1], got {self.confidence_threshold}")
        if self.method == "draft":
            _need(self.draft_model is not None, "--speculative draft needs --draft-model")
        _need(self.draft_head is None or self.method in ("chain", "block"),
              "--draft-head is for --speculative chain or block")
        _need(self.tree is None or self.method in ("chain", "block"),
              "--speculative-tree is for --speculative chain (a tree of the head's drafts) "
              "or block (1xK:K+gG: the block of K drafts and an n-gram branch of G; or a "
              "tree of the block's rows)")
        if self.tree is not None and self.method == "chain":
            self.tree.check_beams()
        _need(1 <= self.tree_max_bs <= TREE_MAX_BS,
              f"trees are drafted in steps of 1 .. {TREE_MAX_BS} requests, got "
              f"{self.tree_max_bs}")
        _need(self.draft_model is None or self.method == "draft",
              "--draft-model is for --speculative draft")


@dataclass
class EngineConfig:
    model: str = "default"
    device: str | None = None  # None: cuda if available
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on GPU
    use_graphs: bool = True  # CUDA graphs on GPU; ignored on CPU
    # launch step N + 1 (decode or speculative) before reading step N's tokens (graphs)
    async_scheduling: bool = True
    # with async scheduling: prompts that arrive while every running request decodes get a
    # prefill-only forward queued behind the step in flight instead of stopping the launches
    # for a step mixing them with the decode rows, and join the next launch, which reads
    # their first tokens on the device (engine/first_tokens.py). Served SmolLM2 at 64
    # streams 33.3k -> 37.2k tok/s, TTFT p99 125 -> 66 ms (H100, benchmarks/NOTES.md stop 53)
    overlap_prefill: bool = True
    # with it, plain decode: the decode rows of the step after the one in flight ride in that
    # prefill (their last tokens read on the device from the step in flight's rows), so an
    # arrival costs the GPU one forward, not a prefill and a decode step (engine/engine.py
    # `_riders`)
    decode_rides_prefill: bool = True
    # with it: prompts that arrive while requests decode wait up to this many milliseconds
    # (from their arrival) for others to join their prefill behind the step in flight, unless
    # they already fill half the step's token budget; 0: prefilled at the next step. Served
    # SmolLM2 at 64 streams (H100, three runs of the same 512 prompts) ran 107 / 230 / 248
    # such steps at 4.4 / 4.0 / 3.6 ms each (~1.1 of it the decode rows riding) for 42.4k /
    # 33.0k / 38.8k tok/s: a step's cost hardly follows its prompts, so arrivals that trickle
    # in one or two a step pay it each time (benchmarks/NOTES.md stop 57). Off until timed.
    prefill_coalesce_ms: float = 0.0
    # captured prefill: extend steps (prefill chunks, mixed steps) of at most this many tokens
    # replay CUDA graphs of bucketed token counts instead of launching every kernel from the
    # host (GPU, with graphs, one rank); 0: every extend step eager. The GPU's default token
    # budget (SchedulerConfig.GPU_DEFAULTS): offline SmolLM2 at 64 streams ran its steps of
    # ~6k prompt tokens eagerly under 4096, 13.7 ms each against 7.6 replayed (36.1k -> 43.2k
    # tok/s, H100, benchmarks/NOTES.md stop 52)
    prefill_graph_tokens: int = 8192
    attention_backend: str | None = None  # None: triton on GPU, torch on CPU
    # "on": every verify row computed exactly as the decode row at its position (GPU: every
    # multi-row step of up to 16 rows through the fused single-row kernels; CPU: verify
    # attention, projections and logsumexp row by row), so bf16 speculation equals plain
    # decoding at batch 1, at a cost per step; "auto": on for models of at most 1 GiB of
    # weights; None: on with quantization "int4" (its verify rows drift from decode rows
    # otherwise: speculation would not equal int4 plain decoding), else off
    exact_rows: str | None = None
    # GPU: products of 2 .. 128 rows (verify rows, batched decode) on the Triton tensor-core
    # matmul, which overlaps its launch with the kernel before it and carries SwiGLU and the
    # next norm in its epilogues, instead of cuBLAS (kernels/gemv.py: DOT_ROWS); "auto": on
    # for models of at most 1 GiB of weights, where it was measured to win
    tensor_core_rows: str = "auto"
    # batch invariance: a request's tokens do not depend on its batch-mates, the batch size
    # or the step's shape (GPU: every projection through the batch-invariant matmul, decode
    # attention in fixed-length splits, decode rows never in a prefill step's forward;
    # CPU: exact rows). Verify rows are then decode rows at every batch size: bf16
    # speculation equals plain decoding. Costs time (benchmarks/NOTES.md), hence off.
    deterministic: bool = False
    # "int4": the projections and LM head read 4-bit weights (CPU only; models/quant.py), the
    # target's and a draft model's; approximate, so off ("none") by default
    quantization: str = "none"
    # CPU, fp32: projections of 2 .. 64 rows (verify rows, batched decode) through a blocked
    # copy of each weight (oneDNN; at 5 rows a SmolLM2 layer 1.24x and its LM head 1.49x
    # MKL's GEMM; models/row_pack.py), twice the weight memory; "auto": on for models of at
    # most 1 GiB of weights
    row_pack: str = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1  # ranks (processes, one GPU each) the model is split over
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        _need(self.device.split(":")[0] in ("cpu", "cuda"),
              f"--device must be cpu or cuda, got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda was given but no CUDA GPU is visible; use --device cpu")
        if self.dtype is None:
            self.dtype = "float32" if self.device == "cpu" else "bfloat16"
        _need(isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED,
              f"--engine-seed must be an integer in [0, {MAX_SEED}], got {self.seed!r}")
        self.scheduler.resolve(gpu=self.device.startswith("cuda"))
        _need(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, "
              f"got {self.dtype!r}")
        if self.exact_rows is None:
            self.exact_rows = "on" if self.quantization == "int4" else "off"
        _need(self.exact_rows in ("auto", "on", "off"),
              f"--exact-rows must be auto, on or off, got {self.exact_rows!r}")
        _need(self.tensor_core_rows in ("auto", "on", "off"),
              f"--tensor-core-rows must be auto, on or off, got {self.tensor_core_rows!r}")
        _need(self.row_pack in ("auto", "on", "off"),
              f"--row-pack must be auto, on or off, got {self.row_pack!r}")
        _need(self.row_pack != "on" or (self.device.startswith("cpu")
                                        and self.dtype == "float32"
                                        and self.quantization == "none"
                                        and self.tensor_parallel_size == 1),
              "--row-pack on is for fp32 weights on the CPU (--device cpu --dtype float32, "
              "no --quantization, one process)")
        _need(self.quantization in ("none", "int4"),
              f"--quantization must be none or int4, got {self.quantization!r}")
        _need(self.quantization == "none" or self.device == "cpu",
              "--quantization int4 is a CPU path (torch's CPU int4 matmul); on a GPU run "
              "--dtype bfloat16")
        _need(self.attention_backend in (None, "torch", "triton"),
              f"--attention-backend must be torch or triton, got {self.attention_backend!r}")
        _need(0 <= self.prefill_coalesce_ms <= MAX_COALESCE_MS,
              f"--prefill-coalesce-ms must be in [0, {MAX_COALESCE_MS}], got "
              f"{self.prefill_coalesce_ms}")
        _need(isinstance(self.prefill_graph_tokens, int) and self.prefill_graph_tokens >= 0,
              f"--prefill-graph-tokens must be an integer >= 0, got "
              f"{self.prefill_graph_tokens!r}")
        tp = self.tensor_parallel_size
        _need(isinstance(tp, int) and tp >= 1,
              f"--tensor-parallel-size must be an integer >= 1, got {tp!r}")
        _need(self.quantization == "none" or tp == 1,
              "--quantization int4 does not run under --tensor-parallel-size > 1")
        _need(not self.cache.enable_prefix_caching or tp == 1,
              "--enable-prefix-caching does not run under --tensor-parallel-size > 1 yet")
        if tp > 1 and self.device.startswith("cuda"):
            _need(self.device == "cuda", f"--tensor-parallel-size {tp} uses GPUs 0..{tp - 1}; "
                  f"pass --device cuda, not {self.device}")
            n = torch.cuda.device_count()
            _need(tp <= n, f"--tensor-parallel-size {tp} needs {tp} GPUs; {n} visible")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
