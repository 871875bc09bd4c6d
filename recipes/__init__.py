"""Training loops (SFT, PPO/GRPO) that consume the engine contract."""
