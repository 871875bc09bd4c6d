"""On-policy distillation (``distill``): the student (the actor) samples, a teacher model scores
the sampled tokens, and the student is trained to lower the per-token reverse KL to the teacher
(Agarwal et al. 2024, GKD; Lu and Thinking Machines 2025, "On-Policy Distillation";
tinker-cookbook's ``distillation/train_on_policy``).

Per sampled token ``t`` with ``lp_s`` the student's log-prob of it (the old policy's, the one that
sampled it) and ``lp_T`` the teacher's, the reverse-KL estimate is ``k_t = lp_s - lp_T`` (its mean
over the student's own samples is KL(student || teacher) per token), and the token's advantage is

    A_t = reward_weight * A_task_t - coef * k_t

(``A_task`` the ``algo.advantage`` estimator's on the task reward). The policy objective
(``actor.policy_loss``) turns the advantage into the update as for any RL run: at ratio 1 its
gradient is ``coef * mean_t(k_t * grad lp_s(t))``, the score-function gradient of the reverse KL
with each token's own KL as its reward (no discounting over later tokens, as tinker-cookbook).
``reward_weight = 0`` (default) is pure distillation; the task reward is still computed and logged.

Top-k forward KL (``distill.topk`` = K >= 1): the teacher also returns, at every position, its K
most likely next tokens and their log-probs; the student's update adds ``topk_coef`` times the
forward KL from the teacher's candidates to its own, both renormalised over the K candidates
(``roles.teacher.topk_forward_kl``; NeMo-RL's ``DistillationLossFn`` forward mode), aggregated
over the sampled tokens like the policy loss (``engine.loss_agg_mode``). It is a loss term, not
an advantage: its gradient is exact (no sampling), and it needs the student's log-probs of the
teacher's ids, so the update's forward scores them as ``target_ids``. Metric:
``distill/topk_forward_kl``. Sequence-split layouts (Ulysses SP, megatron CP) do not compute
top-k outputs and refuse it, naming the setting. ``coef = 0`` with ``topk`` > 0 is forward KL
alone.

The teacher is a frozen engine (``roles.teacher.Teacher``) built from ``distill.teacher_path`` with
the actor's engine keys (strategy, parallelism, dtype), any family the engine loads; it needs the
student's vocabulary (the same ``vocab_size`` and, when both directories carry a tokenizer, the
same token-to-id map), else the run is refused naming both. Metrics: ``distill/reverse_kl`` (the
mean of ``k_t`` over the batch's sampled tokens) and ``distill/teacher_logprob_mean``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from engine_api.batch import attach
from engine_api.logprobs import TARGETS_FIELD, TOPK_IDS, TOPK_LOG_PROBS
from roles.actor import TEACHER_TOPK, TOPK_KL_COEF


@dataclass(frozen=True)
class DistillConfig:
    """The ``distill`` section (module docstring).

    Attributes:
        teacher_path: the teacher's HF model directory; null: no distillation.
        coef: the weight of the reverse-KL advantage (>= 0; 0 only with ``topk``).
        reward_weight: the weight of the task reward's advantage (0: pure distillation).
        topk: K >= 1 adds the forward KL on the teacher's K most likely next tokens as a loss
            term (0: off).
        topk_coef: that term's weight (> 0).
    """

    teacher_path: str | None = None
    coef: float = 1.0
    reward_weight: float = 0.0
    topk: int = 0
    topk_coef: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.teacher_path is not None

    def _problems(self) -> list[str]:
        out = []
        if not self.coef >= 0:
            out.append(f"coef = {self.coef}: must be >= 0; fix: e.g. 1.0")
        elif self.coef == 0 and self.topk == 0:
            out.append("coef = 0 with topk = 0: nothing is distilled; fix: coef > 0 (reverse KL), topk >= 1 (forward KL), or both")
        if self.topk < 0:
            out.append(f"topk = {self.topk}: must be >= 0; fix: 0 (off) or the teacher's candidates per token, e.g. 16")
        if self.topk and not self.topk_coef > 0:
            out.append(f"topk_coef = {self.topk_coef}: must be > 0 with topk = {self.topk}; fix: e.g. 1.0")
        if not self.reward_weight >= 0:
            out.append(f"reward_weight = {self.reward_weight}: must be >= 0; fix: 0 (pure distillation) or a positive weight")
        return out


def _vocab(path: str) -> tuple[int | None, dict[str, int] | None]:
    """``(vocab_size from config.json, the tokenizer's token->id map or None)`` of a model dir."""
    size = None
    cfg = os.path.join(path, "config.json")
    if os.path.isfile(cfg):
        with open(cfg) as f:
            raw = json.load(f)
        size = raw.get("vocab_size", raw.get("text_config", {}).get("vocab_size"))
    tokenizer = None
    if any(os.path.isfile(os.path.join(path, n)) for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path).get_vocab()
    return size, tokenizer


def vocabulary_problems(student_path: str, teacher_path: str, key: str = "distill.teacher_path", what: str = "teacher") -> list[str]:
    """Why the model at ``teacher_path`` (the setting ``key``, a ``what``: the teacher, a reward
    model) cannot score the student's tokens (empty when it can): another ``vocab_size``, or
    tokenizers that map tokens to other ids."""
    if not os.path.isdir(teacher_path):
        return [f"{key} = {teacher_path!r} is not a directory; fix: the model's HF directory"]
    s_size, s_tok = _vocab(student_path)
    t_size, t_tok = _vocab(teacher_path)
    if t_size is None:
        return [f"{key} = {teacher_path!r} has no config.json with a vocab_size; fix: an HF model directory"]
    if s_size != t_size:
        return [
            f"{key} = {teacher_path!r}: the {what}'s vocabulary has {t_size} tokens, the student's "
            f"({student_path!r}) {s_size}; the {what} scores the policy's token ids as they are, so both "
            f"need one vocabulary; fix: a {what} of the student's tokenizer family"
        ]
    if s_tok is not None and t_tok is not None and s_tok != t_tok:
        differ = sorted(set(s_tok.items()) ^ set(t_tok.items()))[:3]
        return [
            f"{key} = {teacher_path!r}: the {what}'s tokenizer maps tokens to other ids than the student's "
            f"({student_path!r}; e.g. {differ}); fix: a {what} of the student's tokenizer"
        ]
    return []


def output_problems(teacher_path: str, output_dir: str) -> list[str]:
    """A teacher inside the run's own output directory would be the student's checkpoint or
    export being written: refused."""
    teacher, out = os.path.realpath(teacher_path), os.path.realpath(output_dir)
    if teacher == out or teacher.startswith(out + os.sep):
        return [
            f"distill.teacher_path = {teacher_path!r} is inside this run's trainer.output_dir ({output_dir!r}), where the student's "
            "checkpoints and export are written; fix: copy the teacher elsewhere, or use another trainer.output_dir"
        ]
    return []


def distill_problems(config: DistillConfig, student_path: str | None, output_dir: str) -> list[str]:
    """Everything that refuses the teacher before any engine is built (module docstring)."""
    out = output_problems(config.teacher_path, output_dir)
    if student_path is not None:
        out += vocabulary_problems(student_path, config.teacher_path)
    return out


def distill_advantages(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, task: torch.Tensor, config: DistillConfig
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Per-token advantages ``reward_weight * task - coef * (student - teacher)`` on the sampled
    tokens (flat values; ``student`` the old policy's log-probs) and the metrics."""
    keep = mask > 0
    kl = (student - teacher) * keep
    adv = config.reward_weight * task - config.coef * kl
    tokens = keep.sum().clamp(min=1)
    metrics = {
        "distill/reverse_kl": float(kl.sum() / tokens),
        "distill/teacher_logprob_mean": float((teacher * keep).sum() / tokens),
    }
    return adv * keep, metrics


def topk_batch(batch: TensorDict, taught: TensorDict, coef: float) -> TensorDict:
    """A shallow copy of the global ``batch`` for the student's update with the teacher's top-k
    (``taught``: the teacher's outputs with ``topk_ids`` / ``topk_log_probs``): the ids as
    ``target_ids``, their log-probs as ``teacher_topk_log_probs`` and the metadata
    ``topk_kl_coef`` the actor reads (``roles.actor``)."""
    out = attach(batch.copy(), **{TARGETS_FIELD: taught[TOPK_IDS].values(), TEACHER_TOPK: taught[TOPK_LOG_PROBS].values().float()})
    out.set_non_tensor(TOPK_KL_COEF, float(coef))
    return out
