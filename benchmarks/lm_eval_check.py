"""lm-evaluation-harness through the server = the engine's own logprobs, in process.

`benchmarks/lm_eval_check.sh` serves a model, runs lm-eval's `local-completions` on the two
local tasks under `benchmarks/lm_eval_tasks/` (`--log_samples`), stops the server and runs
this on lm-eval's output directory. Here the engine is built from the same engine flags and
the same requests are made in process:

- draftgraph_mc (loglikelihood): each (question, choice) split into context and continuation
  ids as lm-eval's `_encode_pair` does (trailing spaces of the context move to the
  continuation; the continuation is the whole text's ids past the context's), scored from
  `prompt_logprobs`: the sum over the continuation and whether every continuation token is
  the top-ranked one. Per item, equal to lm-eval's within --atol and is_greedy identical;
  acc and acc_norm (argmax of the loglikelihoods, the latter over the choice's length)
  identical per document and in aggregate.
- draftgraph_gen (generate_until, greedy): the context's ids (no special tokens added, as
  lm-eval's remote tokenizer asks), the task's `until` plus the EOS text as stop strings,
  max_gen_toks; the generated text identical to lm-eval's, and so exact match (after
  stripping whitespace) per document and in aggregate.

The requests are rebuilt from the task data (benchmarks/data/) and checked against the
arguments lm-eval logged, so a change in either task's template shows up as a failure, not a
silent comparison of different requests. Writes JSON (run header, model shape, both sides'
scores, agreement) and exits 1 when anything differs.

    python3 benchmarks/lm_eval_check.py --lm-eval-output DIR [MODEL] [engine flags]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

from _meta import model_shape, run_header  # benchmarks/ is on sys.path: the script's folder

from draftgraph import flags
from draftgraph.engine.engine import LLMEngine
from draftgraph.engine.sampling import SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))
MC_DATA = os.path.join(HERE, "data", "lm_eval_mc.jsonl")
GEN_DATA = os.path.join(HERE, "data", "lm_eval_gen.jsonl")
# the tasks' templates (benchmarks/lm_eval_tasks/*.yaml), as lm-eval renders them
MC_CONTEXT = "Question: {question}\nAnswer:"
MC_DELIMITER = " "  # lm-eval's target_delimiter, between context and choice
GEN_CONTEXT = (
    "Question: What is 1 + 2?\nAnswer: 3\n\nQuestion: What is 7 - 3?\nAnswer: 4\n\n"
    "Question: What is 5 + 6?\nAnswer: 11\n\nQuestion: What is {question}?\nAnswer:"
)
GEN_KWARGS = {"until": ["\n"], "max_gen_toks": 8}
SEED = 1234  # lm-eval's default model seed, sent with every request


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def lm_eval_outputs(root: str) -> tuple[dict, dict[str, list[dict]]]:
    """lm-eval's results file and, per task, its logged samples sorted by doc_id."""
    (results_path,) = glob.glob(os.path.join(root, "**", "results_*.json"), recursive=True)
    with open(results_path) as f:
        results = json.load(f)
    samples = {}
    for task in ("draftgraph_mc", "draftgraph_gen"):
        (path,) = glob.glob(os.path.join(root, "**", f"samples_{task}_*.jsonl"), recursive=True)
        samples[task] = sorted(read_jsonl(path), key=lambda s: s["doc_id"])
    return results, samples


def logged_arguments(sample: dict) -> list[tuple]:
    """The (arg_0, arg_1, ...) of each request lm-eval made for a document, in order."""
    args = sample["arguments"]
    return [tuple(args[k].values()) for k in sorted(args, key=lambda k: int(k.split("_")[-1]))]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair for a causal model."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids) :]


def first_argmax(values: list[float]) -> int:
    """numpy's argmax: the first index of the largest value."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def check_mc(engine: LLMEngine, samples: list[dict], atol: float) -> dict:
    docs = read_jsonl(MC_DATA)
    requests, problems = [], []
    for doc_id, (doc, sample) in enumerate(zip(docs, samples, strict=True)):
        context = MC_CONTEXT.format(question=doc["question"])
        mine = [(context, MC_DELIMITER + c) for c in doc["choices"]]
        if sample["doc_id"] != doc_id or logged_arguments(sample) != mine:
            problems.append(f"doc {doc_id}: lm-eval's requests are not the ones rebuilt here")
        requests += [(doc_id, i, *encode_pair(engine.tokenizer, *m)) for i, m in enumerate(mine)]
    finals = engine.generate(
        [ctx + cont for _, _, ctx, cont in requests],
        SamplingParams(max_tokens=1, temperature=0, seed=SEED, prompt_logprobs=1),
    )
    engine_scores: dict[int, list[tuple[float, bool]]] = {}
    for (doc_id, _, ctx, _), out in zip(requests, finals, strict=True):
        lps = out.prompt_logprobs[len(ctx) :]
        ranks = [top[0] for top in out.prompt_top_logprobs[len(ctx) :]]
        engine_scores.setdefault(doc_id, []).append((sum(lps), all(r == 1 for r in ranks)))

    max_diff, greedy_agree, acc_agree, n_requests = 0.0, 0, 0, 0
    correct = {"acc": 0, "acc_norm": 0}
    per_doc = []
    for doc, sample in zip(docs, samples, strict=True):
        doc_id = sample["doc_id"]
        served = [(float(ll), greedy == "True") for ((ll, greedy),) in sample["resps"]]
        ours = engine_scores[doc_id]
        lls = [ll for ll, _ in ours]
        lengths = [float(len(c)) for c in doc["choices"]]
        acc = float(first_argmax(lls) == doc["answer"])
        acc_norm = float(
            first_argmax([ll / n for ll, n in zip(lls, lengths, strict=True)]) == doc["answer"]
        )
        correct["acc"] += int(acc)
        correct["acc_norm"] += int(acc_norm)
        diffs = [abs(s[0] - o[0]) for s, o in zip(served, ours, strict=True)]
        max_diff = max(max_diff, *diffs)
        greedy_agree += sum(s[1] == o[1] for s, o in zip(served, ours, strict=True))
        n_requests += len(ours)
        same_acc = acc == sample["acc"] and acc_norm == sample["acc_norm"]
        acc_agree += same_acc
        if max(diffs) > atol or not same_acc:
            problems.append(
                f"doc {doc_id}: served {served} vs engine {ours}; "
                f"acc {sample['acc']}/{acc}, acc_norm {sample['acc_norm']}/{acc_norm}"
            )
        per_doc.append(
            {"doc_id": doc_id, "served": served, "engine": ours, "acc": acc, "acc_norm": acc_norm}
        )
    n = len(docs)
    engine_metrics = {"acc": correct["acc"] / n, "acc_norm": correct["acc_norm"] / n}
    if greedy_agree != n_requests:
        problems.append(f"is_greedy agrees on {greedy_agree} of {n_requests} requests")
    return {
        "docs": n,
        "requests": n_requests,
        "engine": engine_metrics,
        "max_abs_loglikelihood_diff": max_diff,
        "is_greedy_agree": greedy_agree,
        "acc_agree_docs": acc_agree,
        "problems": problems,
        "per_doc": per_doc,
    }


def check_gen(engine: LLMEngine, samples: list[dict]) -> dict:
    docs = read_jsonl(GEN_DATA)
    eos = engine.tokenizer.hf.eos_token
    problems, prompts = [], []
    for doc_id, (doc, sample) in enumerate(zip(docs, samples, strict=True)):
        context = GEN_CONTEXT.format(question=doc["question"])
        ((logged_context, gen_kwargs),) = logged_arguments(sample)
        if (
            sample["doc_id"] != doc_id
            or logged_context != context
            or {k: gen_kwargs.get(k) for k in GEN_KWARGS} != GEN_KWARGS
        ):
            problems.append(f"doc {doc_id}: lm-eval's request is not the one rebuilt here")
        prompts.append(engine.tokenizer.encode(context, add_special_tokens=False))
    params = SamplingParams(
        max_tokens=GEN_KWARGS["max_gen_toks"],
        temperature=0,
        seed=SEED,
        stop=[*GEN_KWARGS["until"], eos],  # lm-eval's handle_stop_sequences
    )
    finals = engine.generate(prompts, params)
    identical, em_agree, correct = 0, 0, 0
    per_doc = []
    for doc, sample, out in zip(docs, samples, finals, strict=True):
        ((served,),) = sample["resps"]
        em = float(out.text.strip() == doc["answer"])
        correct += int(em)
        identical += served == out.text
        em_agree += em == sample["exact_match"]
        if served != out.text or em != sample["exact_match"]:
            problems.append(
                f"doc {sample['doc_id']}: served {served!r} vs engine {out.text!r}; "
                f"exact_match {sample['exact_match']}/{em}"
            )
        per_doc.append(
            {"doc_id": sample["doc_id"], "served": served, "engine": out.text, "exact_match": em}
        )
    return {
        "docs": len(docs),
        "engine": {"exact_match": correct / len(docs)},
        "identical_generations": identical,
        "exact_match_agree_docs": em_agree,
        "problems": problems,
        "per_doc": per_doc,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=flags.Formatter)
    p.add_argument("--lm-eval-output", required=True, help="lm-eval's --output_path")
    p.add_argument("--lm-eval-seconds", type=float, default=None, help="lm-eval's wall time")
    p.add_argument("--lm-eval-command", default=None, help="the lm-eval command line, recorded")
    p.add_argument("--atol", type=float, default=1e-4, help="per-item loglikelihood tolerance")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    p.add_argument(
        "--command", default=None, help="the benchmark's command line, recorded (default: this one)"
    )
    flags.add_model_args(p)
    flags.add_engine_args(p)
    args = p.parse_args()

    results, samples = lm_eval_outputs(args.lm_eval_output)
    served = results["results"]
    flags.apply_process_flags(args)
    engine = LLMEngine(flags.engine_config_from_args(args))
    start = time.perf_counter()
    mc = check_mc(engine, samples["draftgraph_mc"], args.atol)
    mc["in_process_seconds"] = round(time.perf_counter() - start, 2)
    gen = check_gen(engine, samples["draftgraph_gen"])
    seconds = time.perf_counter() - start
    gen["in_process_seconds"] = round(seconds - mc["in_process_seconds"], 2)

    mc["served"] = {m: served["draftgraph_mc"][f"{m},none"] for m in ("acc", "acc_norm")}
    gen["served"] = {"exact_match": served["draftgraph_gen"]["exact_match,strip"]}
    for task in (mc, gen):
        if task["served"] != task["engine"]:
            task["problems"].append(f"served {task['served']} != engine {task['engine']}")
    passed = not mc["problems"] and not gen["problems"]
    report = {
        **run_header(),
        **({"command": args.command} if args.command else {}),
        "model": flags.resolve_model(args),
        "dtype": engine.config.dtype,
        "model_shape": model_shape(engine.model_config),
        "lm_eval": {
            "version": results.get("lm_eval_version"),
            "model": results["config"]["model"],
            "batch_size": results["config"].get("batch_size"),
            "command": args.lm_eval_command,
            "seconds": args.lm_eval_seconds,
            "evaluation_seconds": float(results.get("total_evaluation_time_seconds") or "nan"),
        },
        "in_process_seconds": round(seconds, 2),
        "load_average_1min_at_end": os.getloadavg()[0],  # other jobs share these cores
        "atol": args.atol,
        "passed": passed,
        "draftgraph_mc": mc,
        "draftgraph_gen": gen,
    }
    print(
        f"draftgraph_mc: acc {mc['served']['acc']:.4f} served / {mc['engine']['acc']:.4f} "
        f"engine, acc_norm {mc['served']['acc_norm']:.4f} / {mc['engine']['acc_norm']:.4f}; "
        f"{mc['requests']} loglikelihoods, max |diff| {mc['max_abs_loglikelihood_diff']:.2e}, "
        f"is_greedy agrees on {mc['is_greedy_agree']}"
    )
    print(
        f"draftgraph_gen: exact_match {gen['served']['exact_match']:.4f} served / "
        f"{gen['engine']['exact_match']:.4f} engine; identical generations "
        f"{gen['identical_generations']} of {gen['docs']}"
    )
    for problem in mc["problems"] + gen["problems"]:
        print("MISMATCH", problem)
    print(
        f"in process {seconds:.1f} s; lm-eval {args.lm_eval_seconds} s; "
        f"{'PASSED' if passed else 'FAILED'}"
    )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print("wrote", args.out)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
