"""Sampling controls on the device: allowed token ids, bad words, logit bias, min_tokens,
repetition / frequency / presence penalties and min_p, applied to the logits of every row of a
step (the 1 + k target rows of a verify step too), graph-safe.

Per-request state lives in `ControlTables`, one row per request row (`req_pool_indices`):

  token_counts [rows, V] int32   output occurrences of each token, + PROMPT_FLAG when the token
                                 is in the prompt (the repetition penalty's "seen")
  counted_lens [rows] int64      token-table positions [0, counted_lens) folded into the counts
  bias_ids     [rows, MAX_LOGIT_BIAS] int64, bias_values [rows, MAX_LOGIT_BIAS] fp32
  stop_ids     [rows, MAX_MIN_TOKENS_STOP_IDS] int64: tokens masked until min_tokens is reached
                                 (EOS and the request's stop_token_ids), -1 padding
  allowed_ids  [rows, MAX_ALLOWED_TOKEN_IDS] int64: the only tokens a request may emit
                                 (vLLM's allowed_token_ids), -1 padding
  bad_words    [rows, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS] int64, bad_lens [rows, MAX_BAD_WORDS]:
                                 vLLM's bad_words as token sequences, -1 padding

`admit` writes a row on the host once, when a request gets its row (first schedule, or again
after a preemption); no step rebuilds anything on the host. Each controlled step first `fold`s
the positions the token table gained since the last one (at most `fold_width` = 1 + k: what
one step can emit), so counts follow the emitted tokens with bounded work, and folding twice
(a step re-run after a failure) adds nothing.

Order (vLLM's): the allowed_token_ids and bad_words masks (a bad word's last token is
banned where the outputs just before end with its other tokens; one-token words always),
logit bias and the min_tokens mask, then the repetition penalty (prompt and output tokens:
positive logits divided, negative multiplied), then frequency (x count) and presence
(x [count > 0]) penalties (output tokens only), then min_p at the row's temperature (a token
less likely than min_p times the likeliest is masked). Temperature, top-k and top-p come
after, in `runtime/sampling.processed_probs`.

Verify rows: target row j decides the token after drafts 0..j-1, so its counts include them;
`apply_controls` corrects the few entries those drafts touch (static shape [bs, 1 + k, k]), so
rejection sampling verifies against exactly the distribution plain decoding samples from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PROMPT_FLAG = 1 << 24  # added once to the count of a token that is in the prompt
COUNT_MASK = PROMPT_FLAG - 1
MAX_LOGIT_BIAS = 300  # entries of logit_bias per request (OpenAI caps it about there)
MAX_MIN_TOKENS_STOP_IDS = 64  # EOS + stop_token_ids that min_tokens can hold back
MAX_ALLOWED_TOKEN_IDS = 1024  # allowed_token_ids per request
MAX_BAD_WORDS = 64  # bad_words token sequences per request (a word may give two)
MAX_BAD_WORD_TOKENS = 16  # tokens of one bad word


class ControlTables:
    def __init__(self, num_rows: int, vocab: int, token_table: torch.Tensor, fold_width: int,
                 device: torch.device) -> None:
        self.vocab = vocab
        self.token_table = token_table  # [rows, max_context] int64, the slot space's
        self.fold_width = fold_width
        self.token_counts = torch.zeros(num_rows, vocab, dtype=torch.int32, device=device)
        self.counted_lens = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.bias_ids = torch.full((num_rows, MAX_LOGIT_BIAS), -1, dtype=torch.int64,
                                   device=device)
        self.bias_values = torch.zeros(num_rows, MAX_LOGIT_BIAS, dtype=torch.float32,
                                       device=device)
        self.stop_ids = torch.full((num_rows, MAX_MIN_TOKENS_STOP_IDS), -1, dtype=torch.int64,
                                   device=device)
        self.allowed_ids = torch.full((num_rows, MAX_ALLOWED_TOKEN_IDS), -1,
                                      dtype=torch.int64, device=device)
        self.bad_words = torch.full((num_rows, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), -1,
                                    dtype=torch.int64, device=device)
        self.bad_lens = torch.zeros(num_rows, MAX_BAD_WORDS, dtype=torch.int64, device=device)

    def admit(self, row: int, prompt_ids: list[int], output_ids: list[int],
              logit_bias: dict[int, float], stop_ids: list[int],
              allowed_ids: list[int] = (), bad_words: list[list[int]] = ()) -> None:
        """A request's row, written once (host): prompt flags, the counts of the outputs it
        already has (after a preemption), its bias, min_tokens stop ids, allowed ids and bad
        words' token sequences."""
        dev = self.token_counts.device
        counts = torch.zeros(self.vocab, dtype=torch.int32)
        counts[torch.tensor(prompt_ids, dtype=torch.int64)] = PROMPT_FLAG
        if output_ids:
            counts.index_add_(0, torch.tensor(output_ids, dtype=torch.int64),
                              torch.ones(len(output_ids), dtype=torch.int32))
        self.token_counts[row].copy_(counts.to(dev))
        self.counted_lens[row] = len(prompt_ids) + len(output_ids)
        ids = torch.full((MAX_LOGIT_BIAS,), -1, dtype=torch.int64)
        vals = torch.zeros(MAX_LOGIT_BIAS, dtype=torch.float32)
        for i, (t, b) in enumerate(sorted(logit_bias.items())):
            ids[i], vals[i] = t, b
        self.bias_ids[row].copy_(ids.to(dev))
        self.bias_values[row].copy_(vals.to(dev))
        stops = torch.full((MAX_MIN_TOKENS_STOP_IDS,), -1, dtype=torch.int64)
        stops[: len(stop_ids)] = torch.tensor(sorted(stop_ids), dtype=torch.int64)
        self.stop_ids[row].copy_(stops.to(dev))
        allowed = torch.full((MAX_ALLOWED_TOKEN_IDS,), -1, dtype=torch.int64)
        allowed[: len(allowed_ids)] = torch.tensor(sorted(allowed_ids), dtype=torch.int64)
        self.allowed_ids[row].copy_(allowed.to(dev))
        words = torch.full((MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), -1, dtype=torch.int64)
        lens = torch.zeros(MAX_BAD_WORDS, dtype=torch.int64)
        for i, w in enumerate(bad_words):
            words[i, : len(w)] = torch.tensor(w, dtype=torch.int64)
            lens[i] = len(w)
        self.bad_words[row].copy_(words.to(dev))
        self.bad_lens[row].copy_(lens.to(dev))

    def fold(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Count the token-table positions [counted_lens, seq_lens) of each row (at most
        fold_width of them). req_pool_indices / seq_lens [bs] int64. Graph-safe."""
        rows = req_pool_indices
        start = self.counted_lens[rows]  # [bs]
        pos = start[:, None] + torch.arange(self.fold_width, device=rows.device)  # [bs, W]
        valid = pos < seq_lens[:, None]
        tok = self.token_table[rows[:, None], pos.clamp(0, self.token_table.shape[1] - 1)]
        self.token_counts.index_put_((rows[:, None].expand_as(tok), tok.clamp(0, self.vocab - 1)),
                                     valid.to(torch.int32), accumulate=True)
        self.counted_lens[rows] = torch.maximum(start, seq_lens)


@dataclass
class StepControls:
    """One step's controls: the tables and the per-request parameters ([bs] each)."""

    tables: ControlTables
    req_pool_indices: torch.Tensor  # [bs] int64
    presence_penalty: torch.Tensor  # [bs] fp32, 0: off
    frequency_penalty: torch.Tensor  # [bs] fp32, 0: off
    repetition_penalty: torch.Tensor  # [bs] fp32, 1 (or <= 0, a padded row): off
    min_tokens: torch.Tensor  # [bs] int64: stop ids masked while fewer outputs exist
    prompt_lens: torch.Tensor  # [bs] int64
    num_logit_bias: torch.Tensor  # [bs] int64: entries of the row's bias table in use
    num_allowed: torch.Tensor | None = None  # [bs] int64: allowed ids in use, 0: every token
    num_bad_words: torch.Tensor | None = None  # [bs] int64: bad word sequences in use
    min_p: torch.Tensor | None = None  # [bs] fp32, 0: off; None: no row asks
    temperature: torch.Tensor | None = None  # [bs] fp32, the step's (min_p is taken at it)


def _penalize(x: torch.Tensor, count: torch.Tensor, seen: torch.Tensor, rep: torch.Tensor,
              freq: torch.Tensor, pres: torch.Tensor) -> torch.Tensor:
    """Penalties on logits x [..., m] given output counts and "seen" (prompt or output);
    rep / freq / pres broadcast against x."""
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - freq * count - pres * (count > 0).to(x.dtype)


def apply_controls(logits: torch.Tensor, ctl: StepControls, draft_tokens: torch.Tensor,
                   seq_lens: torch.Tensor) -> torch.Tensor:
    """The controlled logits [bs * (k + 1), V] fp32 (a new tensor; `logits` is not changed).

    logits [bs * (k + 1), V] fp32, request after request; draft_tokens [bs, k] int64;
    seq_lens [bs] int64: the position of each request's first new token (the tokens at
    positions < seq_lens are folded into the counts: call `tables.fold` first)."""
    bs, k = draft_tokens.shape
    T, V = k + 1, logits.shape[-1]
    t = ctl.tables
    rows = ctl.req_pool_indices
    x = logits.view(bs, T, V)
    if ctl.num_allowed is not None:  # allowed_token_ids: every other token masked
        keep = _id_set(t.allowed_ids[rows], V) | (ctl.num_allowed == 0)[:, None]
        x = torch.where(keep[:, None, :], x, float("-inf"))
    if ctl.num_bad_words is not None:
        x = _ban_bad_words(x, t, rows, ctl.num_bad_words, ctl.prompt_lens, seq_lens,
                           draft_tokens)
    # logit bias: unique ids per row; padding goes to a spare column V
    slot = torch.arange(t.bias_ids.shape[1], device=rows.device)[None, :]
    bias_ids = torch.where(slot < ctl.num_logit_bias[:, None], t.bias_ids[rows], V)
    bias = torch.zeros(bs, V + 1, dtype=x.dtype, device=x.device)
    bias.scatter_(1, bias_ids.clamp(0, V), t.bias_values[rows])
    x = x + bias[:, None, :V]
    # min_tokens: row j's token is output number (seq_lens - prompt_lens) + j
    stop_mask = _id_set(t.stop_ids[rows], V)
    n_out = (seq_lens - ctl.prompt_lens)[:, None] + torch.arange(T, device=x.device)  # [bs, T]
    blocked = (n_out < ctl.min_tokens[:, None])[:, :, None] & stop_mask[:, None, :]
    x = torch.where(blocked, float("-inf"), x)
    # penalties over the counts; verify rows j add the drafts before them
    raw_counts = t.token_counts[rows]  # [bs, V] int32
    count = (raw_counts & COUNT_MASK).to(x.dtype)
    seen = raw_counts != 0
    rep = torch.where(ctl.repetition_penalty > 0, ctl.repetition_penalty, 1.0)[:, None, None]
    freq = ctl.frequency_penalty[:, None, None]
    pres = ctl.presence_penalty[:, None, None]
    before = x
    x = _penalize(before, count[:, None, :], seen[:, None, :], rep, freq, pres)
    if k:
        d = draft_tokens.clamp(0, V - 1)  # [bs, k]
        eq = (d[:, :, None] == d[:, None, :]).to(x.dtype)  # [bs, i', i]
        # extra[b, j, i]: drafts i' < j equal to draft i
        extra = torch.cat([torch.zeros(bs, 1, k, dtype=x.dtype, device=x.device),
                           eq.cumsum(dim=1)], dim=1)  # [bs, T, k]
        idx = d[:, None, :].expand(bs, T, k)
        c_d = count.gather(1, d)[:, None, :] + extra
        seen_d = seen.gather(1, d)[:, None, :] | (extra > 0)
        # equal drafts get equal values, so duplicate scatter indices agree
        x = x.scatter(2, idx, _penalize(before.gather(2, idx), c_d, seen_d, rep, freq, pres))
    if ctl.min_p is not None:
        x = _min_p(x, ctl.min_p, ctl.temperature)
    return x.reshape(bs * T, V)


def _id_set(ids: torch.Tensor, V: int) -> torch.Tensor:
    """[bs, V] bool: True at each row's ids [bs, N] (-1 padding ignored)."""
    mask = torch.zeros(ids.shape[0], V + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(1, torch.where(ids >= 0, ids, V).clamp_max(V), True)  # padding: column V
    return mask[:, :V]


def _ban_bad_words(x: torch.Tensor, t: ControlTables, rows: torch.Tensor,
                   num_bad: torch.Tensor, prompt_lens: torch.Tensor, seq_lens: torch.Tensor,
                   drafts: torch.Tensor) -> torch.Tensor:
    """vLLM's bad_words on logits x [bs, T, V]: for each of a row's word sequences (n tokens),
    its last token is masked where the n - 1 outputs just before the row's token are its first
    n - 1 (a one-token word: always). Verify row j's outputs before it end with drafts
    0..j-1; prompt tokens never count (vLLM matches outputs only)."""
    bs, T, V = x.shape
    words, lens = t.bad_words[rows], t.bad_lens[rows]  # [bs, W, L], [bs, W]
    W, L = words.shape[1:]
    back = L - 1  # the longest prefix a word can have
    dev = x.device
    # the table's last `back` positions before the step's first new token, then the drafts
    pos = seq_lens[:, None] - back + torch.arange(back, device=dev)  # [bs, back]
    hist = t.token_table[rows[:, None], pos.clamp_min(0)]
    hist = torch.where(pos >= prompt_lens[:, None], hist, -2)  # -2: matches no token
    ctx = torch.cat([hist, drafts], dim=1)  # [bs, back + k]
    win = ctx[:, torch.arange(T, device=dev)[:, None] + torch.arange(back, device=dev)]
    # a word's prefix right-aligned in the window: slot s holds its token s - (back - n + 1)
    src = torch.arange(back, device=dev) - (back - (lens - 1))[:, :, None]  # [bs, W, back]
    want = words.gather(2, src.clamp_min(0))
    same = (win[:, :, None, :] == want[:, None]) | (src < 0)[:, None]  # [bs, T, W, back]
    hit = same.all(dim=-1) & (torch.arange(W, device=dev) < num_bad[:, None])[:, None, :]
    last = words.gather(2, (lens - 1).clamp_min(0)[:, :, None]).squeeze(2)  # [bs, W]
    banned = torch.zeros(bs, T, V + 1, dtype=torch.bool, device=dev)
    banned.scatter_(2, torch.where(hit, last[:, None, :], V).clamp(0, V), True)
    return torch.where(banned[:, :, :V], float("-inf"), x)


def _min_p(x: torch.Tensor, min_p: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """vLLM's min_p on logits x [bs, T, V]: token i of a row is masked (-inf) when its
    probability at the request's temperature is below min_p times the row's likeliest token's,
    exp((x_i - max) / t) < min_p, i.e. x_i - max < t ln(min_p). Rows with min_p 0 or
    temperature 0 (greedy: the argmax is never masked anyway) keep every token."""
    on = (min_p > 0) & (temperature > 0)
    floor = torch.where(on, temperature * torch.log(min_p.clamp_min(1e-30)), float("-inf"))
    gap = x - x.amax(dim=-1, keepdim=True)
    return torch.where(gap < floor[:, None, None], float("-inf"), x)
