"""``posttrain.trainer_utils.demo_setting_warnings``: the demo configs' settings are flagged on
the user's own model only, each naming its key and the fix."""

from __future__ import annotations

from posttrain.trainer_utils import demo_setting_warnings


def test_the_demo_settings_are_flagged_on_a_real_model_only():
    # The RL demo (configs/grpo_tiny.yaml): lr 7e-4 and an entropy bonus of 0.03.
    warned = demo_setting_warnings("rl", True, 7e-4, False, 0.03)
    assert len(warned) == 2
    assert "engine.optim.lr = 0.0007" in warned[0] and "configs/examples/" in warned[0]
    assert "actor.entropy_coef = 0.03" in warned[1] and "fix: actor.entropy_coef=0" in warned[1]
    assert demo_setting_warnings("rl", False, 7e-4, False, 0.03) == []  # the built tiny model: what the demo is tuned for
    assert len(demo_setting_warnings("sft", True, 3e-3, False)) == 1  # the SFT demo's lr


def test_the_anchors_settings_pass():
    # configs/examples/: SFT 1e-5, GRPO 1e-6 full and 1e-5 LoRA, no entropy bonus.
    assert demo_setting_warnings("sft", True, 1e-5, False) == []
    assert demo_setting_warnings("rl", True, 1e-6, False, 0.0) == []
    assert demo_setting_warnings("rl", True, 1e-5, True, 0.0) == []
    # LoRA tolerates ten times the full-weight limit, but not the demo's full-weight RL lr on top of that.
    assert demo_setting_warnings("rl", True, 1e-4, True) == [] and demo_setting_warnings("rl", True, 1e-4, False) != []
