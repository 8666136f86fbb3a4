"""Incremental detokenisation for streaming: text deltas from token ids, one step at a time.

vLLM's prefix/read offsets: ids[prefix_offset:read_offset] is a window already turned into
text; each step decodes the window plus the new ids and emits what extends the window's text.
Decoding with a few tokens of context keeps tokenizers that drop a leading space at the start of
a decode (sentencepiece) correct, and a decode that ends in U+FFFD means a UTF-8 character is
still split across tokens: nothing is emitted until its last byte arrives.
"""

from __future__ import annotations

from draftgraph.models.tokenizer import Tokenizer

# Tokens of prompt context decoded with the first generated tokens.
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)  # prompt + generated
        self.prefix_offset = max(len(self.ids) - INITIAL_CONTEXT_TOKENS, 0)
        self.read_offset = len(self.ids)
        self._text: list[str] = []

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Append generated ids; return the text they complete (possibly "")."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character still split across tokens
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._text.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of a request: whatever is still held back (an incomplete character
        becomes U+FFFD here, as a full decode would show it)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        if delta:
            self._text.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text)
