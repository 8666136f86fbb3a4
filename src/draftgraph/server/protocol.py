"""OpenAI request bodies as pydantic models, and their translation to SamplingParams.

Types are strict (`max_tokens: true` or `"4"` is a 400 naming the field, not 1 or 4), numbers
are finite, text is valid Unicode (a lone UTF-16 surrogate is a 400, not a crash in the
tokenizer or the error handler); a field the OpenAI API lets be null takes null as its default.
Unknown fields are ignored (clients send many optional ones), but fields of the OpenAI API this
server does not implement (`tools`, `response_format`, `chat_template`, ...) are
refused by name rather than silently ignored, and so are fields valid alone but not together
(`stream_options` without `stream`, `top_logprobs` without `logprobs`).

Logprobs: `logprobs` (completions) / `top_logprobs` (chat) up to 20 alternatives, computed on
the device; `echo` + `logprobs` scores the prompt too (null only for its first token), as does
vLLM's `prompt_logprobs` extra. Sampling controls: `presence_penalty`, `frequency_penalty`
([-2, 2]), `repetition_penalty` (> 0), `logit_bias` (token id -> [-100, 100], at most 300),
`min_tokens`, `min_p` ([0, 1]), `allowed_token_ids` (at most 1024) and `bad_words` (vLLM's),
applied on the device (runtime/controls.py). Text: `include_stop_str_in_output` (vLLM's)
keeps the stop string a text ends at, `skip_special_tokens` false (vLLM's) writes special
tokens into it; `detokenize` false (vLLM's) leaves it empty; `truncate_prompt_tokens`
(vLLM's) keeps a prompt's last N tokens. Chat (vLLM's): `add_generation_prompt`,
`continue_final_message` (the last message continued), `chat_template_kwargs`, `echo` (the
last message's content first, when it is the assistant's).
Token ids: vLLM's `return_token_ids` adds the generated ids to each choice (a stream's chunks:
the ids each one adds) and the prompt's ids once (serving.py says where).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)

from draftgraph.engine.sampling import (
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    SamplingParams,
)

# Fields of the OpenAI API (and vLLM's extensions) that change what a request means: ignoring
# one would return a plausible but wrong answer. The value that means "off" is accepted.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "length_penalty": (None, 1, 1.0),
    "use_beam_search": (None, False),
    # vLLM's extras that change the text, the prompt or the tokens allowed
    "spaces_between_special_tokens": (None, True),
    "logits_processors": (None, []),
    "return_tokens_as_token_ids": (None, False),
    "prompt_embeds": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    # chat: the prompt is the messages through the model's own template
    "chat_template": (None,),
}


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid text: a lone UTF-16 surrogate at character {e.start}"
                         ) from None
    return s


Text = Annotated[StrictStr, AfterValidator(_valid_unicode)]
TokenId = Annotated[StrictInt, Field(ge=0)]
TokenIds = list[TokenId]
Count = Annotated[StrictInt, Field(ge=1)]
Finite = Annotated[float, Strict(), Field(allow_inf_nan=False)]
NumLogprobs = Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)]
Penalty = Annotated[Finite, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]


class StreamOptions(BaseModel):
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False  # vLLM's: refused unless off


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept to refuse UNSUPPORTED_FIELDS by name

    model: Text | None = None
    temperature: Annotated[Finite, Field(ge=0, le=100)] | None = None
    top_p: Annotated[Finite, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=MAX_TOP_K)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=MAX_SEED)] | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False  # vLLM's extra
    skip_special_tokens: StrictBool = True  # vLLM's extra
    detokenize: StrictBool = True  # vLLM's extra: false, no text (token ids only)
    allowed_token_ids: TokenIds | None = None  # vLLM's extra
    bad_words: list[Text] | None = None  # vLLM's extra
    # vLLM's extra: keep the prompt's last N tokens (its -1, "the model's length", is refused:
    # a prompt that long leaves no room to generate)
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=16)] = 1
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[Finite, Field(gt=0, le=MAX_REPETITION_PENALTY)] = 1.0
    # OpenAI's JSON object keys are strings: token ids as decimal strings; the values are
    # bounded by SamplingParams (errors then name `logit_bias`, not `logit_bias.<key>`)
    logit_bias: dict[StrictStr, Any] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    min_p: Annotated[Finite, Field(ge=0, le=1)] = 0.0  # vLLM's extra
    prompt_logprobs: NumLogprobs | None = None  # vLLM's extra
    return_token_ids: StrictBool = False  # vLLM's extra: output (and prompt) token ids

    # OpenAI (and vLLM) let these be null: null means the default, any other value is checked
    @field_validator("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "detokenize", "stream", "n", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_tokens", "min_p", "return_token_ids", "echo",
                     "logprobs", mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, v: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict | None) -> dict | None:
        # ASCII digits only: str.isdigit() takes "²" and "١", which int() refuses or reads as 1
        bad = [k for k in (v or {}) if not (k.isascii() and k.isdigit())]
        if bad:
            raise ValueError(f"keys must be token ids (decimal integers), got {bad[:3]}")
        return v

    def unsupported_fields(self) -> list[str]:
        """Names of the fields sent that this server does not implement (with a value other
        than the one meaning "off")."""
        extra = self.model_extra or {}
        names = [k for k, off in UNSUPPORTED_FIELDS.items()
                 if k in extra and not any(extra[k] == v and type(extra[k]) is type(v)
                                           for v in off)]
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            names.append("stream_options.continuous_usage_stats")
        return names

    def conflicting_field(self) -> tuple[str, str] | None:
        """(name, why) of a field valid alone but not with the others sent, or None."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        if self.prompt_logprobs is not None and self.stream:
            return ("prompt_logprobs", "prompt_logprobs is not available when stream=true: "
                    "ask for them without streaming")
        return None

    def _params(self, max_tokens: int, logprobs: bool, default_temperature: float,
                top_logprobs: int = 0, prompt_logprobs: int | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=default_temperature if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            detokenize=self.detokenize,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or None,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            min_tokens=self.min_tokens,
            min_p=self.min_p,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    # text, token ids, or a batch of either
    prompt: Text | TokenIds | list[Text] | list[TokenIds]
    # 0 only with echo: the prompt scored, nothing generated (OpenAI's legacy scoring request)
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = 16
    logprobs: NumLogprobs | None = None
    echo: StrictBool = False

    @property
    def prompt_only(self) -> bool:
        """echo + max_tokens 0: the response is the prompt (and its logprobs) alone. The
        engine still generates one token (a request generates at least one); the server
        drops it, as vLLM does."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token: echo + logprobs scores the prompt (OpenAI), and so
        does prompt_logprobs (vLLM); None: the prompt is not scored."""
        asked = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs)
                 if n is not None]
        return max(asked) if asked else None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return self._params(max_tokens, self.logprobs is not None, default_temperature=1.0,
                            top_logprobs=self.logprobs or 0,
                            prompt_logprobs=self.num_prompt_logprobs)


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None  # only an assistant's may be left out
    # tools are not implemented: kept only to refuse a message that carries calls
    tool_calls: list[Any] | None = None
    function_call: Any = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


def _checked_messages(messages: list[ChatMessage]) -> list[ChatMessage]:
    for i, m in enumerate(messages):
        if m.tool_calls or m.function_call:
            raise ValueError(f"messages[{i}] carries tool calls: this server does not "
                             "implement tools (leave tool_calls and function_call out)")
        if m.role != "assistant" and m.content in (None, []):
            raise ValueError(f"messages[{i}] ({m.role}) has no content")
    return messages


Messages = Annotated[list[ChatMessage], AfterValidator(_checked_messages)]


def chat_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them (OpenAI's `developer` is the system role)."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in messages]


class ChatRendering(BaseModel):
    """How chat messages render through the template (vLLM's options): the template's reply
    opening after them (default), or none and the last message continued (an assistant reply
    begun by the client); more template variables."""

    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[StrictStr, Any] | None = None

    def render_options(self) -> dict[str, Any]:
        """The options as `admission.encode_prompt` takes them."""
        return dict(add_generation_prompt=self.add_generation_prompt,
                    continue_final_message=self.continue_final_message,
                    template_kwargs=self.chat_template_kwargs)


class ChatCompletionRequest(_SamplingRequest, ChatRendering):
    messages: Messages = Field(min_length=1)
    max_completion_tokens: Count | None = None
    max_tokens: Count | None = None  # deprecated alias in the OpenAI API
    logprobs: StrictBool = False
    top_logprobs: NumLogprobs | None = None
    # vLLM's: the reply's content starts with the last message's when that is the assistant's
    # too (with continue_final_message: the whole message, the client's part and the reply)
    echo: StrictBool = False

    def chat_messages(self) -> list[dict[str, Any]]:
        return chat_dicts(self.messages)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The field the client bounded the output with (errors name it)."""
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def conflicting_field(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs is only allowed when logprobs is true"
        if self.continue_final_message and self.add_generation_prompt:
            return ("continue_final_message", "continue_final_message continues the last "
                    "message: set add_generation_prompt to false with it")
        return super().conflicting_field()

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return self._params(max_tokens, self.logprobs, default_temperature=1.0,
                            top_logprobs=(self.top_logprobs or 0) if self.logprobs else 0,
                            prompt_logprobs=self.prompt_logprobs)


class TokenizeRequest(ChatRendering):
    """vLLM's /tokenize: a prompt (text, chat template off) or chat messages (template on,
    rendered as for chat completions). add_special_tokens (vLLM's): whether the tokenizer adds
    its own (a BOS, for Llama 3); by default yes for a prompt, no for messages (the template
    writes them)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: Messages | None = None
    add_special_tokens: StrictBool | None = None

    def target(self) -> tuple[str | list[dict[str, Any]], bool]:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of `prompt` and `messages`")
        if self.messages is not None:
            return chat_dicts(self.messages), True
        return self.prompt, False


class DetokenizeRequest(BaseModel):
    model: Text | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]
