"""The multi-turn demo in one command: build its assets (a tiny model with a ChatML template and
a tool-using task, ``posttrain.agents.demo``), then run ``configs/agent_tiny.yaml`` on them.

Run: ``python -m recipes.agent_demo [--assets=DIR] [key=value ...]`` (overrides go to the recipe;
the assets go to ``outputs/agent_tiny/assets`` unless ``--assets`` says otherwise, and are reused
when present).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from posttrain.agents.demo import DEFAULT_ASSETS, build_assets
from recipes import ppo


def main(argv: Sequence[str] | None = None) -> dict:
    """Build the assets, then train on ``configs/agent_tiny.yaml`` with ``argv``'s overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    assets = next((a.split("=", 1)[1] for a in argv if a.startswith("--assets=")), DEFAULT_ASSETS)
    overrides = [a for a in argv if not a.startswith("--assets=")]
    if assets != DEFAULT_ASSETS:
        overrides = [
            f"engine.model.path={assets}/model",
            f"data.train_files=[{assets}/train.jsonl]",
            f"data.val_files=[{assets}/val.jsonl]",
            *overrides,
        ]
    build_assets(assets)
    return ppo.main(["--config", "configs/agent_tiny.yaml", *overrides])


if __name__ == "__main__":
    main()
