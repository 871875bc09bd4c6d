"""Resuming on a different number of data-parallel ranks (issue 13, item 2: world size).

A checkpoint saved on 2 ranks resumes on 1 and one saved on 1 resumes on 2, on both backends
(megatron with the plain and the distributed optimizer): model and optimizer state are
resharded by DCP / megatron dist_checkpointing, the scheduler and step come from the save,
and the next steps equal the uninterrupted run's (the gradient of a global batch does not
depend on the DP size; fp32, relative 1e-5 on losses, grad norms and the final parameters).
A model-parallel change (megatron TP=2 -> TP=1) is refused, naming the setting.
"""

from __future__ import annotations

import pytest

from tests.reliability import _resize_targets as T
from tests.reliability._step_common import rel_diff, run

pytestmark = pytest.mark.slow

CASES = {
    "fsdp": ("fsdp", []),
    "megatron": ("megatron", []),
    "megatron-distopt": ("megatron", ["megatron.use_distributed_optimizer=true"]),
}


@pytest.mark.parametrize("sizes", [(2, 1), (1, 2)], ids=["2to1", "1to2"])
@pytest.mark.parametrize("case", list(CASES))
def test_resume_on_another_data_parallel_size_continues_the_run(case, sizes, model_dir, tmp_path):
    strategy, overrides = CASES[case]
    saved_on, resumed_on = sizes
    first = run(T.save_then_continue, saved_on, strategy, model_dir, str(tmp_path), overrides)[0]
    second = run(T.resume_and_continue, resumed_on, strategy, model_dir, str(tmp_path), overrides)
    for got in second:
        assert "error" not in got, got.get("error")
        assert got["step"] == T.K_STEPS
        for a, b in zip(got["after"], first["after"], strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
            assert a["lr"] == b["lr"]
        assert rel_diff(got["end"], first["end"]) < 1e-5


def test_a_model_parallel_change_is_refused_naming_the_setting(model_dir, tmp_path):
    run(T.save_then_continue, 2, "megatron", model_dir, str(tmp_path), ["megatron.tensor_model_parallel_size=2"])
    got = run(T.resume_and_continue, 1, "megatron", model_dir, str(tmp_path), [])[0]
    assert "megatron.tensor_model_parallel_size = 1 (saved with 2)" in got.get("error", ""), got
