"""DAPO's dynamic sampling (``algo.dynamic_sampling``): a step trains on prompt groups whose
rewards differ, drawing more prompts until the batch is full.

A group whose responses all got the same reward (after any reward shaping) has no learning
signal under a group baseline: its advantages are 0. With dynamic sampling on, such groups are
dropped when the step's batch is finished, and the producer samples more prompts, ``data.batch_size``
at a time, until ``data.batch_size`` groups with a spread are in hand (the surplus of the last draw
is dropped, as in DAPO) or ``algo.dynamic_sampling_max_draws`` draws (the step's own included) are
spent: then the step stops with an error naming the step and the counts, never a smaller batch.

Where the refills come from: draw ``d >= 1`` of step ``s`` takes the prompts of the virtual step
``REFILL_STEP_OFFSET + s * max_draws + d`` of the task (``source.prompts_at``: the sorting task's
seeded prompts, or the data files' shuffled order, an epoch far ahead), sampled with that virtual
step's seeds. So a refill is a function of the step and the draw alone (no counter to checkpoint):
a resumed run draws the same refills as an uninterrupted one, and no refill repeats a regular
step's positions in the data order. Refills are sampled with the step's current weights, when
the step's batch is finished and before the next round starts (staleness 0; under
``async.max_staleness = K`` the step's own rows keep their staleness <= K). The prompt ledger
records each draw's prompt ids (``refill_prompt_ids``).

Metrics: ``dynamic_sampling/draws`` (batches sampled for the step, 1 = no refill),
``dynamic_sampling/prompts_drawn``, ``dynamic_sampling/groups_dropped`` (no spread),
``dynamic_sampling/groups_surplus`` (kept but past the batch), ``dynamic_sampling/reward_drawn``
(the mean reward over every drawn response; ``reward`` is the trained batch's). The producer's own
metrics (``env/*``) are the step's first draw's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from posttrain.async_rl.producer import PART_PREFIX, TOKEN_FIELDS, ScoredBatch

REFILL_STEP_OFFSET = 5 * 10**8  # below the sorting task's held-out prompts (10**9)


def refill_step(step: int, draw: int, max_draws: int) -> int:
    """The virtual step whose prompts are draw ``draw`` (>= 1) of ``step``."""
    return REFILL_STEP_OFFSET + step * max_draws + draw


def groups_with_spread(scored: ScoredBatch, n: int) -> tuple[list[int], int]:
    """``(trajectories of the groups whose rewards differ, in order; the number of groups)``."""
    gids = scored.group_ids(n).tolist()
    members: dict[int, list[int]] = {}
    for t, g in enumerate(gids):
        members.setdefault(g, []).append(t)
    keep = []
    for trajs in members.values():
        s = scored.scores[trajs]
        if len(trajs) >= 2 and bool(s.max() != s.min()):
            keep.append(trajs)
    return keep, len(members)


def assemble(parts: list[tuple[ScoredBatch, list[list[int]]]]) -> ScoredBatch:
    """One scored batch of the given groups (each a list of trajectories) of each part, in order:
    rows, per-token fields, scores, reward parts, turns and texts carried; groups numbered anew."""
    from engine_api.moe import ROLLOUT_ROUTING_FIELD

    token_keys = ("ids", "turns", *TOKEN_FIELDS)
    cols: dict[str, list[torch.Tensor]] = {k: [] for k in (*token_keys, ROLLOUT_ROUTING_FIELD, "lengths")}
    prompt_len, truncated, traj_of_row, scores, groups, origin = [], [], [], [], [], []
    reward_parts: dict[str, list[torch.Tensor]] = {name: [] for name in parts[0][0].parts}
    temperature, reward_s = None, 0.0
    for scored, kept in parts:
        tensors, meta = scored.to_tensors()
        temperature = meta["temperature"] if temperature is None else temperature
        reward_s += scored.reward_s
        split = tensors["lengths"].tolist()
        rows = {k: tensors[k].split(split) for k in token_keys + ((ROLLOUT_ROUTING_FIELD,) if ROLLOUT_ROUTING_FIELD in tensors else ())}
        new_index = {}
        for trajs in kept:
            gid = groups[-1] + 1 if groups else 0
            for t in trajs:
                new_index[t] = len(scores)
                scores.append(scored.scores[t])
                for name, part in reward_parts.items():
                    part.append(scored.parts[name][t])
                groups.append(gid)
                origin.append((scored, t))
        for r, t in enumerate(tensors["traj_of_row"].tolist()):
            if t not in new_index:
                continue
            for k, v in rows.items():
                cols[k].append(v[r])
            cols["lengths"].append(tensors["lengths"][r : r + 1])
            prompt_len.append(tensors["prompt_len"][r : r + 1])
            truncated.append(tensors["rollout_truncated"][r : r + 1])
            traj_of_row.append(new_index[t])
    out = {k: torch.cat(v) for k, v in cols.items() if v}
    out.update(
        prompt_len=torch.cat(prompt_len),
        rollout_truncated=torch.cat(truncated),
        traj_of_row=torch.tensor(traj_of_row),
        scores=torch.stack(scores).double(),
        **{PART_PREFIX + name: torch.stack(part).double() for name, part in reward_parts.items()},
    )
    first = parts[0][0]
    merged = ScoredBatch.from_tensors(out, {"metrics": first.metrics, "texts": [], "temperature": temperature})
    merged.scores = merged.scores.to(first.scores.dtype)
    if all(scored.turns is None for scored, _ in parts):
        merged.turns = None
    merged.groups = torch.tensor(groups)
    merged.reward_s = reward_s
    merged.describe = lambda i: origin[i][0].text(origin[i][1])
    return merged


@dataclass(frozen=True)
class DynamicSampling:
    """The filter and its refills for one run (module docstring).

    Attributes:
        batch_size: groups a step trains on (``data.batch_size``).
        n_samples: responses per prompt (the group).
        max_draws: batches a step may sample, its own included.
    """

    batch_size: int
    n_samples: int
    max_draws: int

    def fill(
        self, step: int, scored: ScoredBatch, draw: Callable[[int], tuple[ScoredBatch, list[int]]]
    ) -> tuple[ScoredBatch, list[list[int]], dict[str, float]]:
        """The step's training batch: ``scored``'s groups with a spread, then refills
        (``draw(d)`` -> the scored batch of draw ``d`` and its prompt ids) until ``batch_size``
        groups. Returns the batch, the prompt ids of each refill, and the metrics. ``scored``
        itself when every group has a spread (bit for bit the same step as without the filter).

        Raises:
            RuntimeError: ``max_draws`` draws left fewer than ``batch_size`` groups with a spread
                (nothing was trained).
        """
        keep, total = groups_with_spread(scored, self.n_samples)
        parts, refills = [(scored, keep)], []
        drawn = [scored.scores]
        kept = len(keep)
        while kept < self.batch_size:
            d = len(parts)
            if d >= self.max_draws:
                raise RuntimeError(
                    f"algo.dynamic_sampling: step {step + 1}: {d} draw(s) of {self.batch_size} prompts gave {kept} group(s) whose "
                    f"rewards differ, fewer than data.batch_size = {self.batch_size}; nothing was trained; fix: raise "
                    f"algo.dynamic_sampling_max_draws (now {self.max_draws}), use a denser reward or more samples per prompt "
                    "(algo.n_samples), or turn algo.dynamic_sampling off"
                )
            extra, ids = draw(d)
            more, count = groups_with_spread(extra, self.n_samples)
            total += count
            parts.append((extra, more))
            refills.append(ids)
            drawn.append(extra.scores)
            kept += len(more)
        surplus = kept - self.batch_size
        if surplus:  # the last draw's extra groups are dropped (DAPO)
            extra, more = parts[-1]
            parts[-1] = (extra, more[: len(more) - surplus])
        metrics = {
            "dynamic_sampling/draws": float(len(parts)),
            "dynamic_sampling/prompts_drawn": float(total),
            "dynamic_sampling/groups_dropped": float(total - kept),
            "dynamic_sampling/groups_surplus": float(surplus),
            "dynamic_sampling/reward_drawn": float(torch.cat([s.double() for s in drawn]).mean()),
        }
        if len(parts) == 1 and len(keep) == total:
            return scored, refills, metrics
        return assemble(parts), refills, metrics
