"""A Tinker-API-compatible server on Enginekit's engines (docs/tinker.md):
``python -m tinker_server --config configs/tinker_tiny.yaml``."""
