"""ServerConfig: what the HTTP layer needs beyond the engine's own configuration."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: no authentication
    served_model_names: list[str] = field(default_factory=lambda: ["default"])
    retry_after_s: int = 1  # Retry-After of a 503 when the waiting queue is full

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if not self.served_model_names or any(not n for n in self.served_model_names):
            raise ValueError("--served-model-name must be non-empty")
        if self.api_key == "":
            self.api_key = None
