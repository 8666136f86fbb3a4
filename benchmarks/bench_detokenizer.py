"""Incremental detokenisation per token, the default model's tokenizer: `tokenizers`'
DecodeStream (the engine's path where it exists) against two decodes of a window (the
fallback), on 256 tokens of code and of text with multi-byte characters, arms interleaved.

    python benchmarks/bench_detokenizer.py --out detok.json

The engine detokenises every token of every stream that asks for text, inside its step loop
(engine.py `_check_stop`), so at 64 streams a step pays this 64 times on the host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from _meta import run_header

from draftgraph.engine import detokenizer
from draftgraph.engine.detokenizer import IncrementalDetokenizer
from draftgraph.models.loader import load_model

TEXTS = {
    "code": "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n" * 20,
    "multibyte": "café naïve ñ — “quotes” … 日本語のテキスト 😀🚀 and more words " * 20,
}


def us_per_token(tok, prompt: list[int], ids: list[int], repeats: int = 20) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        d = IncrementalDetokenizer(tok, prompt)
        for i in ids:
            d.add([i])
    return (time.perf_counter() - t0) * 1e6 / (repeats * len(ids))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if detokenizer.DecodeStream is None:
        print("this tokenizers has no DecodeStream: nothing to compare")
        return 1
    tok = load_model(args.model).tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write something."}])
    stream = detokenizer.DecodeStream
    results = []
    for name, text in TEXTS.items():
        ids = tok.encode(text, add_special_tokens=False)[:256]
        arms: dict[str, list[float]] = {"stream": [], "windows": []}
        for _ in range(args.rounds):
            for arm in arms:
                detokenizer.DecodeStream = stream if arm == "stream" else None
                arms[arm].append(us_per_token(tok, prompt, ids))
        detokenizer.DecodeStream = stream
        row = {"text": name, "tokens": len(ids),
               **{f"{arm}_us_per_token": statistics.median(v) for arm, v in arms.items()},
               **{f"{arm}_runs": v for arm, v in arms.items()}}
        results.append(row)
        print(f"{name}: DecodeStream {row['stream_us_per_token']:.2f} us a token, windows "
              f"{row['windows_us_per_token']:.2f}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "detokenizer", **run_header("cpu"), "model": args.model,
                   "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
