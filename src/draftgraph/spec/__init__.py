"""Drafters behind one interface (spec/drafter.py), the speculative step body (spec/step.py)
and acceptance (spec/verify.py): device-side, sync-free."""

from draftgraph.config import SpecConfig
from draftgraph.spec.drafter import Acceptance, DraftContext, Drafter, Proposal
from draftgraph.spec.ngram import NgramDrafter, NgramProposer, propose_ref
from draftgraph.spec.verify import emit, first_stop_index, greedy_accept, rejection_sample

__all__ = [
    "Acceptance",
    "DraftContext",
    "Drafter",
    "NgramDrafter",
    "NgramProposer",
    "Proposal",
    "emit",
    "first_stop_index",
    "greedy_accept",
    "make_drafter",
    "propose_ref",
    "rejection_sample",
]


# heads that ship inside the package (draftgraph/heads/<dir>), by method and the model name
# they were trained for; each directory records its training command and data hash
SHIPPED_HEADS = {"chain": {"default": "smollm2-135m-chain"},
                 "block": {"default": "smollm2-135m-block"}}


def shipped_head(method: str, model: str | None) -> str:
    """The head directory that ships for `model` ("default", or the default GGUF by path)."""
    import os

    from draftgraph.models.loader import is_default_model

    name = SHIPPED_HEADS[method].get(model or "")
    if name is None and is_default_model(model):
        name = SHIPPED_HEADS[method].get("default")
    if name is None:
        ships = ", ".join(SHIPPED_HEADS[method]) or "none yet"
        raise ValueError(f"--speculative {method} needs --draft-head: no {method} head ships "
                         f"for model {model!r} (heads ship for: {ships}; "
                         f"`draftgraph train-drafter` trains one)")
    return os.path.join(os.path.dirname(os.path.dirname(__file__)), "heads", name)


def make_drafter(cfg: SpecConfig, device="cpu", dtype=None, target_config=None,
                 model: str | None = None, quantization: str = "none") -> Drafter | None:
    """The drafter `--speculative` names (None without speculation); a draft model or head is
    loaded onto `device` in `dtype` (a head is built for `target_config`; without
    --draft-head, the head that ships for `model`; a draft model quantized as the target)."""
    if cfg.method is None:
        return None
    if cfg.method == "ngram":
        return NgramDrafter(cfg.ngram_min, cfg.ngram_max, cfg.num_draft_tokens)
    if cfg.method == "draft":
        from draftgraph.models.loader import load_model
        from draftgraph.spec.draft_model import DraftModelDrafter

        kw = {} if dtype is None else {"dtype": dtype}
        loaded = load_model(cfg.draft_model, device=device, **kw)
        if quantization == "int4":
            from draftgraph.models.quant import quantize_int4_

            quantize_int4_(loaded.model)
        return DraftModelDrafter(loaded.model.eval(), cfg.num_draft_tokens)
    import torch

    from draftgraph.models.heads import head_kind, load_head, random_head

    dtype = dtype or torch.float32
    path = cfg.draft_head or shipped_head(cfg.method, model)
    if path == "random" or path.startswith("random:"):
        head = random_head(target_config, path.partition(":")[2], device, dtype,
                           kind=cfg.method)
    else:
        kind = head_kind(path)
        if kind != cfg.method:
            raise ValueError(f"--draft-head {path!r} is a {kind} head; use --speculative {kind}")
        head = load_head(path, target_config, device, dtype)
    if cfg.method == "chain" and cfg.tree is not None:
        from draftgraph.spec.tree import TreeHeadDrafter

        return TreeHeadDrafter(head, cfg.tree, max_bs=cfg.tree_max_bs,
                               ngram_n=(cfg.ngram_min, cfg.ngram_max),
                               chain=cfg.num_draft_tokens)
    if cfg.method == "chain":
        from draftgraph.spec.chain_head import ChainHeadDrafter

        return ChainHeadDrafter(head, cfg.num_draft_tokens)
    from draftgraph.spec.block import BlockHeadDrafter

    # with a tree, steps without one (batches above tree_max_bs, top-N, penalties) verify the
    # block's first num_draft_tokens drafts, as a chain head's tree drafter drafts that chain
    nb = (cfg.block_size or head.head_config.block_size) - 1
    return BlockHeadDrafter(head, cfg.block_size, cfg.confidence_threshold, tree=cfg.tree,
                            ngram_n=(cfg.ngram_min, cfg.ngram_max), max_bs=cfg.tree_max_bs,
                            chain=min(cfg.num_draft_tokens, nb) if cfg.tree else None)
