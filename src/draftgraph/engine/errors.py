"""Errors the engine raises for requests it refuses (the server maps them to HTTP 4xx/503)."""


class EngineError(ValueError):
    """A request the engine refuses; the message says what to change."""


class QueueFullError(EngineError):
    """The waiting queue is full; retry later."""
