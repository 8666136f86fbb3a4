"""Speculative acceptance on the device: greedy chain acceptance and rejection sampling.

Layout of one verify step, per request: the target reads 1 + k tokens (the last accepted token,
then k draft tokens padded to the configured k) and returns logits `[bs, k + 1, vocab]`; row j
is the target's distribution for the token after input j. `num_draft_tokens [bs]` says how many
of the k drafts are active (0..k). Output token j of a request sits at sequence position
`positions + j`, where `positions` is the position of the first draft token; every random
number is drawn at the position of the token it decides.

Every function here is static-shape in (bs, k, vocab) and never reads a value back to the
host, so it can run inside the verify CUDA graph as well as on the CPU.
"""

from __future__ import annotations

import torch

from draftgraph.kernels._triton import triton_usable
from draftgraph.kernels.argmax import argmax_lse, greedy_emit_triton
from draftgraph.kernels.sampling import rejection_sample_triton
from draftgraph.runtime.controls import ControlTables, StepControls, apply_controls
from draftgraph.runtime.sampling import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    STREAM_SAMPLE,
    processed_probs,
    sample,
    sample_from_probs,
    uniform_noise,
)

__all__ = ["emit", "first_stop_index", "greedy_accept", "greedy_accept_from_argmax",
           "rejection_sample", "step_extras"]


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True per row. mask [bs, k] bool -> [bs] int64."""
    return ((~mask).to(torch.int64).cumsum(dim=1) == 0).sum(dim=1)


def _active(num_draft_tokens: torch.Tensor, k: int) -> torch.Tensor:
    """[bs, k] bool: draft slot i is active for the request."""
    slots = torch.arange(k, device=num_draft_tokens.device)
    return slots[None, :] < num_draft_tokens[:, None]


def _emit(draft_tokens: torch.Tensor, num_accepted: torch.Tensor,
          final_token: torch.Tensor) -> torch.Tensor:
    """The emitted run: accepted drafts, then the final token, then -1.

    draft_tokens [bs, k]; num_accepted, final_token [bs] int64 -> [bs, k + 1] int64.
    """
    bs, k = draft_tokens.shape
    slots = torch.arange(k + 1, device=draft_tokens.device)[None, :]
    padded = torch.cat([draft_tokens, draft_tokens.new_full((bs, 1), -1)], dim=1)
    out = torch.where(slots < num_accepted[:, None], padded, -1)
    return torch.where(slots == num_accepted[:, None], final_token[:, None], out)


def greedy_accept_from_argmax(draft_tokens: torch.Tensor, num_draft_tokens: torch.Tensor,
                              target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_accept given the target's argmax tokens [bs, k + 1] int64 (e.g. from
    `kernels.argmax.argmax_lse`, which the step graphs compute once for tokens and logprobs)."""
    k = draft_tokens.shape[1]
    match = (draft_tokens == target_argmax[:, :k]) & _active(num_draft_tokens, k)  # [bs, k]
    num_accepted = _leading_true(match)  # [bs] int64
    final_token = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)  # [bs] int64
    return _emit(draft_tokens, num_accepted, final_token), num_accepted + 1


def greedy_accept(draft_tokens: torch.Tensor, num_draft_tokens: torch.Tensor,
                  target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest prefix of active drafts equal to the target's argmax.

    draft_tokens [bs, k] int64; num_draft_tokens [bs] int64 in 0..k;
    target_logits [bs, k + 1, vocab] fp32.
    Returns output_tokens [bs, k + 1] int64 (the first accept_lens entries valid, the rest -1)
    and accept_lens [bs] int64 = accepted drafts + 1 (the target's token at the first mismatch,
    or the bonus token after the last active draft).
    """
    return greedy_accept_from_argmax(draft_tokens, num_draft_tokens,
                                     target_logits.argmax(dim=-1))


def _accept_probs(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                  target_probs: torch.Tensor) -> torch.Tensor:
    """[bs, k] fp32: min(1, p_target(x) / p_draft(x)) for each draft token x."""
    k = draft_tokens.shape[1]
    p_target = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(2)  # [bs, k]
    p_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2)  # [bs, k]
    # p_draft(x) = 0 cannot happen for a token drawn from the draft; accept iff p_target > 0
    ratio = p_target / torch.where(p_draft > 0, p_draft, 1.0)
    ratio = torch.where(p_draft > 0, ratio, (p_target > 0).to(ratio.dtype))
    return ratio.clamp(0.0, 1.0)


def _residual_weights(target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """max(0, p_target - p_draft) [n, vocab], unnormalised (a race draw needs no normalising:
    it draws in proportion to the weights); p_target where that is all zero.

    target_row, draft_row [n, vocab] fp32.
    """
    residual = (target_row - draft_row).clamp_min(0.0)
    return torch.where((residual > 0).any(dim=-1, keepdim=True), residual, target_row)


def _coupled_accept(draft_tokens: torch.Tensor, num_draft_tokens: torch.Tensor,
                    target_probs: torch.Tensor, seeds: torch.Tensor,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Point-mass drafts against plain sampling's own draws (see `rejection_sample`):
    (output_tokens [bs, k + 1], accept_lens [bs])."""
    bs, k = draft_tokens.shape
    T = k + 1
    at = positions[:, None] + torch.arange(T, device=positions.device)[None, :]  # [bs, T]
    drawn = sample_from_probs(target_probs.reshape(bs * T, -1), seeds.repeat_interleave(T),
                              at.reshape(-1), STREAM_SAMPLE).view(bs, T)
    return greedy_accept_from_argmax(draft_tokens, num_draft_tokens, drawn)


def rejection_sample(draft_tokens: torch.Tensor, num_draft_tokens: torch.Tensor,
                     draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     seeds: torch.Tensor, positions: torch.Tensor,
                     greedy_mask: torch.Tensor, target_argmax: torch.Tensor | None = None,
                     draft_index: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023), seeded and sync-free.

    draft_tokens [bs, k] int64; num_draft_tokens [bs] int64 in 0..k;
    draft_probs [bs, k, vocab] fp32, the distributions the drafts were drawn from, or None for a
    deterministic (point-mass) draft such as n-gram lookup;
    target_probs [bs, k + 1, vocab] fp32, already processed (temperature, top-k, top-p);
    seeds [bs] int64; positions [bs] int64, the position of the first draft token;
    greedy_mask [bs] bool, rows with temperature 0: these get exactly greedy_accept's result;
    target_argmax [bs, k + 1] int64, the target's argmax when the caller has it already;
    draft_index [V] int32: draft_probs is over the drafter's own (reduced) vocabulary, [bs, k,
    V'], and draft_index the column there of each target token (-1: probability 0).

    Point-mass drafts (draft_probs None) are coupled to plain sampling: at every position the
    token plain decoding would draw (`sample_from_probs` on STREAM_SAMPLE at that position) is
    drawn, draft i is accepted iff it equals that draw, and the first draw that differs (or
    the bonus draw) is emitted. P(accept x) = p_target(x) and a rejected position emits a
    draw conditioned on not being x, i.e. the residual normalize(max(0, p_target - onehot(x))):
    the rule of Leviathan et al. for a point mass, with the same acceptance, and the emitted
    tokens are the very tokens plain decoding draws with the same seed, whatever the drafts.
    Otherwise draft i is accepted with probability min(1, p_target(x) / p_draft(x)), the
    uniform drawn at position positions + i on STREAM_ACCEPT. At the first rejection the token
    is drawn from normalize(max(0, p_target - p_draft)) on STREAM_RESIDUAL; when all active
    drafts are accepted the bonus token is drawn from target_probs[:, num_draft_tokens] on
    STREAM_SAMPLE.
    Returns (output_tokens [bs, k + 1] int64, -1 past accept_lens; accept_lens [bs] int64).

    On CUDA, drafts with a distribution take `kernels.sampling.rejection_sample_triton`:
    these steps in three launches, the same tokens.
    """
    bs, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    device = draft_tokens.device
    slots = torch.arange(k, device=device)
    if target_argmax is None:
        target_argmax = target_probs.argmax(dim=-1)
    if (draft_probs is not None and k > 0 and draft_tokens.is_cuda
            and triton_usable(draft_tokens)):
        return rejection_sample_triton(
            draft_tokens, num_draft_tokens, draft_probs.contiguous(),
            target_probs.contiguous(), seeds, positions, greedy_mask, target_argmax,
            STREAM_ACCEPT, STREAM_SAMPLE, STREAM_RESIDUAL, draft_index)
    if draft_probs is not None and draft_index is not None:  # q onto the target's vocabulary
        q = draft_probs.index_select(-1, draft_index.clamp_min(0).to(torch.int64))
        draft_probs = torch.where(draft_index >= 0, q, 0.0)
    greedy_tokens, greedy_lens = greedy_accept_from_argmax(draft_tokens, num_draft_tokens,
                                                           target_argmax)
    if draft_probs is None:
        output_tokens, accept_lens = _coupled_accept(draft_tokens, num_draft_tokens,
                                                     target_probs, seeds, positions)
        output_tokens = torch.where(greedy_mask[:, None], greedy_tokens, output_tokens)
        return output_tokens, torch.where(greedy_mask, greedy_lens, accept_lens)

    # acceptance of each draft: u < min(1, p/q), u at the draft's own position
    draft_positions = positions[:, None] + slots[None, :]  # [bs, k] int64
    u = uniform_noise(seeds[:, None].expand(bs, k).reshape(-1), draft_positions.reshape(-1),
                      STREAM_ACCEPT, 1).view(bs, k)  # [bs, k] fp32
    accepted = (u < _accept_probs(draft_tokens, draft_probs, target_probs))
    accepted &= _active(num_draft_tokens, k)  # [bs, k] bool
    num_accepted = _leading_true(accepted)  # [bs] int64
    rejected = num_accepted < num_draft_tokens  # [bs] bool

    # the final token is drawn at slot num_accepted: from the residual if that draft was
    # rejected, else (all active drafts accepted) the bonus token from the target
    final_positions = positions + num_accepted  # [bs] int64
    gather_row = num_accepted[:, None, None].expand(bs, 1, vocab)
    target_row = target_probs.gather(1, gather_row).squeeze(1)  # [bs, vocab]
    row_in_draft = num_accepted.clamp_max(max(k - 1, 0))[:, None]  # [bs, 1]
    if k == 0:
        draft_row = torch.zeros_like(target_row)
    else:
        draft_row = draft_probs.gather(1, row_in_draft[..., None].expand(bs, 1, vocab))
        draft_row = draft_row.squeeze(1)  # [bs, vocab]
    residual_token = sample_from_probs(_residual_weights(target_row, draft_row), seeds,
                                       final_positions, STREAM_RESIDUAL)  # [bs] int64
    bonus_token = sample_from_probs(target_row, seeds, final_positions, STREAM_SAMPLE)
    final_token = torch.where(rejected, residual_token, bonus_token)  # [bs] int64

    output_tokens = _emit(draft_tokens, num_accepted, final_token)
    accept_lens = num_accepted + 1
    output_tokens = torch.where(greedy_mask[:, None], greedy_tokens, output_tokens)
    accept_lens = torch.where(greedy_mask, greedy_lens, accept_lens)
    return output_tokens, accept_lens


def first_stop_index(output_tokens: torch.Tensor, accept_lens: torch.Tensor,
                     stop_token_ids: torch.Tensor,
                     remaining: torch.Tensor | None = None) -> torch.Tensor:
    """accept_lens cut at the first stop token (kept) and at the max_tokens budget.

    output_tokens [bs, k + 1] int64; accept_lens [bs] int64;
    stop_token_ids [S] int64 shared by the batch (e.g. the EOS ids), or [bs, S] per request,
    padded with -1 (a row of -1 stops on nothing, e.g. for ignore_eos);
    remaining [bs] int64: tokens the request may still emit (max_tokens - generated), or None.
    Returns the truncated accept_lens [bs] int64; output_tokens is left as it is.
    """
    width = output_tokens.shape[1]
    slots = torch.arange(width, device=output_tokens.device)[None, :]  # [1, k + 1]
    if stop_token_ids.dim() == 1:
        stop_token_ids = stop_token_ids[None, :]
    valid = slots < accept_lens[:, None]  # [bs, k + 1] bool
    is_stop = (output_tokens[:, :, None] == stop_token_ids[:, None, :]).any(dim=-1)
    is_stop &= valid & (output_tokens >= 0)
    stop_lens = torch.where(is_stop, slots + 1, width).amin(dim=1)  # [bs] int64
    lens = torch.minimum(accept_lens, stop_lens)
    if remaining is not None:
        lens = torch.minimum(lens, remaining.clamp_min(0))
    return lens


def emit(logits: torch.Tensor, draft_tokens: torch.Tensor, num_draft_tokens: torch.Tensor,
         draft_probs: torch.Tensor | None, temperature: torch.Tensor, top_p: torch.Tensor,
         top_k: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, greedy: bool,
         out_tokens: torch.Tensor | None = None, out_logprobs: torch.Tensor | None = None,
         out_top_ids: torch.Tensor | None = None, out_top_logprobs: torch.Tensor | None = None,
         controls: StepControls | None = None, draft_index: torch.Tensor | None = None,
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one sampling tail of every step (eager, host verify, graphs): logits -> emitted
    tokens and their logprobs. With k = 0 drafts it is plain sampling.

    logits [bs * (k + 1), V] fp32, request after request; draft_tokens [bs, k] int64;
    num_draft_tokens [bs]; draft_probs as `rejection_sample`; temperature / top_p [bs] fp32,
    top_k / seeds [bs] int64; positions [bs] int64: the position of each request's first new
    token; greedy: every row has temperature 0 (the caller knows it on the host).
    out_tokens / out_logprobs [bs, k + 1]: written in place when given (a graph's outputs).
    out_top_ids [bs, (k + 1) * N] int64 / out_top_logprobs [bs, (k + 1) * N] fp32: when given,
    the N most likely tokens of every row and their logprobs, most likely first.
    controls: allowed ids, bad words, logit bias, min_tokens, penalties and min_p
    (runtime/controls.py), applied to every row before sampling, acceptance and the greedy
    argmax; None: none of them (no extra work).
    draft_index: as `rejection_sample`'s (draft_probs over the drafter's own vocabulary).
    Logprobs (emitted and top) are those of the model's own distribution, log_softmax of the
    logits before any control (vLLM's default, "raw").
    Returns tokens [bs, k + 1] (-1 past accept_lens), accept_lens [bs], logprobs [bs, k + 1]
    fp32 (log_softmax of each emitted token; past accept_lens the value of token 0).
    """
    bs, k = draft_tokens.shape
    T = k + 1
    if out_tokens is None:
        out_tokens = torch.empty(bs, T, dtype=torch.int64, device=logits.device)
        out_logprobs = torch.empty(bs, T, dtype=torch.float32, device=logits.device)
    ones = torch.ones(bs, dtype=torch.int64, device=logits.device)
    raw = logits
    if controls is not None:
        controls.tables.fold(controls.req_pool_indices, positions)
        logits = apply_controls(raw, controls, draft_tokens, positions)
    if k == 0 and greedy and controls is None:
        # one pass: the argmax and its logprob straight into the outputs
        _, raw_lse = argmax_lse(logits, out=out_tokens[:, 0], top_logprob=out_logprobs[:, 0])
        _top_n(raw, raw_lse, out_top_ids, out_top_logprobs)
        return out_tokens, ones, out_logprobs
    # one pass over the vocabulary: the greedy tokens and the logsumexp of every row
    target_argmax, lse = argmax_lse(logits)  # [bs * T] int64, [bs * T] fp32
    raw_lse = lse if controls is None else argmax_lse(raw)[1]
    if k == 0:
        tokens = sample(logits, temperature, top_p, top_k, seeds, positions, target_argmax)
        tokens, accept_lens = tokens[:, None], ones
    elif greedy and _greedy_emit_fused(logits):  # the tail below, one launch
        accept_lens = greedy_emit_triton(target_argmax, raw, raw_lse, draft_tokens,
                                         num_draft_tokens, out_tokens, out_logprobs)
        _top_n(raw, raw_lse, out_top_ids, out_top_logprobs)
        return out_tokens, accept_lens, out_logprobs
    elif greedy:
        tokens, accept_lens = greedy_accept_from_argmax(draft_tokens, num_draft_tokens,
                                                        target_argmax.view(bs, T))
    else:
        probs = processed_probs(logits, temperature.repeat_interleave(T),
                                top_p.repeat_interleave(T), top_k.repeat_interleave(T),
                                target_argmax)
        tokens, accept_lens = rejection_sample(draft_tokens, num_draft_tokens, draft_probs,
                                               probs.view(bs, T, -1), seeds, positions,
                                               temperature <= 0, target_argmax.view(bs, T),
                                               draft_index)
    out_tokens.copy_(tokens)
    # log_softmax of each emitted token (-1 past accept_lens reads token 0, never emitted)
    picked = raw.gather(1, tokens.reshape(-1, 1).clamp_min(0)).squeeze(1)
    torch.sub(picked, raw_lse, out=out_logprobs.view(-1))
    _top_n(raw, raw_lse, out_top_ids, out_top_logprobs)
    return out_tokens, accept_lens, out_logprobs


def _greedy_emit_fused(logits: torch.Tensor) -> bool:
    """Whether a greedy verify's tail runs as `kernels.argmax.greedy_emit_triton` (CUDA)."""
    return logits.is_cuda and triton_usable(logits)


def _top_n(logits: torch.Tensor, lse: torch.Tensor, out_ids: torch.Tensor | None,
           out_logprobs: torch.Tensor | None) -> None:
    """The N most likely tokens of each row and their log_softmax, into out_ids / out_logprobs
    [bs, T * N] (N from their width); nothing when they are None.
    logits [bs * T, V] fp32; lse [bs * T] fp32."""
    if out_ids is None:
        return
    n = out_ids.shape[1] * out_ids.shape[0] // logits.shape[0]
    values, ids = torch.topk(logits, n, dim=-1)  # [bs * T, N]
    out_ids.view(-1, n).copy_(ids)
    torch.sub(values, lse[:, None], out=out_logprobs.view(-1, n))


def step_extras(raw: dict[str, torch.Tensor], out: dict[str, torch.Tensor], bs: int,
                controls: ControlTables | None) -> dict:
    """The optional tail arguments of `emit` that a step body's lanes ask for: top-N outputs
    when its results have `top_ids` / `top_logprobs` lanes, sampling controls when its inputs
    have the penalty lanes (spec/extras.py). A body without them gets {}: no extra work."""
    extras: dict = {}
    if "top_ids" in out:
        extras.update(out_top_ids=out["top_ids"][:bs], out_top_logprobs=out["top_logprobs"][:bs])
    if "repetition_penalty" in raw:
        extras["controls"] = StepControls(
            controls, raw["req_pool_indices"][:bs], raw["presence_penalty"][:bs],
            raw["frequency_penalty"][:bs], raw["repetition_penalty"][:bs],
            raw["min_tokens"][:bs], raw["prompt_lens"][:bs], raw["num_logit_bias"][:bs],
            num_allowed=raw["num_allowed"][:bs], num_bad_words=raw["num_bad_words"][:bs],
            min_p=raw["min_p"][:bs], temperature=raw["temperature"][:bs])
    return extras
