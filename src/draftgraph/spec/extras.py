"""Step bodies whose tail does more: the top-N alternatives of every emitted token, and the
sampling controls (penalties, logit bias, min_tokens: runtime/controls.py).

A request that asks for none of these must not pay for them, and a captured graph cannot skip
work at run time, so the engine keeps two graph sets per step kind: the plain one, and one
built by `ExtrasFactory` whose body declares the extra lanes (`step_inputs(controls=True)`,
`step_outputs(top_n=TOP_N_MAX)`); `spec.verify.step_extras` turns those lanes into the tail's
work. A step runs the extras set only when one of its requests asks (the batch-mates' rows get
the same work, with their controls off).

NOTE: the tail always computes TOP_N_MAX alternatives in the extras set (a static shape); each
request keeps the ones it asked for.

NOTE: the twin of a speculative body drafts with the same drafter, bound once (StepBody binds
a drafter only for a target it is not bound to yet): a second bind would give it a new
executor, KV pool and buffers while the plain body's captured graphs kept the old ones.
"""

from __future__ import annotations

from draftgraph.runtime.controls import ControlTables
from draftgraph.spec.step import step_inputs, step_outputs

TOP_N_MAX = 20  # OpenAI's top_logprobs bound


class ExtrasFactory:
    """A picklable `(executor) -> StepBody` around a BodyFactory: the same body, with the
    extra lanes; the executor's ControlTables made when it has none (TP ranks > 0 too)."""

    def __init__(self, inner, fold_width: int) -> None:
        self.inner = inner
        self.fold_width = fold_width  # tokens one step may emit per request: 1 + k

    def __call__(self, target):
        ensure_controls(target, self.fold_width)
        body = self.inner(target)
        body.name = f"{body.name} +extras"
        body.inputs = step_inputs(target.max_bs, body.k, controls=True)
        body.outputs = step_outputs(target.max_bs, body.k, top_n=TOP_N_MAX)
        return body


def ensure_controls(target, fold_width: int) -> ControlTables:
    """The executor's control tables (one row per request row of the slot space)."""
    if target.controls is None:
        table = target.slots.token_table
        target.controls = ControlTables(table.shape[0], target.config.vocab_size, table,
                                        fold_width, target.device)
    return target.controls
