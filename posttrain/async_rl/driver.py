"""The asynchronous RL driver: the rollout generates the batches of the next K steps while the
actor trains on the current one, under the staleness bound ``async.max_staleness`` (K).

One step ``s`` (the actor has made ``s`` updates: its weights are version ``s + 1``):

1. the rollout's weights become version ``s + 1`` (``Rollout.sync_weights``); nothing is being
   generated at that moment, so every response in flight pauses at a token boundary and no
   forward ever sees two versions;
2. admission: the prompts of steps up to ``s + K`` join the pipeline (the data cursor), never
   past the run's last step (``trainer.total_steps - 1``): nothing is generated to be dropped;
3. the responses of step ``s``'s batch that are still unfinished are finished now (the trainer
   waits for this part: ``async/trainer_wait_frac``);
4. one round of generation for the admitted batches ``s + 1 .. s + K``, under version ``s + 1``:
   with partial rollouts each unfinished batch ``b`` advances by ``ceil(units left / (b - s))``
   of its producer's budget units, spread over the steps it has left (single-turn: new tokens
   of every unfinished response, ``rollout.max_new_tokens`` being the budget; multi-turn: whole
   turns, ``env.max_turns`` being the budget, pausing between turns); without, a batch is
   generated whole in its first round. On a layout where the rollout has a Ray pool of its own
   this round runs WHILE step 5 trains (a driver thread); elsewhere before it;
5. the batch of step ``s`` is finished by its producer (scored) and the actor (and critic)
   train on it (the recipe's ``train``).

So batch ``b``'s tokens come from versions ``b + 1 - K .. b + 1`` and it is trained by version
``b + 1``: staleness (trainer version minus the OLDEST version of any of its tokens) <= K, and
a guard raises if it ever is not. K = 0 is the synchronous loop: batch ``s`` is generated whole
in step 3 with version ``s + 1``, with the seeds of ``Rollout.generate(prompts, seed_offset=s)``.

What produces a batch is a ``posttrain.async_rl.producer.Producer`` (single-turn sampling, or
the multi-turn agent loop): the driver plans rounds in its budget units and never learns which
one runs.

The schedule depends on the step, the data order and the settings only (never on timing),
so a run is reproducible bit for bit, and its state at a step boundary (the admitted batches and
their kept tokens, log-probs and versions) is checkpointed with the roles and restored on
resume (``posttrain.async_rl.state``; the producer restores its own work: multi-turn
trajectories paused between turns are rebuilt by replaying their kept turns through fresh
environments, ``AgentLoop.restore``).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.async_rl.config import AsyncConfig
from posttrain.async_rl.dynamic import DynamicSampling, refill_step
from posttrain.async_rl.producer import Producer, ScoredBatch
from posttrain.async_rl.state import Pending, has_state, load_state, prune_states, save_state, saved_batches
from posttrain.trainer_utils import truncate_metrics, warn
from roles.rollout import step_seeds

LEDGER_FILE = "prompt_ledger.jsonl"


@dataclass(frozen=True)
class Schedule:
    """What the pipeline reads of a run besides its ``async`` section.

    Attributes:
        batch_size: prompts per step (``data.batch_size``).
        n_samples: responses (trajectories) per prompt (``algo.n_samples``).
        seed: the rollout's base seed (``rollout.seed``).
        total_steps: the run's steps (``trainer.total_steps``): nothing past the last is admitted.
        output_dir: where the prompt ledger goes (``trainer.output_dir``).
    """

    batch_size: int
    n_samples: int
    seed: int
    total_steps: int
    output_dir: str


class Pipeline:
    """The asynchronous driver of one RL run (module docstring).

    Args:
        async_cfg: the ``async`` section.
        schedule: the rest of what it reads (:class:`Schedule`).
        producer: what makes and scores the batches (single-turn sampling, multi-turn
            trajectories).
        rollout: the ``Rollout`` role, or its Ray stand-in (``sample``, ``sync_weights``,
            ``release``; ``overlaps``: whether it runs on a pool of its own).
        source: the task (``prompts_at``).
        rank0: whether this process writes the ledger.
        score: the actor's per-token log-probs of a protocol batch (a jagged tensor): the
            ``async.check_version_parity`` probe; None: no probe.
        shape: reward shaping of a finished batch (``posttrain.reward_shaping``), before the
            dynamic-sampling filter and training; None: none.
        shape_runs_model: the shaping runs a model (``reward.model``'s scores): under dynamic
            sampling, where the shaping comes before the step's round, a rollout that shares
            this process's devices releases its memory first (its next ``generate`` resumes it),
            as it does before training.
        dynamic: DAPO's dynamic sampling (``posttrain.async_rl.dynamic``); None: off.
    """

    def __init__(
        self,
        async_cfg: AsyncConfig,
        schedule: Schedule,
        producer: Producer,
        rollout,
        source,
        rank0: bool,
        score: Callable[[Any], torch.Tensor] | None = None,
        shape: Callable[[ScoredBatch], ScoredBatch] | None = None,
        dynamic: DynamicSampling | None = None,
        shape_runs_model: bool = False,
    ) -> None:
        self.k, self.partial = async_cfg.max_staleness, async_cfg.partial_rollouts
        self.n, self.batch_size, self.seed = schedule.n_samples, schedule.batch_size, schedule.seed
        self.producer, self.rollout, self.source, self.rank0 = producer, rollout, source, rank0
        self.score = score if async_cfg.check_version_parity else None
        self.shape, self.dynamic, self.shape_runs_model = shape, dynamic, shape_runs_model
        self.refills: dict[int, list[list[int]]] = {}  # step -> each refill draw's prompt ids (the ledger)
        self.overlap = bool(getattr(rollout, "overlaps", False)) and self.score is None
        self.pending: dict[int, Pending] = {}
        self.cursor = 0  # the next step whose prompts are admitted
        self.last = schedule.total_steps - 1  # the last step: nothing past it is admitted
        self.ledger = os.path.join(schedule.output_dir, LEDGER_FILE)
        if self.k and not self.overlap:
            warn(
                [
                    f"async.max_staleness = {self.k}: the rollout shares its processes with training on this layout, so it cannot "
                    "generate while the actor trains; the asynchronous schedule runs (the same samples, staleness and metrics) but "
                    "without overlap, so no faster than K = 0; fix: trainer.launcher=ray with the rollout on a pool of its own "
                    "(docs/async.md)"
                ],
                rank0,
            )

    def settings(self) -> dict[str, Any]:
        """What a saved state depends on (a resume with other values regenerates instead)."""
        out = {"max_staleness": self.k, "partial_rollouts": self.partial, "n_samples": self.n}
        return {**out, **self.producer.settings()}

    # ------------------------------------------------------------------ checkpoint
    def save(self, ckpt_dir: str, step: int) -> None:
        """Checkpoint the state after ``step`` updates (before the roles' own checkpoints)."""
        if self.k and self.rank0:
            save_state(ckpt_dir, step, [self.pending[b] for b in sorted(self.pending)], self.settings(), self.producer.save)

    def after_save(self, ckpt_dir: str, step: int, role_steps: set[int]) -> None:
        """Drop saved states whose role checkpoints retention removed."""
        if self.k and self.rank0:
            prune_states(ckpt_dir, role_steps, step)

    def resume(self, ckpt_dir: str, start: int) -> None:
        """Restore the state saved with checkpoint step ``start`` and rewind the ledger.

        A run saved without in-flight batches (synchronous, or other settings) resumes with an
        empty pipeline: the batches from ``start`` on are generated again with the resumed
        weights, each still trained once (said in a warning, naming each setting that changed);
        so does a synchronous resume (K = 0) of a checkpoint that has batches in flight, and a
        resume that raised ``trainer.total_steps`` generates the batches the saving run never
        admitted (warned). A batch whose producer cannot continue its work (a multi-turn
        environment that does not replay) is generated again (the producer warns). The data
        order itself (``data.batch_size``, the seed, the files) is checked before, by
        ``posttrain.data_order``.

        Raises:
            ValueError: the state does not verify, or its prompts are not the data's.
        """
        if self.rank0:
            truncate_metrics(self.ledger, start)
        self.cursor = start
        if start == 0:
            return
        if not self.k:
            held = saved_batches(ckpt_dir, start)
            if held:
                warn(
                    [
                        f"trainer.resume: checkpoint step {start} holds {held} batch(es) in flight, saved by an asynchronous run; "
                        f"async.max_staleness = 0 drops them: the batches of steps {start}.. are generated again with the resumed "
                        "weights (every prompt is still trained exactly once; the run differs from an uninterrupted one); fix: "
                        "resume with the saving run's async.max_staleness to continue them"
                    ],
                    self.rank0,
                )
            return
        loaded = load_state(ckpt_dir, start)
        why = None
        if loaded is None:
            why = "no asynchronous state was saved with it" + (" (the run was synchronous)" if not has_state(ckpt_dir) else "")
        else:
            changed = _changed_settings(loaded[1], self.settings())
            if changed:
                why = f"its asynchronous state was made with other settings ({changed})"
        if why is not None:
            warn(
                [
                    f"trainer.resume: checkpoint step {start}: {why}; the batches of steps {start}.. are generated again with the "
                    "resumed weights (every prompt is still trained exactly once; the run differs from an uninterrupted one)"
                ],
                self.rank0,
            )
            return
        for p in loaded[0]:
            want = self._admitted(p.step)
            if len(want.prompts) != len(p.prompts) or any(not torch.equal(x, y) for x, y in zip(want.prompts, p.prompts, strict=True)):
                raise ValueError(
                    f"trainer.resume: the asynchronous state of checkpoint step {start} holds other prompts for step {p.step} than "
                    "the data gives now (data files, data.seed or data.batch_size changed); nothing was loaded; fix: resume with the "
                    "run's own data settings"
                )
            if p.saved is not None:
                tensors, meta = p.saved
                try:
                    p.work = self.producer.restore(tensors, meta, p.prompts, self._metas(p.step), p.seeds, start)
                except (KeyError, TypeError, ValueError) as exc:
                    raise ValueError(
                        f"trainer.resume: the asynchronous state of checkpoint step {start}, batch of step {p.step}, does not describe "
                        f"its work ({type(exc).__name__}: {exc}); nothing was loaded; fix: resume from another checkpoint step"
                    ) from None
                p.saved = None
            self.pending[p.step] = p
        self.cursor = max([start, *(b + 1 for b in self.pending)])
        ahead = min(start - 1 + self.k, self.last) + 1  # what an uninterrupted run of this length has admitted by now
        if self.cursor < ahead:
            warn(
                [
                    f"trainer.resume: checkpoint step {start} was saved by a run that ended at step {self.cursor} (trainer.total_steps "
                    f"was raised): the batches of steps {self.cursor + 1}..{ahead} were never admitted and are generated from now on "
                    "(every prompt is still trained exactly once; the run differs from an uninterrupted one of this length)"
                ],
                self.rank0,
            )

    # ------------------------------------------------------------------ one step
    def step(self, step: int, train: Callable[[ScoredBatch, dict], dict[str, Any]]) -> dict[str, Any]:
        """Run step ``step`` (module docstring); ``train(scored, timings)`` is the training half
        (the recipe's). Returns its metrics plus ``async/*``."""
        began = time.perf_counter()
        self.rollout.sync_weights(version=step + 1)
        while self.cursor <= min(step + self.k, self.last):
            self.pending[self.cursor] = self._admitted(self.cursor)
            self.cursor += 1
        current = self._started(self.pending[step])
        if not self.producer.finished(current.work):
            self.producer.advance(self.rollout, [(current.work, None)])
        filled = None
        if self.dynamic is not None:  # before the round: the refills need the rollout
            filled = self._fill(step, current)
        finished = time.perf_counter()
        plan = self._round_plan(step)
        round_s, error = [0.0], []

        def round_() -> None:
            t0 = time.perf_counter()
            try:
                self.producer.advance(self.rollout, plan)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the driver's thread
                error.append(exc)
            round_s[0] = time.perf_counter() - t0

        thread = None
        if plan and self.overlap:
            thread = threading.Thread(target=round_, name=f"rollout-round-{step}", daemon=True)
            thread.start()
        else:
            round_()
            if error:
                raise error[0]
            self.rollout.release()  # the engine's memory back to training (colocated)
        waited = time.perf_counter() - began  # the sync, the finish and a round that could not overlap
        try:
            del self.pending[step]
            scored = filled[0] if filled is not None else self._shaped(self.producer.finish(current.work))
            batch = scored.batch
            probe = self._version_parity(step, batch) if self.score is not None else {}
            stale = (step + 1) - batch["rollout_weight_version"]
            if int(stale.max()) > self.k:  # the schedule guarantees it; a bug must not train silently
                raise RuntimeError(f"async: a sample of step {step + 1} has staleness {int(stale.max())} > async.max_staleness {self.k}")
            m = train(scored, {"rollout_s": waited})
        except BaseException as exc:
            if thread is not None:
                thread.join()
            if error:  # the round failed first (e.g. a rollout worker died and the cluster went down): its error is the cause
                raise error[0] from exc
            raise
        if thread is not None:
            thread.join()
        if error:
            raise error[0]
        if thread is not None:
            self.rollout.release()
        wall = time.perf_counter() - began
        busy = (finished - began) + round_s[0]  # the sync and the finish, then the round
        m.update(self._metrics(batch, step, wall, waited, busy))
        if filled is not None:
            m.update(filled[1])
        m.update(probe)
        m["tokens_per_s"] = float(batch["loss_mask"].values().sum()) / max(wall, 1e-9)
        self._log_ledger(step, current)
        return m

    # ------------------------------------------------------------------ internals
    def _shaped(self, scored: ScoredBatch) -> ScoredBatch:
        return self.shape(scored) if self.shape is not None else scored

    def _fill(self, step: int, current: Pending) -> tuple[ScoredBatch, dict[str, float]]:
        """Step ``step``'s batch through the dynamic-sampling filter, with its refills
        (``posttrain.async_rl.dynamic``), and the filter's metrics."""

        def shaped(scored: ScoredBatch) -> ScoredBatch:
            if self.shape_runs_model and not getattr(self.rollout, "overlaps", False):
                self.rollout.release()  # the model's memory beside a colocated rollout's (vLLM sleeps)
            return self._shaped(scored)

        def draw(d: int) -> tuple[ScoredBatch, list[int]]:
            virtual = refill_step(step, d, self.dynamic.max_draws)
            p = self._admitted(virtual)
            return shaped(self.producer.produce(self.rollout, p.prompts, self._metas(virtual), p.seeds)), p.prompt_ids

        scored, refills, metrics = self.dynamic.fill(step, shaped(self.producer.finish(current.work)), draw)
        self.refills[step] = refills
        return scored, metrics

    def _admitted(self, step: int) -> Pending:
        prompts, _ = self.source.prompts_at(step)
        ids = [step * self.batch_size + i for i in range(len(prompts))]
        prompts = [torch.as_tensor(p, dtype=torch.long) for p in prompts for _ in range(self.n)]
        return Pending(step, ids, prompts, step_seeds(self.seed, step, len(prompts)))

    def _metas(self, step: int) -> list:
        """Step ``step``'s prompt rows, one per response (each ``n_samples`` times)."""
        return [m for m in self.source.prompts_at(step)[1] for _ in range(self.n)]

    def _started(self, p: Pending) -> Pending:
        if p.work is None:
            p.work = self.producer.start(p.step, p.prompts, self._metas(p.step), p.seeds)
        return p

    def _round_plan(self, step: int) -> list[tuple[Any, int | None]]:
        """``(work, units)`` of this step's background round (module docstring): every admitted
        batch after ``step`` whose work is unfinished, by ``ceil(units left / steps left)`` with
        partial rollouts; without, a batch not started yet, whole (None)."""
        plan = []
        for b in sorted(self.pending):
            if b <= step:
                continue
            p = self.pending[b]
            fresh = p.work is None
            work = self._started(p).work
            if self.producer.finished(work):
                continue
            if self.partial:
                plan.append((work, math.ceil((self.producer.budget - self.producer.used(work)) / (b - step))))
            elif fresh:
                plan.append((work, None))
        return plan

    def _version_parity(self, step: int, batch) -> dict[str, float]:
        """The ``check_version_parity`` probe: the trainer (version ``step + 1``) against the
        rollout's log-probs of the tokens version ``step + 1`` sampled, in ``batch`` and in
        flight (the round has run: the probe turns the overlap off)."""
        batches = [batch]
        rows = self.producer.in_flight([self.pending[b].work for b in sorted(self.pending) if self.pending[b].work is not None])
        if rows is not None:
            batches.append(rows)
        worst, tokens = 0.0, 0
        for b in batches:
            gap = (self.score(b).values() - b["rollout_log_probs"].values()).abs()
            mine = (b["loss_mask"].values() > 0) & (b["rollout_token_versions"].values() == step + 1)
            tokens += int(mine.sum())
            if mine.any():
                worst = max(worst, float(gap[mine].max()))
        return {"async/version_logprob_abs_diff_max": worst, "async/version_parity_tokens": float(tokens)}

    def _metrics(self, batch, step: int, wall: float, waited: float, busy: float) -> dict[str, float]:
        versions = batch["rollout_token_versions"]
        mask = batch["loss_mask"]
        spans = []
        for v, keep in zip(versions.unbind(), mask.unbind(), strict=True):
            response = v[keep > 0]
            spans.append(int(response.max() - response.min()) + 1 if len(response) else 1)
        stale = ((step + 1) - batch["rollout_weight_version"]).double()
        return {
            "async/staleness_max": float(stale.max()),
            "async/staleness_mean": float(stale.mean()),
            "async/version_span_max": float(max(spans)),
            "async/trainer_wait_frac": min(1.0, waited / max(wall, 1e-9)),
            "async/rollout_idle_frac": max(0.0, 1.0 - busy / max(wall, 1e-9)),
        }

    def _log_ledger(self, step: int, batch: Pending) -> None:
        refills = {"refill_prompt_ids": self.refills.pop(step)} if step in self.refills else {}
        if not self.rank0 or not self.k:
            return
        with open(self.ledger, "a") as f:
            f.write(json.dumps({"step": step + 1, "prompt_ids": batch.prompt_ids, **refills, **self.producer.ledger(batch.work)}) + "\n")


def _changed_settings(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """The settings that differ between a saved state and this run, named with both values
    ("" when none). A key the saved state lacks was not recorded by the run that wrote it (an
    older state file records fewer ``env.*`` settings) and is not compared."""
    keys = [k for k in now if k in saved and saved[k] != now[k]] + [k for k in saved if k not in now]
    return "; ".join(f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in keys)
