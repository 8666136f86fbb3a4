"""Sampling parameters of a request, validated when built. The device-side sampling they
drive lives in `runtime/sampling.py`.

Every field is bounded here, within the dtypes of the step's tensors (temperature and top_p
fp32, top_k and seed int64), so that no request's parameters can make a batched step raise
and fail its batch-mates. Errors name the field (`SamplingParamsError.param`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from draftgraph.config import MAX_SEED

# the device tables size these (min_tokens masks EOS and stop_token_ids: that many ids)
from draftgraph.runtime.controls import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_MIN_TOKENS_STOP_IDS,
)
from draftgraph.spec.extras import TOP_N_MAX

# NOTE: top_k is clamped to the vocabulary at admission (engine/admission.py); this bound only
# keeps it far inside int64 for callers that build params without an engine.
MAX_TOP_K = 2**31 - 1
MAX_TOKENS = 2**31 - 1
MAX_TEMPERATURE = 1000.0  # fp32 logits / T stay finite
# temperatures below this are greedy (vLLM's _SAMPLING_EPS): logits / 1e-40 overflow fp32
GREEDY_TEMPERATURE = 1e-5
# top_p below this keeps the first token only, as any top_p < 1 / vocab does; a top_p that
# rounds to 0 in fp32 would keep no token at all
MIN_TOP_P = 1e-6
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 1024
MAX_TOP_LOGPROBS = TOP_N_MAX  # the device tail computes this many alternatives
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's bound
MAX_PENALTY = 2.0  # presence / frequency penalties in [-2, 2] (OpenAI)
MAX_REPETITION_PENALTY = 100.0


class SamplingParamsError(ValueError):
    """A sampling parameter out of range; `param` is the field's name."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_number(name: str, x, lo: float, hi: float, lo_open: bool = False) -> float:
    if not _is_number(x):
        raise SamplingParamsError(name, f"{name} must be a number, got {x!r}")
    if not math.isfinite(x):
        raise SamplingParamsError(name, f"{name} must be a finite number, got {x}")
    if x < lo or (lo_open and x == lo) or x > hi:
        low = f"({lo}" if lo_open else f"[{lo}"
        raise SamplingParamsError(name, f"{name} must be in {low}, {hi}], got {x}")
    return float(x)


@dataclass
class SamplingParams:
    """What a request asks of generation; validated when built."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # vLLM's: the text keeps the stop string it hit
    skip_special_tokens: bool = True  # vLLM's: special tokens left out of the text
    detokenize: bool = True  # vLLM's: false leaves the text empty (token ids only)
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per output token, 0..MAX_TOP_LOGPROBS (with logprobs)
    prompt_logprobs: int | None = None  # None: off; N: each prompt token's logprob + top N
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    # tokens whose probability (at the temperature) is below min_p times the likeliest one's
    # are not sampled (vLLM's min_p, before top-k / top-p); 0: off
    min_p: float = 0.0
    # vLLM's: the only tokens the request may emit (greedy or sampled); None: any
    allowed_token_ids: list[int] | None = None
    # vLLM's: keep only the prompt's last N tokens (left truncation); None: the whole prompt
    truncate_prompt_tokens: int | None = None
    # vLLM's: words never completed in the output (their last token is banned where the
    # outputs before it spell the rest); tokenised at admission into bad_words_token_ids,
    # which a caller with token ids may also give directly
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_TOKENS:
            raise SamplingParamsError(
                "max_tokens", f"max_tokens must be an integer in [1, {MAX_TOKENS}], "
                f"got {self.max_tokens!r}")
        self.temperature = _check_number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        self.top_p = max(_check_number("top_p", self.top_p, 0.0, 1.0, lo_open=True), MIN_TOP_P)
        if self.top_k is None or self.top_k == 0:
            self.top_k = -1
        if not _is_int(self.top_k) or not (self.top_k == -1 or 1 <= self.top_k <= MAX_TOP_K):
            raise SamplingParamsError(
                "top_k", f"top_k must be -1 or 0 (off) or an integer in [1, {MAX_TOP_K}] (values "
                f"past the vocabulary mean no limit), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise SamplingParamsError(
                "seed", f"seed must be an integer in [0, {MAX_SEED}], got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError(
                "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError("stop", "stop strings must be non-empty strings")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError(
                "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, "
                f"got {len(self.stop_token_ids)}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids",
                                      "stop_token_ids must be non-negative integers")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "detokenize", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"{name} must be true or false, "
                                          f"got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise SamplingParamsError("stop", "stop strings are matched in the text: they need "
                                      "detokenize (use stop_token_ids without it)")
        self._check_extras()

    def _check_extras(self) -> None:
        for name in ("top_logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if (v is not None or name == "top_logprobs") and (
                    not _is_int(v) or not 0 <= v <= MAX_TOP_LOGPROBS):
                raise SamplingParamsError(name, f"{name} must be an integer in "
                                          f"[0, {MAX_TOP_LOGPROBS}], got {v!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _check_number(name, getattr(self, name), -MAX_PENALTY,
                                              MAX_PENALTY))
        self.repetition_penalty = _check_number("repetition_penalty", self.repetition_penalty,
                                                0.0, MAX_REPETITION_PENALTY, lo_open=True)
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingParamsError("logit_bias", f"logit_bias must map at most "
                                      f"{MAX_LOGIT_BIAS} token ids to biases")
        bias = {}
        for t, b in self.logit_bias.items():
            tid = int(t) if isinstance(t, str) and t.isdigit() else t
            if not _is_int(tid) or tid < 0:
                raise SamplingParamsError("logit_bias", f"logit_bias keys must be token ids "
                                          f"(non-negative integers), got {t!r}")
            bias[tid] = _check_number("logit_bias", b, -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS)
        self.logit_bias = bias
        self.min_p = _check_number("min_p", self.min_p, 0.0, 1.0)
        if self.bad_words is not None and (
                not isinstance(self.bad_words, (list, tuple))
                or len(self.bad_words) > MAX_BAD_WORDS // 2
                or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise SamplingParamsError("bad_words", f"bad_words must be at most "
                                      f"{MAX_BAD_WORDS // 2} non-blank strings")
        if self.bad_words_token_ids is not None:
            check_bad_word_sequences(self.bad_words_token_ids, "bad_words_token_ids")
        n = self.truncate_prompt_tokens
        if n is not None and (not _is_int(n) or not 1 <= n <= MAX_TOKENS):
            raise SamplingParamsError("truncate_prompt_tokens", "truncate_prompt_tokens must be "
                                      f"a number of tokens to keep, at least 1, got {n!r}")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not 1 <= len(ids) <= MAX_ALLOWED_TOKEN_IDS \
                    or any(not _is_int(t) or t < 0 for t in ids):
                raise SamplingParamsError(
                    "allowed_token_ids", f"allowed_token_ids must be 1 to "
                    f"{MAX_ALLOWED_TOKEN_IDS} token ids (non-negative integers)")
            self.allowed_token_ids = sorted(set(ids))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError("min_tokens", f"min_tokens must be an integer in "
                                      f"[0, max_tokens = {self.max_tokens}], got "
                                      f"{self.min_tokens!r}")
        if self.min_tokens and len(self.stop_token_ids) > MAX_MIN_TOKENS_STOP_IDS - 8:
            raise SamplingParamsError("min_tokens", f"min_tokens holds back at most "
                                      f"{MAX_MIN_TOKENS_STOP_IDS - 8} stop_token_ids, got "
                                      f"{len(self.stop_token_ids)}")

    @property
    def has_controls(self) -> bool:
        """Any control that changes the distribution (runtime/controls.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens
                    or (self.min_p and self.temperature) or self.allowed_token_ids
                    or self.bad_words or self.bad_words_token_ids)

    @property
    def needs_extras(self) -> bool:
        """The step's tail must do more than sample (spec/extras.py)."""
        return self.has_controls or (self.logprobs and self.top_logprobs > 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_bad_word_sequences(seqs, param: str) -> None:
    """Bad words as token sequences within what the control tables hold, or an error naming
    `param` (the field the caller's words came in)."""
    if (not isinstance(seqs, (list, tuple)) or len(seqs) > MAX_BAD_WORDS
            or any(not isinstance(w, (list, tuple)) or not 1 <= len(w) <= MAX_BAD_WORD_TOKENS
                   or any(not _is_int(t) or t < 0 for t in w) for w in seqs)):
        raise SamplingParamsError(param, f"bad words must be at most {MAX_BAD_WORDS} token "
                                  f"sequences of 1 to {MAX_BAD_WORD_TOKENS} ids")


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The parameters of n choices of one request: choice i of a seeded request draws from its
    own stream, seed + i (mod 2^63), so the choices differ and each is reproducible (choice 0
    keeps the request's seed: n = 1 is unchanged)."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=(params.seed + i) % (MAX_SEED + 1))
            for i in range(n)]
