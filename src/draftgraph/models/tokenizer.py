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
# What a chat template's render sets itself (transformers' arguments and special tokens):
# chat_template_kwargs may add variables, not replace these.
TEMPLATE_OWN_VARIABLES = frozenset((
    "messages", "conversation", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "chat_template", "bos_token", "eos_token",
    "unk_token", "pad_token", "return_dict", "return_tensors", "padding", "truncation",
    "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs"))


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

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    template_kwargs: dict | None = None) -> str:
        """The chat template rendered to text (it writes BOS itself where the model wants one).
        continue_final_message (vLLM's / transformers'): the text ends inside the last message,
        right after its content (whatever the template writes after it, an end-of-turn token,
        is cut), so generation continues that message: an assistant reply begun by the
        client. Not with add_generation_prompt. template_kwargs (vLLM's chat_template_kwargs):
        more variables for the template (e.g. Qwen3's enable_thinking); not its own ones."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a plain "
                             "completion prompt instead of chat messages")
        extra = dict(template_kwargs or {})
        taken = sorted(set(extra) & TEMPLATE_OWN_VARIABLES)
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set the template's own variables "
                             f"{taken}")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each "
                             "other: set add_generation_prompt to false")
        text = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           tokenize=False, **extra)
        if not continue_final_message:
            return text
        last = messages[-1].get("content")
        if not isinstance(last, str) or not last.strip():
            raise ValueError("continue_final_message needs a last message with text to continue")
        # the template may strip the content's surrounding spaces: find it stripped, then keep
        # its trailing spaces only where the template kept them
        core = last.strip()
        at = text.rfind(core)
        if at < 0:
            raise ValueError("continue_final_message: the chat template does not write the last "
                             "message's content as it is, so there is no place to continue it")
        body = last.lstrip()
        end = at + (len(body) if text.startswith(body, at) else len(core))
        return text[:end]

    def apply_chat_template(self, messages: list[dict],
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat; no special tokens are added beyond the template's."""
        return self.encode(self.render_chat(messages, add_generation_prompt),
                           add_special_tokens=False)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={sorted(self.eos_token_ids)})")


class SavedFastTokenizer:
    """What `Tokenizer` uses of a transformers fast tokenizer, read from a directory written by
    its `save_pretrained` (tokenizer.json, tokenizer_config.json, chat_template.jinja) without
    importing transformers, which costs about a second of start-up (the weight cache's path).

    The chat template renders as transformers renders it: a sandboxed jinja2 environment with
    trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a non-escaping
    `tojson`, and the special tokens as variables. A template this cannot compile (one using
    transformers' `{% generation %}` tag) raises ValueError at construction."""

    def __init__(self, path: str) -> None:
        import json
        import os

        from tokenizers import Tokenizer as RawTokenizer

        self.backend_tokenizer = RawTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            cfg = json.load(f)

        def token(key: str) -> str | None:
            v = cfg.get(key)
            return v.get("content") if isinstance(v, dict) else v

        self.bos_token, self.eos_token = token("bos_token"), token("eos_token")
        self.unk_token, self.pad_token = token("unk_token"), token("pad_token")
        self.bos_token_id = self._id(self.bos_token)
        self.eos_token_id = self._id(self.eos_token)
        extra = [t.get("content") if isinstance(t, dict) else t
                 for t in cfg.get("additional_special_tokens") or
                 cfg.get("extra_special_tokens") or []]
        self.all_special_tokens = [t for t in (self.bos_token, self.eos_token, self.unk_token,
                                               self.pad_token, *extra) if t]
        template = cfg.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if not template and os.path.isfile(jinja_file):
            with open(jinja_file) as f:
                template = f.read()
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"),
                            None)
        self.chat_template = template or None

    @property
    def chat_template(self) -> str | None:
        return self._template

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self._compiled = _compile_chat_template(template) if template else None
        self._template = template

    def __getstate__(self) -> dict:  # pickled without the compiled template (recompiled)
        return {k: v for k, v in self.__dict__.items() if k != "_compiled"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.chat_template = state["_template"]

    def _id(self, tok: str | None) -> int | None:
        return None if tok is None else self.backend_tokenizer.token_to_id(tok)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, **template_kwargs) -> str:
        if tokenize:
            raise ValueError("SavedFastTokenizer renders text only (tokenize=False)")
        return self._compiled.render(
            messages=messages, tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
            eos_token=self.eos_token, unk_token=self.unk_token, pad_token=self.pad_token,
            **template_kwargs)


def _compile_chat_template(template: str):
    """The template compiled in an environment like transformers' (see SavedFastTokenizer)."""
    import json
    from datetime import datetime

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat template needs transformers to compile ({e})") from e
