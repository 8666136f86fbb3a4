"""ServerConfig: what the HTTP layer needs beyond the engine's own configuration."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: no authentication
    # a file holding the key (first line), so that it does not show in `ps`
    api_key_file: str | None = None
    served_model_names: list[str] = field(default_factory=lambda: ["default"])
    retry_after_s: int = 1  # Retry-After of a 503 when the waiting queue is full
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413
    body_read_timeout_s: float = 30.0  # a body not received in this time gets 408
    # on shutdown: how long running requests may take to finish before their streams end
    # with an error event
    shutdown_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if not self.served_model_names or any(not n for n in self.served_model_names):
            raise ValueError("--served-model-name must be non-empty")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if not self.body_read_timeout_s > 0:
            raise ValueError(f"--body-read-timeout must be > 0 seconds, got "
                             f"{self.body_read_timeout_s}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got "
                             f"{self.shutdown_timeout_s}")
        if self.api_key_file is not None:
            if self.api_key:
                raise ValueError("give the API key with --api-key or --api-key-file, not both")
            self.api_key = _read_key_file(self.api_key_file)
        if self.api_key == "":
            self.api_key = None


def _read_key_file(path: str) -> str:
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            key = f.readline().strip()
    except OSError as e:
        raise ValueError(f"--api-key-file {path}: {e.strerror}") from None
    if not key:
        raise ValueError(f"--api-key-file {path} is empty: write the key on its first line")
    return key
