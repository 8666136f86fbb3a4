"""Drafter head directories: save, load, and random heads of any shape.

A head is a directory: `config.json` (the fields of its config dataclass; `kind` says which:
"chain", models/chain_head.py, the default for configs without it; or "block",
models/block_head.py) and `*.safetensors` holding the module's state dict. A tensor over the
shard size is split by rows into `name.part<i>` tensors, and no file exceeds the shard size
(16 MiB by default).
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
from torch import nn

from draftgraph.models.block_head import BlockHead, BlockHeadConfig
from draftgraph.models.chain_head import ChainHead, HeadConfig, default_layer_ids
from draftgraph.models.config import ModelConfig
from draftgraph.models.hf_loader import read_json
from draftgraph.models.presets import fill_random

SHARD_BYTES = 16 * 2**20
KINDS = {"chain": (HeadConfig, ChainHead), "block": (BlockHeadConfig, BlockHead)}


def save_head(head: nn.Module, path: str, shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write `config.json` and safetensors shards of at most `shard_bytes` each; returns the
    shard file names."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(head.head_config), f, indent=1)
    pieces: list[tuple[str, torch.Tensor]] = []
    for name, t in head.state_dict().items():
        t = t.detach().cpu().contiguous()
        if t.numel() * t.element_size() <= shard_bytes or t.dim() == 0:
            pieces.append((name, t))
            continue
        rows = max(1, shard_bytes // (t[0].numel() * t.element_size()))
        pieces += [(f"{name}.part{i}", c.clone())
                   for i, c in enumerate(torch.split(t, rows, dim=0))]
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, t in pieces:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and used + nbytes > shard_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = t
        used += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, os.path.join(path, name))
    return names


def head_config(path: str) -> dict:
    """The raw `config.json` of the head directory at `path` (ValueError when it has none)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"--draft-head {path!r}: no config.json there (a head directory "
                         "holds config.json and *.safetensors; or use `random`)")
    try:
        return read_json(cfg_path)
    except ValueError as e:
        raise ValueError(f"--draft-head {path!r}: {e}") from None


def head_kind(path: str) -> str:
    """The `kind` of the head directory at `path` (ValueError when it is not one)."""
    kind = head_config(path).get("kind", "chain")
    if kind not in KINDS:
        raise ValueError(f"--draft-head {path!r}: unknown head kind {kind!r} "
                         f"({', '.join(KINDS)})")
    return kind


def load_head(path: str, target: ModelConfig, device="cpu",
              dtype: torch.dtype = torch.float32) -> nn.Module:
    """A head directory (see the module docstring) for `target`, on `device` in `dtype`."""
    from safetensors.torch import load_file

    config_cls, head_cls = KINDS[head_kind(path)]
    raw = head_config(path)
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"--draft-head {path!r}: unknown config fields {unknown}")
    head = head_cls(config_cls(**raw), target)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name in list(tensors):
        base, sep, idx = name.rpartition(".part")
        if sep and idx.isdigit():
            parts.setdefault(base, []).append((int(idx), tensors.pop(name)))
    for base, chunks in parts.items():
        tensors[base] = torch.cat([t for _, t in sorted(chunks, key=lambda c: c[0])])
    mk = tensors.get("markov_out.weight")
    if mk is not None and "d2t" in tensors and mk.shape[0] != tensors["d2t"].numel():
        # a reduced block head saved before 2026-12-07 kept the Markov head's every row
        tensors["markov_out.weight"] = mk.index_select(0, tensors["d2t"])
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"--draft-head {path!r}: missing weights {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    return head.to(device=device, dtype=dtype).eval()


# random-head spec keys -> config fields, per kind
_SPEC_KEYS = {
    "chain": {"layers": "num_layers", "draft_vocab": "draft_vocab_size",
              "intermediate_size": "intermediate_size", "share_lm_head": "share_lm_head"},
    "block": {"layers": "num_layers", "block_size": "block_size", "window": "window",
              "intermediate_size": "intermediate_size", "markov_rank": "markov_rank",
              "confidence": "confidence", "mask_token_id": "mask_token_id",
              "draft_vocab": "draft_vocab_size"},
}


def random_head(target: ModelConfig, spec: str = "", device="cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0,
                kind: str = "chain") -> nn.Module:
    """A head of random weights (norms 1, biases 0, weights N(0, 0.02)); `spec` is empty or
    comma-separated `key=N` (chain: layers, draft_vocab, intermediate_size, share_lm_head
    (0/1); block: layers,
    block_size, window, intermediate_size, markov_rank, confidence (0/1), mask_token_id,
    draft_vocab: the tokens 0 .. V' - 1)."""
    keys = _SPEC_KEYS[kind]
    kw: dict[str, int] = {}
    for item in filter(None, spec.split(",")):
        key, _, val = item.partition("=")
        if key not in keys or not val.isdigit():
            raise ValueError(f"--draft-head random:{spec}: expected "
                             f"{', '.join(k + '=N' for k in keys)}, comma-separated")
        kw[keys[key]] = int(val)
    for flag in ("confidence", "share_lm_head"):
        if flag in kw:
            kw[flag] = bool(kw[flag])
    config_cls, head_cls = KINDS[kind]
    cfg = config_cls(default_layer_ids(target.num_hidden_layers), target.hidden_size,
                     target.vocab_size, kind=kind, **kw)
    with torch.device(device):
        head = head_cls(cfg, target)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            fill_random(name, p, gen)
    return head.to(dtype=dtype).eval()


def reduce_vocab(head: nn.Module, d2t: torch.Tensor, target: ModelConfig) -> nn.Module:
    """`head` (a chain or block head over the target's whole shared LM head) drafting over
    the target tokens `d2t` alone [V'], its LM head the target's rows d2t (a block head's
    Markov head: its rows d2t too): the same weights and the same drafts wherever its argmax
    is in d2t; each draft's LM head V' rows instead of V. A reduced head whose weights do not
    depend on its vocabulary (no Markov rows, as a chain head's) is its whole-vocabulary
    head's weights and d2t, so it is reduced anew over `d2t` just the same."""
    rows = getattr(head, "markov_out", None) is not None  # weights per draft token
    if getattr(head, "lm_head", None) is not None or (head.reduced_vocab and rows):
        raise ValueError("reduce_vocab takes a head over the target's whole vocabulary (or "
                         "a reduced one without weights of its own per draft token)")
    d2t = torch.as_tensor(d2t, dtype=torch.int64).sort().values
    v = head.head_config.target_vocab_size
    if d2t.numel() == 0 or d2t[0] < 0 or d2t[-1] >= v or d2t.unique().numel() != d2t.numel():
        raise ValueError(f"d2t: distinct target token ids in 0..{v - 1}")
    extra = {"share_lm_head": True} if isinstance(head, ChainHead) else {}
    cfg = dataclasses.replace(head.head_config, draft_vocab_size=d2t.numel(), **extra)
    dev = head.fc.weight.device
    with torch.device(dev):
        out = type(head)(cfg, target)
    state = {k: t for k, t in head.state_dict().items() if k != "d2t"}
    if "markov_out.weight" in state:  # the Markov head's rows d2t alone
        state["markov_out.weight"] = state["markov_out.weight"].index_select(0, d2t.to(dev))
    out.load_state_dict({**state, "d2t": d2t.to(dev)})
    return out.to(head.fc.weight.dtype).eval()
