"""``Teacher``: the model an on-policy distillation run learns from, on ``BaseEngine`` calls only;
and :func:`topk_forward_kl`, the loss term of its top-k candidates."""

from __future__ import annotations

import dataclasses

import torch
from tensordict import TensorDict

from engine_api import BaseEngine
from engine_api.logprobs import TOPK_META, align_to_tokens
from roles.common import infer_global


class Teacher:
    """Log-probs of the student's sampled tokens under another model (``distill.teacher_path``):
    a frozen engine (``engine.frozen: true``: no optimizer, no gradient memory, eval mode), so
    the teacher never receives gradients or optimizer state. Its own class (not a
    ``Reference``), so a host holding both finds each by class (``posttrain.placement``)."""

    def __init__(self, engine: BaseEngine) -> None:
        if not engine.config.frozen:
            raise ValueError("Teacher needs a frozen engine (engine.frozen = False); fix: build its engine with engine.frozen=true")
        self.engine = engine

    def compute_log_probs(self, batch: TensorDict, topk: int = 0) -> TensorDict:
        """``log_probs`` of the global batch under the teacher, on every rank (``batch`` itself
        is not modified); with ``topk`` K >= 1 also ``topk_ids`` / ``topk_log_probs``, each
        position's K most likely next tokens (``engine_api.logprobs``, "Top-k")."""
        return infer_global(self.engine, batch, **({TOPK_META: topk} if topk else {}))


def teacher_engine_config(engine, teacher_path: str):
    """The teacher's engine: the actor's keys (strategy, parallelism, dtypes, micro-batching),
    another model, frozen, no adapters."""
    lora = dataclasses.replace(engine.model.lora, rank=0)
    model = dataclasses.replace(engine.model, path=teacher_path, lora=lora)
    return dataclasses.replace(engine, model=model, frozen=True)


def topk_forward_kl(student: torch.Tensor, teacher: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per token, the forward KL from the teacher's top-k candidates to the student's, both
    renormalised over the candidates (NeMo-RL's ``DistillationLossFn``, ``kl_type: forward``,
    ``zero_outside_topk: false``):

        q = softmax(teacher[t]),  s = log_softmax(student[t]),  KL_t = sum_k q_k (log q_k - s_k)

    ``teacher`` ``[total, K]``: the teacher's log-probs of its K most likely next tokens at each
    packed position (``topk_log_probs``; target convention: computed at position t, about token
    t + 1); ``student`` ``[total, K]``: the student's log-probs of the same ids at the same
    positions (``target_log_probs`` of those ids as ``target_ids``). Returns ``[total]`` aligned
    to the token each distribution predicts (``align_to_tokens``: position t's value at t + 1,
    0 at sequence starts), so the loss mask of a sampled token selects its own distribution.
    With K the whole vocabulary it is KL(p_teacher || p_student) at that token. Gradient flows
    into ``student`` only (the teacher's values are constants)."""
    q_log = torch.log_softmax(teacher.detach().float(), dim=-1)
    s_log = torch.log_softmax(student.float(), dim=-1)
    per_position = (q_log.exp() * (q_log - s_log)).sum(-1)
    return align_to_tokens(per_position[:-1], cu_seqlens)
