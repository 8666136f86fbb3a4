"""Tokenizer: a thin wrapper over a transformers fast tokenizer with the model's chat template.

The engine needs token ids in and out, the chat template rendered to ids, and the set of ids
that end generation (`eos_token_ids`: the EOS token plus the template's end-of-turn token,
e.g. `<|im_end|>` or `<|eot_id|>`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)

# Special tokens that end an assistant turn; they stop generation when the template writes them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
# Special tokens that end a document; they always stop generation.
END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>")


class Tokenizer:
    def __init__(self, hf_tokenizer, chat_template: str | None = None,
                 extra_eos_token_ids: Iterable[int] = ()) -> None:
        self.hf = hf_tokenizer
        if chat_template:
            self.hf.chat_template = chat_template
        self.chat_template: str | None = getattr(self.hf, "chat_template", None) or None
        self.backend = self.hf.backend_tokenizer  # tokenizers.Tokenizer, for fast decode
        vocab = self.hf.get_vocab()
        eos: set[int] = set(extra_eos_token_ids)
        if self.hf.eos_token_id is not None:
            eos.add(int(self.hf.eos_token_id))
        special = set(self.hf.all_special_tokens) | {
            t.content for t in self.backend.get_added_tokens_decoder().values() if t.special
        }
        template = self.chat_template or ""
        for tok in END_OF_TURN_TOKENS + END_OF_TEXT_TOKENS:
            if tok in vocab and tok in special and (tok in END_OF_TEXT_TOKENS or tok in template):
                eos.add(vocab[tok])
        self.eos_token_ids: set[int] = eos
        self.bos_token_id: int | None = self.hf.bos_token_id
        self.vocab_size: int = len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(ids))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template rendered to text (it writes BOS itself where the model wants one)."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a plain "
                             "completion prompt instead of chat messages")
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           tokenize=False)

    def apply_chat_template(self, messages: list[dict],
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat; no special tokens are added beyond the template's."""
        return self.encode(self.render_chat(messages, add_generation_prompt),
                           add_special_tokens=False)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={sorted(self.eos_token_ids)})")
