"""Preference learning (DPO, IPO, SimPO) on the engine, driven only through ``BaseEngine``: on
preference pairs of the built-in sorting task by default, or on the user's model and pair files.

Run it as ``python -m recipes.dpo --config configs/dpo_tiny.yaml [key=value ...]``, or under
``torchrun --nproc-per-node N -m recipes.dpo ...`` for N data-parallel ranks. Own data:
``engine.model.path=DIR data.train_files=[pairs.jsonl] [data.val_files=[...]]`` (the columns:
``posttrain.preference_data``).

Per step: the step's ``data.batch_size`` pairs (``2 x`` rows, chosen then rejected) -> the
reference's log-prob sums (a frozen copy of the starting model; with LoRA the same engine with
its adapters off, no second copy; none for SimPO) -> ``roles.preference.PreferencePolicy.update``
(a forward-only pass for the pair losses' exact weights, then one ``train_batch``). Rank 0
appends one JSON line to ``<output_dir>/metrics.jsonl``: ``loss`` (the pairs' mean loss before
the step), ``dpo/rewards_chosen``, ``dpo/rewards_rejected``, ``dpo/margin``, ``dpo/accuracy``,
``grad_norm``, ``lr``. Every ``trainer.val_every`` steps and at the end the validation pairs are
scored (``val/dpo/*``, exact over every pair). Checkpoints and ``trainer.resume`` as SFT's.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_api import EngineConfig, build_engine
from posttrain.data.tokenizer import load_tokenizer
from posttrain.dist import rank
from posttrain.placement import placement_problems
from posttrain.plots import plot_run
from posttrain.preemption import PreemptionGuard, stop_while_starting
from posttrain.preference_data import PreferenceData, PreferenceDataConfig
from posttrain.tiny_model import is_built_model
from posttrain.trainer_utils import SkipGuard, demo_setting_warnings, guard_fresh_run, quiet_console, run_cli, warn
from recipes.common import (
    EngineWorker,
    TinyModelConfig,
    TrainerConfig,
    data_model_problems,
    open_loggers,
    place_worker,
    progress_bar,
    recipe_main,
    with_model_path,
)
from recipes.sft import checkpoint_or_stop, resume_step
from roles.preference import AGG_MODE, PairTotals, PreferenceConfig, PreferencePolicy
from roles.reference import Reference

DEFAULT_CONFIG = "configs/dpo_tiny.yaml"


@dataclass(frozen=True)
class DPOConfig:
    """Everything ``recipes.dpo`` reads; ``configs/dpo_tiny.yaml`` documents each key.

    ``data.batch_size`` is the number of pairs per step (twice as many rows).

    Attributes:
        engine: the policy's engine; the reference's is the same keys, frozen (LoRA: none).
        tiny_model: the model built when ``engine.model.path`` is null.
        data: the sorting task's pairs, or the user's pair files (``posttrain.preference_data``).
        dpo: the preference loss (``roles.preference``).
        trainer: the loop.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    tiny_model: TinyModelConfig = field(default_factory=TinyModelConfig)
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    dpo: PreferenceConfig = field(default_factory=PreferenceConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def _problems(self) -> list[str]:
        return pair_recipe_problems(self, "DPO")


def pair_recipe_problems(cfg, what: str) -> list[str]:
    """What a recipe on preference pairs (DPO, a reward model) refuses in ``cfg``: the data and
    model checks, an aggregation mode other than the pair mean, generations."""
    out = data_model_problems(cfg)
    if cfg.engine.loss_agg_mode != AGG_MODE:
        out.append(
            f"engine.loss_agg_mode = {cfg.engine.loss_agg_mode}: {what}'s loss is a mean over pairs (each pair two rows, "
            f"each row its tokens' sum); fix: engine.loss_agg_mode={AGG_MODE}"
        )
    if cfg.trainer.log_samples_every:
        out.append(f"trainer.log_samples_every: {what} logs no generations; fix: trainer.log_samples_every=0")
    if cfg.trainer.launcher == "ray":
        out += placement_problems(cfg.trainer.placement, ("actor",))  # one group: the policy (and its reference)
    return out


class PairWorker(EngineWorker):
    """One rank's side of a recipe on preference pairs (DPO, a reward model): the engine, the
    validation batches, the checkpoints (as SFT's worker, so the loop shares SFT's save and
    resume) and the export, behind the calls the loop makes; the same under torchrun (this
    process) and on Ray (one per worker, :func:`recipes.common.place_on_ray`).

    Args:
        cfg: the recipe's config, ``engine.model.path`` filled in.
        data: the run's pairs (None: loaded here, as a Ray worker does).
    """

    def __init__(self, cfg, data: PreferenceData | None = None) -> None:
        self.cfg = cfg
        if data is None:
            data = PreferenceData(cfg.data, load_tokenizer(cfg.engine.model.path) if cfg.data.from_files else None)
        self.val_batches = data.val_batches()

    def has_validation(self) -> bool:
        return bool(self.val_batches)

    def close(self) -> None:
        """Nothing held beyond the engines (on Ray the stand-in's ``close`` ends the workers)."""


class DPOTrainer(PairWorker):
    """One rank's side of DPO: the policy and its reference (:class:`PairWorker`)."""

    def __init__(self, cfg: DPOConfig, data: PreferenceData | None = None) -> None:
        super().__init__(cfg, data)
        engine = build_engine(cfg.engine)
        engine.init_model()
        check_pair_batch(cfg, engine)
        reference = None
        if cfg.dpo.uses_reference:
            if cfg.engine.model.lora.enabled:
                reference = Reference(engine)  # the same model with its adapters off
            else:
                frozen = build_engine(_frozen(cfg.engine))
                frozen.init_model()
                reference = Reference(frozen)
        self.policy = PreferencePolicy(engine, cfg.dpo, reference)
        self.engine = engine
        self._reference_cache: dict[int, torch.Tensor] = {}

    def train_step(self, batch) -> dict[str, Any]:
        return self.policy.update(batch)

    def evaluate(self) -> dict[str, float]:
        """``dpo/*`` over every validation pair (the current weights; reference sums cached:
        the reference never changes)."""
        totals = PairTotals()
        for i, batch in enumerate(self.val_batches):
            if i not in self._reference_cache and self.cfg.dpo.uses_reference:
                self._reference_cache[i] = self.policy.reference_sums(batch)
            totals.add(self.policy.pair_values(batch, self._reference_cache.get(i)))
        return totals.metrics()


def _frozen(engine: EngineConfig) -> EngineConfig:
    return dataclasses.replace(engine, frozen=True)


def check_pair_batch(cfg, engine) -> None:
    """Refuse a step batch (``data.batch_size`` pairs, twice as many rows) that the data-parallel
    ranks do not divide, before any training.

    Raises:
        ValueError: naming the batch size, the row count and the ranks."""
    if engine.dp_size > 1 and (2 * cfg.data.batch_size) % engine.dp_size:
        raise ValueError(
            f"data.batch_size = {cfg.data.batch_size} pairs ({2 * cfg.data.batch_size} rows): not a multiple of the "
            f"{engine.dp_size} data-parallel ranks; fix: a batch size whose row count they divide"
        )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse ``--config`` and overrides, train, return the summary (every rank).

    Raises:
        SystemExit: ``128 + signal`` after a SIGTERM / SIGINT stopped the run at a step
            boundary and its checkpoint was saved.
    """
    return recipe_main(argv, "recipes.dpo", __doc__, DPOConfig, DEFAULT_CONFIG, run)


def run(cfg: DPOConfig, trainer_cls: type | None = None, prefix: str = "dpo", title: str | None = None) -> dict[str, Any]:
    """Train with an already-loaded config; the summary (every rank). The loop of every recipe
    on preference pairs: ``trainer_cls(cfg, data)`` (a :class:`PairWorker`: default
    :class:`DPOTrainer`; the reward model's ``recipes.reward_model.RMTrainer``), here or on Ray
    workers (``trainer.launcher``), gives ``train_step``, ``evaluate`` and the worker's calls;
    its metrics are named ``<prefix>/*``.

    Raises:
        Preempted: a SIGTERM / SIGINT stopped the run at a step boundary (checkpoint saved).
    """
    trainer_cls = trainer_cls or DPOTrainer
    t0 = time.perf_counter()
    rank0 = rank() == 0
    tc = cfg.trainer
    os.makedirs(tc.output_dir, exist_ok=True)
    own_model = cfg.engine.model.path is not None and not is_built_model(cfg.engine.model.path)
    warn(demo_setting_warnings("sft", own_model, cfg.engine.optim.lr, cfg.engine.model.lora.enabled), rank0)
    guard_fresh_run(tc.output_dir, tc.resume, tc.overwrite, rank0)
    cfg = with_model_path(cfg)
    data = PreferenceData(cfg.data, load_tokenizer(cfg.engine.model.path) if cfg.data.from_files else None)
    if rank0:
        for name, counts in data.counts.items():
            print(f"[enginekit] data.{name}_files: {counts}", flush=True)
    with stop_while_starting("building the engines"):
        trainer = place_worker(cfg, trainer_cls, data)
    ckpt_dir = os.path.join(tc.output_dir, "checkpoints")
    metrics_path = os.path.join(tc.output_dir, tc.metrics_file)
    bar = None
    losses: list[float] = []
    try:
        start = resume_step(trainer, cfg, ckpt_dir, data)
        bar = progress_bar(tc, start, rank0, "dpo")
        with open_loggers(cfg, tc, start, rank0, bar) as run_log:
            losses = _train(trainer, cfg, data, start, ckpt_dir, run_log, bar, prefix)
            final = trainer.evaluate() if trainer.has_validation() else {}
            if final:
                run_log.message("final validation: " + _line(final))
            hf_dir = trainer.save_hf(os.path.join(tc.output_dir, "hf"), tc.save_hf_format) if tc.save_hf else None
    finally:
        if bar is not None:
            bar.close()
        trainer.close()
        if rank0:
            plot_run(metrics_path, tc.output_dir, title or f"{cfg.dpo.loss} preference learning")
    summary = {
        "steps": tc.total_steps,
        "start_step": start,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        **{f"val/{k}": v for k, v in final.items()},
        "seconds": round(time.perf_counter() - t0, 2),
        "metrics_path": metrics_path,
        "model_path": cfg.engine.model.path,
        "hf_dir": hf_dir,
    }
    if rank0:
        print(f"{prefix} done: {tc.total_steps - start} steps | loss {summary['first_loss']} -> {summary['last_loss']} | " + _line(final))
    return summary


def _line(metrics: dict[str, float]) -> str:
    return " | ".join(f"{k.split('/', 1)[-1]} {v:.4f}" for k, v in metrics.items())


def _train(trainer, cfg, data: PreferenceData, start: int, ckpt_dir: str, run_log, bar, prefix: str = "dpo") -> list[float]:
    """The loop; the pairs' loss of every step it ran.

    Raises:
        Preempted: after saving the checkpoint of the step a SIGTERM / SIGINT arrived in.
    """
    tc = cfg.trainer
    losses: list[float] = []
    guard = SkipGuard(tc.max_consecutive_skips)
    validate = bool(tc.val_every) and trainer.has_validation()
    with PreemptionGuard() as preemption:
        for step in range(start, tc.total_steps):
            batch = data.batch_at(step)
            t_step = time.perf_counter()
            m = trainer.train_step(batch)
            seconds = time.perf_counter() - t_step
            losses.append(m[f"{prefix}/loss"])
            record = {
                "loss": m[f"{prefix}/loss"],
                **{k: v for k, v in m.items() if k.startswith(f"{prefix}/") and k != f"{prefix}/loss"},
                "grad_norm": float(m["grad_norm"]),
                "lr": m.get("lr"),
                "step_skipped": bool(m.get("step_skipped", 0.0)),
                "tokens": int(batch["input_ids"].values().numel()),
                "seconds": seconds,
            }
            if data.train is not None:
                record["epoch"] = data.order.epoch(step)
            if validate and (step + 1) % tc.val_every == 0:
                scores = trainer.evaluate()
                record.update({f"val/{k}": v for k, v in scores.items()})
                run_log.message(f"validation at step {step + 1}: " + _line(scores))
            run_log.log(step + 1, record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)
            bar.update(1)
            guard.update(step + 1, record["step_skipped"])
            checkpoint_or_stop(trainer, data, ckpt_dir, step + 1, tc, preemption)
    return losses


if __name__ == "__main__":
    quiet_console()
    run_cli(lambda: main(sys.argv[1:]))
