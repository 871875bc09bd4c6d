"""Reward models (``roles.reward_model``, ``recipes.reward_model``): HF sequence-classification
checkpoints in and out, the scores and the Bradley-Terry step against plain HF.

* In: an HF ``AutoModelForSequenceClassification`` checkpoint loads as the engine's value head
  (FSDP and megatron) and scores every sequence as HF does (its last token), rel 1e-5.
* The step: one Bradley-Terry step's gradient equals autograd of the mean pair loss through plain
  HF (every tensor to rel 1e-5 of its max), at one micro-batch, one row per micro-batch (pairs
  split) and 2 ranks.
* Out: after training, the export loads in HF as ``AutoModelForSequenceClassification`` and gives
  the engine's scores to 1e-6 (FSDP and megatron): the reward model's head is bias-free
  (``model.value_bias: false``), HF sequence classification's.
* The demo: on held-out sorting pairs the trained model orders chosen above rejected.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from engine_api import make_batch
from posttrain.export import save_hf
from roles.reward_model import RewardModel
from tests.support import launch
from tests.support.hf_utils import engine_for, make_model
from tests.support.launch import run_distributed
from tests.support.pairs import pair_batch


@pytest.fixture(scope="module")
def seqcls(tmp_path_factory):
    """A tiny HF sequence-classification checkpoint (its ``score`` seeded, no bias)."""
    lm = make_model(tmp_path_factory.mktemp("rm") / "lm", "llama", seed=0)
    torch.manual_seed(7)
    model = AutoModelForSequenceClassification.from_pretrained(lm, num_labels=1, dtype=torch.float32)
    path = str(tmp_path_factory.mktemp("rm") / "seqcls")
    model.save_pretrained(path)
    return path


def _hf_scores(model, rows) -> torch.Tensor:
    """HF sequence classification's score of each sequence of ``rows`` (token id tensors)."""
    with torch.no_grad():
        return torch.stack([model(ids[None]).logits[0, 0] for ids in rows])


def _score(rank, world, path, strategy, bias):
    engine = engine_for(path, "model.head=value", f"model.value_bias={bias}", "frozen=true", strategy=strategy)
    return RewardModel(engine).score(pair_batch())


@pytest.mark.parametrize("strategy, bias", [("fsdp", "false"), ("megatron", "false"), ("fsdp", "true")])
def test_a_sequence_classification_checkpoint_scores_as_in_hf(seqcls, strategy, bias):
    """Bias-free (a reward model's head) or with a bias, which such a checkpoint lacks: at 0."""
    got = run_distributed(_score, 1, seqcls, strategy, bias, timeout=300)[0]
    want = _hf_scores(AutoModelForSequenceClassification.from_pretrained(seqcls, dtype=torch.float32), pair_batch()["input_ids"].unbind())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert float(want.std()) > 1e-3  # the sequences score differently: the check reads the right position


def _trajectory_scores(rank, world, path):
    """The RL loop's scoring (``with_model_rewards``) of 3 trajectories over 7 rows on 2 ranks:
    trajectory 0 is rows 0-2 (split twice), 1 is rows 3-5, 2 is row 6."""
    from posttrain.async_rl.producer import ScoredBatch
    from posttrain.rewards import RewardConfig
    from roles.reward_model import with_model_rewards

    engine = engine_for(path, "model.head=value", "model.value_bias=false", "frozen=true")
    batch = make_batch(list(pair_batch()["input_ids"].unbind())[:7])
    scored = ScoredBatch(batch, torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 0, 0, 1, 1, 1, 2]))
    with_model_rewards(scored, RewardConfig(model=path, model_weight=2.0, function_weight=0.5), RewardModel(engine))
    return scored.scores, scored.parts


def test_a_trajectory_is_scored_by_its_last_row(seqcls):
    """A multi-turn trajectory (several rows) gets the score of its last row, the whole
    conversation; a batch of 3 trajectories is scored on 2 ranks (padded to split, the padding's
    score dropped); the reward is ``0.5 * function + 2 * model``."""
    scores, parts = run_distributed(_trajectory_scores, 2, seqcls, timeout=300)[0]
    hf = AutoModelForSequenceClassification.from_pretrained(seqcls, dtype=torch.float32)
    ids = pair_batch()["input_ids"].unbind()
    want = _hf_scores(hf, [ids[2], ids[5], ids[6]])
    torch.testing.assert_close(parts["model"], want, rtol=1e-5, atol=1e-6)
    assert parts["function"].tolist() == [1.0, 0.0, 0.5]
    torch.testing.assert_close(scores, 0.5 * parts["function"] + 2.0 * parts["model"])


def _step(rank, world, path, overrides, out_dir):
    engine = engine_for(
        path, "model.head=value", "model.value_bias=false", "loss_agg_mode=seq-mean-token-sum", "optim.clip_grad=1e9", *overrides
    )
    rm = RewardModel(engine)
    metrics = rm.update(pair_batch())
    grads = {}
    if engine.config.strategy == "fsdp":
        for name, p in engine.model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name.removeprefix("_orig_mod.")] = g.clone()
    after = rm.score(pair_batch())
    if out_dir is not None:
        save_hf(engine, engine.config, out_dir)
    return metrics, grads, after


def test_the_bradley_terry_step_follows_plain_hf_and_the_export_scores_the_same(seqcls, tmp_path):
    hf = AutoModelForSequenceClassification.from_pretrained(seqcls, dtype=torch.float32)
    scores = torch.stack([hf(ids[None]).logits[0, 0] for ids in pair_batch()["input_ids"].unbind()])
    loss = -torch.nn.functional.logsigmoid(scores[0::2] - scores[1::2]).mean()
    loss.backward()
    want = {n: p.grad for n, p in hf.named_parameters()}
    layouts = {
        "one micro-batch": (1, ["micro_batch_size=8"]),
        "mbs=1": (1, ["micro_batch_size=1"]),
        "2 ranks": (2, ["micro_batch_size=1"]),
        "megatron": (1, ["strategy=megatron", "micro_batch_size=3"]),
    }
    for label, (world, overrides) in layouts.items():
        out = str(tmp_path / label.replace(" ", "_")) if label in ("one micro-batch", "megatron") else None
        metrics, grads, after = run_distributed(_step, world, seqcls, ["optim.lr=1e-2", *overrides], out, timeout=300)[0]
        assert metrics["rm/loss"] == pytest.approx(float(loss), rel=1e-6), label
        for name, g in want.items() if grads else ():
            if g is None:
                continue
            err = float((grads[name] - g).abs().max() / g.abs().max())
            assert err <= 1e-5, (label, name, err)
        if out is not None:  # the export: HF's sequence classification gives the trained scores
            exported = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32)
            assert json.loads((tmp_path / label.replace(" ", "_") / "config.json").read_text())["architectures"][0].endswith(
                "ForSequenceClassification"
            )
            hf_after = _hf_scores(exported, pair_batch()["input_ids"].unbind())
            assert float((hf_after - after).abs().max()) <= 1e-6, (label, hf_after - after)
            assert float((after - scores.detach()).abs().min()) > 1e-4, label  # trained: the scores moved


@pytest.mark.slow
def test_the_demo_reward_model_orders_held_out_pairs(tmp_path):
    """``configs/rm_tiny.yaml`` from a random tiny model: measured held-out pair accuracy 0.92 at
    step 20 and 1.00 at step 100 (margin 7.6); held: at least 0.85 after 20 steps (chance 0.5)."""
    args = ["-m", "recipes.reward_model", "--config", "configs/rm_tiny.yaml", f"trainer.output_dir={tmp_path}"]
    proc = launch.run_script([*args, "trainer.total_steps=20", "trainer.progress_bar=false", "trainer.save_hf=false"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["val/rm/accuracy"] >= 0.85, rows[-1]


def test_a_reward_model_that_is_not_a_scalar_head_or_of_another_vocabulary_is_refused(seqcls, tmp_path):
    """``reward.model`` checks before any engine: a causal LM (its head would be new and random),
    a missing directory, another vocabulary. The combined reward is
    ``function_weight * f + model_weight * m`` with both means reported."""
    from posttrain.distill import vocabulary_problems
    from posttrain.rewards import RewardConfig
    from roles.reward_model import combine_rewards, reward_metrics, scalar_head_problems

    lm = make_model(tmp_path / "lm", "llama")
    assert scalar_head_problems(seqcls) == []
    [msg] = scalar_head_problems(lm)
    assert "not a scalar-head model" in msg and "recipes.reward_model" in msg and "reward.model" in msg
    assert "no config.json" in scalar_head_problems(str(tmp_path / "none"))[0]
    other = make_model(tmp_path / "big", "llama")
    raw = json.loads((tmp_path / "big" / "config.json").read_text())
    (tmp_path / "big" / "config.json").write_text(json.dumps({**raw, "vocab_size": raw["vocab_size"] + 4}))
    [msg] = vocabulary_problems(lm, other, "reward.model", "reward model")
    assert msg.startswith("reward.model = ") and "the reward model's vocabulary" in msg and "fix:" in msg

    reward = RewardConfig(model=seqcls, model_weight=2.0, function_weight=0.5)
    function, model = torch.tensor([1.0, 0.0]), torch.tensor([0.5, -1.5])
    total, metrics = combine_rewards(reward, function, model), reward_metrics(function, model)
    assert total.tolist() == [0.5 + 1.0, 0.0 - 3.0] and metrics["reward/function_mean"] == 0.5 and metrics["reward/model_mean"] == -0.5
    assert "model_weight = 0.0" in RewardConfig(model=seqcls, model_weight=0.0)._problems()[0]
    assert "without reward.model" in RewardConfig(function_weight=0.0)._problems()[0]

    # The head: a reward model's is bias-free (HF sequence classification's). The recipe refuses a
    # bias; a bias-free head refuses a checkpoint whose stored bias it would drop; reward.model
    # takes the head the checkpoint's architecture has.
    from backends.hf import load_hf_model
    from engine_api.typed_config import load_typed
    from recipes.ppo import PPOConfig
    from recipes.reward_model import RMConfig
    from roles.reward_model import reward_engine_config

    assert load_typed(RMConfig, "configs/rm_tiny.yaml").engine.model.value_bias is False
    assert load_typed(RMConfig, {}).engine.model.value_bias is False  # the default, without the demo's yaml
    with pytest.raises(ValueError, match=r"engine.model.value_bias = true: .*fix: engine.model.value_bias=false"):
        load_typed(RMConfig, "configs/rm_tiny.yaml", ["engine.model.value_bias=true"])
    # On Ray one group (actor): a placement of another role is refused at load, before Ray starts.
    assert load_typed(RMConfig, "configs/rm_tiny.yaml", ["trainer.launcher=ray", "trainer.placement.pools.main=2"])
    with pytest.raises(ValueError, match=r"placement.roles places \['reference'\], which this run does not have"):
        load_typed(RMConfig, "configs/rm_tiny.yaml", ["trainer.launcher=ray", "trainer.placement.roles.reference=main"])
    critic = load_hf_model(lm, "value", seed=0)
    with torch.no_grad():
        critic.score.bias.fill_(0.25)
    critic.save_pretrained(tmp_path / "critic")
    with pytest.raises(ValueError, match=r"model.value_bias = false, but .* stores a non-zero score.bias \(\[0.25\]\).*fix:"):
        load_hf_model(str(tmp_path / "critic"), "value", seed=0, value_bias=False)
    assert float(load_hf_model(str(tmp_path / "critic"), "value", seed=0).score.bias) == 0.25
    assert load_hf_model(seqcls, "value", seed=0, value_bias=False).score.bias is None
    engine = load_typed(PPOConfig, "configs/grpo_tiny.yaml").engine
    assert reward_engine_config(engine, seqcls).model.value_bias is False
    assert reward_engine_config(engine, str(tmp_path / "critic")).model.value_bias is True


def test_grpo_trains_on_the_reward_models_scores(tmp_path):
    """``reward.model`` in the RL recipe with ``function_weight: 0``: the reward trained on is the
    reward model's score of each response (``reward`` = ``reward/model_mean``), the task's own
    scorer reported beside it (``reward/function_mean``). With DAPO's dynamic sampling on, the
    filter reads the combined reward (a reward model's scores differ within every group, so no
    group is dropped; the function's partial credit alone is flat in some groups here: filtering by
    it, the step drew refills). The run is on megatron (policy and reward model: every role's
    engine takes the actor's keys); FSDP runs it in ``tests/placement/test_ray_runs.py``, and both
    backends' scores equal HF's (the checkpoint test above)."""
    strategy = "megatron"
    from posttrain.tiny_model import build_tiny_model
    from tests.support.recipe_runs import run_ppo

    rm_dir = str(tmp_path / "rm")
    AutoModelForSequenceClassification.from_pretrained(build_tiny_model(tmp_path / "lm", seed=4), num_labels=1).save_pretrained(rm_dir)
    extra = (f"reward.model={rm_dir}", "reward.function_weight=0", f"engine.strategy={strategy}", "trainer.val_every=0")
    rows = run_ppo(tmp_path / "run", "grpo_tiny.yaml", 2, *extra, "algo.dynamic_sampling=true")
    for row in rows:
        assert row["reward"] == pytest.approx(row["reward/model_mean"], rel=1e-6, abs=1e-7)
        assert 0.0 <= row["reward/function_mean"] <= 1.0 and row["reward/model_std"] > 0
        assert row["dynamic_sampling/draws"] == 1 and row["dynamic_sampling/groups_dropped"] == 0, row
