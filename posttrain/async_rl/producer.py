"""The seam between the RL loop and whatever produces its batches: the :class:`Producer` protocol,
the :class:`ScoredBatch` every producer finishes into, and the single-turn producer.

A producer turns a step's prompts into a scored training batch, in pieces the asynchronous
pipeline (``posttrain.async_rl.driver``) can spread over weight versions:

* ``start(step, prompts, metas, seeds)`` -> its in-flight work for one batch;
* ``advance(rollout, plan)``: each planned batch by a number of budget units (``units``: new
  tokens for single-turn sampling, assistant turns for multi-turn trajectories), ``None`` for
  all that is left; one call for the whole round, so a producer may batch rows of several
  batches into one rollout call;
* ``used(work)`` (units advanced so far of ``budget``) and ``finished(work)``: what the round
  planner computes ``ceil(units left / steps left)`` from, once, for either producer;
* ``finish(work) -> ScoredBatch``: the training batch with its scores (the reward is computed
  inside the producer, in both modes), the trajectory of each row, the turn of each token (or
  None), the producer's metrics and a readable row per trajectory;
* ``save(work)`` / ``restore(...)``: in-flight work as tensors and JSON for a checkpoint.

Single-turn sampling (:class:`SingleTurn`, here) and the multi-turn agent loop
(``posttrain.agents.AgentLoop``) are the two producers today: a single-turn rollout is a
one-turn trajectory. The pipeline and the recipe never learn which one ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine_api.rollout import Sample
from roles.rollout import pack_samples, samples_to_batch, unpack_samples


@dataclass
class ScoredBatch:
    """A finished batch, ready to train.

    Attributes:
        batch: the protocol batch (``roles.rollout.rl_batch``), one row per training sample.
        scores: ``[T]`` float, each trajectory's (single-turn: each response's) reward.
        traj_of_row: ``[rows]`` the trajectory of each row (single-turn: ``arange``; a
            multi-turn trajectory split by ``env.history_mismatch=split`` has several rows).
        turns: flat ``[tokens]`` (aligned with the batch's jagged values): the assistant turn
            that sampled each token, -1 elsewhere; None for single-turn batches.
        metrics: the producer's own (``env/*``).
        texts: per trajectory ``{"prompt", "response", "reward"}`` (rank 0), or
            empty with ``describe`` set (made on demand: decoding every response each step
            costs more than the few rows a run logs).
        reward_s: seconds the reward took.
        describe: trajectory index -> its text row, when ``texts`` is empty.
        groups: ``[T]`` each trajectory's GRPO group, when not ``index // n_samples``.
        parts: ``{name: [T]}`` the components ``scores`` combines, per trajectory, when the
            reward has several (``reward.model``: ``function`` and ``model``); empty otherwise.
    """

    batch: Any
    scores: torch.Tensor
    traj_of_row: torch.Tensor
    turns: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    texts: list[dict[str, Any]] = field(default_factory=list)
    reward_s: float = 0.0
    describe: Callable[[int], dict[str, Any]] | None = None
    groups: torch.Tensor | None = None
    parts: dict[str, torch.Tensor] = field(default_factory=dict)

    def group_ids(self, n: int) -> torch.Tensor:
        """``[T]`` each trajectory's GRPO group: ``groups`` when the producer says (a batch whose
        failed sessions were left out), else consecutive groups of ``n`` (a prompt's samples)."""
        return self.groups if self.groups is not None else torch.arange(len(self.scores)) // n

    def text(self, i: int) -> dict[str, Any]:
        """Trajectory ``i`` as ``{"prompt", "response", "reward"}`` (texts are made on rank 0:
        elsewhere, empty strings)."""
        if self.texts:
            return self.texts[i]
        if self.describe is not None:
            return self.describe(i)
        return {"prompt": "", "response": "", "reward": float(self.scores[i])}

    def rows(self) -> list[dict[str, Any]]:
        """Every trajectory's ``{"prompt", "response", "stopped", "reward"}`` (``stopped``: ``stop``,
        or ``length`` when a length cap or the token budget ended it)."""
        out = []
        for i, cut in enumerate(self.truncated()):
            text = self.text(i)
            out.append(
                {"prompt": text["prompt"], "response": text["response"], "stopped": "length" if cut else "stop", "reward": text["reward"]}
            )
        return out

    def sample_rows(self, count: int, group: int) -> list[dict[str, Any]]:
        """``count`` trajectories' text rows for the logs: the first of each group of ``group``,
        then the second of each, and so on (a GRPO group of one prompt is not logged over and over)."""
        total = len(self.scores)
        order = [g * group + k for k in range(group) for g in range(total // group)][:count]
        return [self.text(i) for i in order]

    def turn_indices(self) -> list[int]:
        """The assistant turns that sampled a token of the batch (none for single-turn)."""
        if self.turns is None:
            return []
        return sorted(set(self.turns[self.batch["loss_mask"].values() > 0].tolist()))

    def truncated(self) -> list[int]:
        """Per trajectory: 1 when a length cap (or the token budget) ended it."""
        flags = [0] * len(self.scores)
        for row, traj in enumerate(self.traj_of_row.tolist()):
            flags[traj] = max(flags[traj], int(self.batch["rollout_truncated"][row]))
        return flags

    # ------------------------------------------------------------------ checkpointing
    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(tensors, meta)``: everything to rebuild it (:meth:`from_tensors`), for the
        asynchronous pipeline's checkpoint (tensors and JSON only; nothing pickled)."""
        from engine_api.moe import ROLLOUT_ROUTING_FIELD

        b = self.batch
        ids = b["input_ids"]
        out = {
            "lengths": ids.offsets().diff(),
            "ids": ids.values(),
            "turns": self.turns if self.turns is not None else torch.full_like(ids.values(), -1),
            "traj_of_row": self.traj_of_row,
            "scores": self.scores.double(),
            "prompt_len": b["prompt_len"],
            "rollout_truncated": b["rollout_truncated"],
        }
        for key in TOKEN_FIELDS + ((ROLLOUT_ROUTING_FIELD,) if ROLLOUT_ROUTING_FIELD in b.keys() else ()):
            out[key] = b[key].values()
        out.update({PART_PREFIX + name: part.double() for name, part in self.parts.items()})
        meta = {"metrics": self.metrics, "texts": self.texts, "temperature": float(b["temperature"])}
        return {k: v.contiguous().cpu() for k, v in out.items()}, meta

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> ScoredBatch:
        """The batch :meth:`to_tensors` described."""
        from engine_api.moe import ROLLOUT_ROUTING_FIELD
        from roles.rollout import rl_batch

        split = tensors["lengths"].tolist()
        rows = {k: list(tensors[k].split(split)) for k in ("ids", *TOKEN_FIELDS)}
        routing = list(tensors[ROLLOUT_ROUTING_FIELD].split(split)) if ROLLOUT_ROUTING_FIELD in tensors else None
        batch = rl_batch(
            rows["ids"],
            rows["loss_mask"],
            rows["rollout_log_probs"],
            rows["rollout_token_versions"],
            tensors["prompt_len"],
            tensors["rollout_truncated"],
            meta["temperature"],
            routing,
        )
        out = cls(batch, tensors["scores"], tensors["traj_of_row"], tensors["turns"], dict(meta["metrics"]), list(meta["texts"]))
        out.parts = {k.removeprefix(PART_PREFIX): v for k, v in tensors.items() if k.startswith(PART_PREFIX)}
        return out


TOKEN_FIELDS = ("loss_mask", "rollout_log_probs", "rollout_token_versions")
#: The key prefix of a reward component (``ScoredBatch.parts``) among ``to_tensors``' tensors.
PART_PREFIX = "reward_part/"


class Producer(Protocol):
    """What produces an RL run's batches (module docstring)."""

    units: str
    budget: int

    def settings(self) -> dict[str, Any]:
        """What in-flight work depends on (a saved state made with other values is regenerated)."""

    def start(self, step: int, prompts: list[torch.Tensor], metas: list, seeds: list[int]) -> Any:
        """The in-flight work of one batch (one entry per response / trajectory), nothing sampled."""

    def used(self, work: Any) -> int:
        """Budget units advanced so far."""

    def finished(self, work: Any) -> bool:
        """Every response (trajectory) of the batch has ended."""

    def advance(self, rollout: Any, plan: Sequence[tuple[Any, int | None]]) -> None:
        """Advance each planned batch by its units (None: to the end). Collective."""

    def finish(self, work: Any) -> ScoredBatch:
        """The scored training batch of finished work. Collective."""

    def produce(self, rollout: Any, prompts: list[torch.Tensor], metas: list, seeds: list[int]) -> ScoredBatch:
        """``start``, ``advance`` to the end and ``finish`` in one go (validation). Collective."""

    def save(self, work: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Work as tensors and JSON (a checkpoint)."""

    def restore(
        self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], prompts: list, metas: list, seeds: list[int], max_version: int
    ) -> Any:
        """Work saved by ``save``, live again (its samples' versions at most ``max_version``,
        the checkpoint's step); None when it cannot continue (the batch is regenerated, warned).

        Raises:
            ValueError: the tensors do not describe the batch, or hold values out of range.
        """

    def in_flight(self, works: Sequence[Any]) -> Any:
        """The rows ``works`` have sampled so far as one protocol batch (the version-parity
        probe), or None when there are none."""

    def close(self) -> None:
        """Release what the producer holds (worker processes); idempotent."""

    def ledger(self, work: Any) -> dict[str, Any]:
        """What the prompt ledger records of a trained batch besides its prompt ids (e.g. which
        sessions a resume started again); empty for most producers."""


# ---------------------------------------------------------------------------------- single turn
@dataclass
class Responses:
    """One single-turn batch in flight: prompts, their seeds and rows, each response so far."""

    prompts: list[torch.Tensor]
    metas: list
    seeds: list[int]
    samples: list[Sample | None]
    scored: ScoredBatch | None = None


class SingleTurn:
    """Single-turn sampling: each prompt's response, continued token-wise across weight updates
    (partial rollouts), scored by the task (``source.score``: the sorting task's scorer, or
    ``reward.function`` on the decoded text) when the batch is finished.

    Args:
        source: the task (``score``, ``decode``).
        max_new_tokens: a response's length cap (the budget, in tokens).
        temperature: the rollout temperature (batch metadata).
    """

    units = "tokens"

    def __init__(self, source, max_new_tokens: int, temperature: float) -> None:
        self.source, self.budget, self.temperature = source, max_new_tokens, temperature

    def settings(self) -> dict[str, Any]:
        return {"max_new_tokens": self.budget}

    def start(self, step: int, prompts: list[torch.Tensor], metas: list, seeds: list[int]) -> Responses:
        return Responses(list(prompts), list(metas), list(seeds), [None] * len(prompts))

    def _done(self, s: Sample | None) -> bool:
        return s is not None and (s.finish_reason == "stop" or len(s.token_ids) >= self.budget)

    def used(self, work: Responses) -> int:
        left = [0 if s is None else len(s.token_ids) for s in work.samples if not self._done(s)]
        return min(left, default=self.budget)

    def finished(self, work: Responses) -> bool:
        return all(self._done(s) for s in work.samples)

    def advance(self, rollout, plan: Sequence[tuple[Responses, int | None]]) -> None:
        """Every unfinished response of the planned batches by its batch's tokens (capped by
        what is left), one sampler call per distinct count (rows of several batches together),
        each row continuing from its kept tokens."""
        by_amount: dict[int, list[tuple[Responses, int]]] = {}
        for work, amount in plan:
            for i, s in enumerate(work.samples):
                if self._done(s):
                    continue
                left = self.budget - (0 if s is None else len(s.token_ids))
                by_amount.setdefault(left if amount is None else min(amount, left), []).append((work, i))
        for amount, rows in sorted(by_amount.items()):
            kept: list[Sample | None] = [w.samples[i] for w, i in rows]
            out = rollout.sample(
                [w.prompts[i] for w, i in rows],
                [w.seeds[i] for w, i in rows],
                kept=kept if any(k is not None for k in kept) else None,
                max_new_tokens=amount,
            )
            for (w, i), s in zip(rows, out, strict=True):
                w.samples[i] = s

    def finish(self, work: Responses) -> ScoredBatch:
        if work.scored is None:
            work.scored = self.score(samples_to_batch(work.prompts, work.samples, self.temperature), work.metas)
        return work.scored

    def score(self, batch, metas: list) -> ScoredBatch:
        """``batch`` (one sampled response per row, rows in ``metas``' order) scored by the task.
        Collective (the reward runs on rank 0)."""
        t0 = time.perf_counter()
        scores = self.source.score(responses(batch), metas)  # raises before any update when a reward fails
        reward_s = time.perf_counter() - t0
        out = ScoredBatch(batch, scores, torch.arange(len(scores)), reward_s=reward_s)
        out.describe = lambda i: self._describe(batch, scores, i)
        return out

    def produce(self, rollout, prompts: list[torch.Tensor], metas: list, seeds: list[int]) -> ScoredBatch:
        work = self.start(0, prompts, metas, seeds)
        self.advance(rollout, [(work, None)])
        return self.finish(work)

    def save(self, work: Responses) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return pack_samples(work.samples), {}

    def restore(self, tensors, meta, prompts: list, metas: list, seeds: list[int], max_version: int) -> Responses:
        samples = unpack_samples(tensors)
        if len(samples) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts, {len(samples)} response rows")
        for s in samples:
            if s is not None:
                check_sample(s, max_version, "a batch in flight")
        return Responses(list(prompts), list(metas), list(seeds), samples)

    def in_flight(self, works: Sequence[Responses]):
        rows = [(p, s) for w in works for p, s in zip(w.prompts, w.samples, strict=True) if s is not None]
        return samples_to_batch([p for p, _ in rows], [s for _, s in rows], self.temperature) if rows else None

    def close(self) -> None:
        pass

    def ledger(self, work: Responses) -> dict[str, Any]:
        return {}

    def _describe(self, batch, scores: torch.Tensor, i: int) -> dict[str, Any]:
        ids = batch["input_ids"]
        offsets, plen = ids.offsets().tolist(), int(batch["prompt_len"][i])
        seq = ids.values()[offsets[i] : offsets[i + 1]].tolist()
        return {"prompt": self.source.decode(seq[:plen]), "response": self.source.decode(seq[plen:]), "reward": float(scores[i])}


def check_sample(s: Sample, max_version: int | None, what: str) -> None:
    """A saved sample's weight versions (``0 .. max_version``) and sampling log-probs (finite,
    at most 0) are in range.

    Raises:
        ValueError: naming what holds it and the value.
    """
    versions, lps = s.versions(), s.log_probs
    if len(versions) and (int(versions.min()) < 0 or (max_version is not None and int(versions.max()) > max_version)):
        raise ValueError(f"{what}: a sample holds weight versions {int(versions.min())}..{int(versions.max())}, outside 0..{max_version}")
    if len(lps) and (not bool(torch.isfinite(lps).all()) or float(lps.max()) > 1e-4):
        raise ValueError(f"{what}: a sample holds sampling log-probs that are not finite numbers <= 0 (max {float(lps.max())})")


def responses(batch) -> list[torch.Tensor]:
    """Each sample's response token ids. Sliced from the jagged field's flat values: indexing
    a nested tensor row by row cost ~1 ms a row (measured: a third of a tiny GRPO step)."""
    ids = batch["input_ids"]
    values, offsets, plen = ids.values(), ids.offsets().tolist(), batch["prompt_len"].tolist()
    return [values[offsets[i] + int(plen[i]) : offsets[i + 1]] for i in range(len(plen))]
