"""Training backends behind the engine_api contract; each registers itself on import."""
