"""ModelConfig: the shape of a Llama-family decoder, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, field

# the fields of an HF config.json without a default here
HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads")


@dataclass
class ModelConfig:
    """Architecture of a Llama-family model (Llama 2/3, SmolLM2, Qwen2/2.5, Mistral).

    `layer_types[i]` is "full_attention" or "sliding_attention"; sliding layers attend to the
    last `sliding_window` positions including the query itself (HF semantics:
    q_pos - kv_pos < sliding_window).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0 means hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, or {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; {"rope_type": "linear", "factor"} is also accepted.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "llama"

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not self.layer_types:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"invalid model config ({self.name}): {msg}")

        for attr in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            need(getattr(self, attr) > 0, f"{attr} must be positive, got {getattr(self, attr)}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads={self.num_attention_heads} is not a multiple of "
             f"num_key_value_heads={self.num_key_value_heads}")
        need(len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries for "
             f"{self.num_hidden_layers} layers")
        for t in self.layer_types:
            need(t in ("full_attention", "sliding_attention"), f"unknown layer type {t!r}")
        if "sliding_attention" in self.layer_types:
            need(bool(self.sliding_window) and self.sliding_window > 0,
                 "sliding layers need a positive sliding_window")

    def is_sliding(self, layer_id: int) -> bool:
        return self.layer_types[layer_id] == "sliding_attention"

    @property
    def has_sliding_layers(self) -> bool:
        return "sliding_attention" in self.layer_types

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict, name: str = "llama",
                     source: str = "config.json") -> ModelConfig:
        """Build from a Hugging Face `config.json` dictionary (Llama, Qwen2, Mistral);
        ValueError naming `source` when it lacks a field the shape needs."""
        missing = [k for k in HF_REQUIRED if k not in cfg]
        if missing:
            raise ValueError(f"{source} lacks {', '.join(missing)}")
        arch = (cfg.get("model_type") or name).lower()
        sliding = cfg.get("sliding_window")
        layer_types = list(cfg.get("layer_types") or [])
        n_layers = cfg["num_hidden_layers"]
        if arch == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding = None  # Qwen2 ships a sliding_window value it does not use by default
        if arch == "qwen2" and sliding and not layer_types:
            max_window_layers = cfg.get("max_window_layers", n_layers)
            layer_types = ["sliding_attention" if i >= max_window_layers else "full_attention"
                           for i in range(n_layers)]
        if layer_types and "sliding_attention" not in layer_types:
            sliding = None
        eos = cfg.get("eos_token_id")
        eos_ids = list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and isinstance(cfg.get("rope_parameters"), dict):
            params = dict(cfg["rope_parameters"])
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(cfg.get("rope_parameters"), dict):
            rope_theta = cfg["rope_parameters"].get("rope_theta")
        if rope_scaling is not None:
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rtype == "default":
                rope_scaling = None
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=cfg.get("head_dim") or 0,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            sliding_window=sliding if (sliding and (layer_types or arch == "mistral")) else None,
            layer_types=layer_types,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=arch,
        )
