"""Hugging Face checkpoint directories: config.json, *.safetensors, tokenizer files."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator

import torch

from draftgraph.models.config import ModelConfig
from draftgraph.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def hf_config(path: str) -> ModelConfig:
    """ModelConfig from `<path>/config.json` (and EOS ids from generation_config.json);
    ValueError naming the file when it is not JSON or lacks a field."""
    cfg_path = os.path.join(path, "config.json")
    cfg = read_json(cfg_path)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{path}: model_type {model_type!r} (architectures "
                         f"{cfg.get('architectures')}) is not supported "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    config = ModelConfig.from_hf_dict(cfg, name=model_type, source=cfg_path)
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        eos = read_json(gen_path).get("eos_token_id")
        for e in eos if isinstance(eos, list) else ([eos] if eos is not None else []):
            if e not in config.eos_token_ids:
                config.eos_token_ids.append(e)
    return config


def read_json(path: str) -> dict:
    """The JSON object in the file at `path`; ValueError naming the file when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def safetensors_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (only safetensors "
                                "checkpoints are supported; convert .bin files first)")
    return files


def count_tensors(path: str) -> int:
    from safetensors import safe_open

    total = 0
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            total += len(f.keys())
    return total


def iter_safetensors_weights(path: str,
                             dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in `dtype`) for every tensor of every shard, one at a time."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name).to(dtype)


def has_tokenizer(path: str) -> bool:
    """Whether an HF directory has tokenizer files."""
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def hf_tokenizer(path: str, config: ModelConfig) -> Tokenizer | None:
    """Tokenizer from tokenizer.json / tokenizer_config.json, or None if the directory has none."""
    if not has_tokenizer(path):
        logger.warning("%s has weights but no tokenizer files (%s); loading without a "
                       "tokenizer", path, ", ".join(TOKENIZER_FILES))
        return None
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return Tokenizer(hf, extra_eos_token_ids=config.eos_token_ids)
