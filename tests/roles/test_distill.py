"""On-policy distillation (``posttrain.distill``, ``roles.teacher``): the reverse-KL objective's
gradient through the actor equals a hand computation with plain HF student and teacher (fp32,
rel 1e-6); the teacher is frozen (no gradients, no optimizer, unchanged after the update); the
advantage mixes the task's by its weight; a teacher of another vocabulary or inside the run's
output directory is refused naming both. The recipe with a teacher: ``tests/recipes/test_ppo.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_api.batch import unpack
from posttrain.distill import DistillConfig, distill_advantages, distill_problems
from roles.actor import Actor, ActorConfig
from roles.teacher import Teacher
from tests.support.hf_utils import engine_for, make_model, make_test_batch
from tests.support.launch import run_distributed
from tests.support.role_engines import fsdp_engine as _engine
from tests.support.role_engines import with_old_log_probs


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    return make_model(root / "student", "llama", seed=0), make_model(root / "teacher", "qwen2", seed=5)


def _hf_log_probs(model, batch) -> torch.Tensor:
    """Flat per-token log-probs of the batch's rows under a plain HF model (position 0: 0)."""
    out = []
    for ids in batch["input_ids"].unbind():
        logits = model(ids[None]).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)
        out.append(torch.cat([lp.new_zeros(1), lp]))
    return torch.cat(out)


def test_the_update_follows_the_reverse_kl_gradient_of_plain_hf_models_and_the_teacher_stays_frozen(dirs):
    """One update, token-mean, ratio 1: ``grad = mean_t (lp_s - lp_T) grad lp_s`` (the
    score-function gradient of KL(student || teacher) with each token's KL as its reward),
    computed by hand with HF's models, equals the engine's gradient to rel 1e-6."""
    student_dir, teacher_dir = dirs
    actor = Actor(_engine(student_dir, "optim.lr=0.0", "optim.clip_grad=1e9"), ActorConfig())
    teacher = Teacher(_engine(teacher_dir, "frozen=true"))
    batch = with_old_log_probs(actor, make_test_batch())
    mask = batch["loss_mask"].values()
    teacher_lp = teacher.compute_log_probs(batch)["log_probs"].values()
    task = torch.zeros_like(mask)
    adv, metrics = distill_advantages(batch["old_log_probs"].values(), teacher_lp, mask, task, DistillConfig(teacher_path="t", coef=0.7))
    batch.set("advantages", unpack(adv, batch["input_ids"]))
    before = {k: v.detach().clone() for k, v in teacher.engine.model.state_dict().items()}
    actor.engine.set_loss_fn(actor.loss)
    with actor.engine.train_mode():
        actor.engine.optimizer_zero_grad()
        actor.engine.forward_backward_step(actor.engine.shard_data(batch))
    got = {
        n.removeprefix("_orig_mod."): p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        for n, p in actor.engine.model.named_parameters()
    }

    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    hf_teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    lp_s = _hf_log_probs(student, batch)
    with torch.no_grad():
        lp_t = _hf_log_probs(hf_teacher, batch)
    assert torch.allclose(lp_t, teacher_lp, rtol=1e-5, atol=1e-6)  # the teacher role is the HF teacher
    kl = (lp_s.detach() - lp_t) * mask
    (0.7 * (kl * lp_s).sum() / mask.sum()).backward()
    assert metrics["distill/reverse_kl"] == pytest.approx(float(kl.sum() / mask.sum()), rel=1e-5)
    for name, p in student.named_parameters():
        err = float((got[name] - p.grad).abs().max() / p.grad.abs().max())
        assert err <= 1e-6, (name, err)

    assert teacher.engine.optimizer is None and not any(p.requires_grad or p.grad is not None for p in teacher.engine.model.parameters())
    assert all(torch.equal(before[k], v) for k, v in teacher.engine.model.state_dict().items())


def _hf_topk_forward_kl(student, teacher, batch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat per-token forward KL from the teacher's top-k (at each token, over the distribution
    that predicts it) to the student's, both renormalised over the k ids, by plain HF models;
    and the teacher's top-k ids (target convention: the distribution computed at each position)."""
    out, ids_out = [], []
    for ids in batch["input_ids"].unbind():
        s_logp = torch.log_softmax(student(ids[None]).logits[0].float(), -1)
        with torch.no_grad():
            t_logp = torch.log_softmax(teacher(ids[None]).logits[0].float(), -1)
        t_top, top_ids = t_logp.topk(k, -1)
        q = torch.softmax(t_top, -1)
        s = torch.log_softmax(s_logp.gather(-1, top_ids), -1)
        kl = (q * (q.log() - s)).sum(-1)  # at position t: about token t + 1
        out.append(torch.cat([kl.new_zeros(1), kl[:-1]]))
        ids_out.append(top_ids)
    return torch.cat(out), torch.cat(ids_out)


TOPK, TOPK_COEF = 4, 0.6


def _topk_step(rank, world, student_dir, teacher_dir, strategy):
    """The engine side (a rank of a long-lived world: megatron's CPU layer stays out of pytest's
    process): the teacher's top-k and one actor step of the top-k term alone (advantages 0).
    Returns the batch, the teacher's outputs, the loss, the grad norm and (FSDP) the grads."""
    from posttrain.distill import topk_batch

    actor = Actor(engine_for(student_dir, "optim.lr=0.0", "optim.clip_grad=1e9", "micro_batch_size=2", strategy=strategy), ActorConfig())
    teacher = Teacher(engine_for(teacher_dir, "frozen=true", strategy=strategy))
    batch = with_old_log_probs(actor, make_test_batch())
    batch.set("advantages", unpack(torch.zeros_like(batch["loss_mask"].values()), batch["input_ids"]))
    taught = teacher.compute_log_probs(batch, topk=TOPK)
    actor.engine.set_loss_fn(actor.loss)
    with actor.engine.train_mode():
        actor.engine.optimizer_zero_grad()
        local = actor.engine.shard_data(topk_batch(batch, taught, TOPK_COEF))
        local.set_non_tensor("topk_kl_coef", TOPK_COEF)
        _, loss, _ = actor.engine.forward_backward_step(local)
        grad_norm = actor.engine.optimizer_step()
    grads = {}
    if strategy == "fsdp":
        for n, p in actor.engine.model.named_parameters():
            grads[n.removeprefix("_orig_mod.")] = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
    return batch, taught, float(loss), grad_norm, grads


@pytest.mark.parametrize("strategy", ["fsdp", "megatron"])
def test_the_topk_forward_kl_term_follows_plain_hf_models(dirs, strategy):
    """``distill.topk``: the teacher's top-4 (``return_topk``) and the actor's loss term
    ``coef * token-mean KL(q_teacher || s_student)`` over the candidates, both renormalised, equal
    a hand computation with HF's models: the teacher's ids exactly, the term's value to 1e-7 (fp32
    noise of its O(1) terms), (FSDP) every parameter's gradient to rel 3e-6 of its max, the gradient
    norm to 1e-5 (both backends). The advantages are 0, so the policy term adds nothing."""
    student_dir, teacher_dir = dirs
    batch, taught, loss, grad_norm, grads = run_distributed(_topk_step, 1, student_dir, teacher_dir, strategy, timeout=300)[0]
    mask = batch["loss_mask"].values()
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    hf_teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    kl, top_ids = _hf_topk_forward_kl(student, hf_teacher, batch, TOPK)
    assert torch.equal(taught["topk_ids"].values(), top_ids)
    want = TOPK_COEF * (kl * mask).sum() / mask.sum()
    want.backward()
    # The KL is a difference of O(1) fp32 log-prob terms: its value is exact to their noise (1e-7), not
    # to a relative 1e-6 of the small difference.
    assert loss == pytest.approx(float(want.detach()), abs=1e-7)
    hf_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in student.parameters()))
    assert grad_norm == pytest.approx(float(hf_norm), rel=1e-5)
    for name, p in student.named_parameters() if strategy == "fsdp" else ():
        err = float((grads[name] - p.grad).abs().max() / p.grad.abs().max())
        # fp32 noise of the two log-softmaxes over the gathered candidates: 0.4-1.7e-6 measured (21
        # tensors); a shifted alignment or an unrenormalised student gives > 1e-1.
        assert err <= 3e-6, (name, err)


def test_the_topk_term_is_zero_when_the_student_matches_the_teacher_on_the_candidates():
    """The term is >= 0 and 0 exactly when the student's distribution over the teacher's
    candidates (renormalised) is the teacher's, whatever mass the student puts elsewhere; a
    broken variant without the student's renormalisation is not 0 there."""
    from roles.teacher import topk_forward_kl

    teacher = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [0.5, 0.4, -1.0], [1.0, 1.0, 1.0]]), -1)
    student = teacher - 3.0  # the same shape over the candidates, most mass elsewhere
    cu = torch.tensor([0, 3])
    assert topk_forward_kl(student, teacher, cu).abs().max() < 1e-6
    q = teacher.exp() / teacher.exp().sum(-1, keepdim=True)
    unnormalised = (q * (q.log() - student)).sum(-1)
    assert unnormalised.min() > 2.9
    other = topk_forward_kl(torch.randn(3, 3, generator=torch.Generator().manual_seed(0)), teacher, cu)
    assert other[0] == 0 and bool((other[1:] > 0).all())


def test_the_advantage_mixes_the_task_by_its_weight():
    student, teacher = torch.tensor([-1.0, -2.0, -0.5, -3.0]), torch.tensor([-1.5, -1.0, -0.5, -9.0])
    mask, task = torch.tensor([0.0, 1.0, 1.0, 1.0]), torch.tensor([0.0, 2.0, 2.0, -1.0])
    adv, m = distill_advantages(student, teacher, mask, task, DistillConfig(teacher_path="t", coef=2.0, reward_weight=0.5))
    assert adv.tolist() == [0.0, 0.5 * 2.0 - 2.0 * (-1.0), 0.5 * 2.0 - 0.0, 0.5 * -1.0 - 2.0 * 6.0]
    assert m == {"distill/reverse_kl": pytest.approx((-1.0 + 0.0 + 6.0) / 3), "distill/teacher_logprob_mean": pytest.approx(-10.5 / 3)}


def test_a_teacher_of_another_vocabulary_or_inside_the_output_dir_is_refused(dirs, tmp_path):
    student_dir, teacher_dir = dirs
    assert distill_problems(DistillConfig(teacher_path=teacher_dir), student_dir, str(tmp_path / "out")) == []
    other = tmp_path / "big"
    other.mkdir()
    raw = json.loads((Path(teacher_dir) / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**raw, "vocab_size": raw["vocab_size"] + 8}))
    [msg] = distill_problems(DistillConfig(teacher_path=str(other)), student_dir, str(tmp_path / "out"))
    assert f"has {raw['vocab_size'] + 8} tokens" in msg and student_dir in msg and "fix:" in msg
    inside = tmp_path / "out" / "hf"  # where the student's export is written
    inside.mkdir(parents=True)
    msg = distill_problems(DistillConfig(teacher_path=str(inside)), student_dir, str(tmp_path / "out"))[0]
    assert "inside this run's trainer.output_dir" in msg and "fix:" in msg
    assert "not a directory" in distill_problems(DistillConfig(teacher_path=str(tmp_path / "none")), student_dir, "o")[0]
    assert "nothing is distilled" in DistillConfig(teacher_path="t", coef=0.0)._problems()[0]
    assert DistillConfig(teacher_path="t", coef=0.0, topk=4)._problems() == []
    assert DistillConfig(teacher_path="t", topk=-1)._problems() == [
        "topk = -1: must be >= 0; fix: 0 (off) or the teacher's candidates per token, e.g. 16"
    ]
    assert "topk_coef = 0.0: must be > 0" in DistillConfig(teacher_path="t", topk=2, topk_coef=0.0)._problems()[0]
