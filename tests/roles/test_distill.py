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
from tests.support.hf_utils import make_model, make_test_batch
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
    assert DistillConfig(teacher_path="t", coef=0.0)._problems() == ["coef = 0.0: must be > 0; fix: e.g. 1.0"]
