"""A cache of dequantised GGUF models, so that the second start skips the dequantisation.

One entry per (GGUF file, dtype, parameter layout), a directory under
`$DRAFTGRAPH_CACHE_DIR`, else `$XDG_CACHE_HOME/draftgraph`, else `~/.cache/draftgraph`:

    weights/<gguf stem>-<key>/
        model.safetensors   the model's own parameters (fused names, run dtype), one copy
        config.json         the ModelConfig read from the GGUF metadata
        tokenizer/          the tokenizer (transformers `save_pretrained`), absent if none
        meta.json           source path, chat template, format version

The key hashes the file's size, mtime and a sampled sha256 (16 evenly spaced 64 KiB blocks
plus the last one) and the dtype, so a changed file or another dtype never reads a stale
entry; an entry whose tensors no longer match the model's parameters (a changed model layout)
is rejected when read, and rewritten. Entries are
written to a temporary directory and renamed into place (concurrent starts are safe).
`DRAFTGRAPH_WEIGHT_CACHE=0` (the CLI's `--no-weight-cache`) turns the cache off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import struct
from pathlib import Path

import torch

from draftgraph.models.config import ModelConfig
from draftgraph.models.tokenizer import SavedFastTokenizer, Tokenizer

logger = logging.getLogger(__name__)

CACHE_ENV = "DRAFTGRAPH_WEIGHT_CACHE"  # "0", "false", "no", "off": disabled
CACHE_DIR_ENV = "DRAFTGRAPH_CACHE_DIR"
FORMAT_VERSION = 1
# smaller files dequantise in well under a second: not worth a cache entry
MIN_FILE_BYTES = 8 << 20
_SAMPLES, _BLOCK = 16, 64 << 10


def enabled() -> bool:
    return os.environ.get(CACHE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_root() -> Path:
    """draftgraph's cache directory (not created)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "draftgraph"


def file_fingerprint(path: str, mtime: bool = True) -> str:
    """sha256 of the file's size, mtime (unless `mtime` is False: a copy then fingerprints as
    its original) and sampled contents (cheap: about 1 MiB read)."""
    st = os.stat(path)
    h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns if mtime else ''}".encode())
    with open(path, "rb") as f:
        step = max(1, st.st_size // _SAMPLES)
        for off in [*range(0, st.st_size, step), max(0, st.st_size - _BLOCK)]:
            f.seek(off)
            h.update(f.read(_BLOCK))
    return h.hexdigest()


def entry_dir(path: str, dtype: torch.dtype) -> Path:
    """The cache entry of GGUF `path` dequantised to `dtype`."""
    h = hashlib.sha256(json.dumps([FORMAT_VERSION, file_fingerprint(path), str(dtype)]).encode())
    stem = Path(path).name.removesuffix(".gguf")
    return cache_root() / "weights" / f"{stem}-{str(dtype).removeprefix('torch.')}-" \
        f"{h.hexdigest()[:20]}"


def wanted(path: str, use_cache: bool | None = None) -> bool:
    """Whether a load of `path` uses the cache: on (`use_cache`, else the environment) and a
    file large enough to be worth it."""
    on = enabled() if use_cache is None else use_cache
    return on and os.path.getsize(path) >= MIN_FILE_BYTES


# ---- read -------------------------------------------------------------------------------------

def read_config(entry: Path) -> ModelConfig | None:
    """The entry's ModelConfig, or None when there is no complete entry."""
    try:
        with open(entry / "meta.json") as f:
            meta = json.load(f)
        if meta.get("format") != FORMAT_VERSION:
            return None
        with open(entry / "config.json") as f:
            return ModelConfig(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def read_tokenizer(entry: Path) -> Tokenizer | None:
    with open(entry / "meta.json") as f:
        meta = json.load(f)
    if not meta.get("tokenizer"):
        return None
    path = str(entry / "tokenizer")
    try:  # no transformers import: about a second less start-up
        hf = SavedFastTokenizer(path)
    except ValueError:
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return Tokenizer(hf, chat_template=meta.get("chat_template"))


def read_weights(entry: Path, model: torch.nn.Module) -> None:
    """Fill `model`'s parameters from the entry's safetensors file; ValueError when its
    tensors do not match the parameters. On CPU each tensor is read straight into its
    parameter (one read per tensor: no mmap page faults, no second copy)."""
    file = entry / "model.safetensors"
    params = dict(model.named_parameters())
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        if set(header) != set(params):
            raise ValueError(f"{file}: tensors do not match the model's parameters")
        base = 8 + n
        with torch.no_grad():
            for name, p in params.items():
                begin, end = header[name]["data_offsets"]
                if list(header[name]["shape"]) != list(p.shape) or \
                        end - begin != p.numel() * p.element_size():
                    raise ValueError(f"{file}: {name} has the wrong shape or size")
                if p.device.type == "cpu" and p.is_contiguous():
                    f.seek(base + begin)
                    buf = p.detach().view(-1).view(torch.uint8).numpy()
                    if f.readinto(memoryview(buf)) != end - begin:
                        raise ValueError(f"{file}: truncated at {name}")
                else:
                    f.seek(base + begin)
                    raw = bytearray(f.read(end - begin))
                    t = torch.frombuffer(raw, dtype=torch.uint8).view(p.dtype).view(p.shape)
                    p.copy_(t)


# ---- write ------------------------------------------------------------------------------------

def write(entry: Path, source: str, model: torch.nn.Module, config: ModelConfig,
          tokenizer: Tokenizer | None) -> bool:
    """Write the entry (atomically); False, with a warning, when it cannot be written."""
    from safetensors.torch import save_file

    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({n: p.detach().contiguous().cpu() for n, p in model.named_parameters()},
                  str(tmp / "model.safetensors"))
        with open(tmp / "config.json", "w") as f:
            json.dump(dataclasses.asdict(config), f)
        if tokenizer is not None:
            tokenizer.hf.save_pretrained(str(tmp / "tokenizer"))
        with open(tmp / "meta.json", "w") as f:
            json.dump({"format": FORMAT_VERSION, "source": os.path.abspath(source),
                       "tokenizer": tokenizer is not None,
                       "chat_template": tokenizer.chat_template if tokenizer else None}, f)
        try:
            os.rename(tmp, entry)
        except OSError:  # another process wrote it first
            shutil.rmtree(tmp, ignore_errors=True)
            if not entry.is_dir():
                raise
    except Exception as e:  # a full disk or a read-only home must not fail the load
        shutil.rmtree(tmp, ignore_errors=True)
        logger.warning("could not cache the dequantised weights in %s (%s); the next start "
                       "dequantises again", entry, e)
        return False
    size = (entry / "model.safetensors").stat().st_size
    logger.info("cached the dequantised weights in %s (%.0f MB) for the next start "
                "(--no-weight-cache or %s=0 to turn off)", entry, size / 1e6, CACHE_ENV)
    return True


def remove(entry: Path) -> None:
    shutil.rmtree(entry, ignore_errors=True)
