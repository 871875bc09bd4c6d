"""The SFT recipe: its config, its loss, and real runs on the FSDP backend (in-process, and 2
ranks under torchrun). The sorting task and the tiny model builder: ``tests/posttrain/``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from engine_api.losses import build_norm_context
from posttrain import sort_task as task
from recipes.sft import SFTConfig, load_sft_config, sft_loss
from tests.support import launch

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "sft_tiny.yaml"


# ---------------------------------------------------------------------------------- config
def test_config_loads_and_overrides_reach_the_engine():
    cfg = load_sft_config(CONFIG, ["engine.micro_batch_size=2", "trainer.total_steps=7"])
    assert isinstance(cfg, SFTConfig)
    assert cfg.engine.strategy == "fsdp" and cfg.engine.micro_batch_size == 2
    # The LR schedule length follows the trainer's step count (YAML interpolation).
    assert cfg.engine.optim.total_steps == 7 == cfg.trainer.total_steps
    assert cfg.engine.model.path is None  # the recipe builds the tiny model


def test_yaml_documents_the_recipe_defaults():
    """Outside ``engine:`` (which lists only the keys it changes), the YAML equals the dataclass
    defaults, except the demo's console cadence: a line every 50 of its 800 short steps (the
    default is every step) and samples every 200 steps (off by default), and its HF export at the
    end (off by default; the demo keeps its model for ``recipes.evaluate``)."""
    cfg, default = load_sft_config(CONFIG), SFTConfig()
    assert (cfg.trainer.log_every, cfg.trainer.log_samples_every, cfg.trainer.save_hf) == (50, 200, True)
    trainer = dataclasses.replace(
        cfg.trainer,
        log_every=default.trainer.log_every,
        log_samples_every=default.trainer.log_samples_every,
        save_hf=default.trainer.save_hf,
    )
    assert (cfg.tiny_model, cfg.data, trainer) == (default.tiny_model, default.data, default.trainer)


def test_every_yaml_key_has_a_comment_above_it():
    lines = CONFIG.read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and ":" in stripped:
            assert lines[i - 1].strip().startswith("#"), f"line {i + 1} ({stripped!r}) has no comment above it"


def test_misspelt_key_and_bad_values_are_reported_together():
    with pytest.raises(ValueError) as err:
        load_sft_config(CONFIG, ["trainer.total_step=5", "data.max_digits=1", "engine.optim.lr=-1", "tiny_model.family=gpt"])
    msg = str(err.value)
    assert "4 config problem(s)" in msg
    assert "did you mean 'trainer.total_steps'" in msg
    assert "max_digits = 1" in msg and "lr = -1" in msg and "family = 'gpt'" in msg


# ---------------------------------------------------------------------------------- loss
def test_sft_loss_is_masked_token_mean_nll():
    batch = task.batch_at(task.DataConfig(batch_size=4), 0)
    log_probs = -1.0 - torch.rand(batch["input_ids"].values().shape[0])  # every p < 0.5
    outputs = {"log_probs": torch.nested.nested_tensor_from_jagged(log_probs, batch["input_ids"].offsets())}
    norm = build_norm_context(batch["loss_mask"], "token-mean", group=None)
    loss, metrics = sft_loss(batch, outputs, norm)
    mask = batch["loss_mask"].values()
    assert torch.allclose(loss, -(log_probs * mask).sum() / mask.sum())
    assert metrics == {"confident_token_acc": 0.0}
    outputs = {"log_probs": torch.nested.nested_tensor_from_jagged(torch.zeros_like(log_probs), batch["input_ids"].offsets())}
    assert sft_loss(batch, outputs, norm)[1] == {"confident_token_acc": 1.0}


# ---------------------------------------------------------------------------------- runs
def _run_args(out: Path, steps: int) -> list[str]:
    return [
        "--config",
        str(CONFIG),
        f"trainer.output_dir={out}",
        f"trainer.total_steps={steps}",
        "trainer.progress_bar=false",
        "data.eval_batches=1",
    ]


@pytest.mark.slow
def test_short_run_learns_and_logs_every_step(tmp_path, own_process_group):
    from recipes.sft import main

    steps = 30
    summary = main(_run_args(tmp_path, steps))
    assert summary["last_loss"] < summary["first_loss"] / 2, summary
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert {"loss", "grad_norm", "lr", "tokens_per_s", "seconds"} <= set(r)
    assert records[0]["loss"] == summary["first_loss"] and records[-1]["loss"] == summary["last_loss"]
    assert 0.0 <= summary["eval_confident_token_acc"] <= 1.0


@pytest.mark.slow
def test_two_rank_torchrun(tmp_path):
    # One thread per rank (the launcher's environment): 2 ranks would oversubscribe a small CPU machine.
    proc = launch.torchrun(["-m", "recipes.sft", *_run_args(tmp_path, 3)], nproc=2, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "on 2 rank(s)" in proc.stdout
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.slow
def test_resume_replays_the_uninterrupted_run(tmp_path, own_process_group):
    from recipes.sft import main

    # Warmup + cosine over the engine's own 6 steps for every run (the 3-step run stops half-way
    # through the same schedule): the LR changes at every step after warmup, so steps 4-6 equal the
    # uninterrupted ones only if the scheduler state came back with the checkpoint.
    constant = ["engine.optim.lr_schedule=cosine", "engine.optim.warmup_steps=2", "engine.optim.total_steps=6", "data.eval_batches=0"]
    main([*_run_args(tmp_path / "full", 6), *constant])
    main([*_run_args(tmp_path / "split", 3), *constant, "trainer.checkpoint_every=3"])
    resumed = main([*_run_args(tmp_path / "split", 6), *constant, "trainer.resume=true"])
    assert resumed["start_step"] == 3

    def losses(run: str) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())}

    full, split = losses("full"), losses("split")
    assert sorted(split) == list(range(1, 7))  # the resumed run appended steps 4-6
    assert split == pytest.approx(full, rel=1e-5, abs=1e-6)
    lrs = [r["lr"] for r in map(json.loads, (tmp_path / "full" / "metrics.jsonl").read_text().splitlines())]
    assert len(set(lrs[2:])) == 4, lrs  # the premise: a different LR at the save and every resumed step

    # Issue 60 item 7: a fresh run (the default trainer.resume=false) in that directory is refused
    # before anything is written (it truncated the metrics, overwrote global_step_* and moved
    # `latest`); trainer.overwrite=true deletes the old checkpoints and starts over.
    ckpts = tmp_path / "split" / "checkpoints"
    before = sorted(p.name for p in ckpts.iterdir()), (tmp_path / "split" / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="holds another run's checkpoints .* fix: trainer.resume=true to continue it, another"):
        main([*_run_args(tmp_path / "split", 2), *constant])
    assert (sorted(p.name for p in ckpts.iterdir()), (tmp_path / "split" / "metrics.jsonl").read_text()) == before
    main([*_run_args(tmp_path / "split", 2), *constant, "trainer.overwrite=true"])
    assert not ckpts.exists() and len((tmp_path / "split" / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
def test_one_config_key_switches_backend_with_the_same_losses(tmp_path):
    """The design's promise at recipe level: ``engine.strategy=megatron`` and nothing else
    changes; both backends start from the same HF directory and take the same steps.

    Separate processes, because megatron's parallel state is process-global. Tolerance: relative 1e-5
    per step (fp32; the two backends run different kernels, measured agreement ~1e-7).
    """
    losses = {}
    for strategy in ("fsdp", "megatron"):
        out = tmp_path / strategy
        args = [*_run_args(out, 6), f"engine.strategy={strategy}"]
        proc = launch.run_script(["-m", "recipes.sft", *args], timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        losses[strategy] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["fsdp"]) == len(losses["megatron"]) == 6
    for step, (a, b) in enumerate(zip(losses["fsdp"], losses["megatron"], strict=True)):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: fsdp {a} vs megatron {b}"
    assert losses["fsdp"][-1] < losses["fsdp"][0]  # and it is training


def _flip_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_resume_skips_a_checkpoint_that_fails_verification_and_logs_each_step_once(tmp_path, own_process_group, capsys):
    """A run logged 5 steps and checkpointed 2, 4 and 5; step 5's weights were damaged later.
    ``trainer.resume`` skips step 5 loudly, resumes at 4, and the log ends with each of steps
    1-6 once, steps 5-6 recomputed (equal to an uninterrupted 6-step run)."""
    from recipes.sft import main

    constant = ["engine.optim.lr_schedule=constant", "data.eval_batches=0"]
    main([*_run_args(tmp_path / "full", 6), *constant])
    split = tmp_path / "split"
    main([*_run_args(split, 5), *constant, "trainer.checkpoint_every=2"])
    _flip_middle(split / "checkpoints" / "global_step_5" / "__0_0.distcp")
    lines = (split / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 5
    capsys.readouterr()
    resumed = main([*_run_args(split, 6), *constant, "trainer.resume=true"])
    assert resumed["start_step"] == 4
    err = capsys.readouterr().err
    assert "SKIPPING checkpoint" in err and "global_step_5" in err and "__0_0.distcp" in err, err[-2000:]
    records = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
    full = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in full], rel=1e-5, abs=1e-6)
    # Every checkpoint damaged: an error, not a silent restart that would overwrite them.
    for step in (2, 4):
        _flip_middle(split / "checkpoints" / f"global_step_{step}" / "__0_0.distcp")
    with pytest.raises(ValueError, match="none of the 3 checkpoint"):
        main([*_run_args(split, 8), *constant, "trainer.resume=true"])


@pytest.mark.slow
def test_a_run_whose_steps_are_all_skipped_stops_with_an_error(tmp_path, own_process_group, monkeypatch):
    import recipes.sft as sft

    def nan_loss(mb, out, norm):
        loss, metrics = sft_loss(mb, out, norm)
        return loss * float("nan"), metrics

    monkeypatch.setattr(sft, "sft_loss", nan_loss)
    with pytest.raises(RuntimeError, match=r"steps 1\.\.3: every optimizer step was skipped \(3 in a row"):
        sft.main([*_run_args(tmp_path, 10), "trainer.max_consecutive_skips=3"])
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
