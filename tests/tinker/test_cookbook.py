"""tinker-cookbook 0.6.1's ``recipes/sl_loop.py`` and ``recipes/rl_loop.py``, unchanged, against the
Tinker server on the FSDP engine, through ``tinker_server.demo`` (the offline first run
docs/tinker.md gives: ``python -m tinker_server.demo serve`` / ``sl_loop`` / ``rl_loop``).

What the demo supplies, because nothing may be downloaded here: a tiny Llama-style model served
under a name the cookbook knows (``meta-llama/Llama-3.2-1B``: its ``role_colon`` renderer is plain
text), a character tokenizer registered under that name, and local rows in place of the hub
datasets. The RL loop's reward needs a ``\\boxed{}`` answer, which an untrained tiny model never
writes; the demo's reward scores the sampled text (the share of digits), so the groups have
reward variance and the loop trains.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.support.tinker import running_server
from tinker_server import demo
from tinker_server.config import load_server_config
from tinker_server.factory import EngineFactory

TEACHER = "enginekit/tiny-teacher"  # another base model, served beside the demo's (on-policy distillation)


def _teacher_model(root: Path) -> str:
    """The demo model's architecture and tokenizer with other weights (seed 1)."""
    from posttrain.tiny_model import build_tiny_model

    path = root / "teacher"
    vocab = len(demo.SPECIALS) + len(demo.CHARS)
    build_tiny_model(path, family="llama", seed=1, vocab_size=vocab, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    demo.character_tokenizer().save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = demo.build_demo_model(tmp_path_factory.mktemp("demo"))
    teacher = _teacher_model(tmp_path_factory.mktemp("teacher"))
    cfg = load_server_config(
        "configs/tinker_tiny.yaml",
        [
            f"server.aliases=[{demo.NAME}={model},{TEACHER}={teacher}]",
            f"server.state_dir={tmp_path_factory.mktemp('state')}",
            "server.max_runs=8",
        ],
    )
    factory = EngineFactory(None, cfg.alias_table(), cfg.run_settings())
    with running_server(cfg.server_settings(), factory) as url:
        yield url, model, factory


def _metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_sl_loop_trains_and_the_nll_goes_down(server, tmp_path):
    url, model, _ = server
    log = tmp_path / "sl"
    demo.run_sl_loop(url, model, str(log), batch_size=2, learning_rate=0.01, lora_rank=4, save_every=4)
    nll = [m["train_mean_nll"] for m in _metrics(log) if "train_mean_nll" in m]
    assert len(nll) == 8 and all(math.isfinite(x) for x in nll)
    assert nll[-1] < 0.8 * nll[0], nll  # the same conversation every step: the summed cross_entropy must fit it
    assert (log / "checkpoints.jsonl").exists()  # save_every=4 and the final save went through the server


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo"])
def test_rl_loop_samples_scores_and_trains(server, tmp_path, loss_fn):
    url, model, _ = server
    scored: list[float] = []

    def reward(response: str, answer: str) -> float:
        # the demo's reward (the share of digits: ~10% of an untrained character model's output,
        # so a group of 4 x 12 tokens has reward variance but for a chance of ~1e-2), recorded
        value = demo.digit_reward(response, answer)
        scored.append(value)
        return value

    log = tmp_path / "rl"
    demo.run_rl_loop(url, model, str(log), reward, loss_fn=loss_fn, batch_size=2, group_size=4, max_tokens=12, lora_rank=4, max_steps=2)
    metrics = _metrics(log)
    steps = [m for m in metrics if "reward/total" in m]
    assert len(steps) == 2
    assert len(scored) == 2 * 2 * 4  # every sampled sequence was scored
    assert any(s > 0 for s in scored) and any("grad_norm:mean" in m for m in steps)  # variance -> a training step ran


def test_two_sl_loops_at_once_on_one_engine_each_train_as_alone(server, tmp_path):
    """Two cookbook sl_loops (other learning rates) against the server at the same time: their runs
    share one engine (the same base, rank and targets), their calls interleave on it, and each
    logs exactly the NLLs it logs when it runs alone."""
    import threading

    from tinker_cookbook.recipes import sl_loop

    url, model, factory = server
    rates = (0.01, 0.02)

    def config(lr: float, where: str):
        return sl_loop.Config(
            base_url=url, log_path=str(tmp_path / where), model_name=demo.NAME, batch_size=2, learning_rate=lr, lora_rank=4, save_every=0
        )

    def nll(where: str) -> list[float]:
        return [m["train_mean_nll"] for m in _metrics(tmp_path / where) if "train_mean_nll" in m]

    demo.register_tokenizer(model)
    with demo._api_key(), demo.local_dataset(demo.sl_rows()), demo.closing_service_clients():
        for lr in rates:
            sl_loop.main(config(lr, f"alone-{lr}"))
        threads = [threading.Thread(target=sl_loop.main, args=(config(lr, f"together-{lr}"),)) for lr in rates]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    together = factory.created[-2:]
    assert together[0].shared is together[1].shared  # one engine served both
    for lr in rates:
        assert len(nll(f"together-{lr}")) == 8
        assert nll(f"together-{lr}") == nll(f"alone-{lr}"), lr
    assert nll("alone-0.01") != nll("alone-0.02")


def test_two_rl_loops_at_once_on_one_engine_both_sample_score_and_train(server, tmp_path):
    """Two cookbook rl_loops against the server at the same time, their runs on one engine: each
    samples, scores and steps as it does alone. (The SDK sends unseeded sampling requests, so an
    rl_loop's numbers vary run to run even alone; exactness under interleaving is held by the
    seeded sampling of tests/tinker/test_shared_engine.py.)"""
    import threading

    from tinker_cookbook.recipes import rl_loop

    url, model, factory = server
    demo.register_tokenizer(model)
    settings = {"batch_size": 2, "group_size": 4, "max_tokens": 12, "lora_rank": 4, "save_every": 0, "max_steps": 2}
    configs = [rl_loop.Config(base_url=url, log_path=str(tmp_path / f"rl{i}"), model_name=demo.NAME, **settings) for i in range(2)]
    for cfg in configs:  # the loss the server computes (the recipe's default needs Tinker's stability records)
        object.__setattr__(cfg, "loss_fn", "importance_sampling")
    real, errors = rl_loop.get_reward, []

    def run(cfg) -> None:
        try:
            rl_loop.main(cfg)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    rl_loop.get_reward = demo.digit_reward
    try:
        with demo._api_key(), demo.local_dataset(demo.rl_rows()), demo.closing_service_clients():
            threads = [threading.Thread(target=run, args=(cfg,)) for cfg in configs]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
    finally:
        rl_loop.get_reward = real
    assert not errors, errors
    together = factory.created[-2:]
    assert together[0].shared is together[1].shared
    for i in range(2):
        steps = [m for m in _metrics(tmp_path / f"rl{i}") if "reward/total" in m]
        assert len(steps) == 2 and any("grad_norm:mean" in m for m in steps), steps


@pytest.mark.parametrize("teacher", ["another_base_model", "a_checkpoint_on_the_students_base"])
def test_the_cookbooks_on_policy_distillation_runs_unchanged(server, tmp_path, teacher, monkeypatch):
    """tinker-cookbook 0.6.1's ``distillation/train_on_policy.main``, unchanged, against the
    server: the student (a LoRA run on the demo model) samples, the teacher's sampling client
    scores the samples with ``compute_logprobs``, and the per-token reverse KL is the advantage
    (the recipe's ``importance_sampling``). The teacher is another base model served beside the
    student's, or a checkpoint of a run on the student's own base (an sl_loop's saved sampler
    weights), which the student's base's rollout engine samples (an adapter with a vLLM rollout
    and ``rollout.lora_rank``; with the ``hf`` rollout here, a merged snapshot on the same engine). The prompts are the
    demo's local rows in place of DeepMath (the recipe's ``load_dataset`` answers them)."""
    import asyncio

    import datasets
    from tinker_cookbook.distillation import datasets as dd
    from tinker_cookbook.distillation import train_on_policy

    url, model, factory = server
    demo.register_tokenizer(model)
    # the recipe's module bound datasets.load_dataset at import: its split="train" gets the demo's rows
    monkeypatch.setattr(dd, "load_dataset", lambda *a, **k: datasets.Dataset.from_list(demo.rl_rows()))
    if teacher == "another_base_model":
        teacher_config = dd.TeacherConfig(base_model=TEACHER)
    else:
        log = tmp_path / "sl"
        demo.run_sl_loop(url, model, str(log), batch_size=2, learning_rate=0.01, lora_rank=4, save_every=0)
        saved = [json.loads(line) for line in (log / "checkpoints.jsonl").read_text().splitlines()]
        teacher_config = dd.TeacherConfig(base_model=demo.NAME, load_checkpoint_path=saved[-1]["sampler_path"])
    builder = dd.PromptOnlyDatasetBuilder(
        dataset_name="deepmath", groups_per_batch=2, group_size=4, model_name_for_tokenizer=demo.NAME, renderer_name="role_colon"
    )
    cfg = train_on_policy.Config(
        learning_rate=1e-3,
        dataset_configs=[dd.DistillationDatasetConfig(dataset_builder=builder, teacher_config=teacher_config, groups_per_batch=2)],
        model_name=demo.NAME,
        recipe_name="distillation",
        renderer_name="role_colon",
        max_tokens=12,
        lora_rank=4,
        log_path=str(tmp_path / "distill"),
        base_url=url,
        eval_every=0,
        save_every=0,
        max_steps=2,
    )
    pools_before = set(factory.pools)
    with demo._api_key(), demo.closing_service_clients():
        asyncio.run(train_on_policy.main(cfg))
    steps = [m for m in _metrics(tmp_path / "distill") if "teacher_kl" in m]
    assert len(steps) == 2 and all(math.isfinite(m["teacher_kl"]) and m["teacher_kl"] != 0.0 for m in steps), steps
    # a checkpoint teacher is sampled by its base's one rollout engine (tinker_server.snapshots.RolloutPool),
    # the student's: no second copy of the base is loaded for it
    new_pools = set(factory.pools) - pools_before
    if teacher == "another_base_model":
        assert TEACHER in factory.pools
    else:
        assert new_pools <= {demo.NAME}  # the checkpoint is sampled by its base's engine, the student's


def _comparisons(path: Path, n: int) -> str:
    """``n`` labeled comparisons in tinker-cookbook's JSONL (``ComparisonBuilderFromJsonl``): the
    demo's sequence preferred over a scrambled one, the label alternating between A and B."""
    with open(path, "w") as f:
        for i in range(n):
            good, bad = [{"role": "assistant", "content": "abcabcabc 123"}], [{"role": "assistant", "content": f"cba {i % 10}"}]
            a, b, label = (good, bad, "A") if i % 2 == 0 else (bad, good, "B")
            prompt = [{"role": "user", "content": "Say the sequence."}]
            f.write(
                json.dumps({"comparison": {"prompt_conversation": prompt, "completion_A": a, "completion_B": b}, "label": label}) + "\n"
            )
    return str(path)


@pytest.mark.parametrize("setting", ["defaults", "eval_every=2"])
def test_the_cookbooks_dpo_keeps_its_reference_while_the_evaluator_snapshots(server, tmp_path, setting):
    """tinker-cookbook 0.6.1's ``preference/train_dpo.main``, unchanged: the DPO loss runs
    client-side (``forward_backward_custom``), the reference is the run's first sampling
    snapshot, scored every step, and the test split's evaluator takes a new snapshot every
    ``eval_every`` steps. Before the server evicted snapshots by last use, the 5th newer snapshot
    took the reference: with its defaults (``eval_every=10``, ``save_every=20``, LoRA rank 32, lr
    1e-5) the run died at step 30, with ``eval_every=2`` at step 6 (both checked by reverting the
    last-use update). Here 36 steps with the defaults (5 evaluations) and 14 steps with
    ``eval_every=2`` (7 evaluations) run, the reference answering every step, and the pairs' loss
    falls from ln 2."""
    from tinker_cookbook.preference import train_dpo
    from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
    from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    url, model, _ = server
    demo.register_tokenizer(model)
    steps, evals, settings = (36, 5, {}) if setting == "defaults" else (14, 7, {"learning_rate": 1e-3, "lora_rank": 4, "eval_every": 2})
    comparisons = ComparisonBuilderFromJsonl(
        train_path=_comparisons(tmp_path / "train.jsonl", 2 * steps), test_path=_comparisons(tmp_path / "test.jsonl", 4)
    )
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=demo.NAME, renderer_name="role_colon", max_length=64, batch_size=2)
    cfg = train_dpo.Config(
        log_path=str(tmp_path / "dpo"),
        recipe_name="dpo",
        model_name=demo.NAME,
        dataset_builder=DPODatasetBuilderFromComparisons(comparison_builder=comparisons, common_config=common),
        renderer_name="role_colon",
        base_url=url,
        **({"save_every": 0} if settings else {}),
        **settings,
    )
    with demo._api_key(), demo.closing_service_clients():
        train_dpo.main(cfg)
    rows = [m for m in _metrics(tmp_path / "dpo") if "dpo_loss" in m]
    assert len(rows) == steps, len(rows)
    assert rows[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert rows[-1]["dpo_loss"] < rows[0]["dpo_loss"], [m["dpo_loss"] for m in rows]
    assert sum(any(k.startswith("test") for k in m) for m in _metrics(tmp_path / "dpo")) >= evals
