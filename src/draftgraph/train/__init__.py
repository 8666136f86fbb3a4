"""Drafter training against the engine's own target forward (the shared loop: train/loop.py;
chain heads: train/chain.py; block heads: train/block.py)."""
