"""Evaluation without training: score an RL config's validation prompts with its reward function,
from an HF model directory (the base model, or a run's ``hf/`` export) or from an actor checkpoint
of a run; and generation from the same sources (``recipes.generate``).

Run: ``python -m recipes.evaluate --config CONFIG [key=value ...]`` with the run's own config (its
data, reward and rollout keys) and, to score a checkpoint, ``eval.checkpoint=OUT/checkpoints/actor``
(its newest complete step) or ``.../actor/global_step_N``; without ``eval.checkpoint`` the weights
are ``engine.model.path``'s (point it at an export: ``engine.model.path=OUT/hf``).

The scoring is the training run's validation (``recipes.ppo.validate``): ``eval.samples_per_prompt``
responses per validation prompt (``data.val_files``; the sorting task's held-out prompts without
files), sampled with the ``rollout`` settings from the fixed validation seeds, so one sample per
prompt from the checkpoint of step N reproduces the run's ``val/reward`` at step N. Rank 0 writes
every response (prompt, response, reward, why it stopped) to ``<trainer.output_dir>/<eval.output_file>``
and the summary to ``eval_summary.json`` next to it, and prints the summary. Nothing is trained and
the checkpoint is only read.

Assumptions: a checkpoint is loaded into the actor engine the config describes (``engine.*``, LoRA
included, ``engine.model.path`` as the base architecture), as a resumed run would; the evaluation
runs in this process or under ``torchrun`` (not on Ray).
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from engine_api.dist import is_initialized
from engine_api.typed_config import load_typed
from posttrain.agents.loop import load_env_code
from posttrain.agents.producer import build_producer, producer_sections
from posttrain.cli import parse_recipe_args
from posttrain.dist import init_distributed, rank
from posttrain.evaluation import mean_reward, validation_batches
from posttrain.rl_setup import build_rollout_role, fit_rollout_to_machine, rollout_model_problems
from posttrain.tasks import build_task
from posttrain.trainer_utils import quiet_console, run_cli
from recipes.common import with_model_path
from recipes.ppo import PPOConfig
from roles.rollout import Rollout

DEFAULT_CONFIG = "configs/grpo_tiny.yaml"


@dataclass(frozen=True)
class EvalSection:
    """What to evaluate and where the results go.

    Attributes:
        checkpoint: an actor checkpoint of a run: its checkpoint root (``OUT/checkpoints/actor``:
            the newest complete step) or one step's directory (``.../global_step_N``). null:
            the weights of ``engine.model.path`` (an HF directory or a run's export).
        samples_per_prompt: responses per prompt (1: the training run's validation exactly).
        output_file: the responses, one JSON line each, under ``trainer.output_dir``.
    """

    checkpoint: str | None = None
    samples_per_prompt: int = 1
    output_file: str = "eval.jsonl"

    def _problems(self) -> list[str]:
        out = []
        if self.samples_per_prompt < 1:
            out.append(f"samples_per_prompt = {self.samples_per_prompt}: must be >= 1; fix: e.g. 1 or 8")
        if self.checkpoint is not None and not os.path.isdir(self.checkpoint):
            out.append(
                f"checkpoint = {self.checkpoint!r}: no such directory; fix: a run's OUT/checkpoints/actor (or one of its global_step_N)"
            )
        if not self.output_file or os.sep in self.output_file:
            out.append(f"output_file = {self.output_file!r}: must be a file name (it goes under trainer.output_dir); fix: e.g. eval.jsonl")
        return out


@dataclass(frozen=True)
class EvalConfig(PPOConfig):
    """A training run's config (``recipes.ppo.PPOConfig``) plus the ``eval`` section."""

    eval: EvalSection = field(default_factory=EvalSection)

    def _problems(self) -> list[str]:
        out = super()._problems()
        if self.trainer.launcher != "torchrun":
            out.append(
                f"trainer.launcher = {self.trainer.launcher!r}: evaluation runs in this process (or under torchrun), not on a "
                "cluster; fix: trainer.launcher=torchrun"
            )
        if self.data.from_files and not self.data.val_files:
            out.append("data.val_files = []: evaluation scores the validation prompts; fix: data.val_files=[your_val.jsonl]")
        return out


def load_policy(cfg: PPOConfig, checkpoint: str | None, source) -> tuple[Rollout, Any, int | None]:
    """The rollout role sampling from the weights to evaluate, the actor it was synced from
    (None without a checkpoint) and the checkpoint's step (None: ``engine.model.path``'s
    weights, which the rollout engine loads itself). Collective."""
    refused = rollout_model_problems(cfg)
    if refused:
        raise ValueError("; ".join(refused))
    if checkpoint is None:
        return build_rollout_role(cfg, None, source), None, None
    from roles.factory import build_roles

    actor = build_roles(cfg, include=["actor"]).actor
    step = actor.load_checkpoint(checkpoint)
    rollout = build_rollout_role(cfg, actor, source)
    rollout.sync_weights(version=step + 1)  # the version a run's step step + 1 samples from
    return rollout, actor, step


def run(cfg: EvalConfig) -> dict[str, Any]:
    """Load the weights, score the validation prompts, write the responses; return the summary.
    The scoring is the run's own producer's (``posttrain.agents.producer.build_producer``): a
    multi-turn run (``env.function``) is scored through its environment and reward function,
    exactly as its training run validates."""
    rank0 = rank() == 0
    if cfg.env.enabled:
        load_env_code(cfg.env)  # a misspelt environment fails before the data and the engine
    source = build_task(cfg.data, cfg.engine.model.path, cfg.reward)
    producer = build_producer(source, **producer_sections(cfg))
    rollout, _, step = load_policy(cfg, cfg.eval.checkpoint, source)
    try:
        prompts, metas = source.val_prompts()
        n = cfg.eval.samples_per_prompt
        prompts = [p for p in prompts for _ in range(n)]
        metas = [m for m in metas for _ in range(n)]
        chunk = cfg.data.batch_size * cfg.algo.n_samples  # the training run's validation calls
        batches = validation_batches(producer, rollout, prompts, metas, chunk, cfg.rollout.seed)
    finally:
        rollout.engine.shutdown()
        producer.close()
    rows = [row for b in batches for row in b.rows()]
    rewards = [row["reward"] for row in rows]
    summary = {
        "weights": cfg.eval.checkpoint or cfg.engine.model.path,
        "checkpoint_step": step,
        "prompts": len(rows) // n,
        "samples_per_prompt": n,
        "val/reward": mean_reward(batches),  # as the training run's validation sums it
        "val/reward_std": statistics.pstdev(rewards),
        "val/response_len": statistics.fmean(len(r["response"]) for r in rows) if rows else 0.0,
    }
    if rank0:
        os.makedirs(cfg.trainer.output_dir, exist_ok=True)
        path = os.path.join(cfg.trainer.output_dir, cfg.eval.output_file)
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        with open(os.path.join(cfg.trainer.output_dir, "eval_summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(
            f"evaluated {summary['weights']}{f' (step {step})' if step is not None else ''}: mean reward {summary['val/reward']:.4f} over "
            f"{len(rows)} responses to {summary['prompts']} prompts; responses in {path}"
        )
    return summary


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse ``--config`` + overrides, evaluate, return the summary."""
    return launch(argv, "python -m recipes.evaluate", __doc__, EvalConfig, run)


def launch(argv: Sequence[str] | None, prog: str, doc: str, config_cls: type, run_fn) -> Any:
    """The command line of an evaluation-side recipe: parse and load ``config_cls``, start the
    process group under torchrun, fit the config as the RL recipe does (vLLM on a CPU, the tiny
    model), ``run_fn(cfg)``, and tear the group down."""
    config_path, overrides = parse_recipe_args(
        argv, prog=prog, description=doc.split("\n\n")[0], config_cls=config_cls, default_config=DEFAULT_CONFIG
    )
    cfg = load_typed(config_cls, config_path, overrides)
    started = init_distributed(cfg.engine.dist_timeout_s)
    try:
        return run_fn(with_model_path(fit_rollout_to_machine(cfg, rank() == 0)))
    finally:
        if started and is_initialized():
            dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    quiet_console()
    run_cli(main)
