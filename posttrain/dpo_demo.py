"""The DPO demo's starting model (``configs/dpo_tiny.yaml``, ``trainer.setup``): the tiny sorting
model after a short SFT on the demo's prompts (2-3 digits), built on first use, so DPO starts from
a model that sorts some prompts and not others (as DPO usually starts from an SFT model)."""

from __future__ import annotations

from posttrain.distill_demo import build_teacher

START_DIR = "outputs/dpo_tiny_start"  # relative to the working directory, as the config's engine.model.path
SFT_STEPS = 60


def build_start(out_dir: str = START_DIR, steps: int = SFT_STEPS) -> str:
    """``<out_dir>/hf``: the SFT model after ``steps`` steps, trained now unless it is there."""
    return build_teacher(out_dir, steps, "the DPO demo's starting model")
