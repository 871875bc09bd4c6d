"""Supervised fine-tuning on the digit-sorting task, driven only through ``BaseEngine``.

Run it as ``python -m recipes.sft --config configs/sft_tiny.yaml [key=value ...]`` (dot-list
overrides, e.g. ``engine.micro_batch_size=2``), or under
``torchrun --nproc-per-node N -m recipes.sft ...`` for N data-parallel ranks. ``make run``
is the first form with the defaults.

Per step: the global batch of that step (``recipes.data.batch_at``) -> this rank's shard ->
``engine.train_batch``; rank 0 appends one JSON line to ``<output_dir>/metrics.jsonl``. At
the end the response is scored on held-out batches under ``eval_mode``. :func:`main`
returns the summary so tests call it in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine_api import BaseEngine, EngineConfig, NormContext, agg_loss, build_engine, ckpt_layout
from engine_api.dist import all_reduce, comm_device, is_initialized
from engine_api.typed_config import load_typed
from recipes import data as task
from recipes.common import TinyModelConfig, TrainerConfig, init_distributed, rank, with_model_path
from recipes.trainer_utils import SkipGuard, load_newest_valid, quiet_console, truncate_metrics

DEFAULT_CONFIG = "configs/sft_tiny.yaml"


# ---------------------------------------------------------------------------------- config
# The ``tiny_model`` and ``trainer`` sections (TinyModelConfig, TrainerConfig), init_distributed
# and with_model_path are shared with recipes.ppo and live in recipes.common.
@dataclass(frozen=True)
class SFTConfig:
    """Everything ``recipes.sft`` reads; ``configs/sft_tiny.yaml`` documents each key.

    Attributes:
        engine: the engine (``engine.strategy`` picks the backend).
        tiny_model: the model built when ``engine.model.path`` is null.
        data: the sorting task.
        trainer: the loop.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    tiny_model: TinyModelConfig = field(default_factory=TinyModelConfig)
    data: task.DataConfig = field(default_factory=task.DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def load_sft_config(path: str | os.PathLike | None = DEFAULT_CONFIG, overrides: Sequence[str] = ()) -> SFTConfig:
    """Load an :class:`SFTConfig` from YAML plus dot-list overrides.

    Raises:
        ValueError: every misspelt key, wrong type and invalid value at once.
    """
    return load_typed(SFTConfig, path, overrides)


# ---------------------------------------------------------------------------------- loss
def sft_loss(micro_batch: TensorDict, outputs: TensorDict, norm: NormContext) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the response tokens, aggregated per ``norm`` (the engine's
    ``loss_agg_mode``), plus this micro-batch's response token accuracy (p > 0.5).

    ``train_batch`` reports the plain mean of that accuracy over this rank's micro-batches, so
    the training ``token_acc`` is a rank-local progress signal; the end-of-run eval counts
    tokens exactly over every rank.
    """
    log_probs = outputs["log_probs"]
    mask = micro_batch["loss_mask"]
    loss = agg_loss(-log_probs, mask, norm)
    with torch.no_grad():
        m = mask.values() > 0
        hits = (log_probs.values().detach().exp() > 0.5) & m
        acc = float(hits.sum()) / max(int(m.sum()), 1)
    return loss, {"token_acc": acc}


# ---------------------------------------------------------------------------------- run
def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse ``--config`` and overrides, train, evaluate; return the summary (every rank).

    Returns:
        ``steps``, ``first_loss``, ``last_loss``, ``loss_ratio`` (first / last),
        ``eval_token_acc``, ``eval_seq_acc``, ``seconds``, ``world_size``,
        ``metrics_path``, ``model_path``.
    """
    args = _parse_args(argv)
    cfg = load_sft_config(args.config, args.overrides)
    started_dist = init_distributed(cfg.engine.dist_timeout_s)
    try:
        summary = run(cfg)
        if started_dist:
            # Tear down only when every rank is done: a gloo rank that closes its connections
            # while a peer is still inside a collective makes that peer abort. (Not on an
            # error: a failed rank must not wait for peers that may never arrive.)
            dist.barrier()
        return summary
    finally:
        if started_dist and is_initialized():
            dist.destroy_process_group()


def run(cfg: SFTConfig) -> dict[str, Any]:
    """Train and evaluate with an already-loaded config (``torch.distributed`` as the caller set it up)."""
    t0 = time.perf_counter()
    rank0 = rank() == 0
    os.makedirs(cfg.trainer.output_dir, exist_ok=True)
    cfg = with_model_path(cfg)

    engine = build_engine(cfg.engine)
    engine.init_model()
    engine.set_loss_fn(sft_loss)
    if cfg.data.batch_size % engine.dp_size:
        raise ValueError(
            f"data.batch_size = {cfg.data.batch_size}: not a multiple of the {engine.dp_size} data-parallel ranks; "
            f"fix: use a multiple of {engine.dp_size}"
        )

    ckpt_dir = os.path.join(cfg.trainer.output_dir, "checkpoints")
    start = _maybe_resume(engine, cfg, ckpt_dir)
    metrics_path = os.path.join(cfg.trainer.output_dir, cfg.trainer.metrics_file)
    losses = _train(engine, cfg, start, metrics_path, ckpt_dir, rank0)
    evaluation = _evaluate(engine, cfg)

    summary = {
        "steps": cfg.trainer.total_steps,
        "start_step": start,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "loss_ratio": losses[0] / losses[-1] if losses and losses[-1] > 0 else None,
        **evaluation,
        "seconds": round(time.perf_counter() - t0, 2),
        "world_size": dist.get_world_size() if is_initialized() else 1,
        "metrics_path": metrics_path,
        "model_path": cfg.engine.model.path,
    }
    if rank0:
        print(_summary_line(summary), flush=True)
    return summary


def _train(engine: BaseEngine, cfg: SFTConfig, start: int, metrics_path: str, ckpt_dir: str, rank0: bool) -> list[float]:
    """The loop; returns the loss of every step it ran."""
    from tqdm.auto import tqdm

    tc = cfg.trainer
    losses: list[float] = []
    bar = tqdm(total=tc.total_steps, initial=start, desc="sft", disable=not (rank0 and tc.progress_bar), dynamic_ncols=True)
    # A fresh run truncates the metrics file; a resumed one keeps the steps up to its checkpoint
    # (a killed run may have logged steps past it, which are replayed now) and appends.
    if rank0 and start:
        truncate_metrics(metrics_path, start)
    metrics_out = open(metrics_path, "a" if start else "w") if rank0 else contextlib.nullcontext()
    guard = SkipGuard(tc.max_consecutive_skips)
    # SFT never alternates with inference, so the model stays loaded for the whole loop
    # (with an offload policy this moves params/optimizer once, not once per step).
    with metrics_out as out, engine.train_mode():
        for step, batch in task.iter_batches(cfg.data, start, tc.total_steps):
            tokens = int(batch["input_ids"].values().numel())
            t_step = time.perf_counter()
            m = engine.train_batch(engine.shard_data(batch))
            seconds = time.perf_counter() - t_step
            loss = float(m["loss"])
            losses.append(loss)
            record = {
                "step": step + 1,
                "loss": loss,
                "grad_norm": float(m["grad_norm"]),
                "lr": m.get("lr"),
                "token_acc": m.get("token_acc"),
                "step_skipped": bool(m.get("step_skipped", 0.0)),
                "tokens": tokens,
                "tokens_per_s": tokens / seconds if seconds > 0 else None,
                "seconds": seconds,
            }
            if rank0:
                out.write(json.dumps(record) + "\n")
                out.flush()
                bar.set_postfix(loss=f"{loss:.3f}", acc=f"{record['token_acc'] or 0:.2f}", refresh=False)
                bar.update(1)
                if (step + 1) % tc.log_every == 0 or step + 1 == tc.total_steps:
                    bar.write(
                        f"step {step + 1:>5} | loss {loss:.4f} | grad_norm {record['grad_norm']:.3f} | "
                        f"lr {record['lr'] or 0:.2e} | token_acc {record['token_acc'] or 0:.3f} | "
                        f"{record['tokens_per_s'] or 0:,.0f} tok/s"
                    )
            guard.update(step + 1, record["step_skipped"])  # after the step is logged, before a checkpoint of it
            if tc.checkpoint_every and ((step + 1) % tc.checkpoint_every == 0 or step + 1 == tc.total_steps):
                engine.save_checkpoint(ckpt_dir, global_step=step + 1)
    bar.close()
    return losses


@torch.no_grad()
def _evaluate(engine: BaseEngine, cfg: SFTConfig) -> dict[str, float | None]:
    """Teacher-forced scores of the response on held-out batches.

    ``eval_token_acc``: fraction of response tokens with p(token | prefix) > 0.5, which
    makes the token the model's argmax. ``eval_seq_acc``: fraction of sequences where that
    holds for every response token; such a response is exactly what greedy decoding would
    generate, so this is a lower bound on greedy exact-match accuracy.
    """
    if cfg.data.eval_batches == 0:
        return {"eval_token_acc": None, "eval_seq_acc": None}
    # [correct tokens, response tokens, correct sequences, sequences]
    counts = torch.zeros(4, dtype=torch.float64)
    with engine.eval_mode():
        for i in range(cfg.data.eval_batches):
            local = engine.shard_data(task.eval_batch(cfg.data, i))
            predictions = engine.infer_batch(local)
            if predictions is None:  # a rank that produces no outputs (e.g. early pipeline stage)
                continue
            counts += _score(predictions["log_probs"], local["loss_mask"])
    # Summed over the whole world, not the DP group: model-parallel peers that also return
    # outputs count their shard the same number of times as every other shard, so the
    # ratios are unchanged, and ranks without outputs still learn the global result.
    counts = all_reduce(counts.to(comm_device(None)), "sum", None).cpu()
    return {
        "eval_token_acc": float(counts[0] / counts[1]) if counts[1] else None,
        "eval_seq_acc": float(counts[2] / counts[3]) if counts[3] else None,
    }


def _score(log_probs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[correct tokens, response tokens, fully correct sequences, sequences] of one shard."""
    lp = log_probs.values().detach().float().cpu()
    mask = loss_mask.values().cpu() > 0
    offsets = loss_mask.offsets().cpu()
    hit = (lp.exp() > 0.5) & mask
    seq = torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets[1:] - offsets[:-1])
    n_seq = offsets.numel() - 1
    wrong_per_seq = torch.zeros(n_seq).index_add(0, seq, (mask & ~hit).float())
    return torch.tensor([float(hit.sum()), float(mask.sum()), float((wrong_per_seq == 0).sum()), float(n_seq)], dtype=torch.float64)


# ---------------------------------------------------------------------------------- setup
def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m recipes.sft", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"YAML config (default: {DEFAULT_CONFIG})")
    parser.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. engine.micro_batch_size=2 trainer.total_steps=50")
    return parser.parse_intermixed_args(argv)


def _maybe_resume(engine: BaseEngine, cfg: SFTConfig, ckpt_dir: str) -> int:
    """The step to start from: 0, or the step of the newest checkpoint that verifies when
    resuming (``recipes.trainer_utils.load_newest_valid``)."""
    if not cfg.trainer.resume:
        return 0
    candidates = ckpt_layout.candidates(ckpt_dir)
    if not candidates:
        if rank() == 0:
            print(f"trainer.resume: no complete checkpoint under {ckpt_dir}; starting from step 0", flush=True)
        return 0
    step = load_newest_valid(candidates, lambda path: int(engine.load_checkpoint(path, del_local_after_load=False)), rank() == 0)
    if step >= cfg.trainer.total_steps and rank() == 0:
        print(f"trainer.resume: checkpoint is at step {step} >= trainer.total_steps = {cfg.trainer.total_steps}; nothing to train")
    return step


def _summary_line(s: dict[str, Any]) -> str:
    def f(x: float | None, spec: str) -> str:
        return "n/a" if x is None else format(x, spec)

    return (
        f"sft done: {s['steps'] - s['start_step']} steps on {s['world_size']} rank(s) in {s['seconds']:.1f}s | "
        f"loss {f(s['first_loss'], '.4f')} -> {f(s['last_loss'], '.4f')} ({f(s['loss_ratio'], '.1f')}x lower) | "
        f"eval token_acc {f(s['eval_token_acc'], '.3f')}, seq_acc {f(s['eval_seq_acc'], '.3f')} | metrics {s['metrics_path']}"
    )


if __name__ == "__main__":
    quiet_console()
    main(sys.argv[1:])
