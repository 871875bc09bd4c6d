"""Rollout (inference) backends behind ``engine_api.rollout.BaseRollout``: ``hf`` (plain HF
sampling, always installed) and ``vllm`` (the optional ``vllm`` extra). Imported on first use
through ``engine_api.rollout_registry``."""
