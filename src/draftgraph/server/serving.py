"""OpenAI response bodies built from engine outputs: completions, chat, their stream chunks,
logprobs and usage. Plain functions over dicts; no web framework here."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from draftgraph.engine.request import RequestOutput


@dataclass
class ChoiceState:
    """What the server has sent so far for one choice of a streamed response."""

    index: int
    prompt_text: str = ""  # echoed before the first chunk when echo is on
    prompt_token_ids: list[int] = field(default_factory=list)
    started: bool = False
    text_offset: int = 0
    finish_reason: str | None = None


def token_str(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[float | None],
                        num_top: int, text_offset: int = 0) -> dict:
    """The completions API's logprobs object for the given tokens. Only the sampled token's
    log-probability is known (from the target model), so top_logprobs lists that token."""
    tokens = [token_str(tokenizer, t) for t in token_ids]
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    top = ([{t: lp} if lp is not None else None for t, lp in zip(tokens, logprobs, strict=True)]
           if num_top > 0 else None)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[float],
                  num_top: int) -> dict:
    content = []
    for tid, lp in zip(token_ids, logprobs, strict=True):
        tok = token_str(tokenizer, tid)
        entry = {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}
        entry["top_logprobs"] = [dict(entry)] if num_top > 0 else []
        content.append(entry)
    return {"content": content}


def usage(outputs: list[RequestOutput], prompt_tokens: int) -> dict:
    """OpenAI's usage: the prompt counted once per prompt sent (not once per choice of `n`),
    the completion tokens of every choice."""
    prompt = prompt_tokens
    completion = sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def completion_body(response_id: str, model: str, created: int, finals: list[RequestOutput],
                    states: list[ChoiceState], tokenizer, num_logprobs: int | None,
                    echo: bool, prompt_tokens: int) -> dict:
    choices = []
    for out, st in zip(finals, states, strict=True):
        text = (st.prompt_text if echo else "") + out.text
        lp = None
        if num_logprobs is not None:
            ids, lps = list(out.token_ids), list(out.logprobs or [])
            if echo:
                ids = st.prompt_token_ids + ids
                lps = [None] * len(st.prompt_token_ids) + lps
            lp = completion_logprobs(tokenizer, ids, lps, num_logprobs)
        choices.append({"index": st.index, "text": text, "logprobs": lp,
                        "finish_reason": out.finish_reason})
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(finals, prompt_tokens)}


def completion_chunk(response_id: str, model: str, created: int, out: RequestOutput,
                     st: ChoiceState, tokenizer, num_logprobs: int | None,
                     echo: bool) -> dict | None:
    """The stream chunk for one output of one choice; None when it carries nothing."""
    text = out.delta_text
    ids = list(out.new_token_ids)
    lps: list[float | None] = list(out.new_logprobs or [])
    if not st.started:
        st.started = True
        if echo:
            text = st.prompt_text + text
            ids = st.prompt_token_ids + ids
            lps = [None] * len(st.prompt_token_ids) + lps
    # without a tokenizer (random weights) a chunk per step still reports progress
    if not text and not out.finished and not ((num_logprobs is not None or tokenizer is None)
                                              and ids):
        return None
    lp = None
    if num_logprobs is not None:
        lp = completion_logprobs(tokenizer, ids, lps, num_logprobs, st.text_offset)
        st.text_offset += sum(len(t) for t in lp["tokens"])
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": st.index, "text": text, "logprobs": lp,
                         "finish_reason": out.finish_reason if out.finished else None}]}


def chat_body(response_id: str, model: str, created: int, finals: list[RequestOutput],
              tokenizer, num_logprobs: int | None, prompt_tokens: int) -> dict:
    choices = []
    for i, out in enumerate(finals):
        lp = (chat_logprobs(tokenizer, out.token_ids, out.logprobs or [], num_logprobs)
              if num_logprobs is not None else None)
        choices.append({"index": i, "message": {"role": "assistant", "content": out.text},
                        "logprobs": lp, "finish_reason": out.finish_reason})
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(finals, prompt_tokens)}


def chat_chunk(response_id: str, model: str, created: int, out: RequestOutput, st: ChoiceState,
               tokenizer, num_logprobs: int | None) -> dict | None:
    delta: dict = {}
    if not st.started:
        st.started = True
        delta["role"] = "assistant"
    if out.delta_text or "role" in delta:
        delta["content"] = out.delta_text
    if not delta and not out.finished:
        return None
    lp = None
    if num_logprobs is not None and out.new_token_ids:
        lp = chat_logprobs(tokenizer, out.new_token_ids, out.new_logprobs or [], num_logprobs)
    return {"id": response_id, "object": "chat.completion.chunk", "created": created,
            "model": model,
            "choices": [{"index": st.index, "delta": delta, "logprobs": lp,
                         "finish_reason": out.finish_reason if out.finished else None}]}


def usage_chunk(response_id: str, model: str, created: int, obj: str,
                finals: list[RequestOutput], prompt_tokens: int) -> dict:
    return {"id": response_id, "object": obj, "created": created, "model": model,
            "choices": [], "usage": usage(finals, prompt_tokens)}


def clean_text(s: str) -> str:
    """s as valid Unicode: lone surrogates (from JSON escapes) written as \\udXXX."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """The OpenAI error object; every string made encodable (an error about bad text must not
    fail to render)."""
    return {"error": {"message": clean_text(str(message)), "type": type_,
                      "param": None if param is None else clean_text(str(param)), "code": code}}


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


def now() -> int:
    return int(time.time())
