"""Scripts that run a peer library in its own environment (no Enginekit import)."""
