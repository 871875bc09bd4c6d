"""DAPO's data side: the overlong penalty (``posttrain.reward_shaping``) against verl's
``DAPORewardManager`` values and the formula, and dynamic sampling's filter and refills
(``posttrain.async_rl.dynamic``) on hand-made scored batches: only groups with a reward spread are
trained, exactly ``data.batch_size`` of them, the surplus of the last draw dropped, the draws
counted, a clear error after the stated draws, and the batch untouched when nothing is dropped.
The recipe through faults, SIGTERM and SIGKILL with refills: ``tests/async_rl/test_resume.py``."""

from __future__ import annotations

import pytest
import torch

from posttrain.async_rl.dynamic import REFILL_STEP_OFFSET, DynamicSampling, assemble, refill_step
from posttrain.async_rl.producer import ScoredBatch
from posttrain.reward_shaping import OverlongConfig, overlong_penalty, shape_overlong
from roles.rollout import rl_batch
from tests.roles import verl_values as V


def test_the_overlong_penalty_equals_verls_dapo_reward_manager():
    lengths = torch.tensor(list(V.OVERLONG_REWARD))
    got = overlong_penalty(lengths, V.OVERLONG_MAX_RESP_LEN, V.OVERLONG_BUFFER_LEN, V.OVERLONG_PENALTY_FACTOR)
    assert got.tolist() == list(V.OVERLONG_REWARD.values())


def test_the_overlong_penalty_is_the_formula_and_shapes_the_scores_of_trajectories():
    """``min(0, -(L - (L_max - B)) / B * f)`` by hand; a trajectory over two rows counts both."""
    for L in range(0, 14):
        want = min(0.0, -(L - (10 - 4)) / 4 * 0.5)
        assert float(overlong_penalty(torch.tensor([L]), 10, 4, 0.5)) == pytest.approx(want, abs=1e-12)
    scored = _scored([[1, 1, 1], [1, 1, 1, 1, 1], [1, 1], [1, 1, 1, 1]], [0.5, 1.0, 0.0], traj_of_row=[0, 1, 2, 2])
    shape_overlong(scored, OverlongConfig(buffer=2, penalty_factor=1.0), max_len=5)
    # sampled tokens: 3, 5, 2 + 4 = 6 -> penalties 0, -1, -1.5
    assert scored.scores.tolist() == [0.5, 0.0, -1.5]
    assert scored.metrics["reward/overlong_frac"] == pytest.approx(2 / 3) and scored.metrics["reward/overlong_penalty"] == pytest.approx(
        -2.5 / 3
    )


def test_overlong_settings_are_checked():
    assert OverlongConfig()._problems() == [] and not OverlongConfig().enabled
    assert "buffer = -1" in OverlongConfig(buffer=-1)._problems()[0]
    assert "shorter than the limit" in OverlongConfig(buffer=8, max_len=8)._problems()[0]


# ----------------------------------------------------------------------------- dynamic sampling


def _scored(masks, scores, traj_of_row=None, tag=0.0) -> ScoredBatch:
    """A scored batch with one row per mask (a prompt token first, unmasked), its log-probs
    marking the row (``tag + row``) so an assembled batch's rows can be traced."""
    rows = [torch.tensor([0, *range(1, len(m) + 1)]) for m in masks]
    mask = [torch.tensor([0.0, *m]) for m in masks]
    lp = [torch.full((len(m) + 1,), tag + r) for r, m in enumerate(masks)]
    versions = [torch.ones(len(m) + 1, dtype=torch.long) for m in masks]
    batch = rl_batch(rows, mask, lp, versions, torch.ones(len(masks), dtype=torch.long), torch.zeros(len(masks), dtype=torch.long), 1.0)
    traj = torch.arange(len(masks)) if traj_of_row is None else torch.tensor(traj_of_row)
    return ScoredBatch(batch, torch.tensor(scores, dtype=torch.float32), traj, metrics={"env/x": tag})


def _groups(values: list[list[float]], tag: float) -> ScoredBatch:
    """Groups of 2 with these rewards, each response two sampled tokens."""
    flat = [s for g in values for s in g]
    return _scored([[1, 1]] * len(flat), flat, tag=tag)


def test_only_groups_with_a_spread_are_trained_refilled_to_the_batch_size():
    """Draw 1: groups A (spread), B (flat), C (flat); draw 2: D (flat), E (spread), F (spread).
    Batch size 3: A, E and F, with no third draw. The trained batch holds exactly those rows
    (traced by their log-probs), numbered as new groups."""
    first = _groups([[1.0, 0.0], [0.5, 0.5], [0.0, 0.0]], tag=0.0)
    second = _groups([[1.0, 1.0], [0.2, 0.7], [0.9, 0.1]], tag=10.0)
    draws = []

    def draw(d):
        draws.append(d)
        return second, [100 + d]

    out, refills, m = DynamicSampling(batch_size=3, n_samples=2, max_draws=4).fill(0, first, draw)
    assert draws == [1] and refills == [[101]]
    assert out.scores.tolist() == pytest.approx([1.0, 0.0, 0.2, 0.7, 0.9, 0.1])
    assert out.group_ids(2).tolist() == [0, 0, 1, 1, 2, 2]
    assert [float(r[0]) for r in out.batch["rollout_log_probs"].unbind()] == [0.0, 1.0, 12.0, 13.0, 14.0, 15.0]
    assert out.batch["loss_mask"].values().sum() == 12 and out.turns is None
    assert m == {
        "dynamic_sampling/draws": 2.0,
        "dynamic_sampling/prompts_drawn": 6.0,
        "dynamic_sampling/groups_dropped": 3.0,
        "dynamic_sampling/groups_surplus": 0.0,
        "dynamic_sampling/reward_drawn": pytest.approx(sum([1, 0, 0.5, 0.5, 0, 0, 1, 1, 0.2, 0.7, 0.9, 0.1]) / 12),
    }
    assert out.metrics == {"env/x": 0.0} and out.text(2)["reward"] == pytest.approx(0.2)


def test_the_surplus_of_the_last_draw_is_dropped_and_the_error_comes_after_the_stated_draws():
    first = _groups([[1.0, 0.0], [0.5, 0.5]], tag=0.0)
    rich = _groups([[0.3, 0.4], [0.1, 0.0]], tag=10.0)
    out, _, m = DynamicSampling(batch_size=2, n_samples=2, max_draws=3).fill(4, first, lambda d: (rich, []))
    assert out.scores.tolist() == pytest.approx([1.0, 0.0, 0.3, 0.4]) and m["dynamic_sampling/groups_surplus"] == 1.0
    flat = _groups([[0.5, 0.5], [0.0, 0.0]], tag=10.0)
    with pytest.raises(
        RuntimeError, match=r"step 5: 3 draw\(s\) of 2 prompts gave 1 group\(s\).*algo.dynamic_sampling_max_draws \(now 3\)"
    ):
        DynamicSampling(batch_size=2, n_samples=2, max_draws=3).fill(4, first, lambda d: (flat, []))


def test_a_batch_whose_groups_all_differ_is_trained_as_it_is():
    first = _groups([[1.0, 0.0], [0.5, 0.4]], tag=0.0)
    out, refills, m = DynamicSampling(batch_size=2, n_samples=2, max_draws=2).fill(0, first, lambda d: pytest.fail("no refill"))
    assert out is first and refills == [] and m["dynamic_sampling/draws"] == 1.0


def test_assemble_keeps_every_field_of_the_chosen_rows():
    """A trajectory over two rows stays whole; the assembled batch equals the source rows'
    fields (ids, mask, log-probs, versions, prompt_len, truncation) and the chosen trajectories'
    reward parts (``reward.model``: the function's and the model's scores, for the metrics)."""
    src = _scored([[1], [1, 1], [1, 1, 1], [1]], [0.0, 1.0, 0.5], traj_of_row=[0, 1, 1, 2], tag=3.0)
    src.parts = {"function": torch.tensor([0.0, 0.25, 0.75]), "model": torch.tensor([-1.0, 2.0, 3.0])}
    out = assemble([(src, [[1, 2]])])
    assert out.traj_of_row.tolist() == [0, 0, 1] and out.scores.tolist() == [1.0, 0.5]
    assert out.parts["function"].tolist() == [0.25, 0.75] and out.parts["model"].tolist() == [2.0, 3.0]
    assert assemble([(_scored([[1]], [0.0]), [[0]])]).parts == {}
    for key in ("input_ids", "loss_mask", "rollout_log_probs", "rollout_token_versions"):
        want = [src.batch[key].unbind()[r] for r in (1, 2, 3)]
        assert all(torch.equal(a, b) for a, b in zip(out.batch[key].unbind(), want, strict=True)), key


def test_refills_come_from_virtual_steps_no_regular_step_reaches():
    seen = {refill_step(s, d, 10) for s in range(50) for d in range(1, 10)}
    assert len(seen) == 50 * 9 and min(seen) > REFILL_STEP_OFFSET and max(seen) < 10**9
