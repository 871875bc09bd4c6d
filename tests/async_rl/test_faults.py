"""Issue 43, item 5: a weight update that fails half-way while batches are in flight stops the
run non-zero naming the cause (the rollout keeps its previous weights: the update is staged),
and ``trainer.resume=true`` continues exactly: the finished run equals the uninterrupted one.
(A rollout worker killed mid-generation on Ray: ``tests/placement/test_ray_runs.py``; SIGTERM
and SIGKILL while batches are buffered: ``test_resume.py``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes import ppo

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--config", str(ROOT / "configs" / "grpo_tiny.yaml"), "trainer.progress_bar=false", "data.batch_size=4", "algo.n_samples=4"]
ARGS += ["async.max_staleness=2", "trainer.checkpoint_every=1", "trainer.total_steps=5", "rollout.sync_bucket_mb=0.05"]
ARGS += ["rollout.backend=tests.async_rl.faulty_rollout:FailsHalfway"]
TIMING = ("_s", "tokens_per_s", "_frac")


def _rows(out: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if not k.endswith(TIMING)} for line in (out / "metrics.jsonl").read_text().splitlines()
    ]


def test_a_weight_update_failing_halfway_stops_naming_it_and_resume_is_exact(tmp_path, monkeypatch, own_process_group):
    out = tmp_path / "run"
    monkeypatch.setenv("EK_TEST_FAIL_UPDATE_VERSION", "4")  # the sync at the start of step 4
    with pytest.raises(RuntimeError, match=r"rollout weight sync to version 4 failed on this rank \(ConnectionError: injected"):
        ppo.main([*ARGS, f"trainer.output_dir={out}"])
    assert len(_rows(out)) == 3  # steps 1-3 trained and checkpointed, step 4 never began training
    monkeypatch.delenv("EK_TEST_FAIL_UPDATE_VERSION")
    ppo.main([*ARGS, f"trainer.output_dir={out}", "trainer.resume=true"])
    ppo.main([*ARGS, f"trainer.output_dir={tmp_path / 'ref'}"])
    assert _rows(out) == _rows(tmp_path / "ref")
