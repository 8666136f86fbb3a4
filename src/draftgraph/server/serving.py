"""OpenAI response bodies built from engine outputs: completions, chat, their stream chunks,
logprobs and usage. Plain functions over dicts; no web framework here.

Token ids (`return_token_ids`, placed where vLLM puts them): every choice carries `token_ids`,
its generated ids (in a stream: the ids that chunk adds; a chunk is sent for every output that
adds ids, with or without text, so the chunks' ids concatenate to the whole output). The
prompt's ids come once: `prompt_token_ids` on each completions choice (prompts differ per
choice), in a stream on its first chunk; for chat on the response, in a stream on its first
chunk (the choices share the prompt). Streams read `new_token_ids` alone: an engine output
carries the whole `token_ids` only when it is the request's last.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field

from draftgraph.engine.request import RequestOutput


@dataclass
class ChoiceState:
    """What the server has sent so far for one choice of a streamed response."""

    index: int
    # echoed before the first chunk: completions' prompt when echo is on; chat's last message
    # when echo is on and it is the assistant's
    prompt_text: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    started: bool = False
    prompt_ids_sent: bool = False  # return_token_ids: the first chunk carried prompt_token_ids
    text_offset: int = 0
    finish_reason: str | None = None


def token_str(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[float | None],
                        num_top: int, text_offset: int = 0,
                        tops: list[list[tuple[int, float]] | None] | None = None) -> dict:
    """The completions API's logprobs object for the given tokens. tops: per token its top
    alternatives [(token id, logprob)] (None for the first prompt token); top_logprobs maps
    the first num_top of them, and the token itself (as OpenAI and vLLM do), to logprobs."""
    tokens = [token_str(tokenizer, t) for t in token_ids]
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    top = None
    if num_top > 0:
        top = []
        for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            alts = tops[i] if tops is not None else None
            if lp is None:
                top.append(None)
                continue
            entry = {token_str(tokenizer, a): alp for a, alp in (alts or [])[:num_top]}
            entry.setdefault(t, lp)
            top.append(entry)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top,
            "text_offset": offsets}


def _chat_entry(tokenizer, token_id: int, logprob: float) -> dict:
    tok = token_str(tokenizer, token_id)
    return {"token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8"))}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[float], num_top: int,
                  tops: list[list[tuple[int, float]]] | None = None) -> dict:
    """The chat API's logprobs object: per token its logprob and its num_top alternatives."""
    content = []
    for i, (tid, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        entry = _chat_entry(tokenizer, tid, lp)
        alts = (tops[i] if tops else [])[:num_top]
        entry["top_logprobs"] = [_chat_entry(tokenizer, a, alp) for a, alp in alts]
        content.append(entry)
    return {"content": content}


def prompt_logprobs(tokenizer, token_ids: list[int], logprobs: list[float | None] | None,
                    tops: list | None, num_top: int) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} for the token itself and its num_top alternatives."""
    if logprobs is None:
        return None
    out: list = []
    for tid, lp, top in zip(token_ids, logprobs, tops, strict=True):
        if lp is None:
            out.append(None)
            continue
        rank, ids, lps = top
        entry = {str(tid): {"logprob": lp, "rank": rank,
                            "decoded_token": token_str(tokenizer, tid)}}
        for r, (a, alp) in enumerate(zip(ids[:num_top], lps[:num_top], strict=True), 1):
            entry.setdefault(str(a), {"logprob": alp, "rank": r,
                                      "decoded_token": token_str(tokenizer, a)})
        out.append(entry)
    return out


def _prompt_tops(out: RequestOutput) -> list:
    """Per prompt token its top alternatives [(id, logprob)] (None for the first)."""
    return [None if t is None else list(zip(t[1], t[2], strict=True))
            for t in out.prompt_top_logprobs or []]


def without_output(out: RequestOutput) -> RequestOutput:
    """out with no generated tokens (text, ids, logprobs), its prompt logprobs kept; a
    finished one ends for its length (max_tokens 0), whatever stopped the engine's token.
    Errors and aborts keep their reason."""
    empty = None if out.logprobs is None else []
    reason = out.finish_reason
    if out.finished and reason in ("stop", "length"):
        reason = "length"
    return dataclasses.replace(
        out, token_ids=[], new_token_ids=[], text="", delta_text="", finish_reason=reason,
        logprobs=empty, new_logprobs=None if out.new_logprobs is None else [],
        top_logprobs=None if out.top_logprobs is None else [],
        new_top_logprobs=None if out.new_top_logprobs is None else [])


def usage(outputs: list[RequestOutput], prompt_tokens: int) -> dict:
    """OpenAI's usage: the prompt counted once per prompt sent (not once per choice of `n`),
    the completion tokens of every choice; with prefix caching on, the prompt tokens found
    cached (`prompt_tokens_details.cached_tokens`, the first choice's)."""
    prompt = prompt_tokens
    completion = sum(len(o.token_ids) for o in outputs)
    out = {"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion}
    cached = outputs[0].metrics.get("cached_tokens") if outputs else None
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def _echoed_logprobs(out: RequestOutput, st: ChoiceState) -> tuple[list, list]:
    """The prompt's tokens' logprobs and alternatives, to put before the output's (echo)."""
    n = len(st.prompt_token_ids)
    return (list(out.prompt_logprobs or [None] * n),
            _prompt_tops(out) if out.prompt_top_logprobs else [None] * n)


def completion_body(response_id: str, model: str, created: int, finals: list[RequestOutput],
                    states: list[ChoiceState], tokenizer, num_logprobs: int | None,
                    echo: bool, prompt_tokens: int,
                    num_prompt_logprobs: int | None = None,
                    return_token_ids: bool = False) -> dict:
    choices = []
    for out, st in zip(finals, states, strict=True):
        text = (st.prompt_text if echo else "") + out.text
        lp = None
        if num_logprobs is not None:
            ids, lps = list(out.token_ids), list(out.logprobs or [])
            tops = list(out.top_logprobs or [])
            if echo:
                p_lps, p_tops = _echoed_logprobs(out, st)
                ids, lps, tops = st.prompt_token_ids + ids, p_lps + lps, p_tops + tops
            lp = completion_logprobs(tokenizer, ids, lps, num_logprobs, tops=tops)
        choice = {"index": st.index, "text": text, "logprobs": lp,
                  "finish_reason": out.finish_reason}
        if num_prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(
                tokenizer, st.prompt_token_ids, out.prompt_logprobs, out.prompt_top_logprobs,
                num_prompt_logprobs)
        if return_token_ids:
            choice["token_ids"] = list(out.token_ids)
            choice["prompt_token_ids"] = list(st.prompt_token_ids)
        choices.append(choice)
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(finals, prompt_tokens)}


def completion_chunk(response_id: str, model: str, created: int, out: RequestOutput,
                     st: ChoiceState, tokenizer, num_logprobs: int | None,
                     echo: bool, return_token_ids: bool = False) -> dict | None:
    """The stream chunk for one output of one choice; None when it carries nothing."""
    text = out.delta_text
    ids = list(out.new_token_ids)
    lps: list[float | None] = list(out.new_logprobs or [])
    tops = list(out.new_top_logprobs or [])
    if not st.started:
        if echo and num_logprobs is not None and out.prompt_logprobs is None and \
                not out.finished:
            return None  # the prompt's logprobs come with the first tokens
        st.started = True
        if echo:
            text = st.prompt_text + text
            p_lps, p_tops = _echoed_logprobs(out, st)
            ids, lps, tops = st.prompt_token_ids + ids, p_lps + lps, p_tops + tops
    # without a tokenizer (random weights) a chunk per step still reports progress, and so
    # does every step when the ids are asked for (text held back still has its ids)
    if not text and not out.finished and not (
            (num_logprobs is not None or tokenizer is None or return_token_ids) and ids):
        return None
    lp = None
    if num_logprobs is not None:
        lp = completion_logprobs(tokenizer, ids, lps, num_logprobs, st.text_offset, tops)
        st.text_offset += sum(len(t) for t in lp["tokens"])
    choice = {"index": st.index, "text": text, "logprobs": lp,
              "finish_reason": out.finish_reason if out.finished else None}
    if return_token_ids:
        choice["token_ids"] = list(out.new_token_ids)
        if not st.prompt_ids_sent:
            st.prompt_ids_sent = True
            choice["prompt_token_ids"] = list(st.prompt_token_ids)
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice]}


def chat_body(response_id: str, model: str, created: int, finals: list[RequestOutput],
              tokenizer, num_logprobs: int | None, prompt_tokens: int,
              num_prompt_logprobs: int | None = None,
              prompt_token_ids: list[int] | None = None, echoed: str = "") -> dict:
    """prompt_token_ids: given when the request asked for token ids (return_token_ids);
    echoed: the text each reply's content starts with (chat's echo)."""
    choices = []
    for i, out in enumerate(finals):
        lp = (chat_logprobs(tokenizer, out.token_ids, out.logprobs or [], num_logprobs,
                            out.top_logprobs) if num_logprobs is not None else None)
        choice = {"index": i, "message": {"role": "assistant", "content": echoed + out.text},
                  "logprobs": lp, "finish_reason": out.finish_reason}
        if prompt_token_ids is not None:
            choice["token_ids"] = list(out.token_ids)
        choices.append(choice)
    body = {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(finals, prompt_tokens)}
    if prompt_token_ids is not None:  # vLLM: on the response, for the shared prompt
        body["prompt_token_ids"] = list(prompt_token_ids)
    if num_prompt_logprobs is not None and finals:  # vLLM: once, for the shared prompt
        out = finals[0]
        body["prompt_logprobs"] = prompt_logprobs(tokenizer, out.prompt_token_ids,
                                                  out.prompt_logprobs, out.prompt_top_logprobs,
                                                  num_prompt_logprobs)
    return body


def chat_chunk(response_id: str, model: str, created: int, out: RequestOutput, st: ChoiceState,
               tokenizer, num_logprobs: int | None, return_token_ids: bool = False,
               prompt_token_ids: list[int] | None = None) -> dict | None:
    """prompt_token_ids: put on this chunk (the stream's first, when ids are asked for)."""
    delta: dict = {}
    if not st.started:
        st.started = True
        delta["role"] = "assistant"
    if out.delta_text or "role" in delta:  # the first carries what echo writes first
        delta["content"] = (st.prompt_text if "role" in delta else "") + out.delta_text
    # a token whose text is held back (part of a character) still sends its logprob or id
    if not delta and not out.finished and not (
            (num_logprobs is not None or return_token_ids) and out.new_token_ids):
        return None
    lp = None
    if num_logprobs is not None and out.new_token_ids:
        lp = chat_logprobs(tokenizer, out.new_token_ids, out.new_logprobs or [], num_logprobs,
                           out.new_top_logprobs)
    choice = {"index": st.index, "delta": delta, "logprobs": lp,
              "finish_reason": out.finish_reason if out.finished else None}
    if return_token_ids:
        choice["token_ids"] = list(out.new_token_ids)
    chunk = {"id": response_id, "object": "chat.completion.chunk", "created": created,
             "model": model, "choices": [choice]}
    if prompt_token_ids is not None:  # vLLM: on the chunk, not the choice
        chunk["prompt_token_ids"] = list(prompt_token_ids)
    return chunk


def usage_chunk(response_id: str, model: str, created: int, obj: str,
                finals: list[RequestOutput], prompt_tokens: int) -> dict:
    return {"id": response_id, "object": obj, "created": created, "model": model,
            "choices": [], "usage": usage(finals, prompt_tokens)}


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """vLLM's /tokenizer_info body: the special tokens (as text, or None), the chat template
    and the context the server allows."""
    hf = tokenizer.hf
    return {"bos_token": hf.bos_token,
            "eos_token": hf.eos_token, "pad_token": hf.pad_token, "unk_token": hf.unk_token,
            "chat_template": tokenizer.chat_template, "model_max_length": max_model_len}


def clean_text(s: str) -> str:
    """s as valid Unicode: lone surrogates (from JSON escapes) written as \\udXXX."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """The OpenAI error object; every string made encodable (an error about bad text must not
    fail to render)."""
    return {"error": {"message": clean_text(str(message)), "type": type_,
                      "param": None if param is None else clean_text(str(param)), "code": code}}


# one encoder for every chunk: json.dumps builds a new one per call when given separators
_compact_json = json.JSONEncoder(separators=(",", ":")).encode


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else _compact_json(data)
    return f"data: {payload}\n\n"


def now() -> int:
    return int(time.time())
