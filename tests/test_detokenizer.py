"""IncrementalDetokenizer: streamed deltas add up to the full decode and never show a
half-received UTF-8 character."""

from __future__ import annotations

import pytest

from draftgraph.engine import detokenizer
from draftgraph.engine.detokenizer import IncrementalDetokenizer
from draftgraph.models.loader import load_model

# Every string has characters whose UTF-8 bytes span several tokens in both tokenizers below.
TEXTS = [
    "Hi 😀! 日本語のテキスト and 🚀🚀 done",
    "emoji family 👨‍👩‍👧 flag 🇫🇷 and CJK 你好，世界",
    "café naïve ñ — “quotes” … 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(autouse=True, params=["stream", "windows"])
def decode_path(request, monkeypatch):
    """Every test through `tokenizers`' DecodeStream and through the decoded windows."""
    if request.param == "windows":
        monkeypatch.setattr(detokenizer, "DecodeStream", None)
    elif detokenizer.DecodeStream is None:
        pytest.skip("this tokenizers has no DecodeStream")
    return request.param


@pytest.fixture(scope="module")
def smollm2_tokenizer(default_model):
    return default_model.tokenizer


@pytest.fixture(scope="module")
def byte_tokenizer(tiny_hf_dir):
    """Byte-level, no merges: every byte of a multi-byte character is its own token."""
    return load_model(tiny_hf_dir).tokenizer


def stream(tok, prompt_ids, ids, step=1):
    detok = IncrementalDetokenizer(tok, prompt_ids)
    # each path is the one asked for (a stream path that fell back would test nothing new)
    path = "windows" if detokenizer.DecodeStream is None else "stream"
    assert (detok._stream is not None) == (path == "stream")
    deltas = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    return detok, deltas


@pytest.mark.parametrize("tokenizer", ["smollm2_tokenizer", "byte_tokenizer"])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_equal_full_decode_without_replacement_chars(request, tokenizer, text):
    tok = request.getfixturevalue(tokenizer)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say something."}])
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "test text must split characters across tokens"
    detok, deltas = stream(tok, prompt, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert detok.text == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some steps held back an incomplete character


def test_multi_token_steps_give_the_same_text(byte_tokenizer):
    tok = byte_tokenizer
    ids = tok.encode(TEXTS[0], add_special_tokens=False)
    for step in (2, 3, 5):
        detok, deltas = stream(tok, [], ids, step)
        assert "".join(deltas) == TEXTS[0] and not any("\ufffd" in d for d in deltas)


def test_character_is_emitted_when_its_last_byte_arrives(byte_tokenizer):
    tok = byte_tokenizer
    ids = tok.encode("a😀b", add_special_tokens=False)  # a, 4 bytes, b
    assert len(ids) == 6
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add([i]) for i in ids] == ["a", "", "", "", "😀", "b"]


def test_special_tokens_are_skipped_in_the_stream(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("Hello there", add_special_tokens=False) + [2]  # <|im_end|>
    detok, deltas = stream(tok, [1], ids)
    assert "".join(deltas) == "Hello there" and deltas[-1] == ""


def test_flush_emits_an_unfinished_character_as_replacement(byte_tokenizer):
    tok = byte_tokenizer
    ids = tok.encode("ok😀", add_special_tokens=False)[:-2]  # the emoji cut after 2 bytes
    detok, deltas = stream(tok, [], ids)
    assert "".join(deltas) == "ok"
    assert detok.flush() == "\ufffd" and detok.text == "ok\ufffd" == tok.decode(ids)


def test_leading_space_of_the_first_generated_token_is_kept(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    ids = tok.encode(" Paris.", add_special_tokens=False)
    _, deltas = stream(tok, prompt, ids)
    assert "".join(deltas) == " Paris."
