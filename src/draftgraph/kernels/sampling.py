"""Sampling kernels: seeded uniforms, draws by exponential race, the top-k / top-p cut.

    uniform_noise(seeds [n], positions [n], stream, width) -> [n, width] fp32 in (0, 1)
    race_draw(weights [n, V], seeds [n], positions [n], stream) -> [n] int64
    cut_probs(probs [n, V], temperature, top_p, top_k, argmax) -> probs, cut in place
    draft_sample(logits [n, V'], temperature, seeds, positions, stream) -> tokens, q
    rejection_sample_triton(...): `spec.verify.rejection_sample` in three launches

Each dispatches like `argmax.argmax_lse`: the Triton kernels on CUDA, the torch twin
(`*_ref`) elsewhere.

Race draws: argmax_i w_i / E_i, E_i = -log(u_i), in two launches.

A token drawn this way has probability w_i / sum(w): the weights need no normalising. The
uniforms u_i are `uniform_noise`'s counter hash (seed, position, stream, column) in 32-bit
lanes: the same bits, so the draw is the twin's (`race_draw_ref`, torch) up to the last ulp
of log and division, in which two keys would have to tie.

Torch spends ~17 launches and [n, V] int64 temporaries on the hash alone; here stage 1
(grid (n, chunks), CHUNK columns each, as `argmax.py`'s) hashes, weighs and keeps each
chunk's best key and its first index, stage 2 (grid (n,)) the best chunk, first index on
ties (torch.argmax's rule). Both graph-capturable.
"""

from __future__ import annotations

import torch

from draftgraph.kernels._triton import cdiv, next_pow2, tl, triton, triton_usable

CHUNK = 1024
CHUNK_WARPS = 4
# NOTE: uniforms are at most the largest fp32 below 1: a hash within 128 of 2^32 rounds to
# 2^32 in fp32, so u would be 1 and -log(u) 0, and a weight-0 token's race key 0 / 0 = NaN
# would win the argmax (a token outside the top-k / top-p cut in about one draw of 700 over
# a 49k vocabulary); the kernels write the literal 0.99999994, which is this value in fp32
U_MAX = 1.0 - 2.0**-24


@triton.jit
def _mix32(x):
    """`_hash32` (lowbias32) on uint32 lanes: products wrap mod 2^32."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _uniform_at(seed, pos, cols, stream):
    """`uniform_noise`'s (0, 1) uniforms at (seed, position, stream, cols): seed and pos
    uint32 (scalars, or vectors shaped like cols), stream uint32 / int; fp32 result."""
    # the row's hash: _hash32(seed * 0x9E3779B1 + _hash32(position * 4 + stream)), low 32 bits
    rh = _mix32(seed * 0x9E3779B1 + _mix32(pos * 4 + stream))
    h = _mix32(rh ^ _mix32(cols.to(tl.uint32) + 0x632BE5AB))
    h = _mix32(h + rh)
    return tl.minimum((h.to(tl.float32) + 0.5) * (1.0 / 4294967296.0), 0.99999994)  # U_MAX


@triton.jit
def _uniforms(seeds, positions, row, cols, stream):
    """`uniform_noise`'s (0, 1) uniforms of one row at `cols` (uint32 hash, fp32 result)."""
    seed = tl.load(seeds + row).to(tl.uint32)
    pos = tl.load(positions + row).to(tl.uint32)
    return _uniform_at(seed, pos, cols, stream)


@triton.jit
def _max_first(key, idx, none):
    """(max of key [N], the smallest idx holding it): the first index on ties, torch.argmax's
    rule. Lanes to skip carry a key below every real one, or idx = none."""
    best = tl.max(key, axis=0)
    return best, tl.min(tl.where(key == best, idx, none), axis=0)


@triton.jit
def _uniform_kernel(seeds, positions, out, width, stream, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    u = _uniforms(seeds, positions, row, cols, stream)
    tl.store(out + row * width + cols, u, mask=cols < width)


@triton.jit
def _race_chunk_kernel(
    w, seeds, positions, part_key, part_idx, vocab, stride_row, num_chunks, stream,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < vocab
    x = tl.load(w + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = _uniforms(seeds, positions, row, cols, stream)
    key = tl.where(mask, x / -tl.log(u), -1.0)  # weights >= 0: a masked column never wins
    best, first = _max_first(key, cols, vocab)
    out = row * num_chunks + chunk
    tl.store(part_key + out, best)
    tl.store(part_idx + out, first)


@triton.jit
def _race_combine_kernel(part_key, part_idx, tokens, vocab, num_chunks,
                         BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    cmask = c < num_chunks
    key = tl.load(part_key + row * num_chunks + c, mask=cmask, other=-2.0)
    idx = tl.load(part_idx + row * num_chunks + c, mask=cmask, other=vocab)
    _, first = _max_first(key, idx, vocab)
    tl.store(tokens + row, first.to(tl.int64))


def race_draw_triton(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                     stream: int, chunk: int = CHUNK) -> torch.Tensor:
    """`race_draw_ref`'s draw. weights [n, V] >= 0 (fp32 / bf16 / fp16, read in fp32)."""
    assert weights.dim() == 2, "race_draw takes [n, vocab] rows"
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    n, vocab = weights.shape
    tokens = torch.empty(n, dtype=torch.int64, device=weights.device)
    if n == 0:
        return tokens
    num_chunks = cdiv(vocab, chunk)
    part_key = torch.empty(n, num_chunks, dtype=torch.float32, device=weights.device)
    part_idx = torch.empty(n, num_chunks, dtype=torch.int32, device=weights.device)
    _race_chunk_kernel[(n, num_chunks)](
        weights, seeds.contiguous(), positions.contiguous(), part_key, part_idx, vocab,
        weights.stride(0), num_chunks, stream, CHUNK=chunk, num_warps=CHUNK_WARPS,
    )
    block_c = max(next_pow2(num_chunks), 2)
    _race_combine_kernel[(n,)](part_key, part_idx, tokens, vocab, num_chunks,
                               BLOCK_C=block_c, num_warps=1 if block_c <= 256 else 4)
    return tokens


# ---- a drafter's sampled step -----------------------------------------------------------------
#
# A sampled draft is a draw from q = softmax(l / T) over the drafter's vocabulary, and q goes
# on to rejection sampling. The draw is the exponential race in log space, argmax(l / T -
# log(-log u)) (the Gumbel-max form of argmax(q / E): no normaliser needed), so one pass over
# the logits gives both the draw and the softmax's partial sums: `_draft_chunk_kernel` (grid
# (n, chunks)) keeps each chunk's max, sum of exp and best key, `_draft_write_kernel` (the same
# grid) combines the row's partials, writes q and (chunk 0) the token. A temperature-0 row
# takes its argmax (q then at T = 1, unused: such rows accept by matching). Two launches where
# torch took ~8 over [n, V] and a reduced vocabulary's scatter into the target's.


@triton.jit
def _draft_chunk_kernel(logits, temperature, seeds, positions, part_f, part_idx, vocab,
                        stride_row, num_chunks, stream, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < vocab
    t = tl.load(temperature + row)
    x = tl.load(logits + row * stride_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
    x = x / tl.where(t > 0, t, 1.0)
    m = tl.max(x, axis=0)
    # (a chunk of -inf logits sums to 0, not exp(-inf + inf))
    s = tl.sum(tl.where(x > float("-inf"), tl.exp(x - m), 0.0), axis=0)
    u = _uniforms(seeds, positions, row, cols, stream)
    key = tl.where(mask, tl.where(t > 0, x - tl.log(-tl.log(u)), x), float("-inf"))
    best, first = _max_first(key, cols, vocab)
    out = (row * num_chunks + chunk) * 3
    tl.store(part_f + out, m)
    tl.store(part_f + out + 1, s)
    tl.store(part_f + out + 2, best)
    tl.store(part_idx + row * num_chunks + chunk, first)


@triton.jit
def _draft_write_kernel(logits, temperature, part_f, part_idx, probs, tokens, vocab, stride_row,
                        num_chunks, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    c = tl.arange(0, BLOCK_C)
    cm = c < num_chunks
    base = (row * num_chunks + c) * 3
    m_c = tl.load(part_f + base, mask=cm, other=float("-inf"))
    s_c = tl.load(part_f + base + 1, mask=cm, other=0.0)
    m = tl.max(m_c, axis=0)
    z = tl.sum(tl.where(cm, s_c * tl.exp(m_c - m), 0.0), axis=0)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < vocab
    t = tl.load(temperature + row)
    x = tl.load(logits + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    x = x / tl.where(t > 0, t, 1.0)
    tl.store(probs + row * vocab + cols, tl.exp(x - m) / z, mask=mask)
    if chunk == 0:
        key = tl.load(part_f + base + 2, mask=cm, other=float("-inf"))
        idx = tl.load(part_idx + row * num_chunks + c, mask=cm, other=vocab)
        _, first = _max_first(key, idx, vocab)
        tl.store(tokens + row, first.to(tl.int64))


def draft_sample_triton(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                        positions: torch.Tensor, stream: int,
                        chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`draft_sample_ref`'s (tokens, q) in two launches. logits [n, V] (unit column stride)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n, vocab = logits.shape
    dev = logits.device
    tokens = torch.empty(n, dtype=torch.int64, device=dev)
    probs = torch.empty(n, vocab, dtype=torch.float32, device=dev)
    if n == 0:
        return tokens, probs
    num_chunks = cdiv(vocab, chunk)
    part_f = torch.empty(n, num_chunks, 3, dtype=torch.float32, device=dev)
    part_idx = torch.empty(n, num_chunks, dtype=torch.int32, device=dev)
    temperature = temperature.contiguous()
    _draft_chunk_kernel[(n, num_chunks)](
        logits, temperature, seeds.contiguous(), positions.contiguous(), part_f, part_idx,
        vocab, logits.stride(0), num_chunks, stream, CHUNK=chunk, num_warps=CHUNK_WARPS)
    _draft_write_kernel[(n, num_chunks)](
        logits, temperature, part_f, part_idx, probs, tokens, vocab, logits.stride(0),
        num_chunks, CHUNK=chunk, BLOCK_C=max(next_pow2(num_chunks), 2),
        num_warps=CHUNK_WARPS)
    return tokens, probs


def draft_sample_ref(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                     positions: torch.Tensor, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter's sampled step over its vocabulary: logits [n, V] -> (tokens [n] int64,
    columns of V; q [n, V] fp32 = softmax(logits / T), T <= 0 read as 1). A row with T > 0
    draws argmax(l / T - log(-log u)), u = uniform_noise(seeds, positions, stream, V) (a draw
    from q); a row with T <= 0 takes its argmax.

    No top-k / top-p here: rejection sampling is exact for any draft distribution q (accept
    min(1, p / q), else draw from normalize(max(0, p - q))), so the request's cut applies
    where it decides, to the target's rows in the verify, and a draft step sorts nothing; a
    request that cuts accepts a little less often."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None]
    x = logits.float() / t
    u = uniform_noise_ref(seeds, positions, stream, logits.shape[-1])
    key = torch.where(temperature[:, None] > 0, x - torch.log(-torch.log(u)), x)
    return key.argmax(dim=-1), torch.softmax(x, dim=-1)


def draft_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                 positions: torch.Tensor, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels on CUDA, the twin elsewhere."""
    if logits.is_cuda and triton_usable(logits):
        return draft_sample_triton(logits, temperature, seeds, positions, stream)
    return draft_sample_ref(logits, temperature, seeds, positions, stream)


# ---- rejection sampling of one verify step --------------------------------------------------
#
# `spec.verify.rejection_sample` for drafts drawn from a distribution q, in three launches
# (its torch form is ~40 small ones): `_accept_kernel` (one program a request) decides the
# drafts, u < min(1, p(x) / q(x)) with u at the draft's position on the accept stream, or the
# argmax match for a temperature-0 request; `_final_chunk_kernel` (grid (bs, chunks)) races the
# final token's row, the residual max(0, p - q) after a rejection (q read only then) or the
# target's row for the bonus token, with the target's row keyed on the same uniforms as the
# residual's fallback; `_final_combine_kernel` picks each request's winner and writes the
# emitted run. Every step is `rejection_sample`'s twin op for op, so the tokens are its tokens
# up to the last ulp of log (as `race_draw`'s).


@triton.jit
def _accept_kernel(draft_tokens, num_draft, target_probs, draft_probs, draft_index, seeds,
                   positions, greedy, target_argmax, num_accepted, k, T, st_b, st_t, sd_b,
                   sd_t, stream_accept, BLOCK_K: tl.constexpr, HAS_INDEX: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_K)
    live = i < tl.load(num_draft + b)  # the request's active drafts (<= k)
    x = tl.load(draft_tokens + b * k + i, mask=i < k, other=0)
    p = tl.load(target_probs + b * st_b + i * st_t + x, mask=live, other=0.0)
    # q over the drafter's vocabulary: x's column there (a drawn draft always has one)
    xq = tl.load(draft_index + x, mask=live, other=0) if HAS_INDEX else x
    q = tl.load(draft_probs + b * sd_b + i * sd_t + xq, mask=live & (xq >= 0), other=0.0)
    # min(1, p / q); q = 0 cannot happen for a token drawn from q: accept iff p > 0
    ratio = tl.where(q > 0, p / tl.where(q > 0, q, 1.0), (p > 0).to(tl.float32))
    ratio = tl.minimum(tl.maximum(ratio, 0.0), 1.0)
    seed = tl.load(seeds + b).to(tl.uint32)
    pos = (tl.load(positions + b) + i).to(tl.uint32)
    u = _uniform_at(seed, pos, i * 0, stream_accept)
    match = x == tl.load(target_argmax + b * T + i, mask=live, other=-1)
    ok = tl.where(tl.load(greedy + b) != 0, match, u < ratio) & live
    # the leading run of accepted drafts
    tl.store(num_accepted + b, tl.min(tl.where(ok, k, i), axis=0))


@triton.jit
def _final_chunk_kernel(target_probs, draft_probs, draft_index, num_draft, num_accepted,
                        greedy, seeds, positions, part_key, part_idx, vocab, k, st_b, st_t,
                        sd_b, sd_t, num_chunks, stream_sample, stream_residual,
                        CHUNK: tl.constexpr, HAS_INDEX: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    na = tl.load(num_accepted + b)
    # the request's flags as [CHUNK] blocks (a block & a scalar bool trips Triton 3.9's
    # interpreter: "mask has unsupported dtype")
    zero = tl.zeros([CHUNK], dtype=tl.int32)
    rejected = (zero + na) < tl.load(num_draft + b)
    read = (cols < vocab) & ((zero + tl.load(greedy + b)) == 0)  # greedy: reads nothing
    p = tl.load(target_probs + b * st_b + na * st_t + cols, mask=read, other=0.0)
    # after a rejection the residual max(0, p - q) of draft row na; else q = 0: the target's
    # row itself, the bonus token
    # (q over the drafter's vocabulary: a target token outside it has probability 0)
    qcols = tl.load(draft_index + cols, mask=read & rejected, other=-1) if HAS_INDEX else cols
    q = tl.load(draft_probs + b * sd_b + tl.minimum(na, k - 1) * sd_t + qcols,
                mask=read & rejected & (qcols >= 0), other=0.0)
    r = tl.maximum(p - q, 0.0)
    seed = tl.load(seeds + b).to(tl.uint32)
    pos = (tl.load(positions + b) + na).to(tl.uint32)
    e = -tl.log(_uniform_at(seed, pos, cols, tl.where(rejected, stream_residual,
                                                      stream_sample)))
    key_r = tl.where(cols < vocab, r / e, -1.0)  # weights >= 0: a masked column never wins
    key_p = tl.where(cols < vocab, p / e, -1.0)  # the residual's fallback when it is all 0
    best_r, first_r = _max_first(key_r, cols, vocab)
    best_p, first_p = _max_first(key_p, cols, vocab)
    out = (b * num_chunks + chunk) * 3
    tl.store(part_key + out, best_r)
    tl.store(part_key + out + 1, best_p)
    tl.store(part_key + out + 2, tl.max(r, axis=0))
    tl.store(part_idx + out, first_r)
    tl.store(part_idx + out + 1, first_p)


@triton.jit
def _final_combine_kernel(part_key, part_idx, draft_tokens, num_accepted, greedy,
                          target_argmax, out_tokens, accept_lens, vocab, k, T, num_chunks,
                          BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    cm = c < num_chunks
    base = (b * num_chunks + c) * 3
    key_r = tl.load(part_key + base, mask=cm, other=-2.0)
    key_p = tl.load(part_key + base + 1, mask=cm, other=-2.0)
    mass_r = tl.max(tl.load(part_key + base + 2, mask=cm, other=0.0), axis=0)
    _, tok_r = _max_first(key_r, tl.load(part_idx + base, mask=cm, other=vocab), vocab)
    _, tok_p = _max_first(key_p, tl.load(part_idx + base + 1, mask=cm, other=vocab), vocab)
    na = tl.load(num_accepted + b)
    final = tl.where(mass_r > 0, tok_r, tok_p).to(tl.int64)
    final = tl.where(tl.load(greedy + b) != 0, tl.load(target_argmax + b * T + na), final)
    j = tl.arange(0, BLOCK_T)
    drafts = tl.load(draft_tokens + b * k + j, mask=j < na, other=-1)
    run = tl.where(j == na, final, drafts)
    tl.store(out_tokens + b * T + j, run, mask=j < T)
    tl.store(accept_lens + b, (na + 1).to(tl.int64))


def rejection_sample_triton(draft_tokens: torch.Tensor, num_draft_tokens: torch.Tensor,
                            draft_probs: torch.Tensor, target_probs: torch.Tensor,
                            seeds: torch.Tensor, positions: torch.Tensor,
                            greedy_mask: torch.Tensor, target_argmax: torch.Tensor,
                            stream_accept: int, stream_sample: int, stream_residual: int,
                            draft_index: torch.Tensor | None = None,
                            chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`spec.verify.rejection_sample` for drafts with a distribution, in three launches.

    draft_tokens [bs, k] int64 (k >= 1); num_draft_tokens [bs] int64; target_probs [bs, k + 1,
    V] and draft_probs [bs, k, V'] fp32 with unit stride over the vocabulary, V' = V, or the
    drafter's own vocabulary with draft_index [V] int32 the column of each target token in it
    (-1: q = 0); seeds, positions [bs] int64; greedy_mask [bs] bool; target_argmax [bs, k + 1]
    int64; the three streams' numbers. Returns (output_tokens [bs, k + 1] int64, -1 past
    accept_lens; accept_lens [bs] int64)."""
    bs, k = draft_tokens.shape
    T = k + 1
    vocab = target_probs.shape[-1]
    assert k >= 1 and target_probs.shape[1] == T and draft_probs.shape[1] == k
    assert draft_index is not None or draft_probs.shape[-1] == vocab
    assert target_probs.stride(-1) == 1 and draft_probs.stride(-1) == 1
    dev = draft_tokens.device
    out_tokens = torch.empty(bs, T, dtype=torch.int64, device=dev)
    accept_lens = torch.empty(bs, dtype=torch.int64, device=dev)
    if bs == 0:
        return out_tokens, accept_lens
    draft_tokens = draft_tokens.contiguous()
    target_argmax = target_argmax.contiguous()
    seeds, positions = seeds.contiguous(), positions.contiguous()
    greedy = greedy_mask.to(torch.int8)
    num_accepted = torch.empty(bs, dtype=torch.int32, device=dev)
    strides = (target_probs.stride(0), target_probs.stride(1), draft_probs.stride(0),
               draft_probs.stride(1))
    has_index = draft_index is not None
    index = draft_index if has_index else num_accepted  # a placeholder pointer, never read
    _accept_kernel[(bs,)](draft_tokens, num_draft_tokens, target_probs, draft_probs, index,
                          seeds, positions, greedy, target_argmax, num_accepted, k, T,
                          *strides, stream_accept, BLOCK_K=max(next_pow2(k), 2),
                          HAS_INDEX=has_index, num_warps=1)
    num_chunks = cdiv(vocab, chunk)
    part_key = torch.empty(bs, num_chunks, 3, dtype=torch.float32, device=dev)
    part_idx = torch.empty(bs, num_chunks, 3, dtype=torch.int32, device=dev)
    _final_chunk_kernel[(bs, num_chunks)](
        target_probs, draft_probs, index, num_draft_tokens, num_accepted, greedy, seeds,
        positions, part_key, part_idx, vocab, k, *strides, num_chunks, stream_sample,
        stream_residual, CHUNK=chunk, HAS_INDEX=has_index, num_warps=CHUNK_WARPS)
    block_c = max(next_pow2(num_chunks), 2)
    _final_combine_kernel[(bs,)](part_key, part_idx, draft_tokens, num_accepted, greedy,
                                 target_argmax, out_tokens, accept_lens, vocab, k, T,
                                 num_chunks, BLOCK_C=block_c, BLOCK_T=max(next_pow2(T), 2),
                                 num_warps=1 if block_c <= 256 else 4)
    return out_tokens, accept_lens


_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (lowbias32) on int64 lanes holding values in [0, 2^32)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    x = x ^ (x >> 16)
    return x


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, stream: int,
                  width: int) -> torch.Tensor:
    """[n, width] fp32 uniforms in (0, 1), a pure function of (seed, position, stream, column).

    seeds, positions: [n] int64. On CUDA one launch (`_uniform_kernel`, the same bits); else
    `uniform_noise_ref`.
    """
    if seeds.is_cuda and triton_usable(seeds):
        return uniform_noise_triton(seeds, positions, stream, width)
    return uniform_noise_ref(seeds, positions, stream, width)


def uniform_noise_triton(seeds: torch.Tensor, positions: torch.Tensor, stream: int,
                         width: int, block: int = 1024) -> torch.Tensor:
    n = seeds.shape[0]
    out = torch.empty(n, width, dtype=torch.float32, device=seeds.device)
    if n and width:
        block = min(block, max(next_pow2(width), 16))
        _uniform_kernel[(n, cdiv(width, block))](seeds.contiguous(), positions.contiguous(),
                                                 out, width, stream, BLOCK=block)
    return out


def uniform_noise_ref(seeds: torch.Tensor, positions: torch.Tensor, stream: int,
                      width: int) -> torch.Tensor:
    """`uniform_noise` in torch: the hash on int64 lanes."""
    col = torch.arange(width, device=seeds.device, dtype=torch.int64)
    row = _hash32(seeds * 0x9E3779B1 + _hash32(positions * 4 + stream))
    h = _hash32(row[:, None] ^ _hash32(col[None, :] + 0x632BE5AB))
    h = _hash32(h + row[:, None])
    return ((h.to(torch.float32) + 0.5) * (1.0 / 4294967296.0)).clamp_max(U_MAX)


def race_draw_ref(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  stream: int) -> torch.Tensor:
    """argmax(w / -log(u)) over weights w [n, V] >= 0, u = uniform_noise(seeds, positions,
    stream, V), first index on ties."""
    w = weights.float()
    u = uniform_noise_ref(seeds, positions, stream, w.shape[-1])
    return (w / -torch.log(u)).argmax(dim=-1)


# ---- the top-k / top-p cut ------------------------------------------------------------------
#
# A row's cut is a threshold t: every token with p >= t stays (renormalised), the rest go.
# t = max(t_p, t_k): t_p the largest t whose tokens p >= t hold at least top_p of the mass,
# t_k the largest t that at least top_k tokens reach, i.e. the smallest probability of the
# shortest sorted prefix reaching top_p / of the top_k (tokens tied with it stay too).
# The twin sorts each row; the kernels never sort. t is searched over the int32 bit patterns
# of fp32 probabilities in [0, 1] (ordered as the values are), in five launches:
#   1. (row, chunk) programs: each chunk's count and mass per bin of CUT_WIDTH binades
#      (bin j: 2^-(W (j + 1) - 1) <= p < 2^-(W j - 1)), everything below in the last bin;
#   2. a program a row: the bin holding t (the mass and count at or above each bin's lower
#      edge, summed over the chunks in a fixed order);
#   3. (row, chunk) programs: the tokens of that bin, compacted into a scratch row (each
#      chunk's offset is the count of the chunks before it: no atomics);
#   4. a program a row: t inside the bin, FAN candidates a pass over the few tokens left,
#      each pass compacting those still inside the interval (the mass and count above it
#      carried as numbers); the kept mass;
#   5. (row, chunk) programs: the cut written, renormalised.
# Deterministic: no atomics, every sum in a fixed order. A row that cuts nothing (top_p >= 1,
# top_k off or >= V) is read by none of them: its softmax stays as it is, and a
# temperature-0 row becomes a point mass on its argmax.

# the per-row search's fan and block (launch 4), and every launch's warps: 512-wide blocks
# and 4 warps cut the whole cut 36.0 -> 28.9 us at one row of 49k, 80.3 -> 63.0 at 64 rows
# (H200, one call, `results/sampling/sampling_stop38_h200.json`)
CUT_FAN, CUT_BLOCK, CUT_WARPS = 8, 512, 4
# the chunk launches: 8 bins of 4 binades (the last bin: below 2^-28) beat 64 bins of one at
# every row count swept on the H200 (`cut_bins_h200.json`: 80 against 183 us at 64 rows of
# 49k); a threshold below 2^-28 (top_p above ~0.9995, a top_k deep in a peaked row) searches
# the whole last bin
CUT_CHUNK, CUT_BINS, CUT_WIDTH, CUT_SUB = 1024, 8, 4, 128


def cut_passes(fan: int) -> int:
    """Passes of a FAN-way search that pin a pattern below 2^30 (fan a power of two)."""
    return -(-30 // (fan.bit_length() - 1))


@triton.jit
def _cut_flags(temperature, top_p, top_k, row, vocab):
    """(cuts, top_p, top_k, cut_p, cut_k) of a row: cuts when sampled and top_p < 1 or
    0 < top_k < V."""
    tp = tl.load(top_p + row)
    tk = tl.load(top_k + row)
    cut_p = (tp < 1.0).to(tl.int32)
    cut_k = ((tk > 0) & (tk < vocab)).to(tl.int32)
    cuts = (tl.load(temperature + row) > 0) & (cut_p + cut_k > 0)
    return cuts, tp, tk, cut_p, cut_k


@triton.jit
def _cut_bin(x, NB: tl.constexpr, W: tl.constexpr):
    """A probability's bin of W binades: j for 2^-(W (j + 1) - 1) <= x < 2^-(W j - 1)
    (bin 0 up to x = 1), NB - 1 for everything below."""
    e = x.to(tl.int32, bitcast=True) >> 23
    return tl.minimum(tl.maximum(127 - e, 0) // W, NB - 1)


@triton.jit
def _cut_hist(probs, hist_m, hist_c, row, chunk, vocab, stride_row, num_chunks,
              CHUNK: tl.constexpr, NB: tl.constexpr, W: tl.constexpr, SUB: tl.constexpr):
    """Phase 1 for one chunk of a cutting row: its count and mass per bin."""
    bins = tl.arange(0, NB)
    acc_m = tl.zeros([SUB, NB], dtype=tl.float32)
    acc_c = tl.zeros([SUB, NB], dtype=tl.int32)
    for start in range(0, CHUNK, SUB):
        cols = chunk * CHUNK + start + tl.arange(0, SUB)
        x = tl.load(probs + row * stride_row + cols, mask=cols < vocab, other=-1.0)
        hit = (_cut_bin(x, NB, W)[:, None] == bins[None, :]) & (x >= 0)[:, None]
        acc_m += tl.where(hit, x[:, None], 0.0)
        acc_c += hit.to(tl.int32)
    out = (row * num_chunks + chunk) * NB + bins
    tl.store(hist_m + out, tl.sum(acc_m, axis=0))
    tl.store(hist_c + out, tl.sum(acc_c, axis=0))


@triton.jit
def _cut_pick(hist_m, hist_c, state_i, state_f, row, tp, tk, cut_p, cut_k, num_chunks,
              NB: tl.constexpr, W: tl.constexpr, BLOCK_C: tl.constexpr):
    """Phase 2: the bin holding the row's threshold, its pattern interval and the mass and
    count above it."""
    c = tl.arange(0, BLOCK_C)
    bins = tl.arange(0, NB)
    at = (row * num_chunks + c[:, None]) * NB + bins[None, :]
    cm = (c < num_chunks)[:, None]
    per_m = tl.sum(tl.load(hist_m + at, mask=cm, other=0.0), axis=0)  # [NB]
    per_c = tl.sum(tl.load(hist_c + at, mask=cm, other=0), axis=0)
    mass = tl.cumsum(per_m, axis=0)  # at or above bin j's lower edge
    count = tl.cumsum(per_c, axis=0)
    holds = ((mass >= tp).to(tl.int32) * cut_p + (count >= tk).to(tl.int32) * cut_k) > 0
    # the first bin (largest edge) that holds; the last bin's edge, 0, holds by rule
    j = tl.min(tl.where(holds | (bins == NB - 1), bins, NB), axis=0)
    above_m = tl.sum(tl.where(bins == j - 1, mass, 0.0), axis=0)  # 0 for j = 0
    above_c = tl.sum(tl.where(bins == j - 1, count, 0), axis=0)
    lo = tl.where(j == NB - 1, 0, (128 - W * (j + 1)) << 23)
    hi = tl.where(j == 0, 0x3F800001, (128 - W * j) << 23)
    tl.store(state_i + row * 4, j)
    tl.store(state_i + row * 4 + 1, lo)
    tl.store(state_i + row * 4 + 2, hi - lo)
    tl.store(state_i + row * 4 + 3, above_c)
    tl.store(state_f + row * 4, above_m)


@triton.jit
def _cut_gather(probs, hist_c, state_i, scratch, row, chunk, vocab, stride_row, num_chunks,
                CHUNK: tl.constexpr, NB: tl.constexpr, W: tl.constexpr,
                BLOCK_C: tl.constexpr):
    """Phase 3 for one chunk: its tokens of the bin, at its offset in the scratch row."""
    j = tl.load(state_i + row * 4)
    c = tl.arange(0, BLOCK_C)
    before = tl.load(hist_c + (row * num_chunks + c) * NB + j, mask=c < chunk, other=0)
    offset = tl.sum(before, axis=0)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(probs + row * stride_row + cols, mask=cols < vocab, other=-1.0)
    inside = (x >= 0) & (_cut_bin(x, NB, W) == j)
    at = offset + tl.cumsum(inside.to(tl.int32), axis=0) - 1
    tl.store(scratch + row * vocab + at, x, mask=inside)


@triton.jit
def _cut_search(hist_c, state_i, state_f, scratch, row, tp, tk, cut_p, cut_k, vocab,
                num_chunks, FAN: tl.constexpr, PASSES: tl.constexpr, BLOCK: tl.constexpr,
                NB: tl.constexpr, BLOCK_C: tl.constexpr):
    """Phase 4: the threshold inside the bin's interval, and the kept mass."""
    j0 = tl.load(state_i + row * 4)
    lo = tl.load(state_i + row * 4 + 1)  # a threshold's pattern that holds
    span = tl.load(state_i + row * 4 + 2)  # lo + span: a pattern that does not
    above_c = tl.load(state_i + row * 4 + 3)  # the tokens at or above lo + span
    above_m = tl.load(state_f + row * 4)
    c = tl.arange(0, BLOCK_C)
    m = tl.sum(tl.load(hist_c + (row * num_chunks + c) * NB + j0, mask=c < num_chunks,
                       other=0), axis=0)  # the tokens inside [lo, lo + span)
    buf = scratch + row * vocab
    j = tl.arange(0, FAN)
    offs = tl.arange(0, BLOCK)
    for _ in range(PASSES):
        step = (span + FAN - 1) // FAN
        cand = lo + (j + 1) * step  # [FAN] int32 patterns
        valid = cand < lo + span
        cand_f = tl.where(valid, cand, 0x3F800001).to(tl.float32, bitcast=True)
        # per-lane partial sums, reduced once a pass
        acc_m = tl.zeros([BLOCK, FAN], dtype=tl.float32)
        acc_c = tl.zeros([BLOCK, FAN], dtype=tl.int32)
        for start in range(0, m, BLOCK):
            cols = start + offs
            x = tl.load(buf + cols, mask=cols < m, other=-1.0)
            ge = x[:, None] >= cand_f[None, :]  # [BLOCK, FAN]
            acc_m += tl.where(ge, x[:, None], 0.0)
            acc_c += ge.to(tl.int32)
        mass = above_m + tl.sum(acc_m, axis=0)
        count = above_c + tl.sum(acc_c, axis=0)
        holds = (mass >= tp).to(tl.int32) * cut_p + (count >= tk).to(tl.int32) * cut_k
        # the candidates that hold are a prefix (mass and count fall as t rises); the first
        # that fails bounds the new interval from above
        nk = tl.sum(tl.where(valid & (holds > 0), 1, 0), axis=0)
        stop = (j == nk) & valid
        found = tl.sum(stop.to(tl.int32), axis=0) > 0
        above_m = tl.where(found, tl.sum(tl.where(stop, mass, 0.0), axis=0), above_m)
        above_c = tl.where(found, tl.sum(tl.where(stop, count, 0), axis=0), above_c)
        lo = lo + nk * step
        span = step
        # keep only the tokens inside the new interval (order kept, in place: a token is
        # written at or before where it was read)
        kept_n = tl.full([], 0, tl.int32)
        for start in range(0, m, BLOCK):
            cols = start + offs
            x = tl.load(buf + cols, mask=cols < m, other=-1.0)
            xb = x.to(tl.int32, bitcast=True)
            inside = (cols < m) & (xb >= lo) & (xb - lo < span)
            at = kept_n + tl.cumsum(inside.to(tl.int32), axis=0) - 1
            tl.debug_barrier()  # every lane has read its block before any writes into it
            tl.store(buf + at, x, mask=inside)
            kept_n += tl.sum(inside.to(tl.int32), axis=0)
        tl.debug_barrier()  # the compacted tokens are written before the next pass reads
        m = kept_n
    thr = lo.to(tl.float32, bitcast=True)
    # the kept mass: the tokens above the last interval, and the m inside it, each thr
    tl.store(state_f + row * 4 + 1, thr)
    tl.store(state_f + row * 4 + 2, above_m + m.to(tl.float32) * thr)


@triton.jit
def _cut_write(probs, temperature, argmax, state_f, row, chunk, cuts, vocab, stride_row,
               CHUNK: tl.constexpr):
    """Phase 5 for one chunk: the cut written, renormalised (greedy: the point mass)."""
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    base = probs + row * stride_row
    if tl.load(temperature + row) <= 0:
        a = tl.load(argmax + row)
        tl.store(base + cols, tl.where(cols == a, 1.0, 0.0), mask=cols < vocab)
    elif cuts:
        thr = tl.load(state_f + row * 4 + 1)
        total = tl.load(state_f + row * 4 + 2)
        x = tl.load(base + cols, mask=cols < vocab, other=0.0)
        tl.store(base + cols, tl.where(x >= thr, x / total, 0.0), mask=cols < vocab)


# each phase one launch over (row, program) or row programs; program p of a row takes chunks
# p, p + P, ... (P programs a row: the grid shrinks as rows grow; the chunks, and so every
# sum, stay the same, so a row's cut does not depend on its batch)
@triton.jit
def _cut_hist_kernel(probs, temperature, top_p, top_k, hist_m, hist_c, vocab, stride_row,
                     num_chunks, CHUNK: tl.constexpr, NB: tl.constexpr, W: tl.constexpr,
                     SUB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cuts, tp, tk, cut_p, cut_k = _cut_flags(temperature, top_p, top_k, row, vocab)
    if cuts:
        for chunk in range(tl.program_id(1), num_chunks, tl.num_programs(1)):
            _cut_hist(probs, hist_m, hist_c, row, chunk, vocab, stride_row, num_chunks,
                      CHUNK, NB, W, SUB)


@triton.jit
def _cut_pick_kernel(temperature, top_p, top_k, hist_m, hist_c, state_i, state_f, vocab,
                     num_chunks, NB: tl.constexpr, W: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cuts, tp, tk, cut_p, cut_k = _cut_flags(temperature, top_p, top_k, row, vocab)
    if cuts:
        _cut_pick(hist_m, hist_c, state_i, state_f, row, tp, tk, cut_p, cut_k, num_chunks,
                  NB, W, BLOCK_C)


@triton.jit
def _cut_gather_kernel(probs, temperature, top_p, top_k, hist_c, state_i, scratch, vocab,
                       stride_row, num_chunks, CHUNK: tl.constexpr, NB: tl.constexpr,
                       W: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cuts, tp, tk, cut_p, cut_k = _cut_flags(temperature, top_p, top_k, row, vocab)
    if cuts:
        for chunk in range(tl.program_id(1), num_chunks, tl.num_programs(1)):
            _cut_gather(probs, hist_c, state_i, scratch, row, chunk, vocab, stride_row,
                        num_chunks, CHUNK, NB, W, BLOCK_C)


@triton.jit
def _cut_search_kernel(temperature, top_p, top_k, hist_c, state_i, state_f, scratch, vocab,
                       num_chunks, FAN: tl.constexpr, PASSES: tl.constexpr,
                       BLOCK: tl.constexpr, NB: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cuts, tp, tk, cut_p, cut_k = _cut_flags(temperature, top_p, top_k, row, vocab)
    if cuts:
        _cut_search(hist_c, state_i, state_f, scratch, row, tp, tk, cut_p, cut_k, vocab,
                    num_chunks, FAN, PASSES, BLOCK, NB, BLOCK_C)


@triton.jit
def _cut_write_kernel(probs, temperature, top_p, top_k, argmax, state_f, vocab, stride_row,
                      num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cuts, tp, tk, cut_p, cut_k = _cut_flags(temperature, top_p, top_k, row, vocab)
    for chunk in range(tl.program_id(1), num_chunks, tl.num_programs(1)):
        _cut_write(probs, temperature, argmax, state_f, row, chunk, cuts, vocab, stride_row,
                   CHUNK)


CUT_PROGRAMS = 512  # a chunk launch's programs over all rows (at least one a row)


def cut_probs_triton(probs: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                     top_k: torch.Tensor, argmax: torch.Tensor, block: int = CUT_BLOCK,
                     fan: int = CUT_FAN, num_warps: int = CUT_WARPS, chunk: int = CUT_CHUNK,
                     bins: int = CUT_BINS, width: int = CUT_WIDTH) -> torch.Tensor:
    """`cut_probs_ref` in place on probs [n, V] fp32 (contiguous rows), in five launches."""
    assert probs.dtype == torch.float32 and probs.stride(-1) == 1
    n, vocab = probs.shape
    if n == 0:
        return probs
    dev = probs.device
    num_chunks = cdiv(vocab, chunk)
    block_c = max(next_pow2(num_chunks), 2)
    flags = (temperature.contiguous(), top_p.contiguous(), top_k.contiguous())
    argmax = argmax.contiguous()
    # graphs: all from their pool; scratch: the bin's tokens, compacted row by row
    hist_m = torch.empty(n, num_chunks, bins, dtype=torch.float32, device=dev)
    hist_c = torch.empty(n, num_chunks, bins, dtype=torch.int32, device=dev)
    state_i = torch.empty(n, 4, dtype=torch.int32, device=dev)
    state_f = torch.empty(n, 4, dtype=torch.float32, device=dev)
    scratch = torch.empty(n, vocab, dtype=torch.float32, device=dev)
    sub, passes = min(CUT_SUB, chunk), cut_passes(fan)
    grid = (n, max(1, min(num_chunks, CUT_PROGRAMS // n)))
    _cut_hist_kernel[grid](probs, *flags, hist_m, hist_c, vocab, probs.stride(0), num_chunks,
                           CHUNK=chunk, NB=bins, W=width, SUB=sub, num_warps=num_warps)
    _cut_pick_kernel[(n,)](*flags, hist_m, hist_c, state_i, state_f, vocab, num_chunks,
                           NB=bins, W=width, BLOCK_C=block_c, num_warps=num_warps)
    _cut_gather_kernel[grid](probs, *flags, hist_c, state_i, scratch, vocab, probs.stride(0),
                             num_chunks, CHUNK=chunk, NB=bins, W=width, BLOCK_C=block_c,
                             num_warps=num_warps)
    _cut_search_kernel[(n,)](*flags, hist_c, state_i, state_f, scratch, vocab, num_chunks,
                             FAN=fan, PASSES=passes, BLOCK=block, NB=bins, BLOCK_C=block_c,
                             num_warps=num_warps)
    _cut_write_kernel[grid](probs, *flags, argmax, state_f, vocab, probs.stride(0),
                            num_chunks, CHUNK=chunk, num_warps=num_warps)
    return probs


def _cutting(top_p: torch.Tensor, top_k: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n] bool: the rows whose settings cut anything (top_p < 1, or 0 < top_k < V)."""
    return (top_p < 1.0) | ((top_k > 0) & (top_k < vocab))


def _points(probs: torch.Tensor, temperature: torch.Tensor, argmax: torch.Tensor,
            rows: torch.Tensor) -> torch.Tensor:
    """rows, with the temperature-0 rows a point mass on their argmax."""
    point = torch.arange(probs.shape[1], device=probs.device)[None, :] == argmax[:, None]
    return torch.where((temperature <= 0)[:, None], point.to(rows.dtype), rows)


def cut_probs_ref(probs: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  top_k: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """The cut by sorting: probs [n, V] fp32 (each row a softmax at its temperature) ->
    renormalised to the tokens at or above the row's threshold (a row that cuts nothing
    as it is, like the kernel's); temperature [n] fp32 (<= 0: a point mass on argmax [n]
    int64); top_p [n] fp32; top_k [n] int64 (<= 0: off). New tensor; graph-safe."""
    n, vocab = probs.shape
    sorted_p = probs.sort(dim=-1, descending=True).values
    # the prefix up to the first position whose running mass reaches top_p
    kept = (sorted_p.cumsum(dim=-1) < top_p[:, None]).sum(dim=-1) + 1  # [n] int64
    # top_p 1 keeps everything: fp32's running mass can reach 1.0 before the tail's tokens
    kept = torch.where(top_p >= 1.0, vocab, kept)
    k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k)
    kept = torch.minimum(kept, k).clamp(1, vocab)
    threshold = sorted_p.gather(1, (kept - 1)[:, None])  # [n, 1]
    cut = torch.where(probs >= threshold, probs, 0.0)
    cut = cut / cut.sum(dim=-1, keepdim=True)
    cut = torch.where(_cutting(top_p, top_k, vocab)[:, None], cut, probs)
    return _points(probs, temperature, argmax, cut)


def cut_probs(probs: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
              top_k: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """The kernel on CUDA (in place: rows that cut nothing are not touched), the twin
    elsewhere (a new tensor). Returns the cut rows. On the CPU, where steps run eagerly, a
    batch in which no row cuts skips the twin's sort (7 % of a sampled chain-head step of
    the default model): the same rows, since the twin leaves such rows as they are."""
    if probs.is_cuda and triton_usable(probs):
        return cut_probs_triton(probs, temperature, top_p, top_k, argmax)
    if not probs.is_cuda and not bool(_cutting(top_p, top_k, probs.shape[1]).any()):
        return _points(probs, temperature, argmax, probs)
    return cut_probs_ref(probs, temperature, top_p, top_k, argmax)


def race_draw(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
              stream: int) -> torch.Tensor:
    """The kernels on CUDA, the twin elsewhere (like `argmax.argmax_lse`)."""
    if weights.is_cuda and triton_usable(weights):
        return race_draw_triton(weights, seeds, positions, stream)
    return race_draw_ref(weights, seeds, positions, stream)
