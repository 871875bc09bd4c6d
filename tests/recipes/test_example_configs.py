"""The example configs for real models (``configs/examples/*.yaml``, docs/example-configs.md):
each loads with its recipe's loader, refuses to run until ``engine.model.path`` is set (naming
the key), and runs 2 steps on CPU through the recipe's ``main`` with a tiny model of the same
family (with a tokenizer and chat template, ``tests/support/user_data.py``) and tiny data, while
keeping the hyperparameters that matter from the file. Only the model path, the data files and
sizes (batch, steps, response length, warmup, rollout backend) are overridden."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from engine_api.typed_config import load_typed
from recipes.ppo import PPOConfig
from recipes.sft import load_sft_config
from tests.support import user_data as ud

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "configs" / "examples"
# config file -> the tiny model family that stands in for the real model
SFT = {"qwen2.5-0.5b-sft.yaml": "qwen2", "llama-3.2-1b-sft.yaml": "llama"}
GRPO = {"qwen2.5-1.5b-grpo-gsm8k.yaml": "qwen2", "qwen2.5-1.5b-lora-grpo-gsm8k.yaml": "qwen2"}
AGENT = {"qwen2.5-3b-grpo-gsm8k-tool.yaml": "qwen2"}
DAPO = {"qwen2.5-1.5b-dapo-gsm8k.yaml": "qwen2"}


def _load(name: str, overrides=()):
    path = EXAMPLES / name
    return load_sft_config(path, list(overrides)) if name in SFT else load_typed(PPOConfig, path, list(overrides))


def gsm8k_rows(n: int, seed: int) -> list[dict]:
    """GSM8K-shaped RL rows: a word problem and GSM8K's answer text ending in ``#### N``."""
    return [
        {"prompt": f"Tom has {a} pens and buys {b}. How many? Answer in \\boxed{{}}.", "answer": f"{a}+{b}={a + b}\n#### {a + b}"}
        for a, b in ((int(q[0]), int(q[2])) for q, _ in ud.additions(n, seed))
    ]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """One tiny model directory per family (tokenizer + chat template) and the data files."""
    d = tmp_path_factory.mktemp("examples")
    out = {family: ud.build_model_dir(d / family, family=family) for family in ("qwen2", "llama")}
    out["sft"] = ud.write_rows(ud.message_rows(12, 0), d / "chat_train.jsonl")
    out["sft_val"] = ud.write_rows(ud.message_rows(4, 1), d / "chat_val.jsonl")
    out["rl"] = ud.write_rows(gsm8k_rows(8, 2), d / "gsm8k_train.jsonl")
    out["rl_val"] = ud.write_rows(gsm8k_rows(4, 3), d / "gsm8k_test.jsonl")
    return out


def test_every_example_is_here_and_every_value_has_a_comment():
    """The documented examples exist, and every key with a value has a comment right above
    it (the files are meant to be read)."""
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted([*SFT, *GRPO, *AGENT, *DAPO])
    for name in [*SFT, *GRPO, *AGENT, *DAPO]:
        lines = (EXAMPLES / name).read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"^\s*[A-Za-z_]+:\s*\S", line):
                assert lines[i - 1].lstrip().startswith("#"), f"{name}:{i + 1}: {line.strip()!r} has no comment above it"


@pytest.mark.parametrize("name", [*SFT, *GRPO, *AGENT, *DAPO])
def test_loading_without_a_model_path_names_engine_model_path(name):
    """The shipped ``???`` placeholders fail at load (before anything is built), naming each key."""
    with pytest.raises(ValueError, match=r"engine\.model\.path") as err:
        _load(name)
    assert "engine.model.path = ???: a value this config leaves to you" in str(err.value)
    assert "data.train_files = ???" in str(err.value)


# ---------------------------------------------------------------------------------- SFT
@pytest.mark.parametrize("name", list(SFT))
def test_sft_example_runs_two_steps_and_keeps_its_hyperparameters(name, files, tmp_path, own_process_group):
    from recipes.sft import main

    overrides = [
        f"engine.model.path={files[SFT[name]]}",
        f"data.train_files=[{files['sft']}]",
        f"data.val_files=[{files['sft_val']}]",
        "data.batch_size=4",
        "trainer.total_steps=2",
        "engine.optim.warmup_steps=1",  # 10% of a 2-step run
        f"trainer.output_dir={tmp_path}",
        "trainer.progress_bar=false",
    ]
    cfg = _load(name, overrides)
    o = cfg.engine.optim
    assert (o.lr, tuple(o.betas), o.weight_decay, o.clip_grad, o.lr_schedule) == (1e-5, (0.9, 0.95), 0.01, 1.0, "cosine")
    assert o.total_steps == 2  # ${trainer.total_steps}
    assert cfg.engine.loss_agg_mode == "token-mean" and cfg.engine.model.gradient_checkpointing
    assert not cfg.engine.model.lora.enabled
    assert (cfg.data.format, cfg.data.max_length, cfg.trainer.save_hf) == ("messages", 2048, True)

    s = main(["--config", str(EXAMPLES / name), *overrides])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and s["steps"] == 2
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 and not r["step_skipped"] for r in rows)
    assert rows[0]["lr"] == pytest.approx(1e-5)  # the file's peak lr reached the optimizer (warmup 1)
    assert math.isfinite(s["eval_loss"])
    assert s["data"]["train"]["kept"] == 12
    assert (Path(s["hf_dir"]) / "config.json").exists()


# ---------------------------------------------------------------------------------- GRPO
@pytest.mark.parametrize("name", list(GRPO))
def test_grpo_example_runs_two_steps_and_keeps_its_hyperparameters(name, files, tmp_path, own_process_group):
    from recipes.ppo import main

    lora = "lora" in name
    overrides = [
        f"engine.model.path={files[GRPO[name]]}",
        f"data.train_files=[{files['rl']}]",
        f"data.val_files=[{files['rl_val']}]",
        "data.batch_size=2",
        "data.max_response_length=8",
        "rollout.backend=hf",
        "trainer.total_steps=2",
        f"trainer.output_dir={tmp_path}",
        "trainer.progress_bar=false",
    ]
    cfg = _load(name, overrides)
    a = cfg.actor
    assert cfg.engine.optim.lr == (1e-5 if lora else 1e-6)
    assert (a.entropy_coef, a.kl_coef, a.kl_estimator, a.clip_low, a.clip_high, a.ppo_epochs) == (0.0, 0.001, "k3", 0.2, 0.2, 1)
    assert (cfg.algo.advantage, cfg.algo.n_samples, cfg.reward.function) == ("grpo", 5, "math_answer")
    assert (cfg.rollout.temperature, cfg.data.max_prompt_length, cfg.engine.model.gradient_checkpointing) == (1.0, 512, True)
    lo = cfg.engine.model.lora
    assert (lo.rank, lo.alpha, list(lo.target_modules)) == ((32, 32.0, ["all-linear"]) if lora else (0, 16.0, ["all-linear"]))

    s = main(["--config", str(EXAMPLES / name), *overrides])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and s["steps"] == 2
    for r in rows:
        assert math.isfinite(r["actor_loss"]) and r["actor_skipped"] == 0.0
        assert r["lr"] == pytest.approx(cfg.engine.optim.lr)
        assert 0.0 <= r["reward"] <= 1.0 and 0 < r["response_len"] <= 8
        assert "kl" in r and math.isfinite(r["kl"]) and "entropy" in r  # KL on, from the reference
    assert s["val_reward"] is not None and s["data"]["train"]["kept"] == 8
    assert (Path(s["hf_dir"]) / "config.json").exists()


def test_dapo_example_runs_two_steps_with_its_four_parts(files, tmp_path, own_process_group):
    """Issue 63: DAPO's published hyperparameters are what the file loads (clip-higher 0.2 / 0.28,
    dynamic sampling with 10 draws, token-mean, the overlong buffer, 16 samples, no KL, lr 1e-6,
    weight decay 0.1), and 2 steps run with every part on: each trains full groups only."""
    from recipes.ppo import main

    name = "qwen2.5-1.5b-dapo-gsm8k.yaml"
    overrides = [
        f"engine.model.path={files[DAPO[name]]}",
        f"data.train_files=[{files['rl']}]",
        "data.batch_size=2",
        "algo.n_samples=4",
        "data.max_response_length=8",
        "reward.overlong.buffer=2",
        "rollout.backend=hf",
        "engine.optim.warmup_steps=0",
        "trainer.total_steps=2",
        "trainer.val_every=0",
        f"trainer.output_dir={tmp_path}",
        "trainer.progress_bar=false",
    ]
    cfg = _load(name, overrides)
    a, o = cfg.actor, cfg.engine.optim
    assert (a.policy_loss, a.clip_low, a.clip_high, a.kl_coef, cfg.engine.loss_agg_mode) == ("ppo", 0.2, 0.28, 0.0, "token-mean")
    assert (cfg.algo.advantage, cfg.algo.dynamic_sampling, cfg.algo.dynamic_sampling_max_draws) == ("grpo", True, 10)
    assert (o.lr, o.weight_decay, o.clip_grad, cfg.rollout.temperature) == (1e-6, 0.1, 1.0, 1.0)
    base = _load(name, [f"engine.model.path={files[DAPO[name]]}", f"data.train_files=[{files['rl']}]"])
    assert (base.algo.n_samples, base.reward.overlong.buffer, base.reward.overlong.penalty_factor, base.data.max_response_length) == (
        16,
        256,
        1.0,
        1024,
    )
    main(["--config", str(EXAMPLES / name), *overrides])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["actor_loss"]) and r["frac_reward_zero_std"] == 0.0 and r["dynamic_sampling/draws"] >= 1
        assert "reward/overlong_penalty" in r


# ---------------------------------------------------------------------------------- multi-turn
def test_agent_example_runs_two_steps_with_its_tool_and_keeps_its_hyperparameters(files, tmp_path, own_process_group):
    """The tool example on the tiny Qwen2 (its template has no tool section: the calculator's
    schema is still passed; an untrained model rarely calls it, so the run is checked for what
    every step must have: finite losses, rewards in [0, 1], the env metrics)."""
    from recipes.ppo import main

    name = "qwen2.5-3b-grpo-gsm8k-tool.yaml"
    overrides = [
        f"engine.model.path={files[AGENT[name]]}",
        f"data.train_files=[{files['rl']}]",
        "data.batch_size=2",
        "algo.n_samples=2",
        "rollout.max_new_tokens=8",
        "rollout.backend=hf",
        "rollout.dtype=float32",
        "engine.fsdp.param_dtype=float32",  # fp32 both sides: parity at float noise
        "data.max_prompt_length=128",
        "env.max_tokens=256",
        "rollout.max_model_len=256",
        "trainer.total_steps=2",
        "trainer.val_every=0",
        f"trainer.output_dir={tmp_path}",
        "trainer.progress_bar=false",
    ]
    cfg = _load(name, overrides)
    a, e = cfg.actor, cfg.env
    assert cfg.engine.optim.lr == 1e-6 and (a.kl_coef, a.kl_estimator, a.entropy_coef, a.ppo_epochs) == (0.001, "k3", 0.0, 1)
    assert (e.function, list(e.tools), e.tool_format, e.max_turns) == ("tools", ["posttrain.agents.builtin_tools:calculator"], "hermes", 5)
    main(["--config", str(EXAMPLES / name), *overrides])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["actor_loss"]) and 0.0 <= r["reward"] <= 1.0 and r["env/turns_mean"] >= 1
        assert r["rollout/logprob_abs_diff_max/turn_0"] <= 1e-5


def test_the_calculator_tool_computes_and_refuses_what_is_not_arithmetic():
    from posttrain.agents.builtin_tools import calculator

    assert calculator("(48 / 2) + 48") == "72" and calculator("7 // 2 * -3") == "-9" and calculator("2 ** 10") == "1024"
    for bad in ("__import__('os')", "9 ** 9 ** 9", "x + 1"):
        with pytest.raises(ValueError):
            calculator(bad)
