"""Evaluation and generation without training (issue 42, item 8): ``recipes.evaluate`` scores the
validation files from an actor checkpoint or an HF directory, ``recipes.generate`` samples from
either. Properties: scoring the checkpoint of step N reproduces the training run's own
``val/reward`` at step N exactly (same weights, same validation seeds: an independent path to
the same number), an HF export scores as the checkpoint it came from, the base model does not,
the same seed generates the same text from a checkpoint and from its export, and bad keys are
refused by name before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import user_data as ud

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two GRPO steps on the user's data (validation and a checkpoint after each step, an HF
    export at the end), run in this process; the files and the run's metrics."""
    import torch.distributed as dist

    from recipes import ppo

    d = tmp_path_factory.mktemp("eval")
    files = {
        "model": ud.build_model_dir(d / "model"),
        "reward": ud.write_reward_file(d / "rw.py"),
        "train": ud.write_rows(ud.prompt_rows(64, 2), d / "train.jsonl"),
        "val": ud.write_rows(ud.prompt_rows(12, 3), d / "val.jsonl"),
        "out": str(d / "run"),
    }
    existed = dist.is_initialized()
    ppo.main(
        _args(files, files["out"], "trainer.total_steps=2", "trainer.val_every=1", "trainer.checkpoint_every=1", "trainer.save_hf=true")
    )
    if not existed and dist.is_initialized():
        dist.destroy_process_group()
    files["metrics"] = [json.loads(line) for line in open(Path(files["out"]) / "metrics.jsonl")]
    return files


def _args(files, out, *extra: str) -> list[str]:
    return [
        "--config",
        str(ROOT / "configs" / "grpo_tiny.yaml"),
        f"engine.model.path={files['model']}",
        f"data.train_files=[{files['train']}]",
        f"data.val_files=[{files['val']}]",
        f"reward.function={files['reward']}:score",
        "data.batch_size=4",
        "algo.n_samples=4",
        "data.max_response_length=4",
        "engine.optim.lr=5e-3",  # two steps move the samples: the base model scores differently
        f"trainer.output_dir={out}",
        "trainer.progress_bar=false",
        *extra,
    ]


def _evaluate(files, tmp_path, *extra: str) -> dict:
    from recipes import evaluate

    return evaluate.main(_args(files, tmp_path, *extra))


def test_a_checkpoint_scores_as_the_run_validated_it(trained, tmp_path, own_process_group):
    val = {r["step"]: r["val/reward"] for r in trained["metrics"]}
    actor = Path(trained["out"]) / "checkpoints" / "actor"
    step1 = _evaluate(trained, tmp_path / "s1", f"eval.checkpoint={actor / 'global_step_1'}")
    assert step1["checkpoint_step"] == 1 and step1["val/reward"] == val[1]
    newest = _evaluate(trained, tmp_path / "s2", f"eval.checkpoint={actor}")  # the root: its newest step
    assert newest["checkpoint_step"] == 2 and newest["val/reward"] == val[2]
    rows = [json.loads(line) for line in open(tmp_path / "s2" / "eval.jsonl")]
    assert len(rows) == 12 and {"prompt", "response", "reward", "stopped"} <= set(rows[0])
    assert sum(r["reward"] for r in rows) / 12 == pytest.approx(val[2], abs=1e-6)


def test_the_export_scores_as_its_checkpoint_and_the_base_model_does_not(trained, tmp_path, own_process_group):
    val2 = trained["metrics"][-1]["val/reward"]
    export = dict(trained, model=str(Path(trained["out"]) / "hf"))
    assert _evaluate(export, tmp_path / "hf")["val/reward"] == val2
    base = _evaluate(trained, tmp_path / "base", "eval.samples_per_prompt=2")
    assert base["checkpoint_step"] is None and base["samples_per_prompt"] == 2
    hf_rows = [json.loads(line)["response"] for line in open(tmp_path / "hf" / "eval.jsonl")]
    base_rows = [json.loads(line)["response"] for line in open(tmp_path / "base" / "eval.jsonl")]
    assert len(base_rows) == 24 and base_rows[::2] != hf_rows  # the trained weights sample other responses


def test_generate_from_a_checkpoint_and_from_its_export_gives_the_same_text(trained, tmp_path, own_process_group):
    from recipes import generate

    prompts = 'generate.prompts=["3+4=","12+5="]'
    actor = Path(trained["out"]) / "checkpoints" / "actor"
    a = generate.main(_args(trained, tmp_path / "a", prompts, "generate.samples_per_prompt=3", f"eval.checkpoint={actor}"))
    export = dict(trained, model=str(Path(trained["out"]) / "hf"))
    b = generate.main(_args(export, tmp_path / "b", prompts, "generate.samples_per_prompt=3"))
    assert len(a) == 6 and [r["response"] for r in a] == [r["response"] for r in b]
    assert {r["prompt"] for r in a} == {"<s><|user|>3+4=<|end|><|assistant|>", "<s><|user|>12+5=<|end|><|assistant|>"}
    assert len({r["response"] for r in a}) > 1  # sampled, not one response copied
    other = generate.main(_args(export, tmp_path / "c", prompts, "generate.samples_per_prompt=3", "generate.seed=1"))
    assert [r["response"] for r in other] != [r["response"] for r in b]
    assert (tmp_path / "a" / "generations.jsonl").read_text().count("\n") == 6


@pytest.mark.parametrize(
    ("module", "extra", "needle"),
    [
        ("evaluate", ["eval.checkpoint=/nonexistent/actor"], r"eval.checkpoint = '/nonexistent/actor': no such directory"),
        ("evaluate", ["data.val_files=[]"], r"data.val_files = \[\]: evaluation scores the validation prompts; fix"),
        ("evaluate", ["trainer.launcher=ray"], r"trainer.launcher = 'ray': evaluation runs in this process"),
        ("generate", [], r"generate.prompts = \[\] and prompt_file = null: nothing to generate"),
        ("generate", ["generate.prompt_file=/no/such.jsonl"], r"generate.prompt_file = '/no/such.jsonl': no such file"),
    ],
)
def test_bad_keys_are_refused_by_name_before_anything_loads(trained, tmp_path, module, extra, needle):
    import importlib

    with pytest.raises(ValueError, match=needle):
        importlib.import_module(f"recipes.{module}").main(_args(trained, tmp_path / "x", *extra))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("recipe", ["recipes.evaluate", "recipes.generate"])
def test_a_config_refusal_is_one_message_not_a_traceback(recipe):
    """Run as commands, the evaluation-side recipes refuse a bad key with the message alone and
    exit code 2 (issue 53, item 24: a traceback came first, the useful line last)."""
    from tests.support.launch import run_script

    proc = run_script(["-m", recipe, "engine.model.path=/nonexistent/model"])
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and "engine.model.path = '/nonexistent/model'" in proc.stderr, proc.stderr


def test_the_demos_leave_weights_to_evaluate():
    """After ``make run`` / ``make sft`` the run directory holds the trained model as an HF
    export (``trainer.save_hf``), which ``recipes.evaluate`` reads with
    ``engine.model.path=<output_dir>/hf`` (an export scores as its checkpoint: tested above);
    before, the demos kept nothing to evaluate (issue 53, item 24)."""
    from engine_api.typed_config import load_typed
    from recipes.ppo import PPOConfig
    from recipes.sft import SFTConfig

    root = Path(__file__).resolve().parents[2] / "configs"
    for name, cls in (("ppo_tiny", PPOConfig), ("grpo_tiny", PPOConfig), ("sft_tiny", SFTConfig)):
        assert load_typed(cls, str(root / f"{name}.yaml"), []).trainer.save_hf, name
