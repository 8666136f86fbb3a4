"""Drafter training against the engine's own target forward (chain heads: train/chain.py)."""
