"""Reward-model training (Bradley-Terry on preference pairs), driven only through ``BaseEngine``:
on pairs of the built-in sorting task by default, or on the user's model and pair files.

Run it as ``python -m recipes.reward_model --config configs/rm_tiny.yaml [key=value ...]`` (or under
``torchrun --nproc-per-node N``). The model is the critic's class (``engine.model.head: value``:
an HF causal LM or ``AutoModelForSequenceClassification`` directory in, a one-output ``score``
head); the pairs and their columns are DPO's (``posttrain.preference_data``). Per step:
``roles.reward_model.RewardModel.update`` (the pairs' scores, then one ``train_batch`` of the
Bradley-Terry loss). Metrics ``loss``, ``rm/accuracy`` (chosen scored higher), ``rm/margin``,
``rm/score_chosen``, ``rm/score_rejected``; ``val/rm/*`` every ``trainer.val_every`` steps and
at the end over every validation pair. The export (``trainer.save_hf``) is an HF
``AutoModelForSequenceClassification`` directory giving the same scores; ``reward.model`` in the
RL recipe scores responses with it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_api import EngineConfig, build_engine
from engine_api.config import ModelConfig
from posttrain.preference_data import PreferenceData, PreferenceDataConfig
from posttrain.trainer_utils import quiet_console, run_cli
from recipes.common import TinyModelConfig, TrainerConfig, recipe_main
from recipes.dpo import PairWorker, check_pair_batch, pair_recipe_problems
from recipes.dpo import run as run_pairs
from roles.reward_model import RewardModel, bt_metrics, bt_objective

DEFAULT_CONFIG = "configs/rm_tiny.yaml"


@dataclass(frozen=True)
class RMSettings:
    """The ``rm`` section.

    Attributes:
        margin: the Bradley-Terry loss's margin, ``-log sigmoid(r_c - r_r - margin)`` (Llama 2's
            margin loss with a constant; 0: plain Bradley-Terry).
    """

    margin: float = 0.0


@dataclass(frozen=True)
class RMConfig:
    """Everything ``recipes.reward_model`` reads; ``configs/rm_tiny.yaml`` documents each key.

    Attributes:
        engine: the reward model's engine (defaults: ``model.head: value``, ``model.value_bias:
            false``, HF sequence classification's bias-free head, so the export scores as the
            engine does; ``loss_agg_mode: seq-mean-token-sum``, which the loss needs).
        tiny_model: the model built when ``engine.model.path`` is null.
        data: the pairs (DPO's ``data`` section; ``batch_size`` pairs per step).
        rm: the loss.
        trainer: the loop.
    """

    engine: EngineConfig = field(
        default_factory=lambda: EngineConfig(model=ModelConfig(head="value", value_bias=False), loss_agg_mode="seq-mean-token-sum")
    )
    tiny_model: TinyModelConfig = field(default_factory=TinyModelConfig)
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    rm: RMSettings = field(default_factory=RMSettings)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def _problems(self) -> list[str]:
        out = pair_recipe_problems(self, "a reward model")
        if self.engine.model.head != "value":
            out.append(f"engine.model.head = {self.engine.model.head}: a reward model has a scalar head; fix: engine.model.head=value")
        if self.engine.model.value_bias:
            out.append(
                "engine.model.value_bias = true: a reward model's head is HF sequence classification's, without a bias (the "
                "Bradley-Terry loss cannot train one, and the export has none, so its scores would differ from the engine's); "
                "fix: engine.model.value_bias=false"
            )
        if self.engine.model.lora.enabled:
            out.append("engine.model.lora: a value head trains in full, not through adapters; fix: engine.model.lora.rank=0")
        return out


class RMTrainer(PairWorker):
    """One rank's side of reward-model training (a ``recipes.dpo.PairWorker``)."""

    def __init__(self, cfg: RMConfig, data: PreferenceData | None = None) -> None:
        super().__init__(cfg, data)
        self.engine = build_engine(cfg.engine)
        self.engine.init_model()
        check_pair_batch(cfg, self.engine)
        self.model = RewardModel(self.engine)

    def train_step(self, batch) -> dict[str, Any]:
        return self.model.update(batch, self.cfg.rm.margin)

    def evaluate(self) -> dict[str, float]:
        """``rm/*`` over every validation pair."""
        losses, scores = [], []
        for batch in self.val_batches:
            s = self.model.score(batch)
            losses.append(bt_objective(s, self.cfg.rm.margin)[0])
            scores.append(s)
        return bt_metrics(torch.cat(losses), torch.cat(scores)) if scores else {}


def run(cfg: RMConfig) -> dict[str, Any]:
    """Train with an already-loaded config (``recipes.dpo.run``'s loop); the summary."""
    return run_pairs(cfg, RMTrainer, "rm", "reward model (Bradley-Terry)")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse ``--config`` and overrides, train, return the summary (every rank)."""
    return recipe_main(argv, "recipes.reward_model", __doc__, RMConfig, DEFAULT_CONFIG, run)


if __name__ == "__main__":
    quiet_console()
    run_cli(lambda: main(sys.argv[1:]))
