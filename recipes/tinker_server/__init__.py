"""A Tinker-API-compatible server on Enginekit's engines (docs/tinker.md):
``python -m recipes.tinker_server --config configs/tinker_tiny.yaml``."""
