"""Issue 43: the asynchronous driver (``posttrain.async_rl``) on the FSDP actor in process.

* K = 0 is the synchronous loop (``recipes.ppo.rl_step``, unchanged), bit for bit: every
  metric but the timings, and the final weights;
* K = 2 with partial rollouts: staleness 0, 1, then exactly 2 (never more), responses spanning
  two versions, and each token's rollout log-prob equal, at float noise, to the trainer's at the
  version that sampled it (the probe sees > 1e-2 at every other version: it can tell them apart);
* K = 2 without partial rollouts: the same staleness, every response from one version.
"""

from __future__ import annotations

from tests.async_rl.async_workers import assert_checks, checks


def test_k0_is_the_synchronous_loop_and_k2_is_bounded_partial_and_exact_per_version(tmp_path):
    assert_checks(checks(0, 1, "fsdp", str(tmp_path)))
