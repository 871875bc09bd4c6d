"""Supervised fine-tuning, driven only through ``BaseEngine``: on the built-in digit-sorting
task by default, or on the user's model directory and data files.

Run it as ``python -m recipes.sft --config configs/sft_tiny.yaml [key=value ...]`` (dot-list
overrides, e.g. ``engine.micro_batch_size=2``), or under
``torchrun --nproc-per-node N -m recipes.sft ...`` for N data-parallel ranks. ``make sft``
is the first form with the defaults. Own data: ``engine.model.path=DIR
data.train_files=[a.jsonl] [data.val_files=[b.jsonl]]`` (formats: ``posttrain.text_data``).

Per step: the global batch of that step (``posttrain.sort_task.batch_at``, or the step's samples of
the files, ``posttrain.text_data.StepOrder``) -> this rank's shard -> ``engine.train_batch``;
rank 0 appends one JSON line to ``<output_dir>/metrics.jsonl``. Every ``trainer.val_every``
steps and at the end the validation data (held-out task batches, or ``data.val_files``) is
scored under ``eval_mode`` (loss and token accuracy of the response). :func:`main` returns the
summary so tests call it in-process.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from engine_api import BaseEngine, EngineConfig, NormContext, agg_loss, build_engine, ckpt_layout, make_batch
from engine_api.dist import all_reduce, comm_device, is_initialized
from engine_api.rollout import RolloutEngineConfig
from engine_api.rollout_registry import build_rollout
from engine_api.typed_config import load_typed
from posttrain import sort_task as task
from posttrain.data_order import check_order, files_order, save_order, sort_task_order
from posttrain.dist import rank
from posttrain.loggers import RunLog
from posttrain.placement import placement_problems
from posttrain.plots import plot_run
from posttrain.preemption import Preempted, PreemptionGuard, stop_while_starting
from posttrain.text_data import DataConfig, SFTDataset, StepOrder, load_tokenizer, report_counts, stop_token_ids
from posttrain.tiny_model import is_built_model
from posttrain.trainer_utils import SkipGuard, demo_setting_warnings, guard_fresh_run, load_newest_valid, quiet_console, run_cli, warn
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
from roles.rollout import Rollout, RolloutConfig

DEFAULT_CONFIG = "configs/sft_tiny.yaml"


# ---------------------------------------------------------------------------------- config
# The ``tiny_model`` and ``trainer`` sections (TinyModelConfig, TrainerConfig) and
# with_model_path are shared with recipes.ppo and live in recipes.common.
@dataclass(frozen=True)
class SFTConfig:
    """Everything ``recipes.sft`` reads; ``configs/sft_tiny.yaml`` documents each key.

    Attributes:
        engine: the engine (``engine.strategy`` picks the backend).
        tiny_model: the model built when ``engine.model.path`` is null.
        data: the sorting task, or the user's files (``posttrain.text_data.DataConfig``).
        trainer: the loop.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    tiny_model: TinyModelConfig = field(default_factory=TinyModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def _problems(self) -> list[str]:
        out = data_model_problems(self)
        if self.trainer.launcher == "ray":
            out += placement_problems(self.trainer.placement, ("actor",))  # SFT's one role
        return out


def load_sft_config(path: str | os.PathLike | None = DEFAULT_CONFIG, overrides: Sequence[str] = ()) -> SFTConfig:
    """Load an :class:`SFTConfig` from YAML plus dot-list overrides.

    Raises:
        ValueError: every misspelt key, wrong type and invalid value at once.
    """
    return load_typed(SFTConfig, path, overrides)


# ---------------------------------------------------------------------------------- loss
def sft_loss(micro_batch: TensorDict, outputs: TensorDict, norm: NormContext) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the response tokens, aggregated per ``norm`` (the engine's
    ``loss_agg_mode``), plus ``confident_token_acc``: the fraction of this micro-batch's response
    tokens the model gives p > 0.5. Such a token is the model's argmax with more than even odds,
    so this is a lower bound on greedy top-1 accuracy; it stays near 0 while a pretrained model
    spreads its probability over phrasings, and says nothing is wrong then (the loss is the
    signal). The engine returns only the target tokens' log-probs, not the logits, so the plain
    argmax accuracy is not computed.

    ``train_batch`` reports the plain mean over this rank's micro-batches, so the training value
    is a rank-local progress signal; the evaluation counts tokens exactly over every rank.
    """
    log_probs = outputs["log_probs"]
    mask = micro_batch["loss_mask"]
    loss = agg_loss(-log_probs, mask, norm)
    with torch.no_grad():
        m = mask.values() > 0
        hits = (log_probs.values().detach().exp() > 0.5) & m
        acc = float(hits.sum()) / max(int(m.sum()), 1)
    return loss, {"confident_token_acc": acc}


# ---------------------------------------------------------------------------------- run
def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse ``--config`` and overrides, train, evaluate; return the summary (every rank).

    Returns:
        ``steps``, ``first_loss``, ``last_loss``, ``loss_ratio`` (first / last),
        ``eval_loss``, ``eval_confident_token_acc``, ``eval_confident_seq_acc`` (``_evaluate``),
        ``data`` (row counts of the files: read, kept, truncated, dropped), ``seconds``,
        ``world_size``, ``metrics_path``, ``model_path``, ``hf_dir`` (``trainer.save_hf``).

    Raises:
        SystemExit: ``128 + signal`` after a SIGTERM / SIGINT stopped the run at a step
            boundary and its checkpoint was saved (``posttrain.preemption``).
    """
    return recipe_main(argv, "recipes.sft", __doc__, SFTConfig, DEFAULT_CONFIG, run)


def run(cfg: SFTConfig) -> dict[str, Any]:
    """Train and evaluate with an already-loaded config (``torch.distributed`` as the caller set
    it up; with ``trainer.launcher=ray`` the engine's ranks run in Ray workers driven from here).

    Raises:
        Preempted: a SIGTERM / SIGINT stopped the run at a step boundary (checkpoint saved).
    """
    t0 = time.perf_counter()
    rank0 = rank() == 0
    tc = cfg.trainer
    os.makedirs(tc.output_dir, exist_ok=True)
    lora = cfg.engine.model.lora.enabled
    own_model = cfg.engine.model.path is not None and not is_built_model(cfg.engine.model.path)  # a built model is not pretrained
    warn(demo_setting_warnings("sft", own_model, cfg.engine.optim.lr, lora), rank0)
    guard_fresh_run(tc.output_dir, tc.resume, tc.overwrite, rank0)  # before the tiny model is (re)built there
    cfg = with_model_path(cfg)
    data = SFTData(cfg.data, cfg.engine.model.path)  # before the engine: bad data fails fast

    with stop_while_starting("building the engine"):
        trainer = place_worker(cfg, SFTWorker, data)
    metrics_path = os.path.join(tc.output_dir, tc.metrics_file)
    bar = None
    try:
        ckpt_dir = os.path.join(tc.output_dir, "checkpoints")
        start = resume_step(trainer, cfg, ckpt_dir, data)
        bar = progress_bar(tc, start, rank0, "sft")
        with open_loggers(cfg, tc, start, rank0, bar) as run_log:
            losses = _train(trainer, cfg, data, start, ckpt_dir, run_log, bar)
            # A signal during the final evaluation or the export must not lose the trained
            # state: recorded, the stage in progress finishes, then the run stops saved.
            with PreemptionGuard() as late:
                evaluation, signum = _final_evaluation(trainer, late)
                if evaluation["eval_loss"] is not None:
                    run_log.message(_val_line("final evaluation", evaluation))
                hf_dir = None
                if signum is None and tc.save_hf:
                    hf_dir = trainer.save_hf(os.path.join(tc.output_dir, "hf"), tc.save_hf_format)
                    signum = late.stop_requested()
            if signum is not None:
                if not (tc.checkpoint_every or start >= tc.total_steps):  # the last step is not saved yet
                    save_step(trainer, data, ckpt_dir, tc.total_steps)
                raise Preempted(signum, tc.total_steps, os.path.join(ckpt_dir, f"{ckpt_layout.PREFIX}{tc.total_steps}"))
        world_size = trainer.world_size()
    finally:
        if bar is not None:
            bar.close()
        trainer.close()
        if rank0:
            plot_run(metrics_path, tc.output_dir, f"SFT on {'your data' if cfg.data.from_files else 'digit sorting'}")

    summary = {
        "steps": tc.total_steps,
        "start_step": start,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "loss_ratio": losses[0] / losses[-1] if losses and losses[-1] > 0 else None,
        **evaluation,
        "data": data.counts,
        "seconds": round(time.perf_counter() - t0, 2),
        "world_size": world_size,
        "metrics_path": metrics_path,
        "model_path": cfg.engine.model.path,
        "hf_dir": hf_dir,
    }
    if rank0:
        print(_summary_line(summary), flush=True)
    return summary


class SFTWorker(EngineWorker):
    """One rank's side of SFT: the engine, the validation batches and the logged generations,
    behind the calls the loop makes (``recipes.sft._train``), so the loop is the same whether
    it runs in this process or drives Ray workers (each of which holds one of these).

    Args:
        cfg: the config, ``engine.model.path`` filled in.
        data: the run's data (None: loaded here, as a Ray worker does).

    Raises:
        ValueError: ``data.batch_size`` not a multiple of the data-parallel ranks.
    """

    def __init__(self, cfg: SFTConfig, data: SFTData | None = None) -> None:
        self.cfg = cfg
        self.data = data if data is not None else SFTData(cfg.data, cfg.engine.model.path, report=False)
        self.engine = build_engine(cfg.engine)
        self.engine.init_model()
        self.engine.set_loss_fn(sft_loss)
        if cfg.data.batch_size % self.engine.dp_size:
            raise ValueError(
                f"data.batch_size = {cfg.data.batch_size}: not a multiple of the {self.engine.dp_size} data-parallel ranks; "
                f"fix: use a multiple of {self.engine.dp_size}"
            )
        self.val_batches = self.data.val_batches(self.engine.dp_size)
        self.generations = Generations(cfg, self.data, self.engine) if cfg.trainer.log_samples_every else None
        # SFT alternates with inference only at validation steps, so the model stays in train mode
        # between them (with an offload policy this moves params/optimizer once per stretch, not
        # once per step).
        self._training: contextlib.ExitStack | None = None

    def world_size(self) -> int:
        return dist.get_world_size() if is_initialized() else 1

    def train_step(self, batch: TensorDict) -> dict[str, Any]:
        """``engine.train_batch`` on this rank's shard of the global ``batch``; its metrics."""
        if self._training is None:
            self._training = contextlib.ExitStack()
            self._training.enter_context(self.engine.train_mode())
        return self.engine.train_batch(self.engine.shard_data(batch))

    def _leave_train_mode(self) -> None:
        if self._training is not None:
            self._training.close()  # one mode at a time: train mode ends before eval_mode
            self._training = None

    def has_validation(self) -> bool:
        return bool(self.val_batches)

    def evaluate(self) -> dict[str, float | None]:
        """Scores of the validation batches (``_evaluate``)."""
        self._leave_train_mode()
        return _evaluate(self.engine, self.val_batches)

    def eval_batch_count(self) -> int:
        return len(self.val_batches)

    def eval_counts(self, first: int, count: int) -> list[float]:
        """:func:`_eval_counts` of the validation batches ``first`` .. ``first + count - 1``
        (summed over the world). Collective."""
        self._leave_train_mode()
        return _eval_counts(self.engine, self.val_batches[first : first + count]).tolist()

    def sample_rows(self, step: int) -> list[dict[str, str]]:
        """The logged generations at ``step`` (``Generations.rows``)."""
        return self.generations.rows(step) if self.generations is not None else []

    def close(self) -> None:
        self._leave_train_mode()
        if self.generations is not None:
            self.generations.close()


class SFTData:
    """The batches of a run: the sorting task's, or the user's files' (``posttrain.text_data``)."""

    def __init__(self, cfg: DataConfig, model_path: str, report: bool = True) -> None:
        self.cfg = cfg
        self.counts: dict[str, dict[str, int]] = {}
        self.train = self.val = None
        if not cfg.from_files:
            return
        tokenizer = load_tokenizer(model_path)
        self.train = SFTDataset(cfg.train_files, tokenizer, cfg, "data.train_files")
        self.order = StepOrder(len(self.train), cfg.batch_size, cfg.seed, cfg.shuffle)
        if cfg.val_files:
            self.val = SFTDataset(cfg.val_files, tokenizer, cfg, "data.val_files")
        self.counts = report_counts({"train": self.train, "val": self.val}, cfg.overlong, report and rank() == 0)

    def data_order(self) -> dict[str, Any]:
        """What the batch of every step depends on (``posttrain.data_order``: recorded with the
        checkpoints, checked on resume): the order's keys and, with files, the training samples as
        tokenized (their number and a SHA-256 of their ids and loss masks)."""
        if self.train is None:
            return sort_task_order(self.cfg)
        h = hashlib.sha256()
        for ids, mask in self.train.samples:
            h.update(np.asarray(ids, dtype=np.int64).tobytes())
            h.update(np.asarray(mask, dtype=np.int8).tobytes())
            h.update(b"\0")
        return files_order(self.cfg, len(self.train.samples), h.hexdigest())

    def batch_at(self, step: int) -> TensorDict:
        """The global batch of training step ``step`` (0-based)."""
        if self.train is None:
            return task.batch_at(self.cfg, step)
        return self.train.batch(self.order.indices(step))

    def val_batches(self, dp_size: int) -> list[TensorDict]:
        """Every validation sample once, in batches of ``data.batch_size``; the last batch is
        filled up to a multiple of ``dp_size`` with copies of sample 0 whose loss mask is zero,
        so they change no score."""
        if self.train is None:
            return [task.eval_batch(self.cfg, i) for i in range(self.cfg.eval_batches)]
        if self.val is None:
            return []
        out, n, size = [], len(self.val), self.cfg.batch_size
        for begin in range(0, n, size):
            idx = list(range(begin, min(n, begin + size)))
            batch = self.val.batch(idx + [0] * (-len(idx) % dp_size))
            if batch.batch_size[0] > len(idx):  # the fill rows: sample 0 with an empty loss mask
                masks = list(batch["loss_mask"].unbind())
                masks[len(idx) :] = [torch.zeros_like(m) for m in masks[len(idx) :]]
                batch = make_batch(list(batch["input_ids"].unbind()), loss_mask=masks)
            out.append(batch)
        return out


def _train(trainer, cfg: SFTConfig, data: SFTData, start: int, ckpt_dir: str, run_log: RunLog, bar) -> list[float]:
    """The loop over ``trainer`` (an :class:`SFTWorker` or its Ray stand-in); returns the loss of
    every step it ran.

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
            tokens = int(batch["input_ids"].values().numel())
            t_step = time.perf_counter()
            m = trainer.train_step(batch)
            seconds = time.perf_counter() - t_step
            loss = float(m["loss"])
            losses.append(loss)
            record = {
                "loss": loss,
                "grad_norm": float(m["grad_norm"]),
                "lr": m.get("lr"),
                "confident_token_acc": m.get("confident_token_acc"),
                "step_skipped": bool(m.get("step_skipped", 0.0)),
                "tokens": tokens,
                "tokens_per_s": tokens / seconds if seconds > 0 else None,
                "seconds": seconds,
            }
            if data.train is not None:
                record["epoch"] = data.order.epoch(step)
            if tc.log_samples_every and (step + 1) % tc.log_samples_every == 0:
                run_log.log_samples(step + 1, trainer.sample_rows(step + 1))
            if validate and (step + 1) % tc.val_every == 0:
                scores = trainer.evaluate()
                record.update({f"val/{k[len('eval_') :]}": v for k, v in scores.items()})
                run_log.message(_val_line(f"validation at step {step + 1}", scores))
            run_log.log(step + 1, record)
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            bar.update(1)
            guard.update(step + 1, record["step_skipped"])  # after the step is logged, before a checkpoint of it
            checkpoint_or_stop(trainer, data, ckpt_dir, step + 1, tc, preemption)
    return losses


class Generations:
    """Greedy generations of a few held-out prompts (``trainer.log_samples_every``), logged with
    the reference response: the prompt is a sample's tokens before its first trained token, the
    reference its first trained span.

    Sampled by an ``hf`` rollout engine (``backends/rollout/hf.py``, through
    ``engine_api.rollout_registry``) whose weights are synced from the engine before each
    logging, so it costs one more model copy on every rank, built on first use; ``top_k`` 1
    makes it greedy, and responses stop at the model's end-of-turn / EOS ids or after the longest
    reference plus 16 tokens. The prompts: the validation data's first rows (the training data's
    without validation files; held-out batches for the sorting task), the same at every logging.
    """

    def __init__(self, cfg: SFTConfig, data: SFTData, engine: BaseEngine) -> None:
        self.cfg, self.data, self.engine = cfg, data, engine
        self.rollout: Rollout | None = None
        source = data.val if data.val is not None else data.train
        batch = source.batch(list(range(min(cfg.trainer.log_samples, len(source))))) if source is not None else task.eval_batch(cfg.data, 0)
        self.prompts, self.references = [], []
        for ids, mask in zip(batch["input_ids"].unbind(), batch["loss_mask"].unbind(), strict=True):
            trained = (mask > 0).nonzero().flatten()
            if trained.numel() == 0:
                continue
            begin = int(trained[0])
            end = begin + int((mask[begin:] > 0).int().cumprod(0).sum())  # the first trained span
            self.prompts.append(ids[:begin])
            self.references.append(ids[begin:end])
        self.prompts, self.references = self.prompts[: cfg.trainer.log_samples], self.references[: cfg.trainer.log_samples]
        if data.train is not None:
            self.tokenizer = load_tokenizer(cfg.engine.model.path)
            self.stop_ids = stop_token_ids(self.tokenizer, cfg.engine.model.path)
        else:
            self.tokenizer, self.stop_ids = None, [task.EOS]

    def _decode(self, ids: torch.Tensor) -> str:
        return task.render(ids.tolist()) if self.tokenizer is None else self.tokenizer.decode(ids.tolist(), skip_special_tokens=False)

    def _build(self) -> Rollout:
        cfg = self.cfg
        engine = build_rollout(
            "hf",
            RolloutEngineConfig(model_path=cfg.engine.model.path, tokenizer_path=cfg.engine.model.path if self.tokenizer else None),
        )
        longest = max((len(r) for r in self.references), default=1)
        settings = RolloutConfig(
            backend="hf", max_new_tokens=longest + 16, temperature=1.0, top_k=1, sync_bucket_mb=512, lora_sync="merged"
        )
        return Rollout(self.engine, engine, settings, stop_token_ids=self.stop_ids)

    def rows(self, step: int) -> list[dict[str, str]]:
        """Generate (collective: every rank calls it at the same step) and return the rows."""
        if not self.prompts:
            return []
        self.rollout = self.rollout or self._build()
        self.rollout.sync_weights(version=step)
        out = self.rollout.generate(self.prompts, seed_offset=0)
        self.rollout.release()
        return [
            {
                "prompt": self._decode(p),
                "response": self._decode(out["input_ids"][i][int(out["prompt_len"][i]) :]),
                "reference": self._decode(r),
            }
            for i, (p, r) in enumerate(zip(self.prompts, self.references, strict=True))
        ]

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.engine.shutdown()


def _val_line(what: str, scores: dict[str, float | None]) -> str:
    def f(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    return (
        f"{what}: loss {f(scores['eval_loss'])} | confident_token_acc {f(scores['eval_confident_token_acc'])} | "
        f"confident_seq_acc {f(scores['eval_confident_seq_acc'])}"
    )


@torch.no_grad()
def _evaluate(engine: BaseEngine, batches: list[TensorDict]) -> dict[str, float | None]:
    """Teacher-forced scores of the response (loss-mask tokens) on ``batches``.

    ``eval_loss``: mean negative log-likelihood per response token over all batches.
    ``eval_confident_token_acc``: fraction of response tokens with p(token | prefix) > 0.5, which
    makes the token the model's argmax. ``eval_confident_seq_acc``: fraction of sequences (with a
    response) where that holds for every response token; such a response is exactly what greedy
    decoding would generate, so this is a lower bound on greedy exact-match accuracy.
    """
    if not batches:
        return _scores(torch.zeros(5, dtype=torch.float64))
    return _scores(_eval_counts(engine, batches))


def _scores(counts: torch.Tensor) -> dict[str, float | None]:
    """The three scores from the summed ``[NLL, correct tokens, response tokens, correct
    sequences, sequences]``."""
    return {
        "eval_loss": float(counts[0] / counts[2]) if counts[2] else None,
        "eval_confident_token_acc": float(counts[1] / counts[2]) if counts[2] else None,
        "eval_confident_seq_acc": float(counts[3] / counts[4]) if counts[4] else None,
    }


# The final evaluation checks for a stop signal between parts of about this many batches each
# (at most _EVAL_PARTS parts): a SIGTERM lands in a scheduler's grace period (often 30 s), and
# an evaluation of hundreds of batches took minutes before the trained state was saved.
_EVAL_PARTS = 16


def _final_evaluation(trainer, late) -> tuple[dict[str, float | None], int | None]:
    """The end-of-run evaluation in up to :data:`_EVAL_PARTS` parts, with the signal check
    (``late.stop_requested``, agreed by every rank) before each: ``(scores, signal)``; a signal
    stops it where it is (scores None: the resumed run evaluates again)."""
    n = trainer.eval_batch_count()
    part = max(1, -(-n // _EVAL_PARTS))
    counts = torch.zeros(5, dtype=torch.float64)
    for first in range(0, n, part):
        signum = late.stop_requested()
        if signum is not None:
            return _scores(torch.zeros(5, dtype=torch.float64)), signum
        counts += torch.tensor(trainer.eval_counts(first, part), dtype=torch.float64)
    return _scores(counts), late.stop_requested()


@torch.no_grad()
def _eval_counts(engine: BaseEngine, batches: list[TensorDict]) -> torch.Tensor:
    """``[summed NLL, correct tokens, response tokens, correct sequences, sequences]`` of
    ``batches``, summed over the world. Collective."""
    counts = torch.zeros(5, dtype=torch.float64)
    with engine.eval_mode():
        for batch in batches:
            local = engine.shard_data(batch)
            predictions = engine.infer_batch(local)
            if predictions is None:  # a rank that produces no outputs (e.g. early pipeline stage)
                continue
            counts += _score(predictions["log_probs"], local["loss_mask"])
    # Summed over the whole world, not the DP group: model-parallel peers that also return
    # outputs count their shard the same number of times as every other shard, so the
    # ratios are unchanged, and ranks without outputs still learn the global result.
    return all_reduce(counts.to(comm_device(None)), "sum", None).cpu()


def _score(log_probs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[summed NLL, correct tokens, response tokens, fully correct sequences, sequences with a
    response] of one shard."""
    lp = log_probs.values().detach().double().cpu()
    mask = loss_mask.values().cpu() > 0
    offsets = loss_mask.offsets().cpu()
    hit = (lp.exp() > 0.5) & mask
    seq = torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets[1:] - offsets[:-1])
    n_seq = offsets.numel() - 1
    wrong_per_seq = torch.zeros(n_seq).index_add(0, seq, (mask & ~hit).float())
    has_response = torch.zeros(n_seq).index_add(0, seq, mask.float()) > 0
    return torch.tensor(
        [
            float(-(lp * mask).sum()),
            float(hit.sum()),
            float(mask.sum()),
            float(((wrong_per_seq == 0) & has_response).sum()),
            float(has_response.sum()),
        ],
        dtype=torch.float64,
    )


# ---------------------------------------------------------------------------------- setup
def save_step(trainer, data: SFTData, ckpt_dir: str, step: int) -> None:
    """The checkpoint of ``step``, with the data order it is a position in written beside it
    first (rank 0; ``posttrain.data_order``)."""
    if rank() == 0:
        save_order(ckpt_dir, data.data_order())
    trainer.save_checkpoint(ckpt_dir, step)


def checkpoint_or_stop(trainer, data, ckpt_dir: str, step: int, tc: TrainerConfig, preemption) -> None:
    """The end of training step ``step`` (1-based) in a supervised-style loop (SFT, DPO, reward
    model): its checkpoint when ``trainer.checkpoint_every`` (or the last step) says so; then, if a
    SIGTERM / SIGINT arrived (``preemption.stop_requested``, agreed by every rank), the checkpoint
    (once) and :class:`Preempted`.

    Raises:
        Preempted: a stop was requested; the step's checkpoint is saved."""
    saved = tc.checkpoint_every and (step % tc.checkpoint_every == 0 or step == tc.total_steps)
    if saved:
        save_step(trainer, data, ckpt_dir, step)
    signum = preemption.stop_requested()
    if signum is not None:
        if not saved:
            save_step(trainer, data, ckpt_dir, step)
        raise Preempted(signum, step, os.path.join(ckpt_dir, f"{ckpt_layout.PREFIX}{step}"))


def resume_step(trainer, cfg: SFTConfig, ckpt_dir: str, data: SFTData) -> int:
    """The step to start from: 0, or the step of the newest checkpoint that verifies when
    resuming (``posttrain.trainer_utils.load_newest_valid``). A resume under another data order
    than the checkpoints were trained in is refused (``posttrain.data_order``)."""
    if not cfg.trainer.resume:
        return 0
    candidates = ckpt_layout.candidates(ckpt_dir)
    if candidates:  # a step is a position in the data order: another order is refused before loading
        check_order(ckpt_dir, data.data_order(), rank() == 0)
    if not candidates:
        if rank() == 0:
            print(f"trainer.resume: no complete checkpoint under {ckpt_dir}; starting from step 0", flush=True)
        return 0
    step = load_newest_valid(candidates, trainer.load_checkpoint, rank() == 0)
    if step >= cfg.trainer.total_steps and rank() == 0:
        print(f"trainer.resume: checkpoint is at step {step} >= trainer.total_steps = {cfg.trainer.total_steps}; nothing to train")
    return step


def _summary_line(s: dict[str, Any]) -> str:
    def f(x: float | None, spec: str) -> str:
        return "n/a" if x is None else format(x, spec)

    return (
        f"sft done: {s['steps'] - s['start_step']} steps on {s['world_size']} rank(s) in {s['seconds']:.1f}s | "
        f"loss {f(s['first_loss'], '.4f')} -> {f(s['last_loss'], '.4f')} ({f(s['loss_ratio'], '.1f')}x lower) | "
        f"eval loss {f(s['eval_loss'], '.4f')}, confident_token_acc {f(s['eval_confident_token_acc'], '.3f')}, "
        f"confident_seq_acc {f(s['eval_confident_seq_acc'], '.3f')} | "
        f"metrics {s['metrics_path']}" + (f" | HF model {s['hf_dir']}" if s["hf_dir"] else "")
    )


if __name__ == "__main__":
    quiet_console()
    run_cli(lambda: main(sys.argv[1:]))
