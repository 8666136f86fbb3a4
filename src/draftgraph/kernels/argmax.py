"""Row argmax and logsumexp of the logits in one pass: the tail of every decode step.

    argmax_lse(logits [n, V]) -> (argmax [n] int64, lse [n] fp32)
    argmax_lse(logits, out=tokens, top_logprob=lp)   also: into given buffers, and the
                                                     argmax's logprob (greedy decode's tail)
    row_argmax(logits [..., V]) -> [...] int64       the argmax alone (drafters' greedy draws)
    greedy_emit_triton(argmax, logits, lse, drafts, num_drafts, out_tokens, out_logprobs)
        a greedy verify's tail after them, in one launch (its twin: spec.verify.emit's torch
        path): the longest prefix of active drafts equal to the argmax, then the argmax after
        it, -1 past; each emitted token's logprob; accept lengths

The argmax is the greedy token (ties go to the first index, like `torch.argmax`); with the lse
the logprob of any emitted token is `logits.gather(1, tok) - lse`, with no full log_softmax.
Twin: `argmax_lse_ref` (torch.argmax + torch.logsumexp in fp32). `argmax_lse` dispatches: the
Triton kernels on CUDA, the twin elsewhere; tests call `argmax_lse_triton` directly (real
launches on CUDA, the interpreter on CPU).

Two launches, both graph-capturable (grids from shapes only, scratch from torch.empty):
  stage 1, grid (n, num_chunks): per CHUNK-wide slice of a row, the max m_c, the first index
           of it i_c and s_c = sum(exp(x - m_c)), all in fp32;
  stage 2, grid (n,): M = max_c m_c, argmax = min(i_c : m_c == M),
           lse = M + log(sum_c s_c * exp(m_c - M)).

CHUNK = 1024 with 2 warps: 16 fp32 per thread, four 16-byte loads in flight each, and at batch
1 already 48 programs for a 49152 vocabulary (SmolLM2) and 126 for 128256 (Llama 3), about one
per SM of an H200 (132), so the whole row streams from every SM at once; a larger CHUNK would
leave most SMs idle at batch 1, a smaller one only adds programs and stage-2 work.

NOTE: a slice or row that is all -inf has m = -inf; it is combined with weight 0 (never
-inf - -inf = NaN), so an all -inf row gives lse = -inf and argmax 0, like torch. Masked tail
elements read -inf and are excluded from the first-index search, so they never win. A NaN
ranks as +inf: its index wins like torch.argmax's (only a row holding both +inf and a later
NaN differs) and the row's lse is NaN.
"""

from __future__ import annotations

import torch

from draftgraph.kernels._triton import (
    cdiv,
    next_pow2,
    pdl_kwargs,
    pdl_wait,
    tl,
    triton,
    triton_usable,
)
from draftgraph.kernels.gemv import EXACT_ROWS_MAX_M

CHUNK = 1024
CHUNK_WARPS = 2


@triton.jit
def chunk_max_sumexp(logits, row, cols, mask, stride_row):
    """A row's chunk `cols` read in fp32 (masked columns -inf; a NaN as +inf: it ranks above
    everything, as in torch.argmax / topk, and a row holding one gets lse NaN), its max m and
    sum(exp(x - m)) (an all -inf chunk: m = -inf, the sum over exp(x - 0) = 0)."""
    x = tl.load(logits + row * stride_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    return x, m, tl.sum(tl.exp(x - m_safe), axis=0)  # -inf and masked entries add 0


@triton.jit
def combined_lse(m, s):
    """The row's logsumexp from its chunks' maxima m and sums s (all -inf: -inf; a chunk
    of -inf weighs 0, never -inf - -inf)."""
    big = tl.max(m, axis=0)
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    return big, big_safe + tl.log(tl.sum(s * tl.exp(m - big_safe), axis=0))


@triton.jit
def _argmax_lse_chunk_kernel(
    logits, part_max, part_idx, part_sum, vocab, stride_row, num_chunks,
    CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < vocab
    # a NaN row must still give an index inside the vocabulary: the tokens index tables
    x, m, s = chunk_max_sumexp(logits, row, cols, mask, stride_row)
    # first index of the max among the real columns (an all -inf slice: its first column)
    first = tl.min(tl.where((x == m) & mask, cols, vocab), axis=0)
    out = row * num_chunks + chunk
    tl.store(part_max + out, m)
    tl.store(part_idx + out, first)
    tl.store(part_sum + out, s)


@triton.jit
def _argmax_lse_combine_kernel(
    part_max, part_idx, part_sum, argmax, lse, top_logprob, vocab, num_chunks,
    HAS_TOP_LP: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    cmask = c < num_chunks
    base = row * num_chunks
    m = tl.load(part_max + base + c, mask=cmask, other=float("-inf"))
    i = tl.load(part_idx + base + c, mask=cmask, other=0)
    s = tl.load(part_sum + base + c, mask=cmask, other=0.0)
    big_m, row_lse = combined_lse(m, s)
    # the smallest index among the chunks holding the global max: torch's first index
    first = tl.min(tl.where((m == big_m) & cmask, i, vocab), axis=0)
    tl.store(argmax + row, first.to(tl.int64))
    tl.store(lse + row, row_lse)
    if HAS_TOP_LP:  # the argmax's log_softmax: its logit is the row max
        tl.store(top_logprob + row, big_m - row_lse)


def chunk_partials(logits: torch.Tensor, chunk: int = CHUNK,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1 (one launch): per (row, chunk) of logits [n, V] (unit column stride) its max,
    the first index of it and its sum of exp(x - max), [n, num_chunks] each (inside a
    capture from the graph's pool); a combine stage reads them."""
    n, vocab = logits.shape
    num_chunks = cdiv(vocab, chunk)
    part_max = torch.empty(n, num_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(n, num_chunks, dtype=torch.int32, device=logits.device)
    part_sum = torch.empty(n, num_chunks, dtype=torch.float32, device=logits.device)
    _argmax_lse_chunk_kernel[(n, num_chunks)](
        logits, part_max, part_idx, part_sum, vocab, logits.stride(0), num_chunks,
        CHUNK=chunk, num_warps=CHUNK_WARPS, **pdl_kwargs(logits),
    )
    return part_max, part_idx, part_sum


def argmax_lse_triton(
    logits: torch.Tensor, chunk: int = CHUNK, *, out: torch.Tensor | None = None,
    top_logprob: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same semantics as `argmax_lse_ref`. logits [n, V] fp32 / fp16 / bf16 (read in fp32);
    `chunk` (a power of two) is the stage-1 slice width, smaller in tests."""
    assert logits.dim() == 2, "argmax_lse takes [n, vocab] logits"
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n, vocab = logits.shape
    argmax = out if out is not None else torch.empty(n, dtype=torch.int64,
                                                     device=logits.device)  # [n] int64
    assert argmax.dtype == torch.int64 and argmax.is_contiguous()
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)  # [n] fp32
    if top_logprob is not None:
        assert top_logprob.dtype == torch.float32 and top_logprob.is_contiguous()
    if n == 0:
        return argmax, lse
    part_max, part_idx, part_sum = chunk_partials(logits, chunk)
    num_chunks = part_max.shape[1]
    block_c = max(next_pow2(num_chunks), 2)
    _argmax_lse_combine_kernel[(n,)](
        part_max, part_idx, part_sum, argmax, lse,
        top_logprob if top_logprob is not None else lse, vocab, num_chunks,
        HAS_TOP_LP=top_logprob is not None, BLOCK_C=block_c,
        num_warps=1 if block_c <= 256 else 4, **pdl_kwargs(logits),
    )
    return argmax, lse


# Up to this many rows (verify rows of small batches, as exact rows bound them) the CPU twin takes
# the logsumexp of each row alone: ATen splits a lone long row's reduction across threads but
# reduces each row of a batch in one thread, so a verify row's lse would round differently
# from the decode row's at its position (seen on an AMD EPYC; 16 rows: 0.81 against 0.63 ms).
ROWS_ALONE = EXACT_ROWS_MAX_M


def argmax_lse_ref(logits: torch.Tensor, *, out: torch.Tensor | None = None,
                   top_logprob: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax [n] int64, first index on ties; logsumexp [n] fp32) of logits [n, V], in fp32.
    `out` receives the argmax, `top_logprob` [n] fp32 its log_softmax, when given."""
    x = logits.float()
    argmax = x.argmax(dim=-1)
    if x.is_cuda or not 1 < x.shape[0] <= ROWS_ALONE:
        lse = torch.logsumexp(x, dim=-1)
    else:  # a lone row's reduction splits over threads, a batch's not: rows one at a time
        lse = torch.cat([torch.logsumexp(x[i : i + 1], dim=-1) for i in range(x.shape[0])])
    if top_logprob is not None:
        top_logprob.copy_(x.gather(1, argmax[:, None])[:, 0] - lse)
    if out is not None:
        argmax = out.copy_(argmax)
    return argmax, lse


def argmax_lse(logits: torch.Tensor, *, out: torch.Tensor | None = None,
               top_logprob: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel only on CUDA (like `ops`): on CPU, even in the interpreter, the twin runs.
    Optional outputs written in place: `out` [n] int64 the argmax, `top_logprob` [n] fp32
    the argmax's log_softmax (its logit is the row max: no gather)."""
    if logits.is_cuda and triton_usable(logits):
        return argmax_lse_triton(logits, out=out, top_logprob=top_logprob)
    return argmax_lse_ref(logits, out=out, top_logprob=top_logprob)


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (first index on ties): on CUDA the kernels above, whose
    chunks spread one long row over the SMs (torch's reduction runs a lone row on few: 28 us
    for a 128,256-token row on an H200), elsewhere torch.argmax."""
    if logits.is_cuda and triton_usable(logits):
        flat = logits.reshape(-1, logits.shape[-1])
        return argmax_lse_triton(flat)[0].view(logits.shape[:-1])
    return logits.argmax(dim=-1)


@triton.jit
def _greedy_emit_kernel(argmax, logits, lse, drafts, num_drafts, out_tokens, out_logprobs,
                        accept_lens, stride_logits, stride_drafts, stride_tok, stride_lp,
                        K: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    T = K + 1
    j = tl.arange(0, BLOCK_T)
    jm = j < T
    am = tl.load(argmax + b * T + j, mask=jm, other=-1)
    d = tl.load(drafts + b * stride_drafts + j, mask=j < K, other=-2)
    # draft j rejected, or past the request's count: the first such is the accept point
    miss = (j < K) & ((d != am) | (j >= tl.load(num_drafts + b)))
    na = tl.min(tl.where(miss, j, K), axis=0)
    final = tl.sum(tl.where(j == na, am, 0), axis=0)
    tok = tl.where(j < na, d, tl.where(j == na, final, -1))
    tl.store(out_tokens + b * stride_tok + j, tok, mask=jm)
    row = b * T + j
    lp = tl.load(logits + row * stride_logits + tl.maximum(tok, 0), mask=jm, other=0.0)
    lp = lp - tl.load(lse + row, mask=jm, other=0.0)
    tl.store(out_logprobs + b * stride_lp + j, lp, mask=jm)
    tl.store(accept_lens + b, (na + 1).to(tl.int64))


def greedy_emit_triton(argmax: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor,
                       drafts: torch.Tensor, num_drafts: torch.Tensor, out_tokens: torch.Tensor,
                       out_logprobs: torch.Tensor) -> torch.Tensor:
    """A greedy verify's emitted run in one launch: argmax [bs * T] int64 (the target's token
    after each row, T = 1 + k), logits [bs * T, V] / lse [bs * T] fp32 (the raw
    distribution's, for the logprobs), drafts [bs, k], num_drafts [bs]; writes out_tokens
    [bs, T] (accepted drafts, the argmax after them, -1 past) and out_logprobs [bs, T] (each
    token's log-probability; past the run token 0's); returns accept_lens [bs] int64."""
    bs, k = drafts.shape
    assert logits.stride(1) == 1 and drafts.stride(1) == 1 and argmax.is_contiguous()
    assert out_tokens.stride(1) == 1 and out_logprobs.stride(1) == 1 and lse.is_contiguous()
    accept_lens = torch.empty(bs, dtype=torch.int64, device=drafts.device)
    if bs == 0:
        return accept_lens
    _greedy_emit_kernel[(bs,)](
        argmax, logits, lse, drafts, num_drafts, out_tokens, out_logprobs, accept_lens,
        logits.stride(0), drafts.stride(0), out_tokens.stride(0), out_logprobs.stride(0),
        K=k, BLOCK_T=max(2, next_pow2(k + 1)), num_warps=1, **pdl_kwargs(logits))
    return accept_lens
