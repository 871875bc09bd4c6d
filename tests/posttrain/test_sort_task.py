"""The built-in digit-sorting task (``posttrain.sort_task``): SFT batches, RL prompts and the
partial-credit scorer."""

from __future__ import annotations

import pytest
import torch

from posttrain import sort_task as task
from posttrain.rewards import sort_task_score


# ---------------------------------------------------------------------------------- SFT batches
def test_loss_mask_covers_exactly_the_sorted_response():
    cfg = task.DataConfig(batch_size=16, min_digits=2, max_digits=7, seed=3)
    lengths = set()
    for step in range(3):
        batch = task.batch_at(cfg, step)
        for ids, mask in zip(batch["input_ids"].unbind(), batch["loss_mask"].unbind(), strict=True):
            ids, mask = ids.tolist(), mask.tolist()
            sep = ids.index(task.SEP)
            digits, response = ids[1:sep], ids[sep + 1 :]
            assert ids[0] == task.BOS and cfg.min_digits <= len(digits) <= cfg.max_digits
            assert response == [*sorted(digits), task.EOS]
            assert mask == [0.0] * (sep + 1) + [1.0] * len(response)  # response only; position 0 never
            lengths.add(len(ids))
    assert len(lengths) > 1  # genuinely jagged


def test_batches_are_a_pure_function_of_seed_and_step():
    cfg = task.DataConfig(batch_size=8, seed=11)
    same = task.batch_at(cfg, 5)["input_ids"].values()
    assert torch.equal(task.batch_at(cfg, 5)["input_ids"].values(), same)
    assert not torch.equal(task.batch_at(cfg, 6)["input_ids"].values()[:20], same[:20])
    # Resuming at step 3 replays exactly the batches an uninterrupted run sees from step 3 on.
    resumed = [(s, b["input_ids"].values()) for s, b in task.iter_batches(cfg, start_step=3, total_steps=5)]
    assert [s for s, _ in resumed] == [3, 4]
    assert torch.equal(resumed[0][1], task.batch_at(cfg, 3)["input_ids"].values())
    other_seed = task.batch_at(task.DataConfig(batch_size=8, seed=12), 5)["input_ids"].values()
    assert not torch.equal(other_seed[:20], same[:20])


# ---------------------------------------------------------------------------------- RL prompts
def test_partial_credit_reward():
    target = [4, 5, 3]  # sorted digits 0, 1 then EOS
    assert sort_task_score([4, 5, 3], target) == 1.0
    assert sort_task_score([4, 9, 3], target) == pytest.approx(2 / 3)
    assert sort_task_score([4], target) == pytest.approx(1 / 3)
    assert sort_task_score([], target) == 0.0


def test_prompts_are_a_pure_function_of_seed_and_step():
    cfg = task.DataConfig(batch_size=32, min_digits=2, max_digits=3, seed=1234)  # configs/ppo_tiny.yaml's data
    a, ta = task.prompts_at(cfg, 7)
    b, tb = task.prompts_at(cfg, 7)
    assert [p.tolist() for p in a] == [p.tolist() for p in b] and ta == tb
    assert [p.tolist() for p in task.prompts_at(cfg, 8)[0]] != [p.tolist() for p in a]
