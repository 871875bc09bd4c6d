"""``RewardModel``: a scalar-head model (the critic's model class, ``model.head: value``) that
scores whole sequences, and its Bradley-Terry training on preference pairs, on ``BaseEngine``
calls only.

**The score** of a sequence is the head's value at its last token, as HF's
``AutoModelForSequenceClassification`` computes it (the hidden state of the last token through
the one-output ``score`` layer) and as the RL anchors read a reward model. The engine's values
are aligned to the token they predict (``values[i]`` from the hidden state at ``i - 1``), so the
role appends one token (:data:`SCORE_TOKEN`; causal attention: it changes no earlier hidden
state) and reads the value at that position: exactly the sequence-classification score of the
sequence as given. An exported model loads in HF as ``AutoModelForSequenceClassification``
(``posttrain.export.save_hf``) and gives the same scores.

**Bradley-Terry training**: per pair ``L = -log sigmoid(r_c - r_r)`` (the reward model loss of
Ouyang et al. 2022, TRL's ``RewardTrainer``), mean over pairs. As for DPO
(``roles.preference``), one step takes a forward-only pass for the scores and the pair weights
``g = dL/dr``, then trains the linear surrogate ``sum g_row * r_row / pairs`` under
``seq-mean-token-sum``: exact at any micro-batching and DP size.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict

from engine_api import BaseEngine, agg_loss, make_batch
from engine_api.batch import attach
from roles.common import TrainableRole, infer_global
from roles.preference import AGG_MODE

#: The token appended to read the last real token's score (any id works: it is never attended).
SCORE_TOKEN = 0
#: The per-token field of the training pass: each row's ``g`` at its score position.
SCORE_WEIGHTS = "score_weights"


def scalar_head_problems(path: str, key: str = "reward.model") -> list[str]:
    """Why the HF directory ``path`` is not a scalar-head model (empty when it is): its
    ``config.json`` must name a ``*ForSequenceClassification`` or ``*ForTokenClassification``
    architecture with one label (a causal LM would score with a fresh, random head)."""
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        return [f"{key} = {path!r} has no config.json; fix: the reward model's HF directory (recipes.reward_model's export)"]
    with open(cfg) as f:
        raw = json.load(f)
    archs = raw.get("architectures") or []
    labels = len(raw.get("id2label") or {}) or raw.get("num_labels", 2)
    if not any(a.endswith(("ForSequenceClassification", "ForTokenClassification")) for a in archs) or labels != 1:
        return [
            f"{key} = {path!r} is not a scalar-head model (architectures {archs}, {labels} labels): its score head would be "
            "new and random; fix: a one-label sequence-classification model, e.g. the export of python -m recipes.reward_model"
        ]
    return []


def reward_engine_config(engine, path: str):
    """A reward model's engine: the actor's keys (strategy, parallelism, dtypes, micro-batching),
    the model at ``path`` with its scalar head, frozen, no adapters. The head is the one the
    checkpoint's architecture has: bias-free for ``*ForSequenceClassification`` (a reward
    model, as HF scores it), with a bias for ``*ForTokenClassification`` (e.g. a critic)."""
    model = dataclasses.replace(
        engine.model,
        path=path,
        head="value",
        value_bias=_token_classification(path),
        lora=dataclasses.replace(engine.model.lora, rank=0),
    )
    return dataclasses.replace(engine, model=model, frozen=True)


def _token_classification(path: str) -> bool:
    """Whether ``path``'s ``config.json`` names a ``*ForTokenClassification`` architecture."""
    with open(os.path.join(path, "config.json")) as f:
        archs = json.load(f).get("architectures") or []
    return any(a.endswith("ForTokenClassification") for a in archs)


def combine_rewards(reward, function: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    """Per response ``reward.function_weight * function + reward.model_weight * model`` (the
    scores of the function and of the reward model), in float32."""
    function, model = function.to(torch.float32), model.to(function.device, torch.float32)
    return reward.function_weight * function + reward.model_weight * model


def reward_metrics(function: torch.Tensor, model: torch.Tensor) -> dict[str, float]:
    """``reward/model_mean``, ``reward/model_std``, ``reward/function_mean`` of a batch's
    responses (the function as a held-out measure when its weight is 0)."""
    function, model = function.to(torch.float32), model.to(torch.float32)
    return {
        "reward/model_mean": float(model.mean()),
        "reward/model_std": float(model.std()) if model.numel() > 1 else 0.0,
        "reward/function_mean": float(function.mean()),
    }


def with_model_rewards(scored, reward, model):
    """``scored`` (a finished ``ScoredBatch``) with the reward model's scores combined into its
    scores per trajectory (:func:`combine_rewards`), in place, before any filter reads them
    (DAPO's dynamic sampling keeps the groups whose combined rewards differ). A trajectory is
    scored by its last row (:func:`last_rows`): single-turn, the response; multi-turn, the whole
    conversation as trained (prompt, every turn and observation), the newest sample when
    ``env.history_mismatch: split`` cut it. Its ``parts`` keep both components per trajectory
    (``function``, ``model``) for :func:`reward_metrics` of the batch finally trained; the
    scoring time joins ``reward_s``."""
    t0 = time.perf_counter()
    rows = last_rows(scored.traj_of_row, len(scored.scores))
    batch = scored.batch
    if rows != list(range(batch.batch_size[0])):
        ids = batch["input_ids"].unbind()
        batch = make_batch([ids[r] for r in rows])
    function, scores = scored.scores, model.score(batch)
    scored.scores = combine_rewards(reward, function, scores)
    scored.parts = {"function": function.to(torch.float32), "model": scores.to(function.device, torch.float32)}
    scored.reward_s += time.perf_counter() - t0
    return scored


def last_rows(traj_of_row: torch.Tensor, trajectories: int) -> list[int]:
    """The last row of each of ``trajectories`` trajectories (``traj_of_row``: each row's).

    Raises:
        ValueError: a trajectory has no row.
    """
    last = [-1] * trajectories
    for row, traj in enumerate(traj_of_row.tolist()):
        last[traj] = row
    if -1 in last:
        raise ValueError(f"trajectory {last.index(-1)} of {trajectories} has no row to score; fix: a bug in the producer")
    return last


def scoring_batch(batch: TensorDict) -> TensorDict:
    """``batch``'s sequences each with :data:`SCORE_TOKEN` appended and a loss mask on that one
    position (where the value is the last real token's score)."""
    ids = [torch.cat([row, row.new_tensor([SCORE_TOKEN])]) for row in batch["input_ids"].unbind()]
    masks = [torch.cat([torch.zeros(len(row) - 1), torch.ones(1)]) for row in ids]
    return make_batch(ids, loss_mask=masks)


def bt_objective(scores: torch.Tensor, margin: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair of ``scores`` ``[2P]`` (rows chosen, rejected): ``(loss [P], weights [2P])``, the
    loss ``-log sigmoid(r_c - r_r - margin)`` and ``2 dL/dr`` per row (module docstring)."""
    r = scores.detach().double().clone().requires_grad_(True)
    loss = -F.logsigmoid(r[0::2] - r[1::2] - margin)
    (grad,) = torch.autograd.grad(loss.sum(), r)
    return loss.detach(), 2.0 * grad


def bt_metrics(loss: torch.Tensor, scores: torch.Tensor) -> dict[str, float]:
    """``rm/loss``, ``rm/accuracy`` (chosen scored higher), ``rm/margin``, ``rm/score_chosen``,
    ``rm/score_rejected`` of one batch's pairs."""
    c, r = scores[0::2].double(), scores[1::2].double()
    return {
        "rm/loss": float(loss.mean()),
        "rm/accuracy": float((c > r).double().mean()),
        "rm/margin": float((c - r).mean()),
        "rm/score_chosen": float(c.mean()),
        "rm/score_rejected": float(r.mean()),
    }


def surrogate_loss(mb: TensorDict, out: TensorDict, norm) -> tuple[torch.Tensor, dict[str, float]]:
    """The training pass: ``g_row * value`` at each row's score position, summed per row and
    averaged over rows by the engine (``seq-mean-token-sum``)."""
    per_token = mb[SCORE_WEIGHTS].values() * out["values"].values()
    return agg_loss(per_token, mb["loss_mask"], norm), {}


class RewardModel(TrainableRole):
    """A value-head engine as a reward model.

    Args:
        engine: ``model.head: value``; trained (Bradley-Terry, ``loss_agg_mode:
            seq-mean-token-sum``) or frozen (scoring RL responses).
    """

    def __init__(self, engine: BaseEngine) -> None:
        if engine.config.model.head != "value":
            raise ValueError(
                f"a reward model needs a scalar head (engine.model.head = {engine.config.model.head}); fix: engine.model.head=value"
            )
        if not engine.config.frozen and engine.config.loss_agg_mode != AGG_MODE:
            raise ValueError(
                f"engine.loss_agg_mode = {engine.config.loss_agg_mode}: the Bradley-Terry loss is a mean over pairs; fix: "
                f"engine.loss_agg_mode={AGG_MODE}"
            )
        self.engine = engine
        if not engine.config.frozen:
            engine.set_loss_fn(surrogate_loss)

    def score(self, batch: TensorDict) -> torch.Tensor:
        """One float per sequence of the global ``batch``: its last token's value (the
        sequence-classification score). Any number of sequences: a batch that does not split
        over the DP ranks is padded with copies of its last sequence, whose scores are dropped.
        Collective."""
        rows = batch.batch_size[0]
        pad = -rows % self.engine.dp_size
        if pad:
            ids = list(batch["input_ids"].unbind())
            batch = make_batch(ids + [ids[-1]] * pad)
        scoring = scoring_batch(batch)
        values = infer_global(self.engine, scoring)["values"].values()
        return values[scoring["input_ids"].offsets()[1:] - 1].float()[:rows]

    def update(self, batch: TensorDict, margin: float = 0.0) -> dict[str, Any]:
        """One Bradley-Terry step on a global batch of pairs (rows chosen, rejected): the
        scores before it and ``rm/*`` with the engine's ``grad_norm`` / ``lr``. Collective."""
        if batch.batch_size[0] % 2:
            raise ValueError(f"a pair batch has {batch.batch_size[0]} rows; fix: pairs as consecutive rows (chosen, rejected)")
        scores = self.score(batch)
        loss, weights = bt_objective(scores, margin)
        scoring = scoring_batch(batch)
        rows = scoring["input_ids"].offsets().diff()
        train = attach(scoring, **{SCORE_WEIGHTS: torch.repeat_interleave(weights.float(), rows)})
        with self.engine.train_mode():
            step = self.engine.train_batch(self.engine.shard_data(train))
        step.pop("loss", None)
        return {**step, **bt_metrics(loss, scores)}
