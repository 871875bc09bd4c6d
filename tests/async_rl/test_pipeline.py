"""Issue 43: the asynchronous driver (``posttrain.async_rl``) on the FSDP actor in process.

* K = 0 is the synchronous loop (``tests.support.rl_loop.rl_step``, unchanged), bit for bit: every
  metric but the timings, and the final weights;
* K = 2 with partial rollouts: staleness 0, 1, then exactly 2 (never more), responses spanning
  two versions, and each token's rollout log-prob equal, at float noise, to the trainer's at the
  version that sampled it (the probe sees > 1e-2 at every other version: it can tell them apart);
* K = 2 without partial rollouts: the same staleness, every response from one version.

The same on megatron over two data-parallel ranks (a world), without the last run. Admission
never passes the run's last step, whatever K (issue 53 item 10).
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.async_rl.async_workers import assert_checks, checks
from tests.support.launch import run_distributed


def test_k0_is_the_synchronous_loop_and_k2_is_bounded_partial_and_exact_per_version(tmp_path, own_process_group):
    assert_checks(checks(0, 1, "fsdp", str(tmp_path)))


def test_the_same_on_megatron_over_two_data_parallel_ranks(tmp_path):
    """The other backend (the sync and the K = 0 runs bit for bit; K = 2 bounded and exact per
    version), its outputs gathered over DP ranks."""
    for result in run_distributed(checks, 2, "megatron", str(tmp_path), False):
        assert_checks(result)


def test_the_async_section_is_read_under_its_key_and_bad_values_are_refused_by_name():
    from engine_api.typed_config import load_typed
    from recipes.ppo import PPOConfig
    from tests.async_rl.async_workers import ROOT

    path = ROOT / "configs" / "grpo_tiny.yaml"
    assert load_typed(PPOConfig, path, ["async.max_staleness=2"]).async_.max_staleness == 2
    for bad, message in (
        ("async.max_staleness=-1", "async.max_staleness = -1: must be an integer >= 0"),
        ("async.max_staleness=1000000000", "async.max_staleness = 1000000000: above the limit 64 (each of the K steps ahead holds"),
        ("async.deterministic=false", "deterministic = False: the timing-driven schedule is not built"),
        ("async=2", "async = 2: async is a section"),
        ("async.max_staleness=two", "async.max_staleness = 'two'"),
        ("async.max_stalenes=2", "async.max_stalenes: unknown key 'max_stalenes' at async; fix: did you mean 'async.max_staleness'"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            load_typed(PPOConfig, path, [bad])


class _CountingRollout:
    """A stand-in rollout (no model): every response ``max_new_tokens`` tokens of id 5; it
    records which steps' prompts it was asked for (by seed)."""

    overlaps = False

    def __init__(self) -> None:
        self.version, self.seeds = 0, []

    def sync_weights(self, version: int) -> None:
        self.version = version

    def release(self) -> None:
        pass

    def sample(self, prompts, seeds, kept=None, max_new_tokens=1):
        from engine_api.rollout import Sample

        self.seeds += list(seeds)
        return [Sample(torch.full((max_new_tokens,), 5), torch.zeros(max_new_tokens), "length", self.version) for _ in prompts]


def test_admission_never_passes_the_last_step(tmp_path):
    """K far past the run's length (issue 53 item 10: K = 1e9 admitted every step up to
    ``step + K`` and hung): only the run's own steps are admitted and generated, each once."""
    from engine_api.typed_config import load_typed
    from posttrain.tasks import build_task
    from recipes.ppo import PPOConfig
    from roles.rollout import step_seeds
    from tests.async_rl.async_workers import ROOT, SMALL, pipeline_of

    over = [*SMALL, "async.max_staleness=64", "async.partial_rollouts=false", "trainer.total_steps=3", f"trainer.output_dir={tmp_path}"]
    cfg = load_typed(PPOConfig, ROOT / "configs" / "grpo_tiny.yaml", over)
    rollout = _CountingRollout()
    pipe = pipeline_of(cfg, rollout, build_task(cfg.data, cfg.engine.model.path, cfg.reward))
    for step in range(3):
        pipe.step(step, lambda scored, timings: {})
        assert max(pipe.pending, default=-1) <= 2 and pipe.cursor == 3, sorted(pipe.pending)
    assert rollout.seeds == [s for step in range(3) for s in step_seeds(cfg.rollout.seed, step, 16)]  # each step's batch once
