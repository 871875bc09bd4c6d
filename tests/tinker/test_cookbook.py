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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = demo.build_demo_model(tmp_path_factory.mktemp("demo"))
    cfg = load_server_config(
        "configs/tinker_tiny.yaml",
        [f"server.aliases=[{demo.NAME}={model}]", f"server.state_dir={tmp_path_factory.mktemp('state')}", "server.max_runs=8"],
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
