"""Admission checks: what a request must satisfy before it is queued, so that no request can
block or fail the others once it is in.

- The prompt's length is bounded before it is tokenised (`check_prompt_chars`): a text longer
  than the context times the longest token cannot fit, whatever it tokenises to.
- Text is tokenised with the GIL released (`encode_text`), so a big prompt tokenised on a
  worker thread does not stall the server's event loop or the engine thread.
- A request whose prompt + max_tokens can never fit the KV pool is refused
  (`check_fits_kv`) instead of waiting forever at the head of the queue.
- Sampling parameters that depend on the model are bounded (`bound_params`: top_k is clamped
  to the vocabulary, which the device sampler does anyway; logit_bias keys are token ids).

The engine is read through a few attributes (`tokenizer`, `model_config`, `config`,
`max_model_len`, `spec_k`, `kv_capacity`, `kv_page_size`, `source`): an `LLMEngine`, or the
server's `EngineClient` for an engine in another process, which runs the same checks.
"""

from __future__ import annotations

import dataclasses
import weakref

from draftgraph.engine.sampling import SamplingParams

# NOTE: a normaliser may compose characters (NFC), so a token can stand for more characters
# of the input than its vocabulary string has; the factor keeps the bound a true lower bound.
NORMALISATION_FACTOR = 2

_max_token_chars: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kv_capacity(engine) -> int:
    """KV slots one request may use at most: the whole pool but the reserved dummy page."""
    return engine.kv_capacity


def kv_page_size(engine) -> int:
    return engine.kv_page_size


def max_token_chars(tokenizer) -> int:
    """The longest vocabulary entry, in characters (computed once per tokenizer). Byte-level
    entries are at least as long as the text they decode to."""
    n = _max_token_chars.get(tokenizer)
    if n is None:
        n = max((len(t) for t in tokenizer.hf.get_vocab()), default=1)
        _max_token_chars[tokenizer] = n
    return n


def check_prompt_chars(engine, num_chars: int, what: str = "prompt") -> None:
    """Refuse, before tokenising, a text that cannot fit the context whatever it tokenises to."""
    from draftgraph.engine.errors import EngineError

    limit = engine.max_model_len * max_token_chars(engine.tokenizer) * NORMALISATION_FACTOR
    if num_chars > limit:
        raise EngineError(f"{what} has {num_chars} characters, more than the "
                          f"{engine.max_model_len}-token context (--max-model-len) can hold "
                          f"(at most {limit} characters)")


def check_text(engine, text: str, what: str, length: bool = True) -> None:
    """A prompt text that can be tokenised: not too long for the context (unless `length` is
    false: a prompt that will be truncated), valid Unicode."""
    from draftgraph.engine.errors import EngineError

    if length:
        check_prompt_chars(engine, len(text), what)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise EngineError(f"{what} is not valid text: a lone UTF-16 surrogate at character "
                          f"{e.start}") from None


def check_messages(engine, messages: list[dict], length: bool = True) -> None:
    """Chat messages whose contents pass `check_text`, their total length bounded too (unless
    `length` is false)."""
    contents = [m.get("content") for m in messages]
    texts = [c for c in contents if isinstance(c, str)]
    if length:
        check_prompt_chars(engine, sum(len(t) for t in texts), "messages")
    for t in texts:
        check_text(engine, t, "messages", length)


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """`tokenizer.encode` with the GIL released: the batch entry point of `tokenizers` runs in
    Rust without the GIL, the single-text one holds it for the whole encode."""
    return tokenizer.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def check_fits_kv(engine, prompt_len: int, params: SamplingParams) -> None:
    """Refuse a request that could never hold its KV, even with the whole pool to itself.

    It needs a slot per position up to the context (prompt + max_tokens, at most
    --max-model-len), plus the draft slots of a speculative step, in whole pages."""
    from draftgraph.engine.errors import EngineError

    total = min(prompt_len + params.max_tokens, engine.max_model_len)
    page = kv_page_size(engine)
    need = -(-(total + engine.spec_k) // page) * page
    capacity = kv_capacity(engine)
    if need > capacity:
        raise EngineError(
            f"prompt has {prompt_len} tokens and max_tokens is {params.max_tokens}: the request "
            f"needs {need} KV slots, but the KV pool has {capacity} (raise --kv-cache-tokens or "
            f"--gpu-memory-utilization, or lower --max-model-len or max_tokens)")


def bound_params(engine, params: SamplingParams) -> SamplingParams:
    """Params with the model-dependent bounds applied (a copy when anything changes);
    logit_bias keys, stop_token_ids and allowed_token_ids must be token ids of the
    vocabulary; prompt logprobs need one rank."""
    from draftgraph.engine.sampling import SamplingParamsError

    vocab = engine.model_config.vocab_size
    for name, ids, what in (("logit_bias", params.logit_bias, "logit_bias keys"),
                            ("stop_token_ids", params.stop_token_ids, "stop_token_ids"),
                            ("allowed_token_ids", params.allowed_token_ids or (),
                             "allowed_token_ids")):
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise SamplingParamsError(name, f"{what} must be token ids below the vocabulary "
                                      f"size {vocab}; got {bad[:3]}")
    if params.prompt_logprobs is not None and engine.config.tensor_parallel_size > 1:
        raise SamplingParamsError("prompt_logprobs", "prompt logprobs are not computed under "
                                  "--tensor-parallel-size > 1 yet")
    if params.top_k > vocab:
        params = dataclasses.replace(params, top_k=vocab)
    if params.bad_words:  # tokenised once: the words become sequences (a second pass, in
        # the engine's process after the API server's, finds none left to add)
        params = dataclasses.replace(params, bad_words=None, bad_words_token_ids=[
            *(params.bad_words_token_ids or ()), *bad_word_sequences(engine, params.bad_words)])
    bad = [t for w in params.bad_words_token_ids or () for t in w if t >= vocab]
    if bad:
        raise SamplingParamsError("bad_words", f"bad word token ids must be below the "
                                  f"vocabulary size {vocab}; got {bad[:3]}")
    return params


def bad_word_sequences(engine, words: list[str]) -> list[list[int]]:
    """The token sequences a request's bad words ban (vLLM's rule): each word as it starts a
    text, and, where a leading space makes it other tokens of the same count (a word inside
    a sentence), that spelling too."""
    from draftgraph.engine.sampling import SamplingParamsError, check_bad_word_sequences

    if engine.tokenizer is None:
        raise SamplingParamsError("bad_words", "bad_words need the model's tokenizer: give "
                                  "bad_words_token_ids instead")
    seqs = []
    for word in words:
        bare = encode_text(engine.tokenizer, word.lstrip(), add_special_tokens=False)
        seqs.append(bare)
        spaced = encode_text(engine.tokenizer, " " + word.lstrip(), add_special_tokens=False)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            seqs.append(spaced)
    check_bad_word_sequences(seqs, "bad_words")  # bounded like ids given directly
    return seqs


def encode_prompt(engine, prompt: str | list[int] | list[dict], use_chat_template: bool = True,
                  add_special_tokens: bool | None = None, add_generation_prompt: bool = True,
                  continue_final_message: bool = False, truncate: int | None = None,
                  template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a prompt given as text, token ids, or chat messages. Text that cannot fit
    the context is refused before it is tokenised; tokenising releases the GIL.
    add_special_tokens: whether the tokenizer adds its own (a BOS, for Llama 3); None: for
    plain text yes, for a chat template's text no (the template writes them).
    add_generation_prompt / continue_final_message / template_kwargs: how chat messages
    render (`Tokenizer.render_chat`). truncate: keep the last `truncate` tokens (vLLM's
    truncate_prompt_tokens); the text is then not refused for its length before tokenising
    (the HTTP body limit bounds it)."""
    import os

    from draftgraph.engine.errors import EngineError
    from draftgraph.models.loader import missing_tokenizer_reason

    tokenizer = engine.tokenizer
    if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
        ids = list(prompt)
        vocab = engine.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
               or not 0 <= t < vocab]
        if bad:
            raise EngineError(f"prompt token ids must be integers in [0, {vocab}); "
                              f"got {bad[:3]}")
    else:
        if tokenizer is None:
            source = engine.source
            reason = (missing_tokenizer_reason(source, loaded=True)
                      if os.path.exists(source) or source.startswith("random:")
                      else None) or f"model {engine.config.model} has no tokenizer"
            raise EngineError(f"{reason}: pass prompts as token ids")
        templated = isinstance(prompt, list) or (
            use_chat_template and tokenizer.has_chat_template)
        special = not templated if add_special_tokens is None else add_special_tokens
        if isinstance(prompt, list):
            if not prompt:
                raise EngineError("messages must not be empty")
            check_messages(engine, prompt, length=truncate is None)
            text = tokenizer.render_chat(prompt, add_generation_prompt, continue_final_message,
                                         template_kwargs)
        else:
            check_text(engine, prompt, "prompt", length=truncate is None)
            text = (tokenizer.render_chat([{"role": "user", "content": prompt}],
                                          add_generation_prompt=True)
                    if templated else prompt)
        ids = encode_text(tokenizer, text, add_special_tokens=special)
    if truncate is not None:
        ids = ids[-truncate:]
    if not ids:
        raise EngineError("prompt is empty")
    if len(ids) >= engine.max_model_len:
        raise EngineError(f"prompt has {len(ids)} tokens; the model's context is "
                          f"{engine.max_model_len} (--max-model-len), leaving no room to "
                          "generate")
    return ids


def admit(engine, prompt, params: SamplingParams,
          use_chat_template: bool = True) -> tuple[list[int], SamplingParams]:
    """(token ids, bounded params) of a request that can run, or EngineError /
    SamplingParamsError saying why not: the checks every request passes before it is queued,
    by the engine itself or by a server whose engine runs in another process."""
    ids = encode_prompt(engine, prompt, use_chat_template,
                        truncate=params.truncate_prompt_tokens)
    params = bound_params(engine, params)
    check_fits_kv(engine, len(ids), params)
    return ids, params
