"""Training scripts (SFT, PPO/GRPO): config, wiring and the loop, on the engine contract and the
``posttrain`` library. They never import ``backends``."""
