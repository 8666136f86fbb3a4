"""The cache of dequantised GGUF weights: the second load reads it instead of the GGUF, gives
the same model and tokenizer, follows changes of the file, survives a damaged entry, and is
off with DRAFTGRAPH_WEIGHT_CACHE=0."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import save_tiny_hf_checkpoint, tiny_llama_config
from test_loaders import write_gguf

from draftgraph.models import gguf_loader, weight_cache
from draftgraph.models.loader import load_model
from draftgraph.models.tokenizer import SavedFastTokenizer


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv(weight_cache.CACHE_DIR_ENV, str(path))
    monkeypatch.delenv(weight_cache.CACHE_ENV, raising=False)
    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", 0)  # cache even tiny files
    return path


@pytest.fixture
def tiny_gguf(tmp_path):
    hf = save_tiny_hf_checkpoint(str(tmp_path / "hf"), tiny_llama_config(), tokenizer=False)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, hf, "llama")
    return path


def no_gguf_reads(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the GGUF was read")

    monkeypatch.setattr(gguf_loader, "open_gguf", refuse)


def params(loaded) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in loaded.model.named_parameters()}


def test_second_load_reads_the_cache_and_gives_the_same_model(tiny_gguf, cache_dir,
                                                              monkeypatch):
    first = load_model(tiny_gguf)
    entry = weight_cache.entry_dir(tiny_gguf, torch.float32)
    assert entry.parent == cache_dir / "weights" and entry.name.startswith("tiny-float32-")
    assert {"model.safetensors", "config.json", "meta.json"} <= set(os.listdir(entry))
    no_gguf_reads(monkeypatch)
    second = load_model(tiny_gguf)
    assert second.config == first.config and second.tokenizer is None
    a, b = params(first), params(second)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_cache_entry_is_per_dtype(tiny_gguf, monkeypatch):
    load_model(tiny_gguf)
    assert not weight_cache.entry_dir(tiny_gguf, torch.bfloat16).exists()
    bf16 = load_model(tiny_gguf, dtype=torch.bfloat16)
    assert weight_cache.entry_dir(tiny_gguf, torch.bfloat16).is_dir()
    no_gguf_reads(monkeypatch)
    again = load_model(tiny_gguf, dtype=torch.bfloat16)
    assert next(again.model.parameters()).dtype == torch.bfloat16
    for (n, p), (_, q) in zip(bf16.model.named_parameters(), again.model.named_parameters(),
                              strict=True):
        assert torch.equal(p, q), n


def test_max_model_len_applies_to_a_cached_load_too(tiny_gguf, monkeypatch):
    assert load_model(tiny_gguf).config.max_position_embeddings == 256  # the file's
    no_gguf_reads(monkeypatch)
    capped = load_model(tiny_gguf, max_model_len=64)
    assert capped.config.max_position_embeddings == 64
    assert load_model(tiny_gguf).config.max_position_embeddings == 256


def test_a_changed_file_gets_a_new_entry_and_its_own_weights(tmp_path, tiny_gguf):
    old_entry = weight_cache.entry_dir(tiny_gguf, torch.float32)
    load_model(tiny_gguf)
    hf = save_tiny_hf_checkpoint(str(tmp_path / "hf2"), tiny_llama_config(), seed=7,
                                 tokenizer=False)
    os.remove(tiny_gguf)
    write_gguf(tiny_gguf, hf, "llama")
    new_entry = weight_cache.entry_dir(tiny_gguf, torch.float32)
    assert new_entry != old_entry
    loaded = load_model(tiny_gguf)
    assert new_entry.is_dir()
    torch.testing.assert_close(loaded.model.embed_tokens.weight[: hf.config.vocab_size],
                               hf.model.embed_tokens.weight, atol=0, rtol=0)


def test_a_damaged_entry_is_dequantised_again_and_rewritten(tiny_gguf, caplog):
    good = params(load_model(tiny_gguf))
    entry = weight_cache.entry_dir(tiny_gguf, torch.float32)
    st = entry / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    with caplog.at_level("WARNING"):
        loaded = load_model(tiny_gguf)
    assert "is unusable" in caplog.text
    for name, p in params(loaded).items():
        assert torch.equal(p, good[name]), name
    assert (entry / "model.safetensors").stat().st_size > st.stat().st_size // 2 * 1.5


def test_env_switch_turns_the_cache_off(tiny_gguf, cache_dir, monkeypatch):
    monkeypatch.setenv(weight_cache.CACHE_ENV, "0")
    load_model(tiny_gguf)
    assert not (cache_dir / "weights").exists()
    assert not weight_cache.wanted(tiny_gguf)
    monkeypatch.setenv(weight_cache.CACHE_ENV, "1")
    load_model(tiny_gguf, weight_cache=False)  # the argument wins over the environment
    assert not (cache_dir / "weights").exists()


def test_small_files_are_not_cached_by_default(tiny_gguf, cache_dir, monkeypatch):
    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", os.path.getsize(tiny_gguf) + 1)
    load_model(tiny_gguf)
    assert not (cache_dir / "weights").exists()


def test_cache_root_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv(weight_cache.CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert weight_cache.cache_root() == tmp_path / "xdg" / "draftgraph"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert weight_cache.cache_root() == tmp_path / "home" / ".cache" / "draftgraph"


def test_fingerprint_sees_a_change_in_the_middle_of_the_file(tmp_path):
    f = tmp_path / "x.bin"
    data = bytearray(os.urandom(4 << 20))
    f.write_bytes(bytes(data))
    before = weight_cache.file_fingerprint(str(f))
    st = os.stat(f)
    data[len(data) // 2] ^= 0xFF  # on a sampled block: the middle sample starts here
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime
    assert weight_cache.file_fingerprint(str(f)) != before


def test_default_model_from_the_cache_has_the_same_tokenizer(default_gguf_path, monkeypatch):
    first = load_model(default_gguf_path)
    no_gguf_reads(monkeypatch)
    second = load_model(default_gguf_path)
    a, b = first.tokenizer, second.tokenizer
    text = "Hello, wörld! <|im_start|>user\n12345 def fib(n):"
    assert a.encode(text) == b.encode(text) and a.encode(text, False) == b.encode(text, False)
    ids = a.encode(text)
    assert a.decode(ids) == b.decode(ids)
    assert isinstance(b.hf, SavedFastTokenizer)  # read without transformers
    for chat in ([{"role": "user", "content": "hi"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
                  {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]):
        for gen in (True, False):
            assert a.render_chat(chat, gen) == b.render_chat(chat, gen)
            assert a.apply_chat_template(chat, gen) == b.apply_chat_template(chat, gen)
    assert (a.eos_token_ids, a.bos_token_id, a.vocab_size) == \
        (b.eos_token_ids, b.bos_token_id, b.vocab_size)
    assert second.config == first.config
    assert torch.equal(first.model.layers[3].self_attn.qkv_proj.weight,
                       second.model.layers[3].self_attn.qkv_proj.weight)


def test_cpu_weights_are_advised_huge_pages_where_the_kernel_can():
    import sys

    from draftgraph.models.loader import advise_huge_pages

    t = torch.empty(6 << 20, dtype=torch.uint8)  # 6 MiB: holds an aligned 2 MiB page
    advised = advise_huge_pages([t, torch.empty(16)])
    if sys.platform.startswith("linux"):
        assert advised >= 2 << 20 and advised % (2 << 20) == 0
    else:
        assert advised == 0
